package idemsql_test

import (
	"context"
	"database/sql"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/lib/pq"

	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/testdb"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// driver opens a *sql.DB on the tests' database through one database/sql
// driver.
type driver struct {
	name string
	open func(t testing.TB, url string, dial dialFunc) *sql.DB
}

// dialFunc dials the server: a testdb.WireCount's Dial, to count what a
// driver sends.
type dialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

// pqDialer is lib/pq's Dialer over a dialFunc.
type pqDialer struct{ dial dialFunc }

func (d pqDialer) Dial(network, addr string) (net.Conn, error) {
	return d.dial(context.Background(), network, addr)
}

func (d pqDialer) DialTimeout(network, addr string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.dial(ctx, network, addr)
}

func (d pqDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	return d.dial(ctx, network, addr)
}

// drivers are the database/sql drivers idemsql is proven with: pgx's
// stdlib driver and lib/pq.
var drivers = []driver{
	{"pgx-stdlib", func(t testing.TB, url string, dial dialFunc) *sql.DB {
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		if dial != nil {
			cfg.DialFunc = pgconn.DialFunc(dial)
		}
		return stdlib.OpenDB(*cfg)
	}},
	{"lib-pq", func(t testing.TB, url string, dial dialFunc) *sql.DB {
		connector, err := pq.NewConnector(url)
		if err != nil {
			t.Fatal(err)
		}
		if dial != nil {
			connector.Dialer(pqDialer{dial})
		}
		return sql.OpenDB(connector)
	}},
}

// forEachDriver runs test as a parallel subtest per driver, with a *sql.DB
// of that driver (at most 20 connections, closed when the subtest ends),
// the tests' pgx pool for checks, and a scope of its own.
func forEachDriver(t *testing.T, test func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string)) {
	t.Parallel()
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			pool := env.Pool(t)
			db := d.open(t, env.URL(t), nil)
			db.SetMaxOpenConns(20)
			t.Cleanup(func() { _ = db.Close() })
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			t.Cleanup(cancel)
			test(t, ctx, db, pool, testdb.Name("sql"))
		})
	}
}

// payment is the business write's value, stored and replayed.
type payment struct {
	ID          int64 `json:"id"`
	AmountCents int64 `json:"amount_cents"`
}

// pay inserts one payment row on tx, the transaction idem gave fn, and
// counts the calls.
func pay(scope, key string, amount int64, calls *atomic.Int64) func(context.Context, *sql.Tx) (payment, error) {
	return func(ctx context.Context, tx *sql.Tx) (payment, error) {
		calls.Add(1)
		p := payment{AmountCents: amount}
		err := tx.QueryRowContext(ctx,
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			scope, key, amount).Scan(&p.ID)
		return p, err
	}
}

// waitForKeyWaiters waits until n sessions wait for the lock of (scope,
// key).
func waitForKeyWaiters(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string, n int) {
	t.Helper()
	id := uint64(keylock.ID(scope, key))
	for {
		var waiting int
		if err := pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_locks
			 WHERE locktype = 'advisory' AND NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			   AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1`,
			int64(id>>32), int64(id&0xffffffff)).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting >= n {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d sessions waiting for the key, want %d: %v", waiting, n, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}
