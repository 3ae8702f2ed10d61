// Package testdb gives a package's tests a throwaway PostgreSQL database,
// migrated and dropped again when the tests finish.
//
// The server is TEST_DATABASE_URL when set, or else a postgres container
// started with testcontainers-go. When neither is available the database
// tests skip, except with CI=true, where they fail: a CI run must never
// pass by skipping them.
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
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/pgidem/idem"
)

// Env is the database of one test binary.
type Env struct {
	pool      *pgxpool.Pool
	url       string
	name      string
	serverURL string
	err       error
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

// Pool returns the pool of the throwaway database, or ends the test: it
// skips when no server is available, and fails instead when CI=true.
func (e *Env) Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	if e.err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no test database (CI=true, so this fails instead of skipping): %v", e.err)
		}
		t.Skipf("no test database: %v", e.err)
	}
	return e.pool
}

// ExamplePool returns the pool for runnable examples, which have no
// testing.TB. Main keeps examples from running when there is no database.
func (e *Env) ExamplePool() *pgxpool.Pool { return e.pool }

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
	admin, err := pgx.Connect(ctx, e.serverURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	name := "idem_test_" + randomHex(6)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		admin, err := pgx.Connect(ctx, e.serverURL)
		if err != nil {
			t.Error(err)
			return
		}
		defer admin.Close(ctx)
		_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	})
	return withDatabase(e.serverURL, name)
}

// Main runs the tests of m against a throwaway database, stored in *env,
// and returns the exit code for os.Exit.
func Main(m *testing.M, env **Env) int {
	flag.Parse()
	ctx := context.Background()
	e := &Env{}
	*env = e
	cleanup, err := e.start(ctx)
	if err != nil {
		e.err = err
		fmt.Fprintf(os.Stderr, "testdb: %v\n", err)
		if os.Getenv("CI") != "true" {
			// Examples cannot skip: keep them from failing for want of a
			// server. Tests skip one by one and say why.
			_ = flag.Set("test.skip", "^Example")
		}
	}
	code := m.Run()
	if cleanup != nil {
		cleanup()
	}
	return code
}

func (e *Env) start(ctx context.Context) (func(), error) {
	serverURL := os.Getenv("TEST_DATABASE_URL")
	var stopContainer func()
	if serverURL == "" {
		url, stop, err := startContainer(ctx)
		if err != nil {
			return nil, fmt.Errorf("TEST_DATABASE_URL is not set and no postgres container could be started: %w", err)
		}
		serverURL, stopContainer = url, stop
	}

	admin, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		if stopContainer != nil {
			stopContainer()
		}
		return nil, fmt.Errorf("connect to %s: %w", redact(serverURL), err)
	}
	name := "idem_test_" + randomHex(6)
	// Identifiers cannot be bound as parameters; the name is ours and quoted.
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		admin.Close(ctx)
		return nil, fmt.Errorf("create database: %w", err)
	}
	cleanup := func() {
		if e.pool != nil {
			e.pool.Close()
		}
		dropCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = admin.Exec(dropCtx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		admin.Close(dropCtx)
		if stopContainer != nil {
			stopContainer()
		}
	}

	cfg, err := pgxpool.ParseConfig(serverURL)
	if err != nil {
		cleanup()
		return nil, err
	}
	cfg.ConnConfig.Database = name
	// Packages test in parallel, each with its own pool, against a server
	// that allows 100 connections in all.
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		cleanup()
		return nil, err
	}
	e.pool = pool
	e.url = withDatabase(serverURL, name)
	e.name = name
	e.serverURL = serverURL

	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		cleanup()
		return nil, err
	}
	if _, err := pool.Exec(ctx, appSchema); err != nil {
		cleanup()
		return nil, fmt.Errorf("create app schema: %w", err)
	}
	return cleanup, nil
}

// appSchema is the business table the tests write beside their claims, as
// an application would.
const appSchema = `
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
