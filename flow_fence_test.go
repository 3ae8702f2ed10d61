package idem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// stallingFlow is the charge flow with a pause of the first executor's
// between its local step and its call: stalled is closed when it stalls,
// and it goes on when resume is closed.
func stallingFlow(p *provider, stalled, resume chan struct{}, opts ...idem.FlowOption) *idem.Flow[chargeIn, string] {
	var stalls atomic.Int64
	return idem.MustNewFlow(testdb.Name("stall"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		if _, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, s.Scope(), s.Key(), in.Amount)
			return 1, err
		}); err != nil {
			return "", err
		}
		if stalls.Add(1) == 1 {
			close(stalled)
			<-resume
		}
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
	}, opts...)
}

func TestFlowStaleExecutorCannotCommitIntoTheKeysNextOperation(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	p.keep = time.Millisecond // as long as the flow's provider window
	stalled, resume := make(chan struct{}), make(chan struct{})
	flow := stallingFlow(p, stalled, resume, idem.WithLease(100*time.Millisecond), idem.WithRetention(time.Millisecond),
		idem.WithProviderWindow(time.Millisecond))
	stale := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
		stale <- err
	}()
	<-stalled
	leaseRanOut(t, ctx, pool, scope, "k")
	// Another executor finishes the first operation; it expires and is
	// purged, and the key's next operation starts, and holds its lease
	// while its call runs.
	first, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	expiredFlow(t, ctx, pool, scope, "k")
	if _, err := idem.Purge(ctx, pool, 100); err != nil {
		t.Fatal(err)
	}
	calling, answer := make(chan struct{}), make(chan struct{})
	p.before = func(string, int) error {
		close(calling)
		<-answer
		return nil
	}
	next := make(chan idem.Result[string], 1)
	go func() {
		res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 9900})
		if err != nil {
			t.Error(err)
		}
		next <- res
	}()
	<-calling
	p.before = nil
	// The stale executor of the first operation wakes while the next one
	// holds the flow: none of its writes may land, and it answers what its
	// client's retry would get, the next operation being another request.
	close(resume)
	if err := <-stale; !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("the stale executor: %v, want ErrFingerprintMismatch", err)
	}
	close(answer)
	second := <-next
	if second.Value == first.Value || second.Replayed {
		t.Fatalf("the key's next operation answered %+v, the first %+v: want a charge of its own", second, first)
	}
	// One provider key, which the provider forgot between the operations.
	charges, keys := p.effects()
	if charges != 2 || len(keys) != 1 || p.calls.Load() != 2 {
		t.Fatalf("charges %d, keys %v, calls %d; want 2 charges under 1 key, in 2 calls", charges, keys, p.calls.Load())
	}
}

func TestFlowKeyUsedAgainAfterItsRetentionIsANewOperation(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	// The provider keeps keys for as long as the flow's window says, and
	// the flow keeps its operation at least as long.
	p.keep = 20 * time.Millisecond
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithRetention(p.keep), idem.WithProviderWindow(p.keep))
	first, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	firstKey := providerKeyOf(t, ctx, pool, scope, "k", "charge")
	expiredFlow(t, ctx, pool, scope, "k")
	second, err := flow.Run(ctx, pool, scope, "k", idem.Fingerprint([]byte("charge 9900")), chargeIn{Amount: 9900})
	if err != nil || second.Replayed {
		t.Fatalf("the key's next operation: %+v, %v", second, err)
	}
	// The same provider key, which the provider, past its window, no
	// longer knows: a second charge, with an answer of its own.
	if secondKey := providerKeyOf(t, ctx, pool, scope, "k", "charge"); secondKey != firstKey {
		t.Fatalf("the operations sent the keys %s and %s, want one", firstKey, secondKey)
	}
	if charges, _ := p.effects(); charges != 2 || second.Value.ChargeID == first.Value.ChargeID {
		t.Fatalf("%d charges, answers %+v and %+v: want a second charge", charges, first.Value, second.Value)
	}
}

