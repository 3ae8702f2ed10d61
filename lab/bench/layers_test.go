package bench_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/lab/bench"
)

// BenchmarkLayersBelowPgx measures the layers idem wrote beneath pgx
// (dbsqlc.Wire, Run's claim and record as prepared pgconn batches;
// dbsqlc.SendFlat, a flow's batches likewise) against pgx's own batches,
// which send the same statements in the same round trips: Run's first
// executions and local-call-local flows with an instant provider, each
// both ways, interleaved, at 8 and 32 clients, CPU-bound (the server on
// this machine) and through a proxy that adds 1ms to each round trip. It
// reports, for Run and for the flow, the throughput below pgx over the
// throughput through pgx, and the p50 latencies' ratio the other way
// round (above 1: faster below pgx).
//
//	go test -run '^$' -bench LayersBelowPgx -benchtime 3x ./lab/bench
func BenchmarkLayersBelowPgx(b *testing.B) {
	direct := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, direct); err != nil {
		b.Fatal(err)
	}
	if err := bench.CreateFlowSchema(ctx, direct); err != nil {
		b.Fatal(err)
	}
	defer dbsqlc.BelowPgx.Store(true)
	delayed, proxy, err := bench.DelayedPool(ctx, direct.Config(), time.Millisecond, 40)
	if err != nil {
		b.Fatal(err)
	}
	defer proxy.Close()
	defer delayed.Close()
	cfg := direct.Config().Copy()
	cfg.MaxConns = 40
	cpu, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer cpu.Close()
	for _, net := range []struct {
		name string
		pool *pgxpool.Pool
	}{{"cpu", cpu}, {"1ms", delayed}} {
		for _, clients := range []int{8, 32} {
			b.Run(fmt.Sprintf("net=%s/clients=%d", net.name, clients), func(b *testing.B) {
				scope := testdb.Name("bench-layers")
				run := bench.StandardPhases(net.pool, scope)[1] // run-first
				flow := bench.FlowPhases(net.pool, net.pool, bench.NewProvider(0), scope)[0]
				var phases []bench.Phase
				for _, p := range []bench.Phase{run, flow} {
					for _, below := range []bool{true, false} {
						name := p.Name + "/pgx"
						if below {
							name = p.Name + "/below"
						}
						op := p.Op
						phases = append(phases, bench.Phase{Name: name, Op: func(ctx context.Context, i int64) error {
							dbsqlc.BelowPgx.Store(below)
							return op(ctx, i)
						}})
					}
				}
				if _, err := bench.Interleave(ctx, phases, clients, 1, int64(4*clients)); err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				totals, err := bench.Interleave(ctx, phases, clients, b.N, 300)
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				for _, name := range []string{"run-first", "flow"} {
					below, pgx := totals[name+"/below"], totals[name+"/pgx"]
					b.ReportMetric(below.Throughput()/pgx.Throughput(), name+"-below/pgx-ops")
					b.ReportMetric(float64(pgx.Percentile(0.5))/float64(below.Percentile(0.5)), name+"-pgx/below-p50")
					b.ReportMetric(pgx.Throughput(), name+"-pgx-ops/s")
				}
			})
		}
	}
}
