package bench_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/lab/bench"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// BenchmarkRunVsBare compares, in one run on one database, a bare
// BEGIN/INSERT/COMMIT with idem.Run's first executions and replays of the
// same insert, by default and lookup-first, and with idem's earlier
// claim-first design, at 8 clients. Each iteration is
// one interleaved round of every phase; throughput ratios to the bare
// transaction are reported as metrics.
func BenchmarkRunVsBare(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, pool); err != nil {
		b.Fatal(err)
	}
	scope := testdb.Name("bench")
	phases := bench.StandardPhases(pool, scope)
	for _, d := range bench.Designs(pool, scope) {
		if d.Name == "claim-first" || d.Name == "key-row-only" {
			phases = append(phases, bench.DesignPhases([]bench.Design{d})...)
		}
	}
	// Give the replay phases completed keys, and every statement a warm
	// cache, before timing starts.
	if _, err := bench.Interleave(ctx, phases, 8, 1, 200); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	totals, err := bench.Interleave(ctx, phases, 8, b.N, 400)
	if err != nil {
		b.Fatal(err)
	}
	bare := totals["bare"].Throughput()
	b.ReportMetric(bare, "bare-tx/s")
	for _, p := range phases[1:] {
		b.ReportMetric(totals[p.Name].Throughput()/bare, p.Name+"/bare")
	}
}

// BenchmarkRunVsFloor compares, CPU-bound (the server on this machine, no
// delay), a bare BEGIN/INSERT/COMMIT, Run's first executions and the
// key-row-only floor (bench.Floor), interleaved, at 8 and 32 clients,
// rounds of 400 operations of every phase. It reports Run's throughput
// against the floor and against bare, and the floor's against bare:
//
//	go test -run '^$' -bench 'RunVsFloor$' -benchtime 10x ./lab/bench
func BenchmarkRunVsFloor(b *testing.B) {
	direct := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, direct); err != nil {
		b.Fatal(err)
	}
	cfg := direct.Config().Copy()
	cfg.MaxConns = 36
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	scope := testdb.Name("bench-floor")
	phases := bench.StandardPhases(pool, scope)[:2] // bare, run-first
	for _, d := range bench.Designs(pool, scope) {
		if d.Name == bench.Floor {
			phases = append(phases, bench.DesignPhases([]bench.Design{d})...)
		}
	}
	for _, clients := range []int{8, 32} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			if _, err := bench.Interleave(ctx, phases, clients, 1, int64(max(50, 4*clients))); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			totals, err := bench.Interleave(ctx, phases, clients, b.N, 400)
			if err != nil {
				b.Fatal(err)
			}
			bare, run, floor := totals["bare"], totals["run-first"], totals[bench.Floor]
			b.ReportMetric(run.Throughput()/floor.Throughput(), "run-first/floor")
			b.ReportMetric(run.Throughput()/bare.Throughput(), "run-first/bare")
			b.ReportMetric(floor.Throughput()/bare.Throughput(), "floor/bare")
			b.ReportMetric(bare.Throughput(), "bare-tx/s")
		})
	}
}

// BenchmarkRunVsFloorDelayed compares, with a 1 ms round trip added
// between the pool and the server (bench.DelayProxy), a bare
// BEGIN/INSERT/COMMIT, Run's first executions and the key-row-only floor
// (bench.Floor), interleaved, at 1, 8 and 32 clients. Each iteration is
// one round of 300 operations of every phase; it reports Run's throughput
// against bare and against the floor, the floor's against bare, and the
// heap allocations and round trips of each phase per operation. The
// 32-client ratios, in
// one line (go run ./lab bench -delay 1ms prints them for every phase):
//
//	go test -run '^$' -bench 'RunVsFloorDelayed/clients=32$' -benchtime 5x ./lab/bench
func BenchmarkRunVsFloorDelayed(b *testing.B) {
	const roundTrip = time.Millisecond
	direct := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, direct); err != nil {
		b.Fatal(err)
	}
	pool, proxy, err := bench.DelayedPool(ctx, direct.Config(), roundTrip, 36)
	if err != nil {
		b.Fatal(err)
	}
	defer proxy.Close()
	defer pool.Close()
	scope := testdb.Name("bench-delayed")
	meter := bench.Meter{RoundTrips: proxy.RoundTrips}
	phases := bench.StandardPhases(pool, scope)[:2] // bare, run-first
	for _, d := range bench.Designs(pool, scope) {
		if d.Name == bench.Floor {
			phases = append(phases, bench.DesignPhases([]bench.Design{d})...)
		}
	}
	for _, clients := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			// Open the connections and warm their statement caches.
			if _, err := meter.Interleave(ctx, phases, clients, 1, int64(max(50, 4*clients))); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			totals, err := meter.Interleave(ctx, phases, clients, b.N, 300)
			if err != nil {
				b.Fatal(err)
			}
			bare, run, floor := totals["bare"], totals["run-first"], totals[bench.Floor]
			b.ReportMetric(bare.Throughput(), "bare-tx/s")
			b.ReportMetric(run.Throughput()/bare.Throughput(), "run-first/bare")
			b.ReportMetric(run.Throughput()/floor.Throughput(), "run-first/floor")
			b.ReportMetric(floor.Throughput()/bare.Throughput(), "floor/bare")
			b.ReportMetric(bare.AllocsPerOp(), "bare-allocs/op")
			b.ReportMetric(run.AllocsPerOp(), "run-first-allocs/op")
			b.ReportMetric(floor.AllocsPerOp(), "floor-allocs/op")
			b.ReportMetric(bare.RoundTripsPerOp(), "bare-round-trips/op")
			b.ReportMetric(run.RoundTripsPerOp(), "run-first-round-trips/op")
			b.ReportMetric(floor.RoundTripsPerOp(), "floor-round-trips/op")
		})
	}
}

