package idem_test

import (
	"context"
	"testing"

	"github.com/pgidem/idem/internal/bench"
	"github.com/pgidem/idem/internal/testdb"
)

// BenchmarkRunVsBare compares, in one run on one database, a bare
// BEGIN/INSERT/COMMIT with idem.Run's first executions and replays of the
// same insert, claim-first and lookup-first, at 8 clients. Each iteration is
// one interleaved round of every phase; throughput ratios to the bare
// transaction are reported as metrics.
func BenchmarkRunVsBare(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	if err := bench.CreateSchema(ctx, pool); err != nil {
		b.Fatal(err)
	}
	phases := bench.StandardPhases(pool, testdb.Name("bench"))
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
