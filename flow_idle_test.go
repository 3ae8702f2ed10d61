package idem_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestFlowIdleTimeoutBoundsEachLocalStepsTransaction reads, in a local
// step, the idle_in_transaction_session_timeout in force: a flow's default
// (a third of its lease, up to a minute) without the option, the option's
// value with it, and the
// session's own with zero or a negative value; with the step's BEGIN
// pipelined, and with a BeginQuery of the caller's, which is not. It is
// the transaction's alone: the connection has the session's back after
// the flow.
func TestFlowIdleTimeoutBoundsEachLocalStepsTransaction(t *testing.T) {
	ctx, pool, scope := setup(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	show := func(ctx context.Context, q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}) (string, error) {
		var got string
		return got, q.QueryRow(ctx, `SHOW idle_in_transaction_session_timeout`).Scan(&got)
	}
	session, err := show(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	if session == "1min" || session == "3334ms" {
		t.Fatalf("the session's own idle_in_transaction_session_timeout is the flows' default, %s: the test could not tell them apart", session)
	}
	flow := idem.MustNewFlow(testdb.Name("idle"), func(_ context.Context, s *idem.Steps, _ int) (string, error) {
		return idem.Local(s, "show", func(ctx context.Context, tx pgx.Tx) (string, error) { return show(ctx, tx) })
	})
	for i, c := range []struct {
		opts []idem.FlowOption
		want string
	}{
		{nil, "3334ms"}, // the default lease, 10s, by 3
		{[]idem.FlowOption{idem.WithLease(time.Hour)}, "1min"},
		{[]idem.FlowOption{idem.WithIdleTimeout(2500 * time.Millisecond)}, "2500ms"},
		{[]idem.FlowOption{idem.WithIdleTimeout(0)}, session},
		{[]idem.FlowOption{idem.WithIdleTimeout(-time.Second)}, session},
	} {
		for _, begin := range []string{"", "BEGIN"} {
			key := fmt.Sprintf("k%d-%q", i, begin)
			opts := append(c.opts, idem.WithTxOptions(pgx.TxOptions{BeginQuery: begin}))
			res, err := flow.Run(ctx, conn, scope, key, nil, 0, opts...)
			if err != nil {
				t.Fatalf("case %d, BeginQuery %q: %v", i, begin, err)
			}
			if res.Value != c.want {
				t.Errorf("case %d, BeginQuery %q: idle_in_transaction_session_timeout in the step is %q, want %q", i, begin, res.Value, c.want)
			}
			if after, err := show(ctx, conn); err != nil || after != session {
				t.Errorf("case %d, BeginQuery %q: the session's setting after the flow is %q (%v), want %q", i, begin, after, err, session)
			}
		}
	}
}

// TestFlowIdleTimeoutCostsNoRoundTrip counts what a flow of two local
// steps around a call sends on one warm connection, with the default idle
// timeout and without one (WithIdleTimeout(0)): the same round trips, the
// setting queued in each step's BEGIN round trip; in the extended
// protocol, one statement more per step (the simple protocol sends a
// round trip's statements as one).
func TestFlowIdleTimeoutCostsNoRoundTrip(t *testing.T) {
	ctx, _, scope, p := setupFlow(t)
	var count testdb.WireCount
	cfg, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DialFunc = count.Dial
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	measure := func(key string, opts ...idem.FlowOption) testdb.Counts {
		t.Helper()
		before := count.Counts()
		if res, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 100}, opts...); err != nil || res.Replayed {
			t.Fatalf("%s: %+v, %v; want a first execution", key, res, err)
		}
		after := count.Counts()
		return testdb.Counts{RoundTrips: after.RoundTrips - before.RoundTrips, Statements: after.Statements - before.Statements}
	}
	none := idem.WithIdleTimeout(0)
	// Warm the connection: dialled, statements prepared.
	measure("warm-default")
	measure("warm-none", none)
	bounded, unbounded := measure("default"), measure("none", none)
	t.Logf("a flow of two local steps and a call: %+v with the default idle timeout, %+v without one", bounded, unbounded)
	more := int64(2)
	if cfg.ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeSimpleProtocol {
		more = 0
	}
	if bounded.RoundTrips != unbounded.RoundTrips || bounded.Statements != unbounded.Statements+more {
		t.Errorf("with the default idle timeout %+v, without one %+v; want the same round trips and %d statements more", bounded, unbounded, more)
	}
}
