package idem

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
	"github.com/pgidem/idem/internal/pgtime"
)

// Steps is what a flow's function takes its steps with: pass it to
// [Local] and [Call]. Steps run one at a time, in the function's own
// goroutine, and only until the function returns; a flow that takes the
// same steps in the same order each time it runs is one that can resume.
type Steps struct {
	ctx context.Context // the run's: the flow's function gets it too
	run *flowRun
}

// Scope returns the scope of the flow's operation.
func (s *Steps) Scope() string { return s.run.k.scope }

// Key returns the key of the flow's operation.
func (s *Steps) Key() string { return s.run.k.key }

// The kinds of steps, as idem_flow_step_row.kind spells them.
const (
	stepLocal = "local"
	stepCall  = "call"
)

// Local runs the flow's step named name: fn in a transaction of its own,
// begun on the flow's db with the flow's [WithTxOptions], whose writes
// commit together with the step's result, fn's value (stored as JSON, as
// [Run] stores its value), or not at all. Once the step has committed, it
// never runs again for the flow's operation: when the flow runs again,
// Local returns the recorded result (decoded from JSON) without calling fn.
// fn is called only when the step is to run: never for a step that
// completed, nor by a Run that replays, is refused or waits (see
// [Flow.Run]). Its tx stops working once fn returns (pgx.ErrTxClosed),
// its nested transactions too, and refuses Commit and Rollback: the
// transaction commits with the step's record, or not at all, which
// returning an error asks for. On a pgx pool or connection, below
// SERIALIZABLE, the transaction commits with the flow's next statement
// (the next call's intent, the answer), not when Local returns, and at
// most a third of the lease, or of the idle timeout, later (100ms at
// most); a flow's first step runs in the transaction of the flow's claim,
// and a later one's BEGIN and the lock of the flow's row are sent with
// fn's first statement, in one round trip: see docs/flows.md. A process
// that dies before the commit runs the step again.
//
// The transaction also holds the flow's lease: it locks the flow from its
// first statement on, and no one can take the flow over until the
// transaction ends, however long fn runs. So that an executor frozen in
// the step (a stopped process, a paused VM) does not hold the flow for
// ever, the server ends the transaction once it has sat idle, waiting for
// the executor, for the flow's [WithIdleTimeout] (by default a third of
// its lease, up to 1m): fn's statements are not limited, only the gaps
// between them.
// A step whose executor lost the lease runs no statement and returns
// [ErrLeaseLost] (fn's statements return it too). fn may have run up to
// its first statement before the server checked the lease, so, as for a
// transaction that [WithTx] retries, fn must have no effect outside its
// transaction. Serialization failures and deadlocks are retried as
// [WithTx] retries them; fn's other errors are returned, wrapped, and
// nothing of the step is committed.
//
// Step names follow the rules of keys, and each step of a flow needs a
// name of its own: the name, the kind and the place of each step are
// recorded, and a flow that resumes with other steps gets
// [ErrFlowChanged].
func Local[T any](s *Steps, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	var zero T
	r := s.run
	seq, rec, err := r.begin(name, stepLocal)
	if err != nil {
		return zero, err
	}
	defer r.end()
	if rec != nil {
		return recordedResult[T](r, name, rec.Result)
	}
	var value T
	err = retry(s.ctx, func() error {
		ctx, end := r.obs.step(s.ctx, stepLocal, "idem.Local", name, "", 0)
		var err error
		value, err = runLocal(ctx, r, seq, name, fn)
		end(err)
		return err
	})
	if err != nil {
		return zero, fmt.Errorf("step %q: %w", name, err)
	}
	return value, nil
}

