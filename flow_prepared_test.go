package idem_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// callOnly is a flow of one call, whose statements are all idem's.
var callOnly = idem.MustNewFlow("call-only", func(ctx context.Context, s *idem.Steps, in int) (string, error) {
	return idem.Call(s, "call", func(ctx context.Context, providerKey string) (string, error) { return providerKey, nil })
})

// TestFlowStatementsPreparedAwayArePreparedAgain deallocates the
// connection's prepared statements behind pgx's back between flows (as
// DISCARD ALL or a pooler's reset does): each of a flow's round trips
// fails once at most, with the driver's error and nothing committed, as
// pgx's own statements do, and prepares its statements again; the flows
// after them complete, and every flow completes when run again.
func TestFlowStatementsPreparedAwayArePreparedAgain(t *testing.T) {
	ctx, _, scope := setup(t)
	// A connection of the test's own: DEALLOCATE ALL also spoils pgx's
	// statement cache, which would fail the next statements of whichever
	// test got the connection from the pool.
	conn, err := pgx.Connect(ctx, env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := callOnly.Run(ctx, conn, scope, "k0", nil, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := callOnly.Run(ctx, conn, scope, "k0", nil, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `DEALLOCATE ALL`); err != nil {
		t.Fatal(err)
	}
	var failed []string
	keys := []string{"k1", "k2", "k3", "k4", "k5"}
	for _, key := range keys {
		if _, err := callOnly.Run(ctx, conn, scope, key, nil, 0); err != nil {
			failed = append(failed, key)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) {
				t.Errorf("%s: %v, want the driver's error", key, err)
			}
		}
	}
	// The claim, the call's intent, the answer: three round trips.
	if len(failed) > 3 || slices.Contains(failed, "k5") {
		t.Errorf("flows %v failed after DEALLOCATE ALL, want at most the first three", failed)
	}
	for _, key := range append([]string{"k0"}, keys...) {
		res, err := callOnly.Run(ctx, conn, scope, key, nil, 0)
		if err != nil || res.Replayed == slices.Contains(failed, key) {
			t.Errorf("%s run again: %+v, %v; want it completed or replayed", key, res, err)
		}
	}
}

// TestABatchTracerSeesAFlowsBatches gives a flow a pool whose pgx tracer
// traces batches: the flow's batches then go through pgx, where the tracer
// sees them (three: the claim, the call's intent, the answer).
func TestABatchTracerSeesAFlowsBatches(t *testing.T) {
	ctx, _, scope := setup(t)
	cfg, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	tracer := &countingTracer{}
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := callOnly.Run(ctx, pool, scope, "k", nil, 0); err != nil {
		t.Fatal(err)
	}
	if n := tracer.batches.Load(); n != 3 {
		t.Errorf("the tracer saw %d batches, want 3", n)
	}
}
