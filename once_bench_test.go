package idem_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// A consumer's batch: n messages applied in one transaction, each message's
// effect one INSERT (one round trip). The benchmarks below time the same
// batch three ways, interleaved in each iteration and in alternating order,
// so that the machine's noise falls on all of them alike:
//
//   - bare: the n INSERTs alone, no idempotency;
//   - OnceEach: the batch claimed in one statement, then the n INSERTs;
//   - Once: one Once per message, around its INSERT.
//
// Each reports the time per message of each way, the ratios to bare, and
// the round trips per message of each way (COMMIT included), a figure the
// machine's noise does not change.

// batchWay applies a batch of ids of scope in tx, one way.
type batchWay func(ctx context.Context, tx pgx.Tx, scope string, ids []string) error

func insertPayment(ctx context.Context, tx pgx.Tx, scope, id string) error {
	_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, scope, id)
	return err
}

func bareBatch(ctx context.Context, tx pgx.Tx, scope string, ids []string) error {
	for _, id := range ids {
		if err := insertPayment(ctx, tx, scope, id); err != nil {
			return err
		}
	}
	return nil
}

func onceEachBatch(ctx context.Context, tx pgx.Tx, scope string, ids []string) error {
	_, err := idem.OnceEach(ctx, tx, scope, ids, func(ctx context.Context, tx pgx.Tx, i int) error {
		return insertPayment(ctx, tx, scope, ids[i])
	})
	return err
}

func oncePerMessage(ctx context.Context, tx pgx.Tx, scope string, ids []string) error {
	for _, id := range ids {
		if _, err := idem.Once(ctx, tx, scope, id, func(ctx context.Context, tx pgx.Tx) error {
			return insertPayment(ctx, tx, scope, id)
		}); err != nil {
			return err
		}
	}
	return nil
}

// timeBatch applies n fresh messages in one transaction on one connection,
// COMMIT included, and returns how long it took.
func timeBatch(b *testing.B, ctx context.Context, pool *pgxpool.Pool, n int, way batchWay) time.Duration {
	b.Helper()
	scope := testdb.Name("b")
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("msg-%06d", i)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Release()
	start := time.Now()
	err = idem.WithTx(ctx, conn, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		return way(ctx, tx, scope, ids)
	})
	elapsed := time.Since(start)
	if err != nil {
		b.Fatal(err)
	}
	return elapsed
}

// benchBatches times the ways named in ways at each batch size, against
// bare.
func benchBatches(b *testing.B, sizes []int, ways map[string]batchWay) {
	ctx := context.Background()
	// One connection, whose round trips are counted.
	var wire testdb.WireCount
	cfg, err := pgxpool.ParseConfig(env.URL(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 1
	cfg.ConnConfig.DialFunc = wire.Dial
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	names := []string{"bare"}
	for name := range ways {
		names = append(names, name)
	}
	ways["bare"] = bareBatch
	for _, n := range sizes {
		b.Run(fmt.Sprintf("messages=%d", n), func(b *testing.B) {
			spent := make(map[string]time.Duration, len(names))
			trips := make(map[string]int64, len(names))
			iter := 0
			for b.Loop() {
				// Alternate the order, so that neither way always runs
				// first (on a cold cache) or last.
				for j := range names {
					name := names[(j+iter)%len(names)]
					before := wire.Counts().RoundTrips
					spent[name] += timeBatch(b, ctx, pool, n, ways[name])
					trips[name] += wire.Counts().RoundTrips - before
				}
				iter++
			}
			per := func(name string) float64 {
				return float64(spent[name].Microseconds()) / float64(iter*n)
			}
			for _, name := range names {
				b.ReportMetric(per(name), "µs/msg-"+name)
				b.ReportMetric(float64(trips[name])/float64(iter*n), "trips/msg-"+name)
				if name != "bare" {
					b.ReportMetric(per(name)/per("bare"), name+"/bare")
				}
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}

// BenchmarkOnceEachVsBare: run it with
//
//	go test -run '^$' -bench OnceEachVsBare -benchtime 7x .
func BenchmarkOnceEachVsBare(b *testing.B) {
	benchBatches(b, []int{100, 1000, 10_000}, map[string]batchWay{"onceeach": onceEachBatch})
}

// BenchmarkOncePerMessageVsBare: run it with
//
//	go test -run '^$' -bench OncePerMessageVsBare -benchtime 5x .
func BenchmarkOncePerMessageVsBare(b *testing.B) {
	benchBatches(b, []int{100, 1000, 2000}, map[string]batchWay{"once": oncePerMessage})
}
