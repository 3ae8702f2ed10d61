package idemsql_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testdb"
)

// TestRoundTripsOnDatabaseSQL counts what Run sends over each
// database/sql driver, next to pgx's pool, on one warm connection: a
// first execution whose fn makes one INSERT, and its replay. database/sql
// has no pipeline, so each statement is a round trip; the figures are in
// docs/database-sql.md.
func TestRoundTripsOnDatabaseSQL(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url := env.URL(t)
	want := map[string]struct{ first, replay testdb.Counts }{
		"pgx":        {first: testdb.Counts{RoundTrips: 3, Statements: 6}, replay: testdb.Counts{RoundTrips: 2, Statements: 4}},
		"pgx-stdlib": {first: testdb.Counts{RoundTrips: 6, Statements: 6}, replay: testdb.Counts{RoundTrips: 4, Statements: 4}},
		"lib-pq":     {first: testdb.Counts{RoundTrips: 10, Statements: 6}, replay: testdb.Counts{RoundTrips: 6, Statements: 4}},
	}
	type runner func(ctx context.Context, scope, key string, calls *atomic.Int64) (bool, error)
	runners := map[string]func(t *testing.T, count *testdb.WireCount) runner{
		"pgx": func(t *testing.T, count *testdb.WireCount) runner {
			cfg, err := pgxpool.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.DialFunc = count.Dial
			cfg.MaxConns = 1
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			return func(ctx context.Context, scope, key string, calls *atomic.Int64) (bool, error) {
				res, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
					calls.Add(1)
					var p payment
					return p, tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1) RETURNING id`, scope, key).Scan(&p.ID)
				})
				return res.Replayed, err
			}
		},
	}
	for _, d := range drivers {
		runners[d.name] = func(t *testing.T, count *testdb.WireCount) runner {
			db := d.open(t, url, count.Dial)
			db.SetMaxOpenConns(1)
			t.Cleanup(func() { _ = db.Close() })
			return func(ctx context.Context, scope, key string, calls *atomic.Int64) (bool, error) {
				res, err := idemsql.Run(ctx, db, scope, key, fpA, pay(scope, key, 1, calls))
				return res.Replayed, err
			}
		}
	}
	for name, w := range want {
		t.Run(name, func(t *testing.T) {
			var count testdb.WireCount
			run := runners[name](t, &count)
			scope := testdb.Name("cost")
			var calls atomic.Int64
			measure := func(key string, wantReplayed bool) testdb.Counts {
				before := count.Counts()
				replayed, err := run(ctx, scope, key, &calls)
				if err != nil || replayed != wantReplayed {
					t.Fatalf("%s: replayed %v, %v; want %v", key, replayed, err, wantReplayed)
				}
				after := count.Counts()
				return testdb.Counts{RoundTrips: after.RoundTrips - before.RoundTrips, Statements: after.Statements - before.Statements}
			}
			// Warm the connection: dialled, statements prepared.
			measure("warm", false)
			measure("warm", true)
			first := measure("k", false)
			replay := measure("k", true)
			t.Logf("%s: first execution %d round trips (%d statements), replay %d (%d)",
				name, first.RoundTrips, first.Statements, replay.RoundTrips, replay.Statements)
			if first != w.first || replay != w.replay {
				t.Errorf("first %+v, replay %+v; want %+v and %+v", first, replay, w.first, w.replay)
			}
		})
	}
}
