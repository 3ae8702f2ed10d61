package idem

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

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
	sent := time.Now()
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
	r.lease.renewed(sent)

	value, err := fn(ctx, tx)
	if err != nil {
		return zero, err
	}
	encoded, err := encodeResponse(value, r.k.scope, r.o)
	if err != nil {
		return zero, fmt.Errorf("result: %w", err)
	}
	record := dbsqlc.FlowStepRecordParams{Scope: r.k.scope, Key: r.k.key, Seq: seq, Step: name,
		Result: pgtype.Text{String: string(encoded), Valid: true}}
	// The flow's row is locked since the step began, so the renewal finds
	// the lease as the step's first statement left it.
	sent = time.Now()
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
		r.lease.renewed(sent)
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
	r.lease.renewed(sent)
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
// call's provider key, the same on every attempt, in every process: pass
// it to the provider's own idempotency mechanism (Stripe's Idempotency-Key
// header, an AIP-155 request_id), so that a call made again after a crash
// or a timeout is recognised by the provider and applied once. The key is
// a UUID derived from the database's installation id and the operation's
// scope, key and step name (see docs/flows.md): two databases never send
// the same key, and a flow started again after an asynchronous failover
// lost its row sends the keys its first run sent. [InspectFlow] shows it.
//
// Before fn is called, the step's intent is recorded, in a short
// transaction of its own; once fn returns a value, the value (its result,
// stored as JSON) is recorded in another. A step with a recorded result
// never runs again: when the flow runs again, Call returns the result
// without calling fn. A step whose intent is recorded without a result
// (the process died during the call, or the call failed) calls fn again,
// with the same provider key, until [WithProviderWindow] has passed since
// its first attempt; past it, the flow is stopped for a person's decision
// and Call returns [ErrFlowStopped]. So is a flow whose call returned a
// value that cannot be stored ([ErrResponseNotStorable],
// [ErrResponseTooLarge]): the other system applied the call, and calling it
// again would give the same value.
//
// An error from fn is the call's uncertain outcome: Call returns it,
// wrapped, records nothing but the attempt, and the flow's function should
// return it. A definite failure (a declined card) is a value: return it in
// T, and it is recorded like any result.
//
// fn is called only while the executor's lease surely holds, and its
// context ends when ctx does, when [WithCallTimeout] has passed, or when
// the lease may have run out: it is renewed every third of [WithLease]
// while fn runs (not when the flow runs on a single connection, which the
// call must not hold: its lease then covers one call). fn must stop acting
// when its context ends (an http.Client does): an executor that stalled
// past its lease then calls nobody, and Call returns [ErrLeaseLost].
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
	r.lease.renewed(sent)

	providerKey := r.keys.of(r.k.scope, r.k.key, name)
	value, err := callKeepingLease(ctx, r, name, providerKey, int(start.Attempts), fn)
	if err != nil {
		return zero, err
	}
	encoded, err := encodeResponse(value, r.k.scope, r.o)
	if err != nil {
		return zero, errors.Join(err, r.stop(ctx, fmt.Sprintf("step %q: the call's result cannot be stored (%v); "+
			"the other system applied the call, and calling it again would give the same result: settle it by hand", name, err)))
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
// keepLease), as attempt attempt of the call named name; a panic of fn
// stops the renewals and ends the span before it goes on. fn is not called
// when the lease may have run out, or ctx has ended, by the time it would
// be.
func callKeepingLease[T any](ctx context.Context, r *flowRun, name, providerKey string, attempt int,
	fn func(ctx context.Context, providerKey string) (T, error),
) (value T, err error) {
	if err := r.holdForCall(ctx, name); err != nil {
		return value, err
	}
	callCtx, stop := r.keepLease(ctx, name)
	callCtx, end := r.obs.step(callCtx, stepCall, name, providerKey, attempt)
	defer func() {
		if lost := stop(); lost != nil {
			err = errors.Join(lost, err)
		}
		end(err)
	}()
	// The last look before the call: a process frozen since the lease was
	// renewed wakes here, and must not act.
	if r.lease.left() <= 0 {
		return value, r.lostError()
	}
	if err := callCtx.Err(); err != nil {
		return value, context.Cause(callCtx)
	}
	return fn(callCtx, providerKey)
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

// providerKeys derives the provider keys of an operation's calls: from
// the installation's id as the flow's row recorded it when the flow
// started (namespace), or, for a flow started before migration 00007,
// from its operation number, as that version derived them.
type providerKeys struct {
	namespace pgtype.UUID
	operation pgtype.Int8
}

// of returns the provider key of the call named step of the operation
// (scope, key): a UUID (RFC 9562, version 8) made of the first 16 bytes of
// the SHA-256 of the namespace, scope, key and step, each prefixed with
// its length, after the string "idem.Call/2" ([Fingerprint]), with the
// version and variant bits set. It fits what providers accept as an
// idempotency key: Stripe's up to 255 characters, AIP-155's UUID
// request_id.
func (p providerKeys) of(scope, key, step string) string {
	if !p.namespace.Valid {
		return uuidV8(Fingerprint([]byte("idem.Call"), []byte(scope), []byte(key), []byte(step),
			strconv.AppendInt(nil, p.operation.Int64, 10)))
	}
	return uuidV8(Fingerprint([]byte("idem.Call/2"), p.namespace.Bytes[:], []byte(scope), []byte(key), []byte(step)))
}

// uuidV8 spells the first 16 bytes of sum as a UUID of version 8.
func uuidV8(sum []byte) string {
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
