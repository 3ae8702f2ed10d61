package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

// benchPool is a pool big enough for the writers and relays of the
// benchmarks, on the test database.
func benchPool(b *testing.B) *pgxpool.Pool {
	b.Helper()
	config, err := pgxpool.ParseConfig(env.URL(b))
	if err != nil {
		b.Fatal(err)
	}
	config.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), config)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

// bareInserts commits n one-row INSERT transactions from writers goroutines
// and returns how long they took: the commit rate the relays are measured
// against. Each is BEGIN, INSERT, COMMIT, as the root package's bare
// transaction, or with autocommit the INSERT alone, one round trip.
func bareInserts(b *testing.B, ctx context.Context, pool *pgxpool.Pool, n, writers int, autocommit bool) time.Duration {
	b.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range writers {
		wg.Go(func() {
			for next.Add(1) <= int64(n) {
				var err error
				if autocommit {
					_, err = pool.Exec(ctx, `INSERT INTO bench_bare (payload) VALUES ($1)`, []byte("payload"))
				} else {
					err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
						_, err := tx.Exec(ctx, `INSERT INTO bench_bare (payload) VALUES ($1)`, []byte("payload"))
						return err
					})
				}
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}

// BenchmarkRelayVersusBareInsert measures, side by side in each iteration,
// the rate at which relays with the default configuration (batches of 50;
// and, for comparison, batches of 10) deliver messages to a no-op handler,
// outcomes recorded, and the rate at
// which the same server commits bare one-row INSERT transactions from 8
// writers: BEGIN, INSERT, COMMIT as the root package's bare transaction,
// and the INSERT alone in autocommit, one round trip. Run it with
//
//	go test -run '^$' -bench RelayVersusBareInsert -benchtime 3x ./outbox/
func BenchmarkRelayVersusBareInsert(b *testing.B) {
	const messages, writers = 10_000, 8
	pool := benchPool(b)
	ctx := context.Background()
	// The package's throwaway database is the benchmark's alone.
	if _, err := pool.Exec(ctx, `CREATE TABLE bench_bare (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload bytea NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP TABLE bench_bare`) })
	for _, c := range []struct{ relays, batch int }{{4, 0}, {8, 0}, {4, 10}, {8, 10}} {
		name := fmt.Sprintf("relays=%d/batch=default", c.relays)
		if c.batch != 0 {
			name = fmt.Sprintf("relays=%d/batch=%d", c.relays, c.batch)
		}
		b.Run(name, func(b *testing.B) {
			var bareTx, bareAuto, relayTime time.Duration
			for b.Loop() {
				bareTx += bareInserts(b, ctx, pool, messages, writers, false)
				relayTime += deliverAll(b, ctx, pool, messages, c.relays, c.batch)
				bareAuto += bareInserts(b, ctx, pool, messages, writers, true)
			}
			rate := func(d time.Duration) float64 { return float64(b.N*messages) / d.Seconds() }
			b.ReportMetric(rate(bareTx), "bare-tx/s")
			b.ReportMetric(rate(bareAuto), "bare-autocommit/s")
			b.ReportMetric(rate(relayTime), "delivered/s")
			b.ReportMetric(rate(relayTime)/rate(bareTx), "delivered/bare-tx")
			b.ReportMetric(rate(relayTime)/rate(bareAuto), "delivered/bare-autocommit")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// deliverAll enqueues n messages, untimed, then runs relays with the
// default configuration but batch (0 for the default) until every one is
// recorded as delivered, and returns how long that took.
func deliverAll(b *testing.B, ctx context.Context, pool *pgxpool.Pool, n, relays, batch int) time.Duration {
	b.Helper()
	scope, dest := testdb.Name("s"), testdb.Name("dest")
	all := entries(scope, dest, n)
	for i := 0; i < n; i += 500 {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := outbox.EnqueueMany(ctx, tx, all[i:min(i+500, n)])
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	// Measure the steady state that autovacuum keeps: the table analyzed
	// (a table that grew this fast is analyzed within a minute or so;
	// until then the planner, going by the empty table's statistics, reads
	// every due message to lease ten) and the earlier iterations' dead rows
	// vacuumed away (each delivery leaves two behind, which every lease
	// scans past until vacuum removes them).
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE outbox_message`); err != nil {
		b.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	// The handlers say when the last message has been handed over; only
	// then does the benchmark look, in the database, for the last outcomes
	// to be recorded, so that its own queries do not compete with the
	// relays'.
	var handled atomic.Int64
	allHandled := make(chan struct{})
	handler := func(context.Context, outbox.Message) error {
		if handled.Add(1) == int64(n) {
			close(allHandled)
		}
		return nil
	}
	start := time.Now()
	for range relays {
		relay, err := outbox.NewRelay(pool, handler, &outbox.Config{Destinations: []string{dest}, BatchSize: batch})
		if err != nil {
			b.Fatal(err)
		}
		wg.Go(func() { _ = relay.Run(runCtx) })
	}
	<-allHandled
	for {
		var pending int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE destination = $1 AND state = 'pending'`, dest).Scan(&pending)
		if err != nil {
			b.Fatal(err)
		}
		if pending == 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(start)
	cancel()
	wg.Wait()
	if _, err := pool.Exec(ctx, `DELETE FROM outbox_message WHERE destination = $1`, dest); err != nil {
		b.Fatal(err)
	}
	return elapsed
}

// BenchmarkEnqueueManyVersusEnqueue measures, side by side, enqueuing 500
// messages in one transaction with one Enqueue call each and with one
// EnqueueMany call.
func BenchmarkEnqueueManyVersusEnqueue(b *testing.B) {
	const perTx = 500
	pool := benchPool(b)
	ctx := context.Background()
	dest := testdb.Name("dest")
	b.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DELETE FROM outbox_message WHERE destination = $1`, dest)
	})
	var one, many time.Duration
	for b.Loop() {
		scope := testdb.Name("s")
		all := entries(scope, dest, 2*perTx)
		for i := range all[perTx:] {
			all[perTx+i].Key += "-many"
		}
		start := time.Now()
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			for _, e := range all[:perTx] {
				if _, err := outbox.Enqueue(ctx, tx, e); err != nil {
					return err
				}
			}
			return nil
		})
		one += time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		start = time.Now()
		err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := outbox.EnqueueMany(ctx, tx, all[perTx:])
			return err
		})
		many += time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*perTx)/one.Seconds(), "enqueue-msgs/s")
	b.ReportMetric(float64(b.N*perTx)/many.Seconds(), "enqueuemany-msgs/s")
	b.ReportMetric(one.Seconds()/many.Seconds(), "many/one")
	b.ReportMetric(0, "ns/op")
}
