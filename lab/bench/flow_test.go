package bench_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/lab/bench"
)

// flowBenchConns is the pool size of the flow comparison: a service's
// realistic pool, smaller than its clients.
const flowBenchConns = 10

// BenchmarkFlowVsTxHeldAcrossCall compares, interleaved in one run, a
// payment that calls a provider done as an idem flow (a local step that
// reserves it, the call with no transaction open, a local step that
// records the charge) and done by hand the unsafe way (one transaction
// held open across the call), each on a pool of its own of 10
// connections, at 8 and 32 clients, with an in-process provider that
// answers at once and one that takes 50ms. Each iteration is one round of
// every phase (400 operations each, 200 with the slow provider). It
// reports each design's throughput and their ratio, p50 and p99 latency,
// the most connections its pool had handed out at once and the mean over
// the phase's time, and the time an operation waited for a connection.
//
//	go test -run '^$' -bench FlowVsTxHeldAcrossCall -benchtime 3x ./lab/bench
func BenchmarkFlowVsTxHeldAcrossCall(b *testing.B) {
	direct := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateFlowSchema(ctx, direct); err != nil {
		b.Fatal(err)
	}
	flowPool, flowGauge := gaugedPool(b, direct.Config())
	heldPool, heldGauge := gaugedPool(b, direct.Config())
	for _, latency := range []time.Duration{0, 50 * time.Millisecond} {
		for _, clients := range []int{8, 32} {
			b.Run(fmt.Sprintf("provider=%s/clients=%d", latency, clients), func(b *testing.B) {
				scope := testdb.Name("bench-flow")
				phases := bench.FlowPhases(flowPool, heldPool, bench.NewProvider(latency), scope)
				// Open the connections and warm their statement caches.
				if _, err := bench.Interleave(ctx, phases, clients, 1, int64(2*clients)); err != nil {
					b.Fatal(err)
				}
				ops := int64(400)
				if latency > 0 {
					ops = 200
				}
				flowGauge.Reset()
				heldGauge.Reset()
				flowWait, heldWait := flowPool.Stat().EmptyAcquireWaitTime(), heldPool.Stat().EmptyAcquireWaitTime()
				b.ResetTimer()
				totals, err := bench.Interleave(ctx, phases, clients, b.N, ops)
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				flow, held := totals["flow"], totals["tx-held"]
				b.ReportMetric(flow.Throughput(), "flow-ops/s")
				b.ReportMetric(held.Throughput(), "held-ops/s")
				b.ReportMetric(flow.Throughput()/held.Throughput(), "flow/held")
				for _, d := range []struct {
					name  string
					stats *bench.Stats
					gauge *bench.ConnGauge
					pool  *pgxpool.Pool
					wait  time.Duration
				}{{"flow", flow, flowGauge, flowPool, flowWait}, {"held", held, heldGauge, heldPool, heldWait}} {
					peak, heldTime := d.gauge.Read()
					ms := func(t time.Duration) float64 { return float64(t) / float64(time.Millisecond) }
					b.ReportMetric(ms(d.stats.Percentile(0.5)), d.name+"-p50-ms")
					b.ReportMetric(ms(d.stats.Percentile(0.99)), d.name+"-p99-ms")
					b.ReportMetric(float64(peak), d.name+"-peak-conns")
					b.ReportMetric(float64(heldTime)/float64(d.stats.Elapsed), d.name+"-mean-conns")
					b.ReportMetric(ms(d.pool.Stat().EmptyAcquireWaitTime()-d.wait)/float64(d.stats.Ops), d.name+"-conn-wait-ms/op")
				}
			})
		}
	}
}

// BenchmarkFlowPerOperation reports what one payment costs each design,
// one at a time, with a provider that answers at once: round trips
// (through a proxy that adds 1ms to each, bench.DelayProxy) and the
// median time an operation took through it, heap
// allocations, the WAL bytes written (bench.DatabaseWAL, full-page
// images left out) and the transactions committed that wrote (its COMMIT
// records). -v logs where the bytes go.
//
//	go test -run '^$' -bench FlowPerOperation -benchtime 1x -v ./lab/bench
func BenchmarkFlowPerOperation(b *testing.B) {
	direct := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateFlowSchema(ctx, direct); err != nil {
		b.Fatal(err)
	}
	delayed, proxy, err := bench.DelayedPool(ctx, direct.Config(), time.Millisecond, 4)
	if err != nil {
		b.Fatal(err)
	}
	defer proxy.Close()
	defer delayed.Close()
	p := bench.NewProvider(0)
	meter := bench.Meter{RoundTrips: proxy.RoundTrips}
	// Each its own scope: each set of phases numbers its keys from 1.
	throughProxy := bench.FlowPhases(delayed, delayed, p, testdb.Name("bench-flow-trips"))
	onServer := bench.FlowPhases(direct, direct, p, testdb.Name("bench-flow-wal"))
	// Warm the statement caches, on both pools.
	if _, err := meter.Interleave(ctx, throughProxy, 1, 1, 20); err != nil {
		b.Fatal(err)
	}
	if _, err := bench.Interleave(ctx, onServer, 1, 1, 20); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		totals, err := meter.Interleave(ctx, throughProxy, 1, 1, 100)
		if err != nil {
			b.Fatal(err)
		}
		for _, phase := range onServer {
			name := map[string]string{"flow": "flow", "tx-held": "held"}[phase.Name]
			b.ReportMetric(totals[phase.Name].RoundTripsPerOp(), name+"-round-trips/op")
			b.ReportMetric(float64(totals[phase.Name].Percentile(0.5))/float64(time.Millisecond), name+"-p50-ms-at-1ms-rtt")
			b.ReportMetric(totals[phase.Name].AllocsPerOp(), name+"-allocs/op")
			perOp, parts, err := bench.DatabaseWAL(ctx, direct, phase, 500)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(perOp, name+"-WAL-B/op")
			commits := 0.0
			for _, part := range parts {
				if part.Part == "Transaction COMMIT" {
					commits = part.Records
				}
			}
			b.ReportMetric(commits, name+"-commits/op")
			for _, part := range parts {
				if part.Bytes >= 1 {
					b.Logf("%s: %6.1f B/op  %s", phase.Name, part.Bytes, part.Part)
				}
			}
		}
	}
}

