package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
)

// An executor commits as late as it safely can, so that a flow commits
// about once per call rather than once per step. A local step's
// transaction stays open when its function returns, with the step's
// record not yet sent (openStep), until the flow's next step begins or
// its function returns: the record then commits with what comes next (a
// call's intent, the flow's answer, the lease given up) in one round trip.
// A call's result is kept (flowRun.result) until the next write of the
// flow's row: the next local step's (as its transaction commits: that
// step's BEGIN only locks the row, FlowLock), the next call's intent, the
// answer, in the same transaction. So local–call–local commits twice,
// writes the flow's row twice (an insert as its first step commits,
// FlowStartHeld; an update with the answer) and locks it once (its second
// step's BEGIN): every record goes into the write of the row that the
// statement it travels with makes anyway, or, past maxInlineSteps, into a
// row of its own (see flow_records.go).
//
// What does not change: no call is made with a transaction open or a
// connection held (its intent commits first, with whatever was pending);
// nothing depends on a call's result before it is recorded (whatever
// depends on it commits with it, or after it); every write is fenced by
// the executor's epoch. A process that dies with something pending loses
// it, as if the step had not returned: a local step runs again, in full,
// and a call is made again with the same provider key (or looked up,
// [Reconcile]); an [AtMostOnce] call's result is therefore committed at
// once, since a call made again is what it must never be.

// A flow that no one had started when its executor claimed it is started
// by its first statement, in its transaction (FlowStart): the first local
// step's, or the implicit one of its first call's intent (or of its
// answer, or of the lease given up), so that the claim commits nothing of
// its own, and local–call–local commits twice. Until then the flow's row
// is invisible to others, and the transaction that writes it holds the
// flow's advisory lock (keylock.FlowID): a duplicate, which sees no row,
// finds the lock taken and looks again, under its wait budget, as it does
// for a flow that another executor holds; it never waits for the
// uncommitted row. A run whose first statement finds the flow taken
// (errTaken) commits nothing, and looks at the flow again (Flow.Run). A
// first local step whose transaction stays open takes the lock as it
// begins (FlowStartLock), and writes the row only as it commits
// (FlowStartHeld), carrying the step's record and the first call's
// intent, so that the row is written once; the row statement that
// carries a first call's intent without a local step before it is
// FlowStart itself. A row committed by another executor between the
// lock's snapshot and the lock fails FlowStartHeld (a unique violation),
// and the step's writes with it: errTaken.

// errTaken is what a run that was to start its flow gets when another
// executor was starting it, or had started it, since the claim: the run
// committed nothing, and looks at the flow again, as a duplicate.
var errTaken = errors.New("idem: another executor is starting the flow, or started it, since it was claimed")

// starting is the flow's row queued on a batch (queueStart), and what the
// batch found.
type starting struct {
	row     dbsqlc.FlowStartRow
	written bool
	// held is set for FlowStartHeld, whose row is heldRow.
	held    bool
	heldRow dbsqlc.FlowStartHeldRow
}

// queueStart queues the flow's row (FlowStart), at step (none when
// empty), on b when it is still to be written, and returns what reads its
// outcome, or nil.
func (r *flowRun) queueStart(b *pgx.Batch, step string) *starting {
	if r.start == nil {
		return nil
	}
	st := &starting{}
	params := *r.start
	params.Step = pgtype.Text{String: step, Valid: step != ""}
	dbbatch.QueueFlowStart(b, params, &st.row, &st.written)
	return st
}

// queueStartHeld queues the flow's row (FlowStartHeld), at step, with
// the records steps holds, in the transaction that FlowStartLock began,
// which read the namespace of its provider keys (r.keys).
func (r *flowRun) queueStartHeld(b *pgx.Batch, step string, steps pgtype.Text) *starting {
	st := &starting{held: true}
	p := r.start
	dbbatch.QueueFlowStartHeld(b, dbsqlc.FlowStartHeldParams{Scope: p.Scope, Key: p.Key, FlowName: p.FlowName,
		Fingerprint: p.Fingerprint, Input: p.Input, ProviderNamespace: r.keys.namespace, Epoch: p.Epoch, Lease: p.Lease,
		Step: pgtype.Text{String: step, Valid: step != ""}, Retention: p.Retention, Steps: steps}, &st.heldRow, &st.written)
	return st
}