// runLocal is one attempt of a local step. On a connection it drives (a
// pool's, with neither a BeginQuery nor a CommitQuery of the caller's, and
// an isolation level below serializable, whose COMMIT can fail after the
// step has returned), runLocalOpen runs it: the transaction is left open
// with the step's record still to send (and the last call's result, if
// it is not recorded yet), and the flow's next statement records them in
// the flow's row and commits them (flowRun.flush). Otherwise the step
// begins its transaction with the flow's row locked (FlowLock), in one
// round trip, before fn runs, and once fn has returned renews the lease,
// for the steps after this one, recording them in the same write
// (FlowLeaseSteps), with COMMIT, in one round trip where it can; a
// BeginQuery or CommitQuery of the caller's (WithTxOptions) is run as
// given, through pgx, as Run runs it. The flow's first local step runs in
// the claim's transaction, which holds the flow's lock, and writes the
// flow's row as it commits (FlowStartHeld).
func runLocal[T any](ctx context.Context, r *flowRun, seq int32, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	var zero T
	// The claim's transaction, for the flow's first step; or the step
	// before this one, if local, commits first (and the error of one that
	// committed alone is reported).
	claimed, err := r.claimedOrFlushed(ctx)
	if err != nil {
		return zero, err
	}
	if claimed == nil && r.lease.left() <= 0 {
		// The lease may have run out by the executor's clock (it stalled
		// since its last statement): fn is entered only once a renewal
		// says the flow is still the executor's.
		if err := r.renew(ctx, name); err != nil {
			return zero, err
		}
	}
	var conn *pgx.Conn
	var pooled *pgxpool.Conn
	if claimed != nil {
		conn, pooled = claimed.conn, claimed.pooled
	} else if conn, pooled, err = stepConn(ctx, r.db); err != nil {
		return zero, fmt.Errorf("acquire connection: %w", err)
	}
	opts := r.o.txOptions
	pipelined := conn != nil && opts.BeginQuery == "" && opts.CommitQuery == ""
	if pipelined && opts.IsoLevel != pgx.Serializable {
		return runLocalOpen(ctx, r, seq, name, fn, conn, pooled, opts, claimed)
	}
	defer releaseConn(pooled)
	lease := dbsqlc.FlowLeaseStepsParams{Lease: pgtime.Interval(r.o.lease), Step: name, Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}
	lock := dbsqlc.FlowLockParams{Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}
	var tx pgx.Tx
	var st *starting
	carries := r.result != nil
	sent := time.Now()
	switch {
	case claimed != nil:
		// The claim's transaction, begun with opts, holds the flow's lock:
		// the row is written as the step commits (FlowStartHeld).
		tx = claimed.tx
	case pipelined:
		b := &pgx.Batch{}
		b.BeginTx(opts)
		queueIdleTimeout(b, r.o, namedFor(r.db))
		if st = r.queueStart(b, name); st == nil {
			dbbatch.QueueFlowLock(b, lock)
		}
		results := conn.SendBatch(ctx, b)
		tx = results.Tx()
		err = results.Close()
	default:
		var beginner TxBeginner = r.db
		if conn != nil {
			beginner = conn
		}
		if tx, err = beginner.BeginTx(ctx, opts); err == nil {
			b := &pgx.Batch{}
			queueIdleTimeout(b, r.o, namedFor(r.db))
			if st = r.queueStart(b, name); st == nil {
				dbbatch.QueueFlowLock(b, lock)
			}
			err = tx.SendBatch(ctx, b).Close()
		}
	}
	err = r.started(st, err)
	ended := false
	defer func() {
		if !ended && tx != nil && (conn == nil || conn.PgConn().TxStatus() != 'I') {
			rollback(ctx, tx)
		}
	}()
	switch {
	case errors.Is(err, errTaken):
		return zero, err
	case errors.Is(err, dbbatch.ErrNotHeld): // FlowLock
		return zero, r.lostError()
	case err != nil:
		return zero, translate("begin, locking the flow", err)
	}
	if st != nil {
		r.lease.renewed(sent) // FlowStart leased the flow; FlowLock renews nothing
	}

	// On a TxBeginner that is no pgx connection (idemsql's, whose Unwrap
	// needs its own transaction), fn gets that transaction, which the
	// step commits as soon as fn returns, and which refuses what comes
	// after.
	stx := r.openStepTx(ctx, conn, tx, claimed != nil)
	var ftx pgx.Tx = stx
	if conn == nil {
		ftx = tx
	}
	value, err := fn(ctx, ftx)
	stx.closed.Store(true)
	if err != nil {
		return zero, err
	}
	record, encoded, err := localRecord(r, seq, name, value)
	if err != nil {
		return zero, err
	}
	// The flow's row is locked since the step began, so the renewal finds
	// the lease as the step's first statement left it; it records the
	// step in the same write. A row still to write (the claim's) carries
	// the records instead.
	sent = time.Now()
	steps := stepPatch{base: r.base.Load()}
	if !record.row {
		steps.add(record.seq, &record.rec)
	}
	if carries {
		steps.put(r.result.seq, &r.result.rec, r.result.rec.inRow)
	}
	lease.Steps = steps.text()
	b := &pgx.Batch{}
	if record.row {
		dbbatch.QueueFlowStepRecord(b, record.rowParams(r.k))
	}
	r.queueStepRows(b, &steps)
	leased := &r.stepLeased
	*leased = false
	if claimed != nil {
		st = r.queueStartHeld(b, name, steps.text())
	} else {
		queueLease(b, lease, &steps, leased)
	}
	var commitTag pgconn.CommandTag
	if pipelined {
		dbbatch.QueueTxCommit(b).Exec(func(tag pgconn.CommandTag) error {
			commitTag = tag
			return nil
		})
	}
	err = r.started(st, tx.SendBatch(ctx, b).Close())
	if !pipelined && err == nil {
		ended = true
		if err = tx.Commit(ctx); err != nil {
			return zero, translate("commit", err)
		}
		commitTag = pgconn.NewCommandTag("COMMIT")
	}
	ended = ended || conn != nil && conn.PgConn().TxStatus() == 'I'
	switch {
	case errors.Is(err, errTaken):
		return zero, err
	case err != nil:
		return zero, translate("record step", err)
	case commitTag.String() == "ROLLBACK":
		return zero, translate("commit", pgx.ErrTxCommitRollback)
	case claimed == nil && !*leased:
		return zero, r.lostError()
	}
	if carries {
		r.result = nil
	}
	if st != nil {
		r.startCommitted()
	}
	r.lease.renewed(sent)
	return decodedResult[T](r, encoded)
}

