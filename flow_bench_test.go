package idem_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// BenchmarkFlowLocalCallLocal runs, one at a time on the pool, the first
// execution of a flow of a local step (an INSERT), a call to a provider
// that answers at once, and a local step (an UPDATE), each on a key of its
// own: what the flow's own code costs in CPU and allocations, for
// -cpuprofile and -memprofile. lab/bench's FlowPerOperation and
// FlowVsTxHeldAcrossCall compare it with a transaction held across the
// call.
//
//	go test -run '^$' -bench FlowLocalCallLocal -benchmem .
func BenchmarkFlowLocalCallLocal(b *testing.B) {
	pool := env.Pool(b)
	ctx := context.Background()
	scope := testdb.Name("b")
	flow := idem.MustNewFlow("bench-local-call-local", func(ctx context.Context, s *idem.Steps, amount int64) (int64, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return 0, err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			return "ch_" + providerKey, nil
		})
		if err != nil {
			return 0, err
		}
		_, err = idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
			_, err := tx.Exec(ctx, `UPDATE payment SET key = $2 WHERE id = $1`, id, charge)
			return struct{}{}, err
		})
		return id, err
	})
	fp := idem.Fingerprint([]byte("benchmark"))
	n := 0
	run := func() {
		n++
		if _, err := flow.Run(ctx, pool, scope, strconv.Itoa(n), fp, int64(n)); err != nil {
			b.Fatal(err)
		}
	}
	// Warm the pool's connections and their statement caches.
	for range 20 {
		run()
	}
	b.ReportAllocs()
	for b.Loop() {
		run()
	}
}
