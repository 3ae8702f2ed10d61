// Package bench measures idem against the plain transaction it protects, on
// one database, with the phases interleaved so that drift in the machine's
// load or the table's size hits them alike.
package bench

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// Schema is what the benchmark writes besides idem's own table: the
// business table (the same as the tests'), and the key tables of the two
// designs idem is compared with. Each statement creates what is missing.
var Schema = []string{
	`CREATE TABLE IF NOT EXISTS payment (
    id           bigserial PRIMARY KEY,
    scope        text   NOT NULL,
    key          text   NOT NULL,
    amount_cents bigint NOT NULL
)`,
	// The naive design checks, then inserts: nothing stops two inserts.
	`CREATE TABLE IF NOT EXISTS bench_naive_key (
    scope    text  NOT NULL,
    key      text  NOT NULL,
    response jsonb
)`,
	`CREATE INDEX IF NOT EXISTS bench_naive_key_idx ON bench_naive_key (scope, key)`,
	// The two-phase design reserves the key in a transaction of its own.
	`CREATE TABLE IF NOT EXISTS bench_two_phase_key (
    scope    text  NOT NULL,
    key      text  NOT NULL,
    state    text  NOT NULL,
    response jsonb,
    PRIMARY KEY (scope, key)
)`,
}

// claimFirstSchema is the key table of the claim-first design, laid out as
// idem's own table was when it used that design.
var claimFirstSchema = []string{
	`CREATE TABLE IF NOT EXISTS bench_claim_first_key (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    state       text        NOT NULL,
    response    jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
) WITH (fillfactor = 90)`,
	`CREATE INDEX IF NOT EXISTS bench_claim_first_key_expires_at_idx ON bench_claim_first_key (expires_at)`,
}

func init() { Schema = append(Schema, claimFirstSchema...) }

// CreateSchema creates the benchmark's tables where missing.
func CreateSchema(ctx context.Context, pool *pgxpool.Pool) error {
	for _, stmt := range Schema {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("create benchmark schema: %w", err)
		}
	}
	return nil
}

// Payment is what the protected write returns and a replay gives back.
type Payment struct {
	ID          int64 `json:"id"`
	AmountCents int64 `json:"amount_cents"`
}

// Phase is one way of doing the write, measured one operation at a time.
type Phase struct {
	Name string
	// Op performs operation i.
	Op func(ctx context.Context, i int64) error
}

// Stats is what a phase measured.
type Stats struct {
	Ops     int64
	Elapsed time.Duration
	// Mallocs and Bytes are the heap allocations the process made while
	// the phase ran (runtime.MemStats), whatever goroutine made them: the
	// phase's clients, but also the pool's background work and, when the
	// benchmark runs through a DelayProxy, the proxy (which allocates
	// nothing per message once its buffers exist). Phases run one at a
	// time, so no other phase's work is counted.
	Mallocs uint64
	Bytes   uint64
	// RoundTrips is how many round trips the phase made, when its Meter
	// could count them (Counted).
	RoundTrips int64
	Counted    bool
	latencies  []time.Duration
}

// Throughput is operations per second.
func (s *Stats) Throughput() float64 { return float64(s.Ops) / s.Elapsed.Seconds() }

// Percentile returns the latency below which fraction p of operations fell.
func (s *Stats) Percentile(p float64) time.Duration {
	if len(s.latencies) == 0 {
		return 0
	}
	slices.Sort(s.latencies)
	return s.latencies[min(int(p*float64(len(s.latencies))), len(s.latencies)-1)]
}

// AllocsPerOp is the number of heap allocations per operation.
func (s *Stats) AllocsPerOp() float64 { return float64(s.Mallocs) / float64(s.Ops) }

// BytesPerOp is the number of heap bytes allocated per operation.
func (s *Stats) BytesPerOp() float64 { return float64(s.Bytes) / float64(s.Ops) }

// RoundTripsPerOp is the number of round trips per operation.
func (s *Stats) RoundTripsPerOp() float64 { return float64(s.RoundTrips) / float64(s.Ops) }

// Add adds o's operations, time, allocations, round trips and latencies
// to s's, as one phase measured in several windows.
func (s *Stats) Add(o *Stats) {
	s.Ops += o.Ops
	s.Elapsed += o.Elapsed
	s.Mallocs += o.Mallocs
	s.Bytes += o.Bytes
	s.RoundTrips += o.RoundTrips
	s.Counted = o.Counted
	s.latencies = append(s.latencies, o.latencies...)
}

// numbered returns prefix followed by n in decimal, in one allocation,
// as strconv.Itoa costs the Go benchmarks, so that the harness's own work
// adds as little as it can to a phase's allocations.
func numbered(prefix string, n int64) string {
	b := make([]byte, 0, 32)
	b = append(b, prefix...)
	return string(strconv.AppendInt(b, n, 10))
}