// TestFlowPhasesChargeEachPaymentOnce runs the flow comparison's phases
// briefly and checks what each wrote: one payment per operation, with the
// provider's charge recorded on it, and one charge per payment.
func TestFlowPhasesChargeEachPaymentOnce(t *testing.T) {
	t.Parallel()
	pool := env.Pool(t)
	ctx := t.Context()
	if err := bench.CreateFlowSchema(ctx, pool); err != nil {
		t.Fatal(err)
	}
	scope := testdb.Name("bench-flow-phases")
	p := bench.NewProvider(time.Millisecond)
	totals, err := bench.Interleave(ctx, bench.FlowPhases(pool, pool, p, scope), 4, 1, 20)
	if err != nil {
		t.Fatal(err)
	}
	if totals["flow"].Ops != 20 || totals["tx-held"].Ops != 20 {
		t.Fatalf("ran %d flows and %d held transactions, want 20 each", totals["flow"].Ops, totals["tx-held"].Ops)
	}
	var payments, charged, charges int
	err = pool.QueryRow(ctx, `SELECT count(*), count(charge_id), count(DISTINCT charge_id) FROM bench_flow_payment WHERE scope = $1`,
		scope).Scan(&payments, &charged, &charges)
	if err != nil {
		t.Fatal(err)
	}
	if payments != 40 || charged != 40 || charges != 40 {
		t.Fatalf("%d payments, %d with a charge, %d distinct charges; want 40 of each", payments, charged, charges)
	}
}