// BenchmarkWALPerOperation reports the WAL bytes that one operation writes,
// run one at a time: the bare transaction, Run's first execution (with the
// benchmark's payment row and a 32-byte fingerprint), idem's earlier
// claim-first design, and Run's replay, counted as bench.WAL says. -v logs where the first execution's bytes go:
// go test -run '^$' -bench WALPerOperation -benchtime 1x -v ./internal/bench
func BenchmarkWALPerOperation(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, pool); err != nil {
		b.Fatal(err)
	}
	scope := testdb.Name("bench-wal")
	phases := bench.StandardPhases(pool, scope)
	byName := map[string]bench.Phase{}
	for _, p := range append(phases, bench.DesignPhases(bench.Designs(pool, scope))...) {
		byName[p.Name] = p
	}
	// Warm the caches, and give the replay phase keys.
	for _, name := range []string{"bare", "run-first", "claim-first"} {
		if _, _, err := bench.WAL(ctx, pool, byName[name], 200); err != nil {
			b.Fatal(err)
		}
	}
	const ops = 2000
	for b.Loop() {
		for _, name := range []string{"bare", "run-first", "claim-first"} {
			perOp, parts, err := bench.WAL(ctx, pool, byName[name], ops)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(perOp, name+"-B/op")
			if name == "run-first" {
				for _, part := range parts {
					b.Logf("run-first: %6.1f B/op  %s", part.Bytes, part.Part)
				}
			}
		}
		perOp, _, err := bench.WAL(ctx, pool, byName["run-replay"], ops)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(perOp, "run-replay-B/op")
	}
}

