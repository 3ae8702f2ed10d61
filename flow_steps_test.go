package idem_test

import (
	"context"
	"errors"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

func TestFlowLocalStepIsNotRepeatedWhenALaterStepFailed(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithLease(time.Hour), idem.WithWait(0))
	p.before = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("provider unavailable")
		}
		return nil
	}
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	if steps.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("after the failed call: %d local steps ran, %d payments; want 1, 1", steps.Load(), countPayments(t, pool, scope))
	}
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	// reserve ran once, record once: 2 in all.
	if steps.Load() != 2 || countPayments(t, pool, scope) != 1 || res.Value.PaymentID == 0 {
		t.Fatalf("after the retry: %d local steps ran, %d payments, answer %+v; want 2, 1, the first payment",
			steps.Load(), countPayments(t, pool, scope), res.Value)
	}
}

func TestFlowResumedWithOtherStepsIsRefusedBeforeAnyCall(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	name := testdb.Name("changed")
	failing := errors.New("provider unavailable")
	reserve := func(s *idem.Steps) (int, error) {
		return idem.Local(s, "reserve", func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	}
	charge := func(s *idem.Steps) (string, error) {
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, 2500)
			return id, err
		})
	}
	p.before = func(string, int) error { return failing }
	v1 := idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error) {
		if _, err := reserve(s); err != nil {
			return "", err
		}
		return charge(s)
	}, idem.WithWait(0))
	if _, err := v1.Run(ctx, pool, scope, "k", nil, struct{}{}); !errors.Is(err, failing) {
		t.Fatalf("first run: %v, want the call's failure", err)
	}
	calls := p.calls.Load()
	p.before = nil

	for _, c := range []struct {
		name string
		fn   func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error)
	}{
		{"the call first", func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error) { return charge(s) }},
		{"a local step where the call was", func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error) {
			if _, err := reserve(s); err != nil {
				return "", err
			}
			return idem.Local(s, "charge", func(context.Context, pgx.Tx) (string, error) { return "local", nil })
		}},
		{"a renamed first step", func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error) {
			if _, err := idem.Local(s, "reserve-v2", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
				return "", err
			}
			return charge(s)
		}},
	} {
		v2 := idem.MustNewFlow(name, c.fn, idem.WithWait(0))
		if _, err := v2.Run(ctx, pool, scope, "k", nil, struct{}{}); !errors.Is(err, idem.ErrFlowChanged) {
			t.Errorf("%s: %v, want ErrFlowChanged", c.name, err)
		}
	}
	if p.calls.Load() != calls {
		t.Fatalf("the provider was called %d times after the change, want 0", p.calls.Load()-calls)
	}
	// The flow waits, unchanged, for the version that took its steps.
	v1again := idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error) {
		if _, err := reserve(s); err != nil {
			return "", err
		}
		return charge(s)
	}, idem.WithWait(0))
	if res, err := v1again.Run(ctx, pool, scope, "k", nil, struct{}{}); err != nil || res.Value != "ch_1" {
		t.Fatalf("the original version: %+v, %v; want ch_1", res, err)
	}
}

func TestFlowStepsNeedNamesOfTheirOwn(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	step := func(s *idem.Steps, name string) error {
		_, err := idem.Local(s, name, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
		return err
	}
	twice := idem.MustNewFlow(testdb.Name("twice"), func(ctx context.Context, s *idem.Steps, _ struct{}) (int, error) {
		if err := step(s, "a"); err != nil {
			return 0, err
		}
		return 0, step(s, "a")
	})
	if _, err := twice.Run(ctx, pool, scope, "twice", nil, struct{}{}); err == nil || !regexp.MustCompile(`name of its own`).MatchString(err.Error()) {
		t.Fatalf("a step name taken twice: %v", err)
	}
	invalid := idem.MustNewFlow(testdb.Name("invalid"), func(ctx context.Context, s *idem.Steps, _ struct{}) (int, error) { return 0, step(s, "") })
	if _, err := invalid.Run(ctx, pool, scope, "invalid", nil, struct{}{}); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("an empty step name: %v, want ErrInvalidOption", err)
	}
	var kept *idem.Steps
	late := idem.MustNewFlow(testdb.Name("late"), func(ctx context.Context, s *idem.Steps, _ struct{}) (int, error) { kept = s; return 1, nil })
	if _, err := late.Run(ctx, pool, scope, "late", nil, struct{}{}); err != nil {
		t.Fatal(err)
	}
	if err := step(kept, "after"); err == nil {
		t.Fatal("a step taken after the function returned ran")
	}
}

