package idem_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The crash and freeze tests of an executor that holds its claim's
// transaction: a new flow's run takes the flow's lock in a transaction
// that stays open while its function runs up to its first step, whose
// first local step runs in it, and that writes the flow's row only as it
// commits (see flow_claim.go). Killed or frozen there, the executor leaves
// nothing: no row, no step's write, no call.
//
// What the child does is tied to its progress, not to time, with one
// exception the tests cannot rule out: the claim's transaction commits
// alone (the flow's row, with no step) when the function is slow to reach
// its first step, after at most 100ms (commitIdle), which a loaded machine
// can make it. A child that got to its point only after that holds no
// claim's transaction, and the test runs again, under another scope, up
// to claimTries times.

// claimTries is how often a test runs its child again when the claim's
// transaction committed before the child got to its point.
const claimTries = 5

// claimLease is the lease of the flows frozen holding their claim: short,
// so that their idle timeout, by default a third of it, is about a second.
const claimLease = 3 * time.Second

// TestFlowCrashBeforeItsFirstStepLeavesNothing kills the executor in the
// flow's function before any step, holding the claim's open transaction
// (the flow's lock, nothing written).
func TestFlowCrashBeforeItsFirstStepLeavesNothing(t *testing.T) {
	crashHoldingTheClaimRunsTheFlowOnce(t, crashBeforeFirstStep)
}

// TestFlowCrashAfterALocalStepsFirstStatementRunsTheStepOnce kills the
// executor inside its first local step, which runs in the claim's
// transaction, once the step's INSERT has run there.
func TestFlowCrashAfterALocalStepsFirstStatementRunsTheStepOnce(t *testing.T) {
	crashHoldingTheClaimRunsTheFlowOnce(t, crashInStep)
}

// TestFlowCrashBeforeALocalStepCommitsRunsTheStepOnce kills the executor
// once its first local step has returned, its transaction (the claim's)
// left open for the call's intent.
func TestFlowCrashBeforeALocalStepCommitsRunsTheStepOnce(t *testing.T) {
	crashHoldingTheClaimRunsTheFlowOnce(t, crashBeforeCommit)
}

// crashHoldingTheClaimRunsTheFlowOnce kills the executor at point, while
// it holds the claim's open transaction: the flow's row, which that
// transaction writes as it commits, and the first step's writes die with
// the process, nothing is called, and a retry (the test's own process)
// runs the flow at once, its step's write applied once and the provider
// called once.
func crashHoldingTheClaimRunsTheFlowOnce(t *testing.T, point string) {
	ctx, pool, _ := setup(t)
	crashHoldingTheClaim(t, ctx, pool, env.URL(t), point)
}

// crashHoldingTheClaim is crashHoldingTheClaimRunsTheFlowOnce on pool,
// whose database the child reaches at url.
func crashHoldingTheClaim(t *testing.T, ctx context.Context, pool *pgxpool.Pool, url, point string) {
	for try := 1; ; try++ {
		scope, p := testdb.Name("t"), newProvider()
		providerURL, crash := crashRunner(t, ctx, url, scope, p)
		name := testdb.Name("crash")
		crash(name, "k", point)
		flows, payments, calls := countFlows(t, pool, scope), countPayments(t, pool, scope), p.calls.Load()
		if flows == 1 && calls == 0 && try < claimTries {
			t.Logf("try %d: the flow's row committed before the child got to %s (the claim's transaction committed alone): again", try, point)
			continue
		}
		if flows != 0 || payments != 0 || calls != 0 {
			t.Fatalf("before the retry: %d flows, %d payments, %d calls; want 0, 0, 0", flows, payments, calls)
		}
		res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
		if err != nil || res.Replayed || res.Value.ChargeID != "ch_1" {
			t.Fatalf("the retry: %+v, %v; want the flow run now", res, err)
		}
		checkOneCharge(t, pool, scope, "k", p, 1)
		return
	}
}

