//go:build citus

package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/citustemp"
	"github.com/pgidem/idem/internal/testdb"
)

// citusFlowStartedThroughTwoNodes starts one flow through two nodes of
// the cluster at once, as Citus's MX mode lets clients do: the first
// executor through the coordinator, held inside its first local step
// (its claim's transaction open, its INSERT made), and a duplicate
// through a worker. The claim takes the flow's advisory lock on the node
// of the scope's shard, after BEGIN, whichever node the run came in
// through: the duplicate finds it taken and waits, without running the
// flow's function, until its wait budget runs out; the first executor
// then finishes, and the flow's function has run once.
func citusFlowStartedThroughTwoNodes(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	worker, err := pgxpool.New(ctx, c.WorkerURL(0, "idem_citus"))
	if err != nil {
		t.Fatal(err)
	}
	defer worker.Close()
	scope := testdb.Name("nodes")
	var calls atomic.Int64
	inStep, release := make(chan struct{}), make(chan struct{})
	flow := idem.MustNewFlow(testdb.Name("nodes"), func(ctx context.Context, s *idem.Steps, in chargeIn) (int64, error) {
		first := calls.Add(1) == 1
		return idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			if err == nil && first {
				close(inStep)
				<-release
			}
			return id, err
		})
	})
	type ran struct {
		res idem.Result[int64]
		err error
	}
	done := make(chan ran, 1)
	go func() {
		res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1}, idem.WithWait(time.Minute))
		done <- ran{res, err}
	}()
	<-inStep
	dup, dupErr := flow.Run(ctx, worker, scope, "k", nil, chargeIn{Amount: 1}, idem.WithWait(time.Second))
	close(release)
	first := <-done
	if first.err != nil {
		t.Fatalf("the executor through the coordinator: %v; want the flow's answer", first.err)
	}
	if !errors.Is(dupErr, idem.ErrInProgress) {
		t.Fatalf("the duplicate through a worker: %+v, %v; want ErrInProgress once its wait budget ran out", dup, dupErr)
	}
	if first.res.Replayed {
		t.Fatalf("the executor through the coordinator replayed %+v; want its own answer", first.res)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("the flow's function ran %d times, want 1: the duplicate through a worker did not see the flow's lock", n)
	}
	if n := countPayments(t, pool, scope); n != 1 {
		t.Fatalf("%d payments, want 1", n)
	}
}

// citusClaimCrashes kills and freezes an executor that holds its claim's
// transaction through the coordinator, in its function before its first
// step and inside that step (see flow_claim_crash_test.go): the
// coordinator's session ends, and with it the distributed transaction,
// the step's write on its worker included; a retry runs the flow once.
func citusClaimCrashes(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	url := c.URL("idem_citus")
	for _, at := range []string{crashBeforeFirstStep, crashInStep} {
		t.Run("Killed/"+at, func(t *testing.T) { crashHoldingTheClaim(t, ctx, pool, url, at) })
	}
	for _, at := range []string{freezeBeforeFirstStep, freezeInStep} {
		t.Run("Frozen/"+at, func(t *testing.T) { frozenHoldingTheClaim(t, ctx, pool, url, at) })
	}
}
