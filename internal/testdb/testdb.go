// Package testdb gives a package's tests a throwaway PostgreSQL database,
// migrated and dropped again when the tests finish.
//
// The server is, in this order: TEST_DATABASE_URL when set; a postgres
// container started with testcontainers-go where Docker runs; otherwise a
// throwaway server started from a PostgreSQL installation on the machine
// (see internal/pgtemp), as an unprivileged user when the tests run as
// root. When none of them works the test binary fails before running
// anything, saying what it tried and how to fix it: database tests never
// skip, except under -short, which skips them and says so.
//
// Runnable examples open their own pool from DATABASE_URL, as an
// application would; Main points DATABASE_URL at a second, empty database
// of the run's own, so that they never touch the caller's.
//
// With TEST_PGBOUNCER=1, TEST_DATABASE_URL is a transaction pooler
// (PgBouncer in transaction mode, as .ci/pgbouncer runs it) and
// TEST_DIRECT_DATABASE_URL the same server without it: see [BehindPooler]
// and [Env.DirectPool].
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	neturl "net/url"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgtemp"
)

// Env is the database of one test binary.
type Env struct {
	pool      *pgxpool.Pool
	url       string
	name      string
	serverURL string
	// Server says which server the tests run on.
	Server string
	short  bool
}

// BehindPooler reports whether the tests reach PostgreSQL through a
// transaction pooler (TEST_PGBOUNCER=1). A test of something a
// transaction pooler cannot carry, such as LISTEN, does then what the
// README's "Behind PgBouncer" says, taking [Env.DirectPool] for that part.
func BehindPooler() bool { return os.Getenv("TEST_PGBOUNCER") == "1" }

type execMode struct {
	name string
	mode pgx.QueryExecMode
}

// execModes are pgx's query exec modes, under the names its
// default_query_exec_mode setting takes.
var execModes = []execMode{
	{"cache_statement", pgx.QueryExecModeCacheStatement},
	{"cache_describe", pgx.QueryExecModeCacheDescribe},
	{"describe_exec", pgx.QueryExecModeDescribeExec},
	{"exec", pgx.QueryExecModeExec},
	{"simple_protocol", pgx.QueryExecModeSimpleProtocol},
}

// ExecModes returns the pgx query exec modes the tests' server carries:
// every one, or behind a pooler those named in TEST_PGBOUNCER_MODES
// (space-separated default_query_exec_mode names), the modes .ci/pgbouncer
// runs the suites in.
func ExecModes(t testing.TB) []pgx.QueryExecMode {
	t.Helper()
	var out []pgx.QueryExecMode
	if !BehindPooler() {
		for _, m := range execModes {
			out = append(out, m.mode)
		}
		return out
	}
	for _, name := range strings.Fields(os.Getenv("TEST_PGBOUNCER_MODES")) {
		i := slices.IndexFunc(execModes, func(m execMode) bool { return m.name == name })
		if i < 0 {
			t.Fatalf("TEST_PGBOUNCER_MODES names %q, not a pgx exec mode", name)
		}
		out = append(out, execModes[i].mode)
	}
	if len(out) == 0 {
		t.Fatal("TEST_PGBOUNCER=1 needs TEST_PGBOUNCER_MODES: the exec modes the pooler carries")
	}
	return out
}

// DirectPool returns a pool on the throwaway database that reaches
// PostgreSQL itself. Without a pooler that is [Env.Pool]; behind one it is
// a pool of its own on TEST_DIRECT_DATABASE_URL's server, closed when the
// test ends.
func (e *Env) DirectPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := e.Pool(t)
	if !BehindPooler() {
		return pool
	}
	direct := os.Getenv("TEST_DIRECT_DATABASE_URL")
	if direct == "" {
		t.Fatal("TEST_PGBOUNCER=1 needs TEST_DIRECT_DATABASE_URL: the server without the pooler")
	}
	directPool, err := pgxpool.New(context.Background(), withDatabase(direct, e.name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(directPool.Close)
	return directPool
}

// Pool returns the pool of the throwaway database. Under -short it skips
// the test instead.
func (e *Env) Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	if e.short {
		t.Skip("-short: database tests are skipped")
	}
	return e.pool
}

// URL returns the connection string of the throwaway database.
func (e *Env) URL(t testing.TB) string {
	t.Helper()
	e.Pool(t)
	return e.url
}

// EmptyDatabase creates a database with nothing in it, not even idem's
// migrations, drops it when the test ends, and returns its connection string.
func (e *Env) EmptyDatabase(t testing.TB) string {
	t.Helper()
	e.Pool(t)
	ctx := context.Background()
	name := "idem_test_" + randomHex(6)
	if err := createDatabase(ctx, e.serverURL, name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dropDatabase(e.serverURL, name); err != nil {
			t.Error(err)
		}
	})
	return withDatabase(e.serverURL, name)
}

