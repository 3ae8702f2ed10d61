package bench

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// Long flows: what a flow's records write as it grows, for the WAL of a
// flow of many steps (BenchmarkLongFlowWAL, TestLongFlowWALGrowsWithItsSteps).

// LongFlow describes a long flow: calls calls, the first returning a
// result of firstResult bytes, then locals local steps.
type LongFlow struct {
	Name        string
	Calls       int
	FirstResult int
	Locals      int
}

// LongFlows are the long flows measured: a call with an 8 kB result and 20
// small local steps after it; a small call and 20 small local steps; 100
// small calls.
var LongFlows = []LongFlow{
	{Name: "8kB-call-20-local", Calls: 1, FirstResult: 8 << 10, Locals: 20},
	{Name: "call-20-local", Calls: 1, Locals: 20},
	{Name: "100-calls", Calls: 100},
}

// LongFlowPhase returns l as a phase of first executions on new keys of
// scope, on pool. Its steps write nothing but their records.
func LongFlowPhase(pool *pgxpool.Pool, l LongFlow, scope string) Phase {
	large := incompressible(l.FirstResult)
	flow := idem.MustNewFlow("bench-long-"+l.Name, func(ctx context.Context, s *idem.Steps, _ struct{}) (int, error) {
		total := 0
		for i := range l.Calls {
			v, err := idem.Call(s, fmt.Sprintf("call-%d", i), func(ctx context.Context, providerKey string) (string, error) {
				if i == 0 && large != "" {
					return large, nil
				}
				return "ch_" + providerKey[:8], nil
			})
			if err != nil {
				return 0, err
			}
			total += len(v)
		}
		for i := range l.Locals {
			v, err := idem.Local(s, fmt.Sprintf("local-%d", i), func(ctx context.Context, tx pgx.Tx) (int, error) {
				return i, nil
			})
			if err != nil {
				return 0, err
			}
			total += v
		}
		return total, nil
	})
	var next atomic.Int64
	return Phase{Name: l.Name, Op: func(ctx context.Context, _ int64) error {
		n := next.Add(1)
		res, err := flow.Run(ctx, pool, scope, numbered(l.Name+"-", n), nil, struct{}{})
		if err == nil && res.Replayed {
			err = fmt.Errorf("long flow %d replayed on its first execution", n)
		}
		return err
	}}
}

// incompressible returns n bytes of hex that do not compress (TOAST would
// shrink a repeated byte to almost nothing).
func incompressible(n int) string {
	var b []byte
	sum := sha256.Sum256([]byte("long flow"))
	for len(b) < n {
		b = hex.AppendEncode(b, sum[:])
		sum = sha256.Sum256(sum[:])
	}
	return string(b[:n])
}
