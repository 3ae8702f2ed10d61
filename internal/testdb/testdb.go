// Package testdb gives a package's tests a throwaway PostgreSQL database,
// migrated and dropped again when the tests finish.
//
// The server is the one idemtest's tests get, found in the same order by
// the same code (internal/testserver): TEST_DATABASE_URL when set; a
// postgres container started with testcontainers-go where Docker runs;
// otherwise a throwaway server started from a PostgreSQL installation on
// the machine (see internal/pgtemp), as an unprivileged user when the tests
// run as root. When none of them works the test binary fails before
// running anything, saying what it tried and how to fix it: database tests
// never skip, except under -short, which skips them and says so.
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
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/faultproxy"
	"github.com/pgidem/idem/internal/testserver"
)

// Env is the database of one test binary.
type Env struct {
	pool   *pgxpool.Pool
	url    string
	name   string
	server *testserver.Server
}

// BehindPooler reports whether the tests reach PostgreSQL through a
// transaction pooler (TEST_PGBOUNCER=1). A test of something a
// transaction pooler cannot carry, such as LISTEN, does then what the
// docs/pgbouncer.md says, taking [Env.DirectPool] for that part.
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
	directPool, err := pgxpool.New(context.Background(), testserver.WithDatabase(direct, e.name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(directPool.Close)
	return directPool
}

// DirectURL returns url, of a database of the tests' server, as it
// reaches PostgreSQL itself: url without a pooler; behind one, the same
// database on TEST_DIRECT_DATABASE_URL's server. A test of sessions (their
// settings) takes it, since a transaction pooler gives a client's
// transactions to sessions of its own.
func DirectURL(t testing.TB, url string) string {
	t.Helper()
	if !BehindPooler() {
		return url
	}
	direct := os.Getenv("TEST_DIRECT_DATABASE_URL")
	if direct == "" {
		t.Fatal("TEST_PGBOUNCER=1 needs TEST_DIRECT_DATABASE_URL: the server without the pooler")
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return testserver.WithDatabase(direct, cfg.Database)
}

// Pool returns the pool of the throwaway database. Under -short it skips
// the test instead.
func (e *Env) Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	if testing.Short() {
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
	name := "idem_test_" + testserver.RandomHex(6)
	if err := e.server.CreateDatabase(ctx, name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.server.DropDatabase(name); err != nil {
			t.Error(err)
		}
	})
	return e.server.DatabaseURL(name)
}

// Main runs the tests of m against a throwaway database, stored in *env,
// and returns the exit code for os.Exit.
func Main(m *testing.M, env **Env) int {
	e := &Env{}
	*env = e
	return testserver.Run(m, testserver.Config{Prefix: "testdb", SkipExamples: true, Setup: e.start})
}

// start creates the binary's database, migrated and with AppSchema, and
// the examples' empty one, and returns what drops them.
func (e *Env) start(ctx context.Context, s *testserver.Server) (func(), error) {
	e.server = s
	name := "idem_test_" + testserver.RandomHex(6)
	examples := name + "_examples"
	var made []string
	cleanup := func() {
		if e.pool != nil {
			e.pool.Close()
		}
		for _, db := range made {
			if err := s.DropDatabase(db); err != nil {
				fmt.Fprintf(os.Stderr, "testdb: %v\n", err)
			}
		}
	}
	fail := func(err error) (func(), error) {
		cleanup()
		return nil, err
	}
	for _, db := range []string{name, examples} {
		if err := s.CreateDatabase(ctx, db); err != nil {
			return fail(err)
		}
		made = append(made, db)
	}

	cfg, err := pgxpool.ParseConfig(s.URL)
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
	e.url = s.DatabaseURL(name)
	e.name = name

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
	if err := os.Setenv("DATABASE_URL", s.DatabaseURL(examples)); err != nil {
		return fail(err)
	}
	return cleanup, nil
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

// Name returns a name unique to this run, for scopes and keys that must not
// meet another test's.
func Name(prefix string) string { return prefix + "-" + testserver.RandomHex(8) }

// CountPayments counts the rows of the tests' payment table in scope.
func CountPayments(t testing.TB, pool *pgxpool.Pool, scope string) int {
	t.Helper()
	return Count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, scope)
}

// CountRecords counts idem's records in scope.
func CountRecords(t testing.TB, pool *pgxpool.Pool, scope string) int {
	t.Helper()
	return Count(t, pool, `SELECT count(*) FROM idempotency_key WHERE scope = $1`, scope)
}

// Count returns the number that sql, given args, counts.
func Count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// WaitForBlocked returns once some session waits for a lock that the
// session pid holds: a duplicate request or call is waiting on the claim.
func WaitForBlocked(ctx context.Context, t testing.TB, pool *pgxpool.Pool, pid int32) {
	t.Helper()
	for {
		var waiting bool
		err := pool.QueryRow(ctx,
			`SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid)))`, pid).Scan(&waiting)
		if err != nil {
			t.Fatalf("look for a waiting duplicate: %v", err)
		}
		if waiting {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal("no duplicate waited for the first")
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// Setup marks the test parallel and returns a context that ends with it
// (within two minutes), the pool of a database of the test's own, and a
// name no other test uses, for a scope or tenant.
func (e *Env) Setup(t *testing.T, prefix string) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	t.Parallel()
	pool := e.Pool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx, pool, Name(prefix)
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

// StartFreezer starts a faultproxy.Freezer in front of the PostgreSQL
// server at host and port, closed when the test ends.
func StartFreezer(t testing.TB, host string, port uint16) *faultproxy.Freezer {
	t.Helper()
	f, err := faultproxy.StartFreezer(faultproxy.PostgresAddress(host, port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f
}

// FlowStep returns the step named step of the flow (scope, key), as
// idem.InspectFlow reads it, and fails the test if there is none.
func FlowStep(t testing.TB, ctx context.Context, pool *pgxpool.Pool, scope, key, step string) idem.FlowStep {
	t.Helper()
	info, err := idem.InspectFlow(ctx, pool, scope, key)
	if err != nil || !info.Found {
		t.Fatalf("no flow for %s: %v", key, err)
	}
	for _, s := range info.Steps {
		if s.Name == step {
			return s
		}
	}
	t.Fatalf("the flow for %s has no step named %s: %+v", key, step, info.Steps)
	return idem.FlowStep{}
}

// CallersTx acquires a connection of pool and begins a caller's
// transaction on it that writes a payment in scope and, when state is
// "failed", then fails, for a test of a call that must refuse a connection
// in a transaction. db is the connection as the call gets it: its
// *pgx.Conn when kind is "pgx.Conn", else the *pgxpool.Conn. want is the
// status the transaction must keep: 'T' open, 'E' failed. The connection
// is released when the test ends.
func CallersTx(t testing.TB, ctx context.Context, pool *pgxpool.Pool, kind, state, scope string) (conn *pgxpool.Conn, db idem.TxBeginner, tx pgx.Tx, want byte) {
	t.Helper()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	db = conn
	if kind == "pgx.Conn" {
		db = conn.Conn()
	}
	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'caller', 1)`, scope); err != nil {
		t.Fatal(err)
	}
	want = 'T'
	if state == "failed" {
		want = 'E'
		if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
			t.Fatal("SELECT 1/0 did not fail")
		}
	}
	return conn, db, tx, want
}