// Main runs the tests of m against a throwaway database, stored in *env,
// and returns the exit code for os.Exit.
func Main(m *testing.M, env **Env) int {
	flag.Parse()
	e := &Env{}
	*env = e
	if testing.Short() {
		e.short = true
		fmt.Fprintln(os.Stderr, "testdb: -short: the database tests and the examples are skipped")
		// Examples cannot skip; keep them from running.
		_ = flag.Set("test.skip", "^Example")
		return m.Run()
	}
	ctx := context.Background()
	cleanup, err := e.start(ctx)
	if err != nil {
		fmt.Fprintf(os.Stderr, "\n%v\n\n", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "testdb: the tests run on %s\n", e.Server)
	// An interrupted run removes what it made too.
	var once sync.Once
	stop := func() { once.Do(cleanup) }
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	go func() {
		sig := <-signals
		fmt.Fprintf(os.Stderr, "testdb: %v: removing the test database and server\n", sig)
		stop()
		os.Exit(1)
	}()
	code := m.Run()
	signal.Stop(signals)
	stop()
	return code
}

// acquire finds a server, in the documented order, and returns its
// connection string, a description, and how to stop it.
func acquire(ctx context.Context) (url, desc string, stop func(), err error) {
	if url := os.Getenv("TEST_DATABASE_URL"); url != "" {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return "", "", nil, fmt.Errorf(`testdb: TEST_DATABASE_URL is set, but %s cannot be used: %w

Fix TEST_DATABASE_URL (each run creates and drops a database of its own
there), or unset it to let the tests start PostgreSQL themselves, in a
container where Docker runs or from a local installation. go test -short
skips the database tests`, redact(url), err)
		}
		_ = conn.Close(ctx)
		return url, "TEST_DATABASE_URL (" + redact(url) + ")", func() {}, nil
	}
	url, stop, containerErr := startContainer(ctx)
	if containerErr == nil {
		return url, "a postgres container (testcontainers-go)", stop, nil
	}
	srv, localErr := pgtemp.Start(ctx, pgtemp.Options{Fast: true})
	if localErr == nil {
		desc := fmt.Sprintf("a throwaway PostgreSQL %s from %s, run as %s in %s", srv.Version, srv.BinDir, srv.User, srv.Dir)
		return srv.URL, desc, func() { _ = srv.Stop() }, nil
	}
	return "", "", nil, fmt.Errorf(`testdb: no PostgreSQL server for the database tests. Tried, in order:
  1. TEST_DATABASE_URL: not set
  2. a container with testcontainers-go: %s
  3. a throwaway server from a local installation: %s
To fix it, do one of these:
  - set TEST_DATABASE_URL=postgres://USER:PASSWORD@HOST:5432/postgres
    (each run creates and drops a database of its own there)
  - start Docker
  - install PostgreSQL (Debian, Ubuntu: apt-get install postgresql;
    macOS: brew install postgresql), or put its initdb and postgres on PATH
or run go test -short to skip the database tests`, oneLine(containerErr), oneLine(localErr))
}

func oneLine(err error) string {
	s := strings.Join(strings.Fields(err.Error()), " ")
	if len(s) > 400 {
		s = s[:400] + "..."
	}
	return s
}

func (e *Env) start(ctx context.Context) (func(), error) {
	serverURL, desc, stopServer, err := acquire(ctx)
	if err != nil {
		return nil, err
	}
	e.Server = desc
	name := "idem_test_" + randomHex(6)
	examples := name + "_examples"
	var made []string
	cleanup := func() {
		if e.pool != nil {
			e.pool.Close()
		}
		for _, db := range made {
			if err := dropDatabase(serverURL, db); err != nil {
				fmt.Fprintf(os.Stderr, "testdb: %v\n", err)
			}
		}
		stopServer()
	}
	fail := func(err error) (func(), error) {
		cleanup()
		return nil, fmt.Errorf("testdb: on %s: %w", desc, err)
	}
	for _, db := range []string{name, examples} {
		if err := createDatabase(ctx, serverURL, db); err != nil {
			return fail(err)
		}
		made = append(made, db)
	}

	cfg, err := pgxpool.ParseConfig(serverURL)
	if err != nil {
		return fail(err)
	}
	cfg.ConnConfig.Database = name
	// Packages test in parallel, each with its own pool.
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	e.pool = pool
	e.url = withDatabase(serverURL, name)
	e.name = name
	e.serverURL = serverURL

	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		return fail(err)
	}
	if _, err := pool.Exec(ctx, AppSchema); err != nil {
		return fail(fmt.Errorf("create app schema: %w", err))
	}
	// The examples connect as an application would, to a database that is
	// theirs.
	if err := os.Setenv("DATABASE_URL", withDatabase(serverURL, examples)); err != nil {
		return fail(err)
	}
	return cleanup, nil
}

func createDatabase(ctx context.Context, serverURL, name string) error {
	admin, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	// Identifiers cannot be bound as parameters; the name is ours and quoted.
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

func dropDatabase(serverURL, name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// AppSchema is the business table the tests write beside their claims, as
// an application would.
const AppSchema = `
CREATE TABLE payment (
    id           bigserial PRIMARY KEY,
    scope        text   NOT NULL,
    key          text   NOT NULL,
    amount_cents bigint NOT NULL
)`

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

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Name returns a name unique to this run, for scopes and keys that must not
// meet another test's.
func Name(prefix string) string { return prefix + "-" + randomHex(8) }

// withDatabase points a connection string, URL or key=value, at database.
func withDatabase(connString, database string) string {
	if u, err := neturl.Parse(connString); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + database
		return u.String()
	}
	return connString + " dbname=" + database
}

func redact(url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "the test database"
	}
	return fmt.Sprintf("%s:%d", cfg.Host, cfg.Port)
}

// CountPayments counts the rows of the tests' payment table in scope.
func CountPayments(t testing.TB, pool *pgxpool.Pool, scope string) int {
	t.Helper()
	return count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, scope)
}

// CountRecords counts idem's records in scope.
func CountRecords(t testing.TB, pool *pgxpool.Pool, scope string) int {
	t.Helper()
	return count(t, pool, `SELECT count(*) FROM idempotency_key WHERE scope = $1`, scope)
}

func count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// Expire moves a record's expiry into the past, as time would.
func Expire(t testing.TB, pool *pgxpool.Pool, scope, key string) {
	t.Helper()
	tag, err := pool.Exec(context.Background(),
		`UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE scope = $1 AND key = $2`, scope, key)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("expire %s/%s: %v (%d rows)", scope, key, err, tag.RowsAffected())
	}
}