// runLocalOpen is an attempt of a local step whose transaction stays open
// when its function returns (see runLocal), on conn, pooled's (nil for
// none), which it gives back unless the step is left open: the claim's
// transaction, for the flow's first step (claimed), or one that begins
// with the function's first statement (stepTx). It is left open, its
// record unsent, for the flow's next statement to commit
// (flowRun.flush).
func runLocalOpen[T any](ctx context.Context, r *flowRun, seq int32, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error),
	conn *pgx.Conn, pooled *pgxpool.Conn, opts pgx.TxOptions, claimed *openStep) (T, error) {
	var zero T
	var t *stepTx
	if claimed != nil {
		t = r.openStepTx(ctx, conn, claimed.tx, true)
	} else {
		t = r.newStepTx(ctx, conn, opts)
	}
	kept := false
	defer func() {
		if kept {
			return
		}
		_ = t.over(nil)
		if t.tx != nil && conn.PgConn().TxStatus() != 'I' {
			rollback(ctx, t.tx)
		}
		releaseConn(pooled)
	}()
	carries := r.result != nil
	value, err := fn(ctx, t)
	t.closed.Store(true)
	if err != nil && t.b != nil {
		return zero, err // nothing was sent
	}
	if t.first != nil {
		// Rows fn left open: the step fails, as its commit would on
		// pgx's transaction (the deferred cleanup closes them).
		return zero, errStepConnBusy
	}
	if _, beginErr := t.begin(ctx); beginErr != nil {
		return zero, beginErr
	}
	if err != nil {
		return zero, err
	}
	record, encoded, err := localRecord(r, seq, name, value)
	if err != nil {
		return zero, err
	}
	value, err = decodedResult[T](r, encoded)
	if err != nil {
		return zero, err
	}
	lease := dbsqlc.FlowLeaseStepsParams{Lease: pgtime.Interval(r.o.lease), Step: name, Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}
	r.keepOpen(&openStep{name: name, conn: conn, pooled: pooled, tx: t.tx, record: record, lease: lease, carries: carries, starts: t.starts})
	kept = true
	return value, nil
}

// localRecord is the record of a local step that returned value, and the
// value as it is stored.
func localRecord[T any](r *flowRun, seq int32, name string, value T) (pendingStep, []byte, error) {
	encoded, err := encodeResponse(value, r.k.scope, r.o)
	if err != nil {
		return pendingStep{}, nil, fmt.Errorf("result: %w", err)
	}
	record := pendingStep{seq: seq, rec: stepRecord{Name: name, Result: encoded, Completed: stampNow}}
	record.row = r.inRow(seq, &record.rec)
	return record, encoded, nil
}