func TestFlowRefusesARetentionShorterThanItsProviderWindow(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	for _, opts := range [][]idem.FlowOption{
		{idem.WithRetention(time.Hour)},
		{idem.WithRetention(time.Hour), idem.WithProviderWindow(2 * time.Hour)},
	} {
		func() {
			defer func() {
				if p := recover(); p == nil || !errors.Is(p.(error), idem.ErrInvalidOption) {
					t.Errorf("MustNewFlow with %d options: panic %v, want ErrInvalidOption", len(opts), p)
				}
			}()
			chargeFlow(p, &steps, opts...)
		}()
		// NewFlow, MustNewFlow's twin, returns what MustNewFlow panics with.
		if f, err := idem.NewFlow("charge", func(context.Context, *idem.Steps, chargeIn) (chargeOut, error) { return chargeOut{}, nil }, opts...); f != nil || !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("NewFlow with %d options: %v, %v; want no flow and ErrInvalidOption", len(opts), f, err)
		}
	}
	if _, err := idem.NewFlow[chargeIn, chargeOut]("charge", nil); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("NewFlow with a nil function: %v, want ErrInvalidOption", err)
	}
	if _, err := idem.NewFlow("", func(context.Context, *idem.Steps, chargeIn) (chargeOut, error) { return chargeOut{}, nil }); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("NewFlow with an empty name: %v, want ErrInvalidOption", err)
	}
	flow := chargeFlow(p, &steps)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithRetention(time.Hour)); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("Run with a retention shorter than the flow's window: %v, want ErrInvalidOption", err)
	}
	if err := idem.CheckFlowOptions(idem.WithProviderWindow(-time.Second)); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("a negative provider window: %v, want ErrInvalidOption", err)
	}
	if err := idem.CheckFlowOptions(idem.WithRetention(time.Hour)); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("CheckFlowOptions with a retention shorter than the default window: %v, want ErrInvalidOption", err)
	}
	if steps.Load() != 0 || p.calls.Load() != 0 {
		t.Fatal("a step or a call ran")
	}
}

// expiredFlow waits until the flow (scope, key) has finished and its
// retention passed, by the database's clock.
func expiredFlow(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) {
	t.Helper()
	for {
		info, err := idem.InspectFlow(ctx, pool, scope, key)
		if err != nil {
			t.Fatal(err)
		}
		if info.Expired {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestFlowDuplicatesAndResumeDoNotWaitOnALocalStepsLock(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	// Two executors whose local step outlasts its lease: a new flow's,
	// whose step holds the flow's row uncommitted (and the flow's lock),
	// and a flow's taken over after a failed run, whose step holds the
	// committed row, locked.
	for _, takenOver := range []bool{false, true} {
		key := fmt.Sprintf("taken-over-%t", takenOver)
		var runs atomic.Int64
		inStep, release := make(chan struct{}), make(chan struct{})
		flow := idem.MustNewFlow(testdb.Name("slow-step"), func(ctx context.Context, s *idem.Steps, in chargeIn) (int, error) {
			return idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
				if runs.Add(1) == 1 && takenOver {
					return 0, errors.New("out of stock") // gives the lease up
				}
				// The step's first statement takes the flow's lock.
				if _, err := tx.Exec(ctx, `SELECT $1::int`, 1); err != nil {
					return 0, err
				}
				close(inStep)
				<-release // a local step that outlasts its lease, holding the flow's row
				return 1, nil
			})
		}, idem.WithLease(50*time.Millisecond), idem.WithIdleTimeout(time.Minute))
		if takenOver {
			if _, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 1}); !errors.Is(err, idem.ErrFlowIncomplete) {
				t.Fatalf("the failed run: %v, want ErrFlowIncomplete", err)
			}
		}
		done := make(chan error, 1)
		go func() {
			_, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 1})
			done <- err
		}()
		<-inStep
		if takenOver {
			leaseRanOut(t, ctx, pool, scope, key)
		}
		// Neither waits for the row: the duplicate's budget is nothing.
		if _, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 1}, idem.WithWait(0)); !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("taken over %t: a duplicate with no wait: %v, want ErrInProgress", takenOver, err)
		}
		if resumed, err := flow.Resume(ctx, pool); err != nil || resumed != 0 {
			t.Fatalf("taken over %t: Resume = %d, %v; want nothing taken", takenOver, resumed, err)
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatalf("taken over %t: the executor whose step outlasted its lease: %v", takenOver, err)
		}
	}
}