// started judges what the batch that carried the flow's row (st, nil for
// none) found, err being the batch's error: errTaken, noted on the run,
// when the row was not written, or was there already (a unique violation
// on the flow's primary key, or its shard's); err otherwise.
func (r *flowRun) started(st *starting, err error) error {
	if st == nil {
		return err
	}
	switch {
	case err == nil && st.written && st.held:
		r.keys = providerKeys{namespace: st.heldRow.ProviderNamespace, operation: st.heldRow.Operation}
		r.base.Store(st.heldRow.CreatedAt.Time.UnixMicro())
		return nil
	case err == nil && st.written:
		r.keys = providerKeys{namespace: st.row.ProviderNamespace, operation: st.row.Operation}
		return nil
	case err == nil, flowKeyTaken(err):
		r.taken = errTaken
		return errTaken
	}
	return err
}

// flowKeyTaken reports whether err is a unique violation of the flow's
// primary key, or of its shard's: PostgreSQL names the constraint
// (23505); Citus relays a shard's 23505 with the constraint's name in
// the message only, and reports one in a statement it ran through the
// coordinator as XX000, also with the name in the message only.
func flowKeyTaken(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	named := strings.Contains(pgErr.Message, `unique constraint "idem_flow_pkey`)
	switch pgErr.Code {
	case "23505":
		return strings.HasPrefix(pgErr.ConstraintName, "idem_flow_pkey") || pgErr.ConstraintName == "" && named
	case "XX000":
		return named
	}
	return false
}

// startCommitted notes that the flow's row committed.
func (r *flowRun) startCommitted() {
	r.start = nil
	r.obs.claimDone(outcomeClaimed)
}

// takenError is errTaken when the run's first statement found the flow
// taken, else nil.
func (r *flowRun) takenError() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.taken
}

// openStep is a local step's transaction, left open when its function
// returned: its writes and the flow's row are locked, its record is still
// to be sent.
type openStep struct {
	name   string
	conn   *pgx.Conn
	pooled *pgxpool.Conn // given back once the step ends (releaseConn)
	tx     pgx.Tx
	record pendingStep
	lease  dbsqlc.FlowLeaseStepsParams
	// carries is set when the transaction also records the call's result
	// (flowRun.result), with the step's record; starts when it took the
	// flow's lock as it began (FlowStartLock), and writes the flow's row
	// (flowRun.start) as it commits (FlowStartHeld).
	carries, starts bool
	// namespace is what the claim's FlowStartLock read, the namespace of
	// the flow's provider keys, for an openStep that is the claim's
	// transaction (see claim).
	namespace pgtype.UUID
	// timer commits the transaction alone when the next step is late
	// (commitIdle).
	timer *time.Timer
}

// claim reports whether o is the claim's transaction, which holds the
// flow's lock and no step yet (see flow_claim.go): the flow's first local
// step runs in it, and what commits it writes the flow's row.
func (o *openStep) claim() bool { return o.name == "" }

// idle reports whether o's connection is in no transaction: the one the
// step left open ended. On a TxBeginner that is no pgx connection it is
// never known, and a rollback is sent all the same.
func (o *openStep) idle() bool { return o.conn != nil && o.conn.PgConn().TxStatus() == 'I' }

// maxOpenStep bounds how long a local step's transaction stays open after
// its function returned, waiting for the flow's next step: past a third of
// the lease, a third of the idle timeout (WithIdleTimeout, after which the
// server would end the session), or this, it commits alone (commitIdle),
// so that Go code that runs long between steps, or an executor stalled
// there, holds no lock for longer, and an executor stalled past its lease
// can be taken over.
const maxOpenStep = 100 * time.Millisecond

