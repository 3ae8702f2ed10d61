package idem

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
	"github.com/pgidem/idem/internal/pgtime"
)

// Steps is what a flow's function takes its steps with: pass it to
// [Local] and [Call]. Steps run one at a time, in the function's own
// goroutine, and only until the function returns; a flow that takes the
// same steps in the same order each time it runs is one that can resume.
type Steps struct {
	ctx context.Context
	run *flowRun
}

// Context returns the context of the run: the caller's context of
// [Flow.Run], or [Flow.Resume]'s.
func (s *Steps) Context() context.Context { return s.ctx }

// Scope returns the scope of the flow's operation.
func (s *Steps) Scope() string { return s.run.k.scope }

// Key returns the key of the flow's operation.
func (s *Steps) Key() string { return s.run.k.key }

// The kinds of steps, as idem_flow_step.kind spells them.
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
//
// The transaction also holds the flow's lease: it is renewed as the step
// begins, and no one can take the flow over until the transaction ends. A
// step whose executor lost the lease runs nothing and returns
// [ErrLeaseLost]. Serialization failures and deadlocks are retried as
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
		ctx, end := r.obs.step(s.ctx, stepLocal, name, "", 0)
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

// runLocal is one attempt of a local step: BEGIN with the lease's renewal
// (FlowLease) in one round trip, fn, then the lease renewed again, for the
// steps after this one, and the step's record (FlowStepRecord), with
// COMMIT, in one round trip. A BeginQuery or CommitQuery of the caller's
// (WithTxOptions) is run as given, through pgx, as Run runs it.
func runLocal[T any](ctx context.Context, r *flowRun, seq int32, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	var zero T
	conn, release, err := ownConn(ctx, r.db)
	if err != nil {
		return zero, fmt.Errorf("acquire connection: %w", err)
	}
	defer release()
	opts := r.o.txOptions
	pipelined := conn != nil && opts.BeginQuery == "" && opts.CommitQuery == ""
	lease := dbsqlc.FlowLeaseParams{Lease: pgtime.Interval(r.o.lease), Step: name, Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}
	var tx pgx.Tx
	var leased bool
	switch {
	case pipelined:
		b := &pgx.Batch{}
		b.BeginTx(opts)
		dbsqlc.QueueFlowLease(b, lease, &leased)
		results := conn.SendBatch(ctx, b)
		tx = results.Tx()
		err = results.Close()
	default:
		var beginner TxBeginner = r.db
		if conn != nil {
			beginner = conn
		}
		if tx, err = beginner.BeginTx(ctx, opts); err == nil {
			var n int64
			n, err = dbsqlc.New(tx).FlowLease(ctx, lease)
			leased = n == 1
		}
	}
	ended := false
	defer func() {
		if !ended && tx != nil && (!pipelined || conn.PgConn().TxStatus() != 'I') {
			rollback(ctx, tx)
		}
	}()
	if err != nil {
		return zero, translate("begin, renewing the lease", err)
	}
	if !leased {
		return zero, r.lostError()
	}

	value, err := fn(ctx, tx)
	if err != nil {
		return zero, err
	}
	encoded, err := encodeResponse(value, r.k.scope, r.o)
	if err != nil {
		return zero, fmt.Errorf("result: %w", err)
	}
	lease.Held = true
	record := dbsqlc.FlowStepRecordParams{Scope: r.k.scope, Key: r.k.key, Seq: seq, Step: name,
		Result: pgtype.Text{String: string(encoded), Valid: true}}
	if !pipelined {
		q := dbsqlc.New(tx)
		if _, err := q.FlowLease(ctx, lease); err != nil {
			return zero, translate("renew the lease", err)
		}
		if err := q.FlowStepRecord(ctx, record); err != nil {
			return zero, translate("record step", err)
		}
		ended = true
		if err := tx.Commit(ctx); err != nil {
			return zero, translate("commit", err)
		}
		return decodedResult[T](r, encoded)
	}
	b := &pgx.Batch{}
	dbsqlc.QueueFlowLease(b, lease, &leased)
	dbsqlc.QueueFlowStepRecord(b, record)
	_ = dbsqlc.Queue(b).TxCommit(ctx)
	results := tx.SendBatch(ctx, b)
	_, _ = results.Exec() // FlowLease: the row is held, it renews
	_, recordErr := results.Exec()
	tag, commitErr := results.Exec()
	closeErr := results.Close()
	ended = conn.PgConn().TxStatus() == 'I'
	switch {
	case recordErr != nil:
		return zero, translate("record step", recordErr)
	case commitErr != nil:
		return zero, translate("commit", commitErr)
	case closeErr != nil:
		return zero, translate("commit", closeErr)
	case tag.String() == "ROLLBACK":
		return zero, translate("commit", pgx.ErrTxCommitRollback)
	}
	return decodedResult[T](r, encoded)
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

// Call runs the flow's step named name: a call to another system, fn,
// made with no transaction open and no connection held. fn gets the
// call's provider key ([ProviderKey] of the operation and the step's
// name), the same on every attempt, in every process: pass it
// to the provider's own idempotency mechanism (Stripe's Idempotency-Key
// header, an AIP-155 request_id), so that a call made again after a crash
// or a timeout is recognised by the provider and applied once.
//
// Before fn is called, the step's intent is recorded, in a short
// transaction of its own; once fn returns a value, the value (its result,
// stored as JSON) is recorded in another. A step with a recorded result
// never runs again: when the flow runs again, Call returns the result
// without calling fn. A step whose intent is recorded without a result
// (the process died during the call, or the call failed) calls fn again,
// with the same provider key, until [WithProviderWindow] has passed since
// its first attempt; past it, the flow is stopped for a person's decision
// and Call returns [ErrFlowStopped].
//
// An error from fn is the call's uncertain outcome: Call returns it,
// wrapped, records nothing but the attempt, and the flow's function should
// return it. A definite failure (a declined card) is a value: return it in
// T, and it is recorded like any result. fn's context ends when ctx does,
// or when the executor loses the flow's lease, which is renewed every third
// of [WithLease] while fn runs (not when the flow runs on a single
// connection, which the call must not hold: its lease then covers one
// call); Call then returns [ErrLeaseLost].
func Call[T any](s *Steps, name string, fn func(ctx context.Context, providerKey string) (T, error)) (T, error) {
	var zero T
	r := s.run
	seq, rec, err := r.begin(name, stepCall)
	if err != nil {
		return zero, err
	}
	defer r.end()
	if rec != nil && rec.State == stepDone {
		return recordedResult[T](r, name, rec.Result)
	}
	value, err := runCall(s.ctx, r, seq, name, fn)
	if err != nil {
		return zero, fmt.Errorf("step %q: %w", name, err)
	}
	return value, nil
}

// stepDone marks a step whose result is recorded.
const stepDone = "done"

// runCall records the call's intent (FlowCallStart), calls fn while the
// lease is kept, and records the result (FlowCallDone).
func runCall[T any](ctx context.Context, r *flowRun, seq int32, name string, fn func(ctx context.Context, providerKey string) (T, error)) (T, error) {
	var zero T
	window := pgtype.Interval{}
	if r.o.providerWindow >= 0 {
		window = pgtime.Interval(r.o.providerWindow)
	}
	sent := time.Now()
	var start dbsqlc.FlowCallStartRow
	err := onDB(ctx, r.db, func(q *dbsqlc.Queries) (err error) {
		start, err = q.FlowCallStart(ctx, dbsqlc.FlowCallStartParams{Lease: pgtime.Interval(r.o.lease), Step: name,
			Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch, Seq: seq, CallWindow: window})
		return err
	})
	switch {
	case err != nil:
		return zero, translate("record the call's intent", err)
	case !start.Leased:
		return zero, r.lostError()
	case start.Attempts == 0:
		return zero, r.stop(ctx, fmt.Sprintf("step %q: the call's first attempt is older than the provider window (%s), "+
			"past which calling again with the same key could apply it twice: find out from the provider whether it was applied", name, r.o.providerWindow))
	}

	providerKey := ProviderKey(r.k.scope, r.k.key, name, r.operation)
	value, err := callKeepingLease(ctx, r, name, providerKey, int(start.Attempts), sent, fn)
	if err != nil {
		return zero, err
	}
	encoded, err := encodeResponse(value, r.k.scope, r.o)
	if err != nil {
		return zero, fmt.Errorf("result: %w", err)
	}
	var n int64
	err = onDB(ctx, r.db, func(q *dbsqlc.Queries) (err error) {
		n, err = q.FlowCallDone(ctx, dbsqlc.FlowCallDoneParams{Result: pgtype.Text{String: string(encoded), Valid: true},
			Scope: r.k.scope, Key: r.k.key, Seq: seq, Lease: pgtime.Interval(r.o.lease), Epoch: r.epoch})
		return err
	})
	if err != nil {
		return zero, translate("record the call's result", err)
	}
	if n == 0 {
		return zero, r.lostError()
	}
	return decodedResult[T](r, encoded)
}

// callKeepingLease calls fn with providerKey while the lease is kept (see
// keepLease), as attempt attempt of the call named name, whose intent was
// recorded at sent; a panic of fn stops the renewals and ends the span
// before it goes on.
func callKeepingLease[T any](ctx context.Context, r *flowRun, name, providerKey string, attempt int, sent time.Time,
	fn func(ctx context.Context, providerKey string) (T, error),
) (value T, err error) {
	callCtx, stop := r.keepLease(ctx, name, sent)
	callCtx, end := r.obs.step(callCtx, stepCall, name, providerKey, attempt)
	defer func() {
		if lost := stop(); lost != nil {
			err = errors.Join(lost, err)
		}
		end(err)
	}()
	return fn(callCtx, providerKey)
}

// keepLease returns the context of a call that starts now, whose lease was
// renewed at renewed, and the function to call when the call has returned,
// which reports ErrLeaseLost if the lease was lost meanwhile. On a pool
// (or any TxBeginner but a single connection, which the call must leave
// alone) the lease is renewed every third of it (FlowLease) while the call
// runs; the call's context ends when a renewal finds the lease lost, or
// when none succeeded for a whole lease. On a single connection the call's
// context ends when the lease runs out.
func (r *flowRun) keepLease(ctx context.Context, step string, renewed time.Time) (context.Context, func() error) {
	ctx, cancel := context.WithCancelCause(ctx)
	lost := r.lostError()
	switch r.db.(type) {
	case *pgx.Conn, *pgxpool.Conn:
		ctx, cancelDeadline := context.WithDeadlineCause(ctx, renewed.Add(r.o.lease), lost)
		return ctx, func() error {
			cause := context.Cause(ctx)
			cancelDeadline()
			cancel(nil)
			return leaseCause(cause)
		}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		ticker := time.NewTicker(r.o.lease / 3)
		defer ticker.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
			// A renewal that has not succeeded by the time the lease runs
			// out is given up: a database out of reach must not keep
			// the call going past its lease.
			sent := time.Now()
			renewCtx, cancelRenew := context.WithDeadline(ctx, renewed.Add(r.o.lease))
			var n int64
			err := onDB(renewCtx, r.db, func(q *dbsqlc.Queries) (err error) {
				n, err = q.FlowLease(renewCtx, dbsqlc.FlowLeaseParams{Lease: pgtime.Interval(r.o.lease), Step: step,
					Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch})
				return err
			})
			cancelRenew()
			switch {
			case err == nil && n == 1:
				renewed = sent
			case err == nil:
				cancel(lost)
				return
			}
			if time.Since(renewed) >= r.o.lease {
				cancel(lost)
				return
			}
		}
	})
	return ctx, func() error {
		close(done)
		wg.Wait()
		cause := context.Cause(ctx)
		cancel(nil)
		return leaseCause(cause)
	}
}

