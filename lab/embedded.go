package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	neturl "net/url"
	"os"
	"path/filepath"
	"time"

	embeddedpostgres "github.com/fergusstrange/embedded-postgres"
)

// embeddedTimeout bounds the download and start of an embedded server: its
// library downloads with no deadline of its own, and a network that drops
// packets would otherwise hang the command.
var embeddedTimeout = 90 * time.Second

// embeddedRepository is where embedded-postgres downloads PostgreSQL from:
// its default, Maven Central. Tests point it elsewhere.
var embeddedRepository = "https://repo1.maven.org/maven2"

// probeRepository fails fast when the repository cannot be reached at all,
// before a download that might wait on it for long.
func probeRepository(ctx context.Context) error {
	u, err := neturl.Parse(embeddedRepository)
	if err != nil {
		return err
	}
	port := u.Port()
	if port == "" {
		port = "443"
		if u.Scheme == "http" {
			port = "80"
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := new(net.Dialer).DialContext(ctx, "tcp", net.JoinHostPort(u.Hostname(), port))
	if err != nil {
		return fmt.Errorf("cannot reach %s, where it downloads PostgreSQL from: %w", embeddedRepository, err)
	}
	return conn.Close()
}

// startEmbedded starts a PostgreSQL server fetched by embedded-postgres,
// in a temporary directory removed at the end.
func startEmbedded(ctx context.Context, stdout io.Writer, command string) (*scratch, error) {
	if os.Geteuid() == 0 {
		return nil, errors.New("embedded-postgres cannot run PostgreSQL as root, and PostgreSQL refuses to run as root")
	}
	if err := probeRepository(ctx); err != nil {
		return nil, fmt.Errorf("embedded-postgres: %w", err)
	}
	dir, err := os.MkdirTemp("", "idem-embedded-")
	if err != nil {
		return nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	password := randomHex(16)
	cfg := embeddedpostgres.DefaultConfig().
		Version(embeddedpostgres.V16).
		Port(uint32(port)).
		Username("postgres").
		Password(password).
		Database("postgres").
		RuntimePath(filepath.Join(dir, "run")).
		DataPath(filepath.Join(dir, "data")).
		StartParameters(map[string]string{"listen_addresses": "127.0.0.1"}).
		StartTimeout(time.Minute).
		Logger(io.Discard)
	cfg = cfg.BinaryRepositoryURL(embeddedRepository)
	fmt.Fprintf(stdout, "idem %s: no DATABASE_URL, PG* variables or local PostgreSQL installation; fetching one with embedded-postgres (at most %s)\n",
		command, embeddedTimeout)
	server := embeddedpostgres.NewDatabase(cfg)
	// embedded-postgres keeps its log in a temporary file it never removes:
	// have it made in dir, which is. Nothing else runs in the command yet.
	oldTmp, hadTmp := os.LookupEnv("TMPDIR")
	os.Setenv("TMPDIR", dir)
	defer func() {
		if hadTmp {
			os.Setenv("TMPDIR", oldTmp)
		} else {
			os.Unsetenv("TMPDIR")
		}
	}()
	started := make(chan error, 1)
	go func() { started <- server.Start() }()
	select {
	case err = <-started:
	case <-time.After(embeddedTimeout):
		err = fmt.Errorf("no PostgreSQL downloaded and started within %s (is the network reachable?)", embeddedTimeout)
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		// A download still under way writes to the cache, not to dir; the
		// command exits before it could get further.
		os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded-postgres: %w", err)
	}
	s := &scratch{
		URL:    fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d/postgres?sslmode=disable", password, port),
		stdout: stdout,
		what:   "the embedded server and its directory " + dir,
	}
	s.cleanup = func() error {
		err := server.Stop()
		return errors.Join(err, os.RemoveAll(dir))
	}
	fmt.Fprintf(stdout, "idem %s: on an embedded PostgreSQL 16 on 127.0.0.1:%d, removed at the end\n", command, port)
	return s, nil
}