// stepConn is ownConn for a local step, without a function to release
// the connection (an allocation): pooled is the pool's connection that
// conn is, to give back with releaseConn, or nil.
func stepConn(ctx context.Context, db TxBeginner) (conn *pgx.Conn, pooled *pgxpool.Conn, err error) {
	if pool, ok := db.(*pgxpool.Pool); ok {
		if pooled, err = pool.Acquire(ctx); err != nil {
			return nil, nil, err
		}
		return pooled.Conn(), pooled, nil
	}
	conn, _, err = ownConn(ctx, db) // the release of any other does nothing
	return conn, nil, err
}

// releaseConn gives pooled, stepConn's, back to its pool, if not nil.
func releaseConn(pooled *pgxpool.Conn) {
	if pooled != nil {
		pooled.Release()
	}
}

// decodedResult is a step's value as its record holds it: decoded from the
// JSON (opened by the codec) that was stored, so that a run gets the value
// a resumed run gets from the record.
func decodedResult[T any](r *flowRun, encoded []byte) (T, error) {
	res, err := replayed[T](encoded, r.k.scope, r.o)
	if err != nil {
		return res.Value, fmt.Errorf("result: %w", err)
	}
	return res.Value, nil
}

// begin starts the function's next step, named name, of kind: it checks
// the name, that no other step runs and the function has not returned, and
// that the step is the one earlier runs recorded at its place, if any, and
// returns its place and its record. end ends it.
func (r *flowRun) begin(name, kind string) (int32, *stepRecord, error) {
	if err := ident.Check(name); err != nil {
		fn := map[string]string{stepLocal: "Local", stepCall: "Call"}[kind]
		return 0, nil, &FieldError{Package: "idem", Field: fn, Problem: fmt.Sprintf("step name %q: %s", name, err)}
	}
	if r.returned.Load() {
		return 0, nil, fmt.Errorf("idem: step %q: the flow's function has returned: steps run only inside it", name)
	}
	if err := r.takenError(); err != nil {
		return 0, nil, err // another executor's flow: nothing more runs
	}
	if r.unreadable != nil {
		return 0, nil, r.unreadable
	}
	if !r.stepping.CompareAndSwap(false, true) {
		return 0, nil, fmt.Errorf("idem: step %q: another step of the flow is running: steps run one at a time", name)
	}
	if !r.names.add(name) {
		r.stepping.Store(false)
		return 0, nil, fmt.Errorf("idem: step %q: the flow took a step of this name already: each step needs a name of its own", name)
	}
	seq := r.next
	r.next++
	rec, ok := r.recorded[seq]
	switch {
	case !ok:
		return seq, nil, nil
	case rec.Name != name || rec.kind() != kind:
		r.stepping.Store(false)
		return 0, nil, fmt.Errorf("%w: step %d is %s %q, the earlier run recorded %s %q", ErrFlowChanged,
			seq, kindName(kind), name, kindName(rec.kind()), rec.Name)
	case rec.done():
		return seq, &rec, nil
	}
	return seq, nil, nil
}

// stepNames are the names of the steps a run took: the first few in a
// slice, in the run's own room, the rest also in a map.
type stepNames struct {
	first [8]string
	n     int
	more  map[string]bool
}

// add adds name, and reports whether it was not there yet.
func (s *stepNames) add(name string) bool {
	if slices.Contains(s.first[:min(s.n, len(s.first))], name) || s.more[name] {
		return false
	}
	if s.n < len(s.first) {
		s.first[s.n] = name
	} else {
		if s.more == nil {
			s.more = make(map[string]bool)
		}
		s.more[name] = true
	}
	s.n++
	return true
}

func (r *flowRun) end() { r.stepping.Store(false) }

func kindName(kind string) string {
	if kind == stepCall {
		return "the call"
	}
	return "the local step"
}

// recordedResult decodes a recorded step's result.
func recordedResult[T any](r *flowRun, name string, result []byte) (T, error) {
	res, err := replayed[T](result, r.k.scope, r.o)
	if err != nil {
		return res.Value, fmt.Errorf("step %q: recorded result: %w", name, err)
	}
	return res.Value, nil
}