// TestConnGaugeCountsAcquiredConnections checks the gauge against
// connections acquired and released by hand: the most held at once, and
// that time is counted only while some are held; and that it traces no
// connection (which would make idem send a local step's first statement
// in a round trip of its own).
func TestConnGaugeCountsAcquiredConnections(t *testing.T) {
	t.Parallel()
	pool, gauge, err := bench.GaugedPool(t.Context(), env.Pool(t).Config(), 4)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var conns []*pgxpool.Conn
	defer func() { // before Close, which waits for them (a second Release does nothing)
		for _, c := range conns {
			c.Release()
		}
	}()
	for range 3 {
		c, err := pool.Acquire(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if c.Conn().Config().Tracer != nil {
			t.Fatalf("a connection of the gauged pool has a tracer: %T", c.Conn().Config().Tracer)
		}
		conns = append(conns, c)
	}
	if peak, _ := gauge.Read(); peak != 3 {
		t.Fatalf("peak %d with 3 connections acquired, want 3", peak)
	}
	for _, c := range conns {
		c.Release()
	}
	peak, heldTime := gauge.Read()
	if peak != 3 || heldTime <= 0 {
		t.Fatalf("after releasing them: peak %d, held time %s; want 3 and some", peak, heldTime)
	}
	gauge.Reset()
	if _, err := pool.Exec(t.Context(), `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	if peak, _ := gauge.Read(); peak != 1 {
		t.Fatalf("after a reset and one statement: peak %d, want 1", peak)
	}
	_, idle := gauge.Read()
	if _, again := gauge.Read(); again != idle {
		t.Fatalf("held time grew from %s to %s with no connection held", idle, again)
	}
}

// gaugedPool opens a pool of flowBenchConns connections on cfg's settings,
// with a gauge of the connections it hands out, closed when b ends.
func gaugedPool(b *testing.B, cfg *pgxpool.Config) (*pgxpool.Pool, *bench.ConnGauge) {
	pool, gauge, err := bench.GaugedPool(context.Background(), cfg, flowBenchConns)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool, gauge
}

// BenchmarkLongFlowWAL reports the WAL that a long flow writes (its
// database's, full-page images left out), for each of LongFlows:
//
//	go test -run '^$' -bench LongFlowWAL -benchtime 1x -v ./lab/bench
func BenchmarkLongFlowWAL(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	for b.Loop() {
		for _, l := range bench.LongFlows {
			perOp, _, err := longFlowWAL(ctx, pool, l, 20)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(perOp, l.Name+"-WAL-B/op")
		}
	}
}

// longFlowWAL is the WAL per flow of ops runs of l, after a few to warm
// the statement caches.
func longFlowWAL(ctx context.Context, pool *pgxpool.Pool, l bench.LongFlow, ops int64) (float64, []bench.WALPart, error) {
	phase := bench.LongFlowPhase(pool, l, testdb.Name("bench-long"))
	for i := range int64(3) {
		if err := phase.Op(ctx, i); err != nil {
			return 0, nil, err
		}
	}
	return bench.DatabaseWAL(ctx, pool, phase, ops)
}

// TestLongFlowWALGrowsWithItsSteps bounds the WAL of a long flow: once its
// row records a large result, or many steps, its further steps go to rows
// of their own, and no write of the flow's row copies its records again.
// The bounds are what idem wrote before it recorded steps in the flow's
// row (every step a row of its own; measured so: 20.4 kB, 12.8 kB and
// 63–68 kB), with 10% of room; recording every step in the flow's row,
// rewritten at each write of it, wrote 198 kB, 24.0 kB and 187 kB.
func TestLongFlowWALGrowsWithItsSteps(t *testing.T) {
	pool := env.Pool(t)
	ctx := context.Background()
	bounds := map[string]float64{"8kB-call-20-local": 22_500, "call-20-local": 14_000, "100-calls": 75_000}
	for _, l := range bench.LongFlows {
		perOp, parts, err := longFlowWAL(ctx, pool, l, 5)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %.0f B of WAL per flow", l.Name, perOp)
		for _, part := range parts {
			if part.Bytes >= 100 {
				t.Logf("%s: %7.0f B, %5.1f records  %s", l.Name, part.Bytes, part.Records, part.Part)
			}
		}
		if perOp > bounds[l.Name] {
			t.Errorf("%s: %.0f B of WAL per flow; want at most %.0f", l.Name, perOp, bounds[l.Name])
		}
	}
}

// BenchmarkFlowOnEveryConnection measures the flow (local step, call,
// local step; an instant provider) and the transaction held across the
// call on each kind of connection an application runs (bench.ConnKinds:
// pgx's default, traced as otelpgx traces it, and the exec modes used
// behind transaction poolers): one operation at a time through the 1 ms
// proxy, its round trips, heap allocations and median time; the WAL and
// the commits of the flow (bench.DatabaseWAL); and, on a pool of 10
// connections at 8 clients, the flow's throughput over the held
// transaction's, interleaved.
//
//	go test -run '^$' -bench FlowOnEveryConnection -benchtime 1x ./lab/bench
func BenchmarkFlowOnEveryConnection(b *testing.B) {
	direct := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateFlowSchema(ctx, direct); err != nil {
		b.Fatal(err)
	}
	p := bench.NewProvider(0)
	for _, kind := range bench.ConnKinds {
		b.Run("conn="+kind.Name, func(b *testing.B) {
			cfg := direct.Config().Copy()
			kind.Apply(cfg)
			delayed, proxy, err := bench.DelayedPool(ctx, cfg, time.Millisecond, 4)
			if err != nil {
				b.Fatal(err)
			}
			defer proxy.Close()
			defer delayed.Close()
			cfg.MaxConns = flowBenchConns
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer pool.Close()
			meter := bench.Meter{RoundTrips: proxy.RoundTrips}
			one := bench.FlowPhases(delayed, delayed, p, testdb.Name("bench-conn-one"))
			eight := bench.FlowPhases(pool, pool, p, testdb.Name("bench-conn-eight"))
			wal := bench.FlowPhases(pool, pool, p, testdb.Name("bench-conn-wal"))
			if _, err := meter.Interleave(ctx, one, 1, 1, 20); err != nil {
				b.Fatal(err)
			}
			if _, err := bench.Interleave(ctx, eight, 8, 1, 80); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				totals, err := meter.Interleave(ctx, one, 1, 1, 100)
				if err != nil {
					b.Fatal(err)
				}
				flow, held := totals["flow"], totals["tx-held"]
				b.ReportMetric(flow.RoundTripsPerOp(), "flow-round-trips/op")
				b.ReportMetric(held.RoundTripsPerOp(), "held-round-trips/op")
				b.ReportMetric(flow.AllocsPerOp(), "flow-allocs/op")
				b.ReportMetric(float64(flow.Percentile(0.5))/float64(time.Millisecond), "flow-p50-ms-at-1ms-rtt")
				b.ReportMetric(float64(held.Percentile(0.5))/float64(time.Millisecond), "held-p50-ms-at-1ms-rtt")
				perOp, parts, err := bench.DatabaseWAL(ctx, pool, wal[0], 200)
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(perOp, "flow-WAL-B/op")
				for _, part := range parts {
					if part.Part == "Transaction COMMIT" {
						b.ReportMetric(part.Records, "flow-commits/op")
					}
				}
				totals, err = bench.Interleave(ctx, eight, 8, 3, 300)
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(totals["flow"].Throughput()/totals["tx-held"].Throughput(), "flow/held-at-8")
			}
		})
	}
}