// A duplicate that finds another executor starting the flow (its first
// step running, the row not committed) waits for it, polling its claim,
// under its budget, and never runs the flow's function.
func TestFlowDuplicateOfAStartingFlowDoesNotRunTheFunction(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	duplicateOfAStartingFlow(t, ctx, pool, scope)
}

// duplicateOfAStartingFlow runs a duplicate of a flow whose first
// executor is in its first step (the claim's transaction open, holding
// the flow's lock): the duplicate waits for its budget, and runs nothing.
func duplicateOfAStartingFlow(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope string) {
	t.Helper()
	var calls atomic.Int64
	inStep, release := make(chan struct{}), make(chan struct{})
	flow := idem.MustNewFlow(testdb.Name("starting"), func(ctx context.Context, s *idem.Steps, in chargeIn) (int, error) {
		first := calls.Add(1) == 1
		return idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
			if _, err := tx.Exec(ctx, `SELECT $1::int`, 1); err != nil {
				return 0, err
			}
			if first {
				close(inStep)
				<-release
			}
			return 1, nil
		})
	})
	done := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1})
		done <- err
	}()
	<-inStep
	const budget = 500 * time.Millisecond
	_, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1}, idem.WithWait(budget))
	close(release)
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("the duplicate: %v, want ErrInProgress", err)
	}
	if dup := calls.Load() - 1; dup != 0 {
		t.Errorf("the duplicate ran the flow's function %d times in its %s budget, want none", dup, budget)
	}
	if err := <-done; err != nil {
		t.Fatalf("the first executor: %v", err)
	}
}

func TestFlowStepWhoseErrorTheFunctionHandledLeavesTheFlowResumable(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var reserveRuns atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("handled"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		_, reserveErr := idem.Local(s, "reserve", func(context.Context, pgx.Tx) (int, error) {
			if reserveRuns.Add(1) == 1 {
				return 0, errors.New("out of stock")
			}
			return 1, nil
		})
		// The function carries on after a failed step: it notes it.
		if _, err := idem.Local(s, "note", func(context.Context, pgx.Tx) (bool, error) { return reserveErr != nil, nil }); err != nil {
			return "", err
		}
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
	})
	p.before = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("timeout")
		}
		return nil
	}
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("the first run: %v, want ErrFlowIncomplete", err)
	}
	if res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err != nil || res.Value != "ch_1" {
		t.Fatalf("the retry: %+v, %v; want it to continue", res, err)
	}
}

func TestFlowConcurrentFirstRunsHaveOneExecutor(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithWait(time.Minute))
	const runs = 12
	results := make([]idem.Result[chargeOut], runs)
	var wg sync.WaitGroup
	for i := range runs {
		wg.Go(func() {
			res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
			if err != nil {
				t.Error(err)
			}
			results[i] = res
		})
	}
	wg.Wait()
	executed := 0
	for _, res := range results {
		if !res.Replayed {
			executed++
		}
		if res.Value != results[0].Value {
			t.Fatalf("answers differ: %+v and %+v", res.Value, results[0].Value)
		}
	}
	if executed != 1 || p.calls.Load() != 1 || steps.Load() != 2 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d executed, %d calls, %d local steps, %d payments; want 1, 1, 2, 1",
			executed, p.calls.Load(), steps.Load(), countPayments(t, pool, scope))
	}
}

