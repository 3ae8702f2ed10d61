package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	neturl "net/url"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/cmd/idem/cli"
	"github.com/pgidem/idem/internal/pgtemp"
)

// connVars are the environment variables that say which server to use.
var connVars = []string{"PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGPASSWORD", "PGPASSFILE", "PGSERVICE", "PGSERVICEFILE"}

// configured reports whether DATABASE_URL or a PG* variable names a server.
func configured() bool {
	if os.Getenv("DATABASE_URL") != "" {
		return true
	}
	for _, v := range connVars {
		if os.Getenv(v) != "" {
			return true
		}
	}
	return false
}

// connectTo opens a pool on connString and checks that the server answers.
func connectTo(ctx context.Context, connString string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := cli.ParseConfig(connString)
	if err != nil {
		return nil, err
	}
	return cli.OpenPool(ctx, cfg, maxConns)
}

// scratch is a database that demo, bench or soak made for itself and
// removes at the end: a database of its own on the configured server, a
// schema of its own where it may not create one, or a throwaway server.
type scratch struct {
	URL     string // connects to it
	cleanup func() error
	stdout  io.Writer
	what    string
}

// Close removes the scratch database (or schema, or server) and says so.
func (s *scratch) Close() {
	if s.cleanup == nil {
		return
	}
	if err := s.cleanup(); err != nil {
		fmt.Fprintf(s.stdout, "could not remove %s: %v\n", s.what, err)
		return
	}
	fmt.Fprintf(s.stdout, "removed %s\n", s.what)
	s.cleanup = nil
}

// openScratch makes a place for command to write to, never one it did
// not make: with DATABASE_URL or PG* variables, a database of its own on
// that server (or a schema of its own in the given database, when it may
// not create databases); with neither, a throwaway server from a local
// PostgreSQL installation, or else one fetched by embedded-postgres. It
// says on stdout which it made.
func openScratch(ctx context.Context, stdout io.Writer, command string) (*scratch, error) {
	name := "idem_" + command + "_" + randomHex(4)
	if configured() {
		return scratchOnServer(ctx, stdout, command, os.Getenv("DATABASE_URL"), name)
	}
	// PostgreSQL's durable defaults: bench measures with them.
	srv, localErr := pgtemp.Start(ctx, pgtemp.Config{})
	if localErr == nil {
		s := &scratch{URL: srv.URL, cleanup: srv.Stop, stdout: stdout,
			what: "the throwaway server and its directory " + srv.Dir}
		fmt.Fprintf(stdout, "idem %s: no DATABASE_URL or PG* variables: running in database \"postgres\" of a throwaway PostgreSQL %s (%s, as %s) on 127.0.0.1:%d, removed at the end\n",
			command, srv.Version, srv.BinDir, srv.User, srv.Port)
		return s, nil
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	s, embeddedErr := startEmbedded(ctx, stdout, command)
	if embeddedErr == nil {
		return s, nil
	}
	return nil, cli.DatabaseError{Err: fmt.Errorf(`no database to run on. Tried, in order:
  1. DATABASE_URL and the PG* variables: not set
  2. a throwaway server from a local installation: %v
  3. a server downloaded by embedded-postgres: %v
Set DATABASE_URL (the command creates a database of its own there and drops it at the end), or install PostgreSQL`,
		oneLine(localErr), oneLine(embeddedErr))}
}

func scratchOnServer(ctx context.Context, stdout io.Writer, command, base, name string) (*scratch, error) {
	cfg, err := cli.ParseConfig(base)
	if err != nil {
		return nil, err
	}
	admin, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return nil, cli.DatabaseError{Err: cli.ConnectError(cfg.ConnConfig, err)}
	}
	defer admin.Close(context.Background())
	ident := pgx.Identifier{name}.Sanitize()
	// Identifiers cannot be bound as parameters; the name is ours and quoted.
	_, err = admin.Exec(ctx, "CREATE DATABASE "+ident)
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		target := cfg.ConnConfig.Copy()
		target.Database = name
		s := &scratch{URL: withDatabase(base, name), stdout: stdout, what: fmt.Sprintf("database %q", name)}
		s.cleanup = func() error { return dropScratch(cfg, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)") }
		fmt.Fprintf(stdout, "idem %s: created %s for this run; it is dropped at the end\n", command, cli.Where(target))
		return s, nil
	case errors.As(err, &pgErr) && pgErr.Code == "42501": // insufficient_privilege
		if _, err := admin.Exec(ctx, "CREATE SCHEMA "+ident); err != nil {
			return nil, cli.DatabaseError{Err: fmt.Errorf("may create neither a database nor a schema of its own on %s: %w", cli.Where(cfg.ConnConfig), err)}
		}
		s := &scratch{URL: withSearchPath(base, name), stdout: stdout, what: fmt.Sprintf("schema %q in database %q", name, cfg.ConnConfig.Database)}
		s.cleanup = func() error { return dropScratch(cfg, "DROP SCHEMA IF EXISTS "+ident+" CASCADE") }
		fmt.Fprintf(stdout, "idem %s: may not create a database on %s, so created schema %q there for this run; it is dropped at the end\n",
			command, cli.Where(cfg.ConnConfig), name)
		return s, nil
	default:
		return nil, cli.DatabaseError{Err: fmt.Errorf("create database %s on %s: %w", name, cli.Where(cfg.ConnConfig), err)}
	}
}

// dropScratch runs the statement that removes a scratch database or schema,
// on a context of its own: it runs after an interrupt too.
func dropScratch(cfg *pgxpool.Config, stmt string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, stmt)
	return err
}

// withDatabase points a connection string, URL or key=value (or empty, for
// the PG* variables), at database.
func withDatabase(connString, database string) string {
	if u, err := neturl.Parse(connString); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + database
		return u.String()
	}
	return strings.TrimSpace(connString + " dbname=" + database)
}

// withSearchPath has a connection string's sessions use schema first.
func withSearchPath(connString, schema string) string {
	if u, err := neturl.Parse(connString); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("search_path", schema)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return strings.TrimSpace(connString + " search_path=" + schema)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func oneLine(err error) string {
	s := strings.Join(strings.Fields(err.Error()), " ")
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}
