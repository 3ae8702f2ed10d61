package idem

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// A run looks at its flow with its first statement, not before its
// function runs: Flow.Run makes it as if the key had no flow (unlooked),
// and the function runs up to its first step. A first local step whose
// transaction stays open reads the flow (FlowGet) in the round trip that
// begins it, after the flow's advisory lock (FlowStartLock) and before
// the check that fails when the flow is there (FlowStartFree), so that
// the step's statement never runs (see flow_steptx.go). Any other first statement
// (a call's intent, a local step of another kind, the answer, the lease
// given up) is preceded by the look alone (look), in a round trip of its
// own, as the claim used to be. A run whose look found no flow goes on,
// and starts it (see flow_pending.go); one whose look found it commits
// nothing and ends, whatever its function makes of the error its step
// returned (errLooked): Run then judges what the look read as the claim
// judges what it reads, to replay the answer, refuse another request, or
// wait for the executor that holds the flow, with no round trip more
// (but for a replay that must wait for a synchronous standby, which a
// look in a step's transaction, rolled back, did not: the claim reads the
// flow again, alone). So
// a new flow's claim costs no round trip of its own, and a replay still
// one; but code before a flow's first step, and a first local step's up
// to its first statement, run on every attempt, replays included: they
// must be free of effects, as they already had to be for duplicates.

// errLooked is what a run gets when its look (see above) found the flow
// there: it committed nothing, and Run judges what the look read.
var errLooked = errors.New("idem: the flow was there when the run looked with its first statement")

// look reads the flow alone, for an unlooked run whose first statement
// cannot read it: errLooked when it is there, nil when it is not (the run
// goes on, and starts it), or the round trip's error.
func (r *flowRun) look(ctx context.Context) error { return r.lookOn(ctx, r.db) }

// lookOn is look on db: a connection the run holds already, so that it
// never waits for its own pool.
func (r *flowRun) lookOn(ctx context.Context, db TxBeginner) error {
	if !r.unlooked {
		return nil
	}
	var b pgx.Batch
	dbsqlc.QueueFlowGet(&b, dbsqlc.FlowGetParams{Scope: r.k.scope, Key: r.k.key}, &r.seen, &r.seenFound)
	if err := sendFlowBatch(ctx, db, &b); err != nil {
		return translate("idem: flow: claim key", err)
	}
	r.seenAlone = true
	return r.looked(false, nil)
}

// queueLook queues the look on b, which begins the first local step's
// transaction, before the flow's lock, for an unlooked run.
func (r *flowRun) queueLook(b *pgx.Batch) {
	if r.unlooked {
		dbsqlc.QueueFlowGet(b, dbsqlc.FlowGetParams{Scope: r.k.scope, Key: r.k.key}, &r.seen, &r.seenFound)
	}
}

// looked judges what the look read, err being the error of the
// statements it travelled with, the flow's lock among them (locked; the
// look went alone otherwise): errLooked, noted on the run, when it found
// the flow and nothing after it ran (the lock failed, or it went alone);
// nil otherwise. A flow found though the lock was taken all the same
// (its row purged since) is started by the run. A round trip that failed
// otherwise leaves the run unlooked: its next statement looks again.
func (r *flowRun) looked(locked bool, err error) error {
	if err != nil && !errors.Is(err, dbsqlc.ErrNotHeld) {
		return nil // the look may not have been read: the run looks again
	}
	r.unlooked = false
	if r.seenFound && (!locked || errors.Is(err, dbsqlc.ErrNotHeld)) {
		r.taken = errLooked
		return errLooked
	}
	return nil
}