// Insert is the business write: one payment row.
func Insert(ctx context.Context, tx pgx.Tx, scope, key string, amount int64) (Payment, error) {
	p := Payment{AmountCents: amount}
	err := tx.QueryRow(ctx,
		`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
		scope, key, amount).Scan(&p.ID)
	return p, err
}

// StandardPhases returns the phases every comparison has: the bare
// transaction (the floor for this write), then idem.Run on new keys (first
// executions) and on keys that completed before (replays), each both ways:
// claim first (the default) and with idem.WithLookupFirst, and last
// idem.Do on new keys in a transaction of the caller's (idem.WithTx), as
// BenchmarkDo measures it. Replays use keys that earlier first executions
// completed, so a first-execution phase must run before any replay phase.
func StandardPhases(pool *pgxpool.Pool, scope string) []Phase {
	var completed, done atomic.Int64
	fp := idem.Fingerprint([]byte("benchmark payment"))
	run := func(ctx context.Context, n int64, opts ...idem.Option) (idem.Result[Payment], error) {
		key := numbered("k-", n)
		return idem.Run(ctx, pool, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (Payment, error) {
			return Insert(ctx, tx, scope, key, n)
		}, opts...)
	}
	first := func(opts ...idem.Option) func(context.Context, int64) error {
		return func(ctx context.Context, _ int64) error {
			n := completed.Add(1)
			res, err := run(ctx, n, opts...)
			if err == nil && res.Replayed {
				err = fmt.Errorf("key %d replayed on its first execution", n)
			}
			return err
		}
	}
	replay := func(opts ...idem.Option) func(context.Context, int64) error {
		return func(ctx context.Context, i int64) error {
			done := completed.Load()
			if done == 0 {
				return fmt.Errorf("no completed keys to replay")
			}
			n := 1 + i%done
			res, err := run(ctx, n, opts...)
			if err == nil && !res.Replayed {
				err = fmt.Errorf("key %d ran again instead of replaying", n)
			}
			return err
		}
	}
	return []Phase{
		{Name: "bare", Op: func(ctx context.Context, i int64) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if _, err := Insert(ctx, tx, scope, "bare", i); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}},
		{Name: "run-first", Op: first()},
		{Name: "run-replay", Op: replay()},
		{Name: "lookup-first", Op: first(idem.WithLookupFirst())},
		{Name: "lookup-replay", Op: replay(idem.WithLookupFirst())},
		{Name: "do-first", Op: func(ctx context.Context, _ int64) error {
			n := done.Add(1)
			key := numbered("d-", n)
			return idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
				res, err := idem.Do(ctx, tx, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (Payment, error) {
					return Insert(ctx, tx, scope, key, n)
				})
				if err == nil && res.Replayed {
					err = fmt.Errorf("key %s replayed on its first execution", key)
				}
				return err
			})
		}},
	}
}

// Meter measures phases. Its zero value times them and counts their heap
// allocations.
type Meter struct {
	// RoundTrips, when set, returns a running count of round trips to the
	// server, such as DelayProxy.RoundTrips: the Meter also records how
	// many each phase made.
	RoundTrips func() int64
}

// Measure is Meter{}.Measure.
func Measure(ctx context.Context, phase Phase, clients int, ops int64) (*Stats, error) {
	return Meter{}.Measure(ctx, phase, clients, ops)
}

// Interleave is Meter{}.Interleave.
func Interleave(ctx context.Context, phases []Phase, clients, rounds int, opsPerPhase int64) (map[string]*Stats, error) {
	return Meter{}.Interleave(ctx, phases, clients, rounds, opsPerPhase)
}

// Measure runs ops operations of phase on clients goroutines and times them,
// and counts the heap allocations made meanwhile (and the round trips).
//
// The operations run on a context that cannot be cancelled, as in the Go
// benchmarks (context.Background): on a cancellable one, pgx arranges to
// be told of the cancellation for each round trip (context.AfterFunc),
// which costs about four allocations per round trip, the same in every
// phase, and would hide the figures that differ. When ctx ends, Measure
// starts no more operations and returns ctx's error once those running
// are done.
func (m Meter) Measure(ctx context.Context, phase Phase, clients int, ops int64) (*Stats, error) {
	opCtx := context.WithoutCancel(ctx)
	var next atomic.Int64
	var firstErr error
	var mu sync.Mutex
	// Operation i's latency goes to latencies[i-1]: nothing grows while
	// the clients run.
	latencies := make([]time.Duration, ops)
	var wg sync.WaitGroup
	var before, after runtime.MemStats
	var roundTrips int64
	if m.RoundTrips != nil {
		roundTrips = m.RoundTrips()
	}
	runtime.ReadMemStats(&before)
	start := time.Now()
	for range clients {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > ops || ctx.Err() != nil {
					return
				}
				t0 := time.Now()
				if err := phase.Op(opCtx, i); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("%s: %w", phase.Name, err)
					}
					mu.Unlock()
					return
				}
				latencies[i-1] = time.Since(t0)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	if m.RoundTrips != nil {
		roundTrips = m.RoundTrips() - roundTrips
	}
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return &Stats{
		Ops:        ops,
		Elapsed:    elapsed,
		Mallocs:    after.Mallocs - before.Mallocs,
		Bytes:      after.TotalAlloc - before.TotalAlloc,
		RoundTrips: roundTrips,
		Counted:    m.RoundTrips != nil,
		latencies:  latencies,
	}, firstErr
}

// Interleave runs rounds of every phase in turn, opsPerPhase operations each
// time, and returns each phase's totals by name.
func (m Meter) Interleave(ctx context.Context, phases []Phase, clients, rounds int, opsPerPhase int64) (map[string]*Stats, error) {
	totals := make(map[string]*Stats, len(phases))
	for _, p := range phases {
		totals[p.Name] = &Stats{}
	}
	for range rounds {
		for _, p := range phases {
			s, err := m.Measure(ctx, p, clients, opsPerPhase)
			if err != nil {
				return nil, err
			}
			totals[p.Name].Add(s)
		}
	}
	return totals, nil
}