// keepOpen leaves open, a local step's transaction, open (see openStep),
// until the next flush, or commitIdle after a while.
func (r *flowRun) keepOpen(open *openStep) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.open = open
	open.timer = time.AfterFunc(openStepWait(r.o), func() { r.commitIdle(open) })
}

// openStepWait is how long a local step's transaction stays open, at
// most, waiting for the flow's next step (see maxOpenStep).
func openStepWait(o *options) time.Duration {
	wait := min(o.lease/3, maxOpenStep)
	if o.idleTimeout > 0 {
		wait = min(wait, o.idleTimeout/3)
	}
	return wait
}

// commitIdle commits open alone, if it is still open: the flow's next step
// did not begin in time. What it fails with, the flow's next statement
// reports (flush), and nothing is sent with it.
func (r *flowRun) commitIdle(open *openStep) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.open != open {
		return
	}
	ctx, cancel := cleanupContext(context.Background())
	defer cancel()
	if err := r.flushLocked(ctx, nil); err != nil {
		r.failed = err
	}
}

// claimedOrFlushed returns the claim's transaction, still open, for the
// flow's first local step to run in, and no longer the run's to commit;
// otherwise it commits the open step's transaction alone, if there is
// one, and reports the error of one that committed alone.
func (r *flowRun) claimedOrFlushed(ctx context.Context) (*openStep, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.failed; err != nil {
		r.failed = nil
		return nil, err
	}
	switch open := r.open; {
	case open == nil:
		return nil, nil
	case open.claim():
		r.open = nil
		open.timer.Stop()
		return open, nil
	}
	return nil, r.flushLocked(ctx, nil)
}

// flush commits what is pending with the statements queue queues (nil for
// none), in one round trip: on the open step's transaction, the
// statements, then COMMIT; otherwise the statements, in one implicit
// transaction. What is pending (the open step's record, or the call's
// result) is recorded in the flow's row by the statement queue queues
// that writes that row, which gets it as steps (and may add its own
// records), so that the row is written once; with nothing queued, by
// FlowLeaseSteps, which renews the lease too. (A local step's record
// that goes to a row of its own, FlowStepRecord, is queued first.) The
// queued statements must check the executor's epoch themselves, and
// report what they found themselves. It reports ErrLeaseLost when
// FlowLeaseSteps found the flow no longer the executor's. When a step's
// transaction that committed alone (commitIdle) failed, it returns that
// error and sends nothing.
func (r *flowRun) flush(ctx context.Context, queue func(b *pgx.Batch, steps *stepPatch)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.failed; err != nil {
		r.failed = nil
		return err
	}
	return r.flushLocked(ctx, queue)
}