func TestFlowLocalStepsAtEveryIsolationLevelAndOnOneConnection(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	for _, c := range []struct {
		name string
		opts pgx.TxOptions
	}{
		{"repeatable_read", pgx.TxOptions{IsoLevel: pgx.RepeatableRead}},
		{"serializable", pgx.TxOptions{IsoLevel: pgx.Serializable}},
		{"begin_query", pgx.TxOptions{BeginQuery: "BEGIN; SET LOCAL application_name = 'flow-test'"}},
	} {
		p := newProvider()
		var steps atomic.Int64
		flow := chargeFlow(p, &steps, idem.WithTxOptions(c.opts))
		if res, err := flow.Run(ctx, pool, scope, c.name, fpCharge, chargeIn{Amount: 2500}); err != nil || res.Value.ChargeID == "" {
			t.Fatalf("%s: %+v, %v", c.name, res, err)
		}
	}
	readOnly := chargeFlow(newProvider(), new(atomic.Int64))
	if _, err := readOnly.Run(ctx, pool, scope, "ro", fpCharge, chargeIn{Amount: 2500},
		idem.WithTxOptions(pgx.TxOptions{AccessMode: pgx.ReadOnly})); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("read-only local steps: %v, want ErrInvalidOption", err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	p := newProvider()
	var steps atomic.Int64
	if res, err := chargeFlow(p, &steps).Run(ctx, conn, scope, "conn", fpCharge, chargeIn{Amount: 2500}); err != nil || res.Value.ChargeID == "" {
		t.Fatalf("on one connection: %+v, %v", res, err)
	}
}

func TestFlowLocalStepLongerThanItsLeaseDoesNotFenceTheNextStep(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	flow := idem.MustNewFlow(testdb.Name("long-step"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		// A first step, whose transaction writes the flow's row as it
		// commits, as the next one begins.
		if _, err := idem.Local(s, "open", func(ctx context.Context, tx pgx.Tx) (int, error) { return 0, nil }); err != nil {
			return "", err
		}
		if _, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
			// The step, which holds the flow's row locked (without
			// renewing its lease as it began), outlasts the lease.
			leaseRanOut(t, ctx, tx, s.Scope(), s.Key())
			return 1, nil
		}); err != nil {
			return "", err
		}
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
	}, idem.WithLease(50*time.Millisecond), idem.WithIdleTimeout(time.Minute))
	if res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err != nil || res.Value != "ch_1" {
		t.Fatalf("%+v, %v; want the call made after the long step", res, err)
	}
}

func TestFlowExpiredFlowBeingRestartedIsNotReplayed(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithRetention(time.Millisecond), idem.WithProviderWindow(time.Millisecond))
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	expiredFlow(t, ctx, pool, scope, "k")
	// Another caller holds the expired row, as one restarting it does.
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT FROM idem_flow WHERE scope = $1 AND key = 'k' FOR UPDATE`, scope); err != nil {
		t.Fatal(err)
	}
	// While it is held, a run does not replay the expired answer: it waits
	// for the row, here until its context ends.
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if res, err := flow.Run(short, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a run while the expired row is held: %+v, %v; want it to wait", res, err)
	}
	// pgx returns at the deadline and cancels the run's statement after,
	// from a goroutine: until that lands, its session still waits for the
	// row, and would restart the flow the moment the row is released (seen
	// on PostgreSQL 14 under load). Release it once nothing waits on it.
	// The server's own pid: through PgBouncer, PgConn().PID() is the
	// pooler's made-up one.
	var holderPID int32
	if err := holder.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holderPID); err != nil {
		t.Fatal(err)
	}
	for {
		var waiting bool
		if err := pool.QueryRow(ctx,
			`SELECT EXISTS (SELECT FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid)))`, holderPID).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if !waiting {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// (The run that gave up may have had a claim in flight, which the
	// server can still carry out once the row is free: the retry then
	// waits for that claim's lease, and takes the flow over.)
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Replayed || p.calls.Load() != 2 {
		t.Fatalf("%+v, %v after %d calls; want the key's next operation run", res, err, p.calls.Load())
	}
}