// leaseCause is cause when it says the lease was lost, else nil.
func leaseCause(cause error) error {
	if errors.Is(cause, ErrLeaseLost) {
		return cause
	}
	return nil
}

// stop stops the flow for a person's decision (FlowStop), and returns the
// error that says so: ErrFlowStopped, or ErrLeaseLost when the executor no
// longer held it.
func (r *flowRun) stop(ctx context.Context, why string) error {
	var n int64
	err := onDB(ctx, r.db, func(q *dbsqlc.Queries) (err error) {
		n, err = q.FlowStop(ctx, dbsqlc.FlowStopParams{LastError: storableText(why), Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch})
		return err
	})
	switch {
	case err != nil:
		return translate("stop the flow", err)
	case n == 0:
		return r.lostError()
	}
	r.obs.flowStopped()
	return fmt.Errorf("%w: it needs attention: %s", ErrFlowStopped, why)
}

// begin starts the function's next step, named name, of kind: it checks
// the name, that no other step runs and the function has not returned, and
// that the step is the one earlier runs recorded at its place, if any, and
// returns its place and its record. end ends it.
func (r *flowRun) begin(name, kind string) (int32, *dbsqlc.FlowStepsRow, error) {
	if err := ident.Check(name); err != nil {
		return 0, nil, fmt.Errorf("%w: step name %q: %s", ErrInvalidOption, name, err)
	}
	if r.returned.Load() {
		return 0, nil, fmt.Errorf("idem: step %q: the flow's function has returned: steps run only inside it", name)
	}
	if !r.stepping.CompareAndSwap(false, true) {
		return 0, nil, fmt.Errorf("idem: step %q: another step of the flow is running: steps run one at a time", name)
	}
	if r.names[name] {
		r.stepping.Store(false)
		return 0, nil, fmt.Errorf("idem: step %q: the flow took a step of this name already: each step needs a name of its own", name)
	}
	seq := r.next
	r.next++
	r.names[name] = true
	rec, ok := r.recorded[seq]
	switch {
	case !ok:
		return seq, nil, nil
	case rec.Name != name || rec.Kind != kind:
		r.stepping.Store(false)
		return 0, nil, fmt.Errorf("%w: step %d is %s %q, the earlier run recorded %s %q", ErrFlowChanged,
			seq, kindName(kind), name, kindName(rec.Kind), rec.Name)
	case rec.State == stepDone:
		return seq, &rec, nil
	}
	return seq, nil, nil
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

// ProviderKey returns the provider key of the call that the step named step
// makes for the flow operation (scope, key) whose number is operation
// ([FlowInfo].Operation; see [Call]): a UUID (RFC 9562, version 8) made of
// the first 16 bytes of the SHA-256 of the four (the number in decimal),
// each prefixed with its length, after the string "idem.Call"
// ([Fingerprint]), with the version and variant bits set. It is the same
// on every attempt, in every process, in every version of idem, and fits
// what providers accept as an idempotency key: Stripe's up to 255
// characters, AIP-155's UUID request_id. The operation's number is new
// each time the key's flow starts: a key used again after its flow expired
// is another operation, whose calls the provider must not take for the old
// one's. [InspectFlow] shows each call's key; a provider's records are
// matched back to the operation by computing it again.
func ProviderKey(scope, key, step string, operation int64) string {
	sum := Fingerprint([]byte("idem.Call"), []byte(scope), []byte(key), []byte(step),
		strconv.AppendInt(nil, operation, 10))
	var u [16]byte
	copy(u[:], sum)
	u[6] = u[6]&0x0f | 0x80 // version 8
	u[8] = u[8]&0x3f | 0x80 // RFC 9562 variant
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:36], u[10:16])
	return string(b[:])
}
