// Package testserver finds the PostgreSQL server a test binary runs on and
// runs the binary's tests there: the one implementation behind idemtest,
// for applications' tests, and internal/testdb, for idem's own.
//
// The server is, in this order: the one TEST_DATABASE_URL names; a
// postgres container started with testcontainers-go where Docker runs;
// otherwise a throwaway server started from a PostgreSQL installation on
// the machine (see internal/pgtemp). When none of them works the test
// binary fails before running anything, saying what it tried and how to
// fix it: database tests never skip, except under -short.
package testserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	neturl "net/url"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/pgidem/idem/internal/pgtemp"
)

// Server is the server of one test binary.
type Server struct {
	// URL connects to the server as a role that may create databases.
	URL string
	// Desc says which server it is, for the binary's log.
	Desc string
	stop func()
}

// Config says how Run runs a binary's tests.
type Config struct {
	// Prefix starts every line Run prints and every error it returns: the
	// name of the package that calls it.
	Prefix string
	// SkipExamples keeps the examples from running under -short: they
	// cannot skip, and some need the database.
	SkipExamples bool
	// Setup prepares the server for the tests, before they run, and
	// returns what undoes it, run before the server stops.
	Setup func(ctx context.Context, s *Server) (cleanup func(), err error)
}

// Run runs the tests of m on a server and returns the exit code for
// os.Exit. Under -short it runs them without one, saying so: the database
// tests skip themselves. An interrupt (SIGINT, SIGTERM) while the tests
// run undoes Setup and stops the server too.
func Run(m *testing.M, cfg Config) int {
	flag.Parse()
	if testing.Short() {
		skipped := "the database tests are skipped"
		if cfg.SkipExamples {
			skipped = "the database tests and the examples are skipped"
			_ = flag.Set("test.skip", "^Example")
		}
		fmt.Fprintf(os.Stderr, "%s: -short: %s\n", cfg.Prefix, skipped)
		return m.Run()
	}
	ctx := context.Background()
	s, err := start(ctx, cfg.Prefix)
	if err != nil {
		fmt.Fprintf(os.Stderr, "\n%v\n\n", err)
		return 1
	}
	undo := func() {}
	if cfg.Setup != nil {
		if undo, err = cfg.Setup(ctx, s); err != nil {
			s.stop()
			fmt.Fprintf(os.Stderr, "\n%s: on %s: %v\n\n", cfg.Prefix, s.Desc, err)
			return 1
		}
	}
	fmt.Fprintf(os.Stderr, "%s: the tests run on %s\n", cfg.Prefix, s.Desc)
	var once sync.Once
	cleanup := func() {
		once.Do(func() {
			undo()
			s.stop()
		})
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	go func() {
		sig := <-signals
		fmt.Fprintf(os.Stderr, "%s: %v: removing the test databases and the server\n", cfg.Prefix, sig)
		cleanup()
		os.Exit(1)
	}()
	code := m.Run()
	signal.Stop(signals)
	cleanup()
	return code
}

// start finds a server, in the documented order.
func start(ctx context.Context, prefix string) (*Server, error) {
	if url := os.Getenv("TEST_DATABASE_URL"); url != "" {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return nil, fmt.Errorf(`%s: TEST_DATABASE_URL is set, but %s cannot be used: %w

Fix TEST_DATABASE_URL (the tests create and drop databases of their own
there), or unset it to let the tests start PostgreSQL themselves, in a
container where Docker runs or from a local installation. go test -short
skips the database tests`, prefix, redact(url), err)
		}
		_ = conn.Close(ctx)
		return &Server{URL: url, Desc: "TEST_DATABASE_URL (" + redact(url) + ")", stop: func() {}}, nil
	}
	url, stop, containerErr := startContainer(ctx)
	if containerErr == nil {
		return &Server{URL: url, Desc: "a postgres container (testcontainers-go)", stop: stop}, nil
	}
	srv, localErr := pgtemp.Start(ctx, pgtemp.Config{Fast: true})
	if localErr == nil {
		desc := fmt.Sprintf("a throwaway PostgreSQL %s from %s, run as %s in %s", srv.Version, srv.BinDir, srv.User, srv.Dir)
		return &Server{URL: srv.URL, Desc: desc, stop: func() { _ = srv.Stop() }}, nil
	}
	return nil, fmt.Errorf(`%s: no PostgreSQL server for the database tests. Tried, in order:
  1. TEST_DATABASE_URL: not set
  2. a container with testcontainers-go: %s
  3. a throwaway server from a local installation: %s
To fix it, do one of these:
  - set TEST_DATABASE_URL=postgres://USER:PASSWORD@HOST:5432/postgres
    (the tests create and drop databases of their own there)
  - start Docker
  - install PostgreSQL (Debian, Ubuntu: apt-get install postgresql;
    macOS: brew install postgresql), or put its initdb and postgres on PATH
or run go test -short to skip the database tests`, prefix, oneLine(containerErr), oneLine(localErr))
}

func startContainer(ctx context.Context) (url string, stop func(), err error) {
	defer func() {
		// testcontainers panics when no Docker provider exists at all.
		if r := recover(); r != nil {
			err = fmt.Errorf("%v", r)
		}
	}()

	ctr, err := postgres.Run(ctx, "postgres:16-alpine",
		postgres.WithDatabase("postgres"),
		postgres.WithUsername("postgres"),
		postgres.WithPassword("postgres"),
		postgres.BasicWaitStrategies(),
	)
	if err != nil {
		if ctr != nil {
			_ = testcontainers.TerminateContainer(ctr)
		}
		return "", nil, err
	}
	url, err = ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return "", nil, err
	}
	return url, func() { _ = testcontainers.TerminateContainer(ctr) }, nil
}

// CreateDatabase creates an empty database on the server.
func (s *Server) CreateDatabase(ctx context.Context, name string) error {
	admin, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	defer admin.Close(ctx)
	// Identifiers cannot be bound as parameters; the name is ours and quoted.
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// DropDatabase drops a database, whoever is connected to it, on a context
// of its own: it runs after an interrupt too.
func (s *Server) DropDatabase(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// DatabaseURL returns the connection string of the server's database name.
func (s *Server) DatabaseURL(name string) string { return WithDatabase(s.URL, name) }

// WithDatabase points a connection string, URL or key=value, at database.
func WithDatabase(connString, database string) string {
	if u, err := neturl.Parse(connString); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + database
		return u.String()
	}
	return connString + " dbname=" + database
}

// RandomHex returns n random bytes in hex, for names unique to a run.
func RandomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func redact(url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "the test database"
	}
	return fmt.Sprintf("%s:%d", cfg.Host, cfg.Port)
}

func oneLine(err error) string {
	s := strings.Join(strings.Fields(err.Error()), " ")
	if len(s) > 400 {
		s = s[:400] + "..."
	}
	return s
}