// TestFlowFrozenHoldingItsClaimIsEndedByTheServerWithinItsIdleTimeout
// freezes the executor (SIGSTOP) holding the claim's open transaction: in
// the flow's function before any step, and inside its first local step,
// whose INSERT ran in that transaction. Nothing of the flow is committed,
// and the frozen session holds the flow's lock, which no retry can take:
// a retry waits, polling, until the server ends that session, after the
// flow's idle timeout, by default a third of its lease (1s here), far
// sooner than the minute that was the default before (the retry's wait
// budget is half of that, so that it fails with ErrInProgress if the
// session is held so long). The retry then runs the flow once, while the
// child is still frozen; woken at the end, the child acts on nothing (its
// session is gone), and answers what a retry gets.
func TestFlowFrozenHoldingItsClaimIsEndedByTheServerWithinItsIdleTimeout(t *testing.T) {
	for _, at := range []string{freezeBeforeFirstStep, freezeInStep} {
		t.Run(at, func(t *testing.T) {
			ctx, pool, _ := setup(t)
			frozenHoldingTheClaim(t, ctx, pool, env.URL(t), at)
		})
	}
}

// frozenHoldingTheClaim freezes a child at at, holding its claim's
// transaction on pool's database, which the child reaches at url (see
// TestFlowFrozenHoldingItsClaimIsEndedByTheServerWithinItsIdleTimeout).
func frozenHoldingTheClaim(t *testing.T, ctx context.Context, pool *pgxpool.Pool, url, at string) {
	lease := claimLease
	for try := 1; ; try++ {
		scope, p := testdb.Name("t"), newProvider()
		providerURL, _ := crashRunner(t, ctx, url, scope, p)
		name, app := testdb.Name("freeze"), testdb.Name("frozen")
		child := freezeChild(t, ctx, crashJob{URL: url, Flow: name, Scope: scope, Key: "k", Provider: providerURL, At: at, Lease: &lease,
			App: app})
		if flowCommitted(t, ctx, pool, scope, "k") {
			if try < claimTries {
				t.Logf("try %d: the flow's row committed before the child got to %s (the claim's transaction committed alone): again", try, at)
				child.kill(t)
				continue
			}
			t.Fatalf("the flow's row committed before the child froze at %s, %d times", at, claimTries)
		}
		// The frozen session, idle in the claim's transaction, holds the
		// flow's lock.
		pid := heldIdleInTransaction(t, ctx, pool, app, scope, "k")
		if p.calls.Load() != 0 || countPayments(t, pool, scope) != 0 {
			t.Fatalf("before the retry: %d calls, %d payments; want 0, 0", p.calls.Load(), countPayments(t, pool, scope))
		}

		start := time.Now()
		res, err := crashFlow(name, providerURL, "", idem.WithLease(lease)).Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500},
			idem.WithWait(idem.DefaultFlowIdleTimeout/2))
		took := time.Since(start)
		if err != nil || res.Replayed || res.Value.ChargeID != "ch_1" {
			t.Fatalf("the retry, %s after the child froze holding its claim (lease %s): %+v, %v; want the flow run now",
				took.Round(time.Millisecond), lease, res, err)
		}
		t.Logf("the retry ran the flow %s after the child froze holding its claim (lease %s)", took.Round(time.Millisecond), lease)
		if !child.stopped(t) {
			t.Fatal("the child woke before the retry completed")
		}
		// The server ended the frozen session: nothing else releases the
		// lock the retry took. (Its entry may outlive the lock a moment.)
		for sessionAlive(t, ctx, pool, pid) {
			if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
				t.Fatalf("the frozen child's session is still there once the retry completed: %v", err)
			}
		}
		checkOneCharge(t, pool, scope, "k", p, 1)

		got := child.wake(t)
		if got.Err != "" || !got.Replayed || got.Value != res.Value {
			t.Fatalf("the woken executor answered %+v, want %+v replayed\n%s", got, res.Value, child.stderr.String())
		}
		checkOneCharge(t, pool, scope, "k", p, 1)
		return
	}
}