// BenchmarkDo measures one Do on a new key inside a transaction, per call,
// with its allocations (run with -benchmem); the transaction's own BEGIN and
// COMMIT are part of every iteration, and BenchmarkBareTx is that floor.
func BenchmarkDo(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	scope := testdb.Name("bench-do")
	fp := idem.Fingerprint([]byte("benchmark"))
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		key := strconv.Itoa(i)
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (bench.Payment, error) {
				return bench.Insert(ctx, tx, scope, key, 1)
			})
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRun measures one first execution through Run, per call, with its
// allocations (run with -benchmem); BenchmarkBareTx is its floor too.
func BenchmarkRun(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	scope := testdb.Name("bench-run")
	fp := idem.Fingerprint([]byte("benchmark"))
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		key := strconv.Itoa(i)
		_, err := idem.Run(ctx, pool, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (bench.Payment, error) {
			return bench.Insert(ctx, tx, scope, key, 1)
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRunReplay measures one replay through Run, with its allocations.
func BenchmarkRunReplay(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	scope := testdb.Name("bench-replay")
	fp := idem.Fingerprint([]byte("benchmark"))
	fn := func(ctx context.Context, tx pgx.Tx) (bench.Payment, error) {
		return bench.Insert(ctx, tx, scope, "k", 1)
	}
	if _, err := idem.Run(ctx, pool, scope, "k", fp, fn); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if res, err := idem.Run(ctx, pool, scope, "k", fp, fn); err != nil || !res.Replayed {
			b.Fatalf("%+v, %v", res, err)
		}
	}
}

// BenchmarkBareTx is the floor for BenchmarkDo: the same insert in
// WithTx, without a key.
func BenchmarkBareTx(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	scope := testdb.Name("bench-bare")
	b.ReportAllocs()
	for b.Loop() {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := bench.Insert(ctx, tx, scope, "k", 1)
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkObserverCost compares, interleaved at 8 clients, Run replays
// without an Observer, with one built from no providers, and with one on
// OpenTelemetry's no-op providers, and reports each against the first.
func BenchmarkObserverCost(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	scope := testdb.Name("bench-observer")
	fp := idem.Fingerprint([]byte("benchmark"))
	fn := func(ctx context.Context, tx pgx.Tx) (bench.Payment, error) {
		return bench.Insert(ctx, tx, scope, "k", 1)
	}
	if _, err := idem.Run(ctx, pool, scope, "k", fp, fn); err != nil {
		b.Fatal(err)
	}
	empty, err := idem.NewObserver(idem.ObserverConfig{})
	if err != nil {
		b.Fatal(err)
	}
	noops, err := idem.NewObserver(idem.ObserverConfig{MeterProvider: metricnoop.NewMeterProvider(), TracerProvider: tracenoop.NewTracerProvider()})
	if err != nil {
		b.Fatal(err)
	}
	phase := func(name string, opts ...idem.Option) bench.Phase {
		return bench.Phase{Name: name, Op: func(ctx context.Context, _ int64) error {
			_, err := idem.Run(ctx, pool, scope, "k", fp, fn, opts...)
			return err
		}}
	}
	phases := []bench.Phase{phase("none"), phase("empty", idem.WithObserver(empty)), phase("noop", idem.WithObserver(noops))}
	b.ResetTimer()
	totals, err := bench.Interleave(ctx, phases, 8, b.N, 2000)
	if err != nil {
		b.Fatal(err)
	}
	none := totals["none"].Throughput()
	b.ReportMetric(none, "replays/s")
	b.ReportMetric(totals["empty"].Throughput()/none, "empty/none")
	b.ReportMetric(totals["noop"].Throughput()/none, "noop/none")
}

// BenchmarkPurgerMillionRows fills the table with a million expired
// records, expiring 50 ms apart as records written over 14 hours do, then
// runs idem.Run first executions at 8 clients in windows of 3,000
// operations, alternately without a purger and with one (the default
// PurgerConfig) started at the window's start and stopped at its end, in
// pairs whose order alternates, until the purgers have deleted the million
// records. It reports the purge rate over the windows with a purger, and
// the load's p50 and p99 latency and throughput with a purger against
// without, over all windows of each kind. It takes about a minute; run it
// alone: go test -run '^$' -bench PurgerMillion -benchtime 1x ./lab/bench
func BenchmarkPurgerMillionRows(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, pool); err != nil {
		b.Fatal(err)
	}
	const expired = 1_000_000
	for range b.N {
		scope := testdb.Name("purge-bench")
		// Test data, written the fast way: a million records that expired,
		// each at its own time.
		if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_key (scope, key, fingerprint, state, response, created_at, expires_at)
SELECT $1, 'expired-' || g, '\x00', 'done', '{"id": 1}',
       now() - interval '3 days' + g * interval '50 ms', now() - interval '2 days' + g * interval '50 ms'
FROM generate_series(1, $2::int) AS g`, scope, expired); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `VACUUM ANALYZE idempotency_key`); err != nil {
			b.Fatal(err)
		}
		load := bench.StandardPhases(pool, scope)[1] // Run, first executions
		window := func() *bench.Stats {
			s, err := bench.Measure(ctx, load, 8, 3000)
			if err != nil {
				b.Fatal(err)
			}
			return s
		}
		without, with := &bench.Stats{}, &bench.Stats{}
		var purging time.Duration
		withPurger := func() {
			started := time.Now()
			purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Interval: time.Hour, Logger: discard})
			if err != nil {
				b.Fatal(err)
			}
			s := window()
			purger.Stop()
			purging += time.Since(started)
			with.Add(s)
		}
		withoutPurger := func() { without.Add(window()) }
		// The table, not the purgers' counts, says when they are done: a
		// batch that Stop interrupts at its commit may have committed
		// without being counted.
		left := func() bool {
			var any bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM idempotency_key WHERE expires_at <= now())`).Scan(&any); err != nil {
				b.Fatal(err)
			}
			return any
		}
		for pair := 0; left(); pair++ {
			if pair%2 == 0 {
				withoutPurger()
				withPurger()
			} else {
				withPurger()
				withoutPurger()
			}
		}
		b.ReportMetric(expired/purging.Seconds(), "purged-rows/s")
		b.ReportMetric(float64(with.Percentile(0.5))/float64(without.Percentile(0.5)), "p50-with/without")
		b.ReportMetric(float64(with.Percentile(0.99))/float64(without.Percentile(0.99)), "p99-with/without")
		b.ReportMetric(with.Throughput()/without.Throughput(), "tx/s-with/without")
		b.ReportMetric(float64(with.Ops), "ops-with")
	}
}

// discard is a logger that writes nothing: the benchmark's output is its
// metrics.
var discard = slog.New(slog.DiscardHandler)
