package idem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/bench"
	"github.com/pgidem/idem/internal/testdb"
)

// setupOwnDatabase is setup on a migrated database of the test's own, for
// tests of purging, which deletes every scope's expired records.
func setupOwnDatabase(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	ctx, _, scope := setup(t)
	pool, err := pgxpool.New(ctx, env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		t.Fatal(err)
	}
	if err := bench.CreateSchema(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return ctx, pool, scope
}

func TestPurgerDeletesExpiredInTheBackground(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	var calls atomic.Int64
	for i := range 12 {
		key := fmt.Sprintf("k%d", i)
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
		if i < 10 {
			expire(t, pool, scope, key)
		}
	}
	purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Batch: 3, Pause: time.Millisecond, Interval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for countRecords(t, pool, scope) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("purger left %d records, want the 2 live ones", countRecords(t, pool, scope))
		}
		time.Sleep(5 * time.Millisecond)
	}
	purger.Stop()
	purger.Stop() // a second Stop is harmless
	if purger.Deleted() != 10 {
		t.Fatalf("Deleted() = %d, want 10", purger.Deleted())
	}
	if _, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Batch: -1}); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("negative batch: %v, want ErrInvalidOption", err)
	}
}

func TestPurgerStopsWithItsContext(t *testing.T) {
	ctx, pool, _ := setupOwnDatabase(t)
	ctx, cancel := context.WithCancel(ctx)
	purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	stopped := make(chan struct{})
	go func() { purger.Stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("purger did not stop after its context was cancelled")
	}
}

// BenchmarkPurgerMillionRows fills the table with a million expired
// records, then measures claim latency at 8 clients without and with the
// purger running, and the purger's rate. It reports rows/s and the p50/p99
// latency ratios (with purger / without). It takes about a minute; run it
// alone: go test -run '^$' -bench PurgerMillion -benchtime 1x
func BenchmarkPurgerMillionRows(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, pool); err != nil {
		b.Fatal(err)
	}
	for range b.N {
		scope := testdb.Name("purge-bench")
		// Test data, written the fast way: a million records that expired.
		if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_key (scope, key, fingerprint, state, response, created_at, expires_at)
SELECT $1, 'expired-' || g, '\x00', 'done', '{"id": 1}', now() - interval '2 days', now() - interval '1 day'
FROM generate_series(1, 1000000) AS g`, scope); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `VACUUM ANALYZE idempotency_key`); err != nil {
			b.Fatal(err)
		}
		phases := bench.StandardPhases(pool, scope)[1:2] // Run, first executions
		measure := func() *bench.Stats {
			s, err := bench.Measure(ctx, phases[0], 8, 3000)
			if err != nil {
				b.Fatal(err)
			}
			return s
		}
		without := measure()

		purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{})
		if err != nil {
			b.Fatal(err)
		}
		started := time.Now()
		var with *bench.Stats
		var wg sync.WaitGroup
		wg.Go(func() { with = measure() })
		for purger.Deleted() < 1000000 {
			time.Sleep(10 * time.Millisecond)
		}
		purgeTime := time.Since(started)
		wg.Wait()
		purger.Stop()

		b.ReportMetric(1000000/purgeTime.Seconds(), "purged-rows/s")
		b.ReportMetric(float64(with.Percentile(0.5))/float64(without.Percentile(0.5)), "p50-with/without")
		b.ReportMetric(float64(with.Percentile(0.99))/float64(without.Percentile(0.99)), "p99-with/without")
		b.ReportMetric(with.Throughput()/without.Throughput(), "tx/s-with/without")
	}
}