func TestFlowHoldsNoTransactionOrConnectionDuringACall(t *testing.T) {
	ctx, _, scope, p := setupFlow(t)
	// A pool of the test's own, named, on the server itself.
	cfg := env.DirectPool(t).Config()
	app := testdb.Name("flow-call")
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	observer := env.DirectPool(t)

	var acquired int32
	var inTx int
	p.before = func(string, int) error {
		acquired = pool.Stat().AcquiredConns()
		return observer.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND xact_start IS NOT NULL`, app).Scan(&inTx)
	}
	var steps atomic.Int64
	if _, err := chargeFlow(p, &steps).Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	if acquired != 0 || inTx != 0 {
		t.Fatalf("during the call: %d connections acquired, %d sessions in a transaction; want 0, 0", acquired, inTx)
	}
}

// leaseRanOut waits until the flow (scope, key) has a row that db sees,
// and its lease has run out, as the database's clock tells.
func leaseRanOut(t *testing.T, ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, scope, key string,
) {
	t.Helper()
	for {
		var out bool
		err := db.QueryRow(ctx, `SELECT leased_until <= clock_timestamp() FROM idem_flow WHERE scope = $1 AND key = $2`, scope, key).Scan(&out)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// Not committed yet: a new flow's row commits with its first
			// step.
		case err != nil:
			t.Fatal(err)
		case out:
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestFlowStalledExecutorIsFencedAtItsNextStep(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	name := testdb.Name("stall")
	var steps atomic.Int64
	stalled, resume := make(chan struct{}), make(chan struct{})
	var stalls atomic.Int64
	flow := idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		if _, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, s.Scope(), s.Key(), in.Amount)
			if err == nil {
				steps.Add(1) // the step ran: its statement did
			}
			return 1, err
		}); err != nil {
			return "", err
		}
		if stalls.Add(1) == 1 {
			close(stalled) // the first executor stalls here, holding no lease renewal
			<-resume
		}
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
	}, idem.WithLease(100*time.Millisecond))

	first := make(chan ran[string], 1)
	go func() {
		res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		first <- ran[string]{res, err}
	}()
	<-stalled
	leaseRanOut(t, ctx, pool, scope, "k")
	second, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || second.Value != "ch_1" {
		t.Fatalf("the retry that took the flow over: %+v, %v", second, err)
	}
	// The stalled executor wakes fenced: it calls nobody, records nothing,
	// and answers its caller what a retry would get.
	close(resume)
	if res := <-first; res.err != nil || !res.Replayed || res.Value != "ch_1" {
		t.Fatalf("the stalled executor: %+v, %v; want the other's answer, replayed", res.Result, res.err)
	}
	if p.calls.Load() != 1 || steps.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d calls, %d local steps, %d payments; want 1, 1, 1", p.calls.Load(), steps.Load(), countPayments(t, pool, scope))
	}
	if again, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil || !again.Replayed || again.Value != "ch_1" {
		t.Fatalf("a later retry: %+v, %v; want the answer replayed", again, err)
	}
}

func TestFlowStalledCallIsFencedAndRecordsNothing(t *testing.T) {
	ctx, frozenPool, scope, f := setupFrozen(t)
	pool, p := env.Pool(t), newProvider()
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithLease(300*time.Millisecond))
	calling, answer, answered := make(chan struct{}), make(chan struct{}), make(chan struct{})
	p.after = func(_ string, attempt int) error {
		if attempt == 1 {
			defer close(answered)
			close(calling)
			<-answer // the first executor's call hangs after the provider applied it
		}
		return nil
	}
	firstCtx, cancelFirst := context.WithCancel(ctx)
	defer cancelFirst()
	first := make(chan error, 1)
	go func() {
		_, err := flow.Run(firstCtx, frozenPool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		first <- err
	}()
	<-calling
	f.Freeze() // and its host is cut off: its lease cannot be renewed
	leaseRanOut(t, ctx, pool, scope, "k")
	second, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || second.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry that took the flow over: %+v, %v", second, err)
	}
	// The stalled call returns; its executor, still cut off, can neither
	// record its result nor learn the other's answer before its caller
	// gives up.
	close(answer)
	<-answered
	cancelFirst()
	if err := <-first; err == nil {
		t.Fatal("the stalled executor answered")
	}
	charges, keys := p.effects()
	if charges != 1 || len(keys) != 1 || countPayments(t, pool, scope) != 1 || steps.Load() != 2 {
		t.Fatalf("charges %d, keys %v, payments %d, local steps %d; want 1, one key, 1, 2", charges, keys, countPayments(t, pool, scope), steps.Load())
	}
	if again, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil || !again.Replayed || again.Value != second.Value {
		t.Fatalf("a later retry: %+v, %v; want %+v replayed", again, err, second.Value)
	}
}

func TestFlowPastTheProviderWindowNothingCallsAgain(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithWait(0))
	// The provider applied the charge; the answer was lost.
	p.after = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("timeout")
		}
		return nil
	}
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	// A day later, past the provider's 24 hours.
	ageCalls(t, pool, scope, "k", 25*time.Hour)
	for range 2 {
		if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
			t.Fatalf("a retry past the window: %v, want ErrFlowStopped", err)
		}
	}
	if p.calls.Load() != 1 {
		t.Fatalf("the provider was called %d times, want once", p.calls.Load())
	}
	// A window of zero never calls twice.
	zero := chargeFlow(p, &steps, idem.WithWait(0), idem.WithProviderWindow(0))
	p.after = func(string, int) error { return errors.New("timeout") }
	if _, err := zero.Run(ctx, pool, scope, "k0", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	calls := p.calls.Load()
	if _, err := zero.Run(ctx, pool, scope, "k0", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("a retry with a window of zero: %v, want ErrFlowStopped", err)
	}
	if p.calls.Load() != calls {
		t.Fatal("a window of zero called again")
	}
}

func TestFlowRunGivesItsLeaseUpWhenItsContextEnds(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithLease(time.Hour), idem.WithWait(0))
	runCtx, cancel := context.WithCancel(ctx)
	p.before = func(_ string, attempt int) error {
		if attempt == 1 {
			cancel() // the client goes away during the call
			<-runCtx.Done()
			return runCtx.Err()
		}
		return nil
	}
	if _, err := flow.Run(runCtx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled run: %v, want context.Canceled", err)
	}
	// With an hour's lease and no wait, only a lease given up lets the retry in.
	if res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v", res, err)
	}
}

// ageCalls makes the calls that the flows of scope (of key, unless empty)
// recorded look by long older, as if their first attempts had been made
// by long earlier (past a provider's window): the flow's created_at, from
// which the times of its records count, and the times of records written
// as objects (by a version before migration 00009).
func ageCalls(t *testing.T, pool *pgxpool.Pool, scope, key string, by time.Duration) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `UPDATE idem_flow AS f
		SET created_at = f.created_at - $3::bigint * interval '1 microsecond',
		    steps = (SELECT jsonb_object_agg(s.key, CASE WHEN s.value ? 'f'
		                 THEN jsonb_set(s.value, '{f}', to_jsonb((s.value->>'f')::bigint - $3::bigint))
		                 ELSE s.value END)
		             FROM jsonb_each(f.steps) AS s)
		WHERE f.scope = $1 AND ($2 = '' OR f.key = $2) AND f.steps IS NOT NULL`, scope, key, by.Microseconds())
	if err != nil {
		t.Fatal(err)
	}
}
