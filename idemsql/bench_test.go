package idemsql_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testdb"
)

// BenchmarkRun runs Run's first executions (one INSERT in fn) and replays
// on pgx's pool and on each database/sql driver, one call after another,
// and first executions from eight clients at once, side by side in one
// run:
//
//	go test -run '^$' -bench BenchmarkRun -benchtime 2000x ./idemsql
func BenchmarkRun(b *testing.B) {
	ctx := context.Background()
	url := env.URL(b)
	scope := testdb.Name("bench")
	type runFunc func(key string, calls *atomic.Int64) (bool, error)
	paths := []struct {
		name string
		open func(b *testing.B) runFunc
	}{{"pgx", func(b *testing.B) runFunc {
		pool := env.Pool(b)
		return func(key string, calls *atomic.Int64) (bool, error) {
			res, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
				calls.Add(1)
				var p payment
				return p, tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1) RETURNING id`, scope, key).Scan(&p.ID)
			})
			return res.Replayed, err
		}
	}}}
	for _, d := range drivers {
		paths = append(paths, struct {
			name string
			open func(b *testing.B) runFunc
		}{d.name, func(b *testing.B) runFunc {
			db := d.open(b, url, nil)
			b.Cleanup(func() { _ = db.Close() })
			return func(key string, calls *atomic.Int64) (bool, error) {
				res, err := idemsql.Run(ctx, db, scope, key, fpA, pay(scope, key, 1, calls))
				return res.Replayed, err
			}
		}})
	}
	// Eight clients at once (four per GOMAXPROCS on the 2-core machine),
	// first executions on keys of their own: ops/s is the throughput.
	for _, p := range paths {
		b.Run(p.name+"/first-8-clients", func(b *testing.B) {
			run := p.open(b)
			var calls atomic.Int64
			var next atomic.Int64
			prefix := testdb.Name(p.name)
			b.SetParallelism(4)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					key := prefix + "-" + strconv.FormatInt(next.Add(1), 10)
					if _, err := run(key, &calls); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
		})
	}
	for _, p := range paths {
		for _, replay := range []bool{false, true} {
			name := p.name + "/first"
			if replay {
				name = p.name + "/replay"
			}
			b.Run(name, func(b *testing.B) {
				run := p.open(b)
				var calls atomic.Int64
				prefix := testdb.Name(p.name)
				key := func(i int) string { return prefix + "-" + strconv.Itoa(i) }
				if replay {
					if _, err := run(key(0), &calls); err != nil {
						b.Fatal(err)
					}
				}
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					k := key(i + 1)
					if replay {
						k = key(0)
					}
					replayed, err := run(k, &calls)
					if err != nil || replayed != replay {
						b.Fatalf("replayed %v, %v; want %v", replayed, err, replay)
					}
				}
			})
		}
	}
}