func (r *flowRun) flushLocked(ctx context.Context, queue func(b *pgx.Batch, steps *stepPatch)) error {
	open := r.open
	r.open = nil
	if open != nil {
		open.timer.Stop()
	}
	if r.taken != nil {
		if open != nil {
			r.discardOpen(ctx, open)
		}
		return r.taken
	}
	b := &pgx.Batch{}
	leased := &r.flushLeased
	*leased = true
	carried := r.result != nil && (open == nil || open.carries)
	// A flow not started yet is started by what is queued, or in the open
	// step's transaction, which began by taking the flow's lock
	// (FlowStartLock) and writes the row as it commits (FlowStartHeld).
	held := open != nil && open.starts
	var st *starting
	if open == nil && queue != nil {
		st = r.queueStart(b, "")
	}
	steps := stepPatch{base: r.base.Load()}
	steps.b = r.patch[:0]
	defer func() { r.patch = steps.b[:0] }()
	steps.starting = held
	if open != nil && !open.claim() {
		if open.record.row {
			dbbatch.QueueFlowStepRecord(b, open.record.rowParams(r.k))
		} else {
			steps.add(open.record.seq, &open.record.rec)
		}
		steps.at = open.name // FlowLock did not note it
	}
	if carried {
		steps.put(r.result.seq, &r.result.rec, r.result.rec.inRow)
	}
	// The records that go to rows of their own, before the statement
	// that writes the flow's row (which may end the flow).
	r.queueStepRows(b, &steps)
	first := b.Len()
	switch {
	case queue != nil:
		queue(b, &steps)
	case held:
		// The row, written now, records the step and leases the flow.
		steps.carry(open.name)
	case open != nil:
		// Nothing after the record renews the lease: the record does,
		// for the steps after this one.
		queueLease(b, open.lease, &steps, leased)
	case carried:
		queueLease(b, dbsqlc.FlowLeaseStepsParams{Lease: pgtime.Interval(r.o.lease), Step: r.result.rec.Name,
			Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &steps, leased)
	}
	if held {
		// The row first, before the statements that write it again.
		if steps.carried {
			st = r.queueStartHeld(b, steps.step, steps.text())
		} else {
			st = r.queueStartHeld(b, steps.at, pgtype.Text{})
		}
		q := b.QueuedQueries
		last := q[len(q)-1]
		copy(q[first+1:], q[first:len(q)-1])
		q[first] = last
		steps.start = st
	}
	if b.Len() == 0 {
		return nil
	}
	sent := time.Now()
	if open == nil {
		if err := r.started(st, sendBatch(ctx, r.db, b)); errors.Is(err, errTaken) {
			return err
		} else if err != nil {
			return translate("record the call's result", err)
		}
		if st != nil {
			r.startCommitted()
		}
		if carried {
			r.result = nil
			if !*leased {
				return r.lostError()
			}
			if queue == nil {
				r.lease.renewed(sent)
			}
		}
		return nil
	}
	defer releaseConn(open.pooled)
	r.commitTag = pgconn.CommandTag{}
	var err error
	if open.conn != nil && r.o.txOptions.CommitQuery == "" {
		dbbatch.QueueTxCommit(b).Exec(r.noteCommit)
		err = r.started(st, open.tx.SendBatch(ctx, b).Close())
	} else if err = r.started(st, open.tx.SendBatch(ctx, b).Close()); err == nil {
		// A TxBeginner that is no pgx connection, or a CommitQuery of the
		// caller's (the claim's transaction, begun with it): COMMIT
		// through the transaction, as it commits.
		err = open.tx.Commit(ctx)
		r.commitTag = pgconn.NewCommandTag("COMMIT")
		if errors.Is(err, pgx.ErrTxCommitRollback) {
			err, r.commitTag = nil, pgconn.NewCommandTag("ROLLBACK")
		}
	}
	commit := r.commitTag
	if (open.conn == nil && err != nil) || (open.conn != nil && !open.idle()) {
		rollback(ctx, open.tx)
	}
	switch {
	case errors.Is(err, errTaken):
		return err
	case err != nil:
		return translate(fmt.Sprintf("commit step %q", open.name), err)
	case commit.String() != "COMMIT":
		return translate(fmt.Sprintf("commit step %q", open.name), pgx.ErrTxCommitRollback)
	}
	if open.carries {
		r.result = nil
	}
	if open.starts {
		r.startCommitted()
	}
	if queue == nil {
		r.lease.renewed(sent)
	}
	return nil
}

// discard rolls back the open step's transaction, if any, and forgets the
// call's result not yet recorded: for an executor that no longer holds
// the flow, which could commit neither.
func (r *flowRun) discard(ctx context.Context) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if open := r.open; open != nil {
		r.open = nil
		r.discardOpen(ctx, open)
	}
	r.result = nil
}

// discardOpen rolls open back, no longer the run's, and gives its
// connection back.
func (r *flowRun) discardOpen(ctx context.Context, open *openStep) {
	open.timer.Stop()
	rollback(ctx, open.tx)
	releaseConn(open.pooled)
}
