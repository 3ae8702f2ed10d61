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

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/pgtime"
)

// Call runs the flow's step named name: a call to another system, fn,
// made with no transaction open and no connection held. fn gets the
// call's provider key, the same on every attempt, in every process, also
// in its context ([ProviderKeyFromContext]): pass it to the provider's own
// idempotency mechanism (Stripe's Idempotency-Key header, an AIP-155
// request_id; idemhttp.Transport and idemgrpc's client interceptor can
// stamp it for you), so that a call made again after a crash or a timeout
// is recognised by the provider and applied once. The key is a UUID
// derived from the database's installation id and the operation's scope,
// key and step name (see docs/flows.md): two databases never send the same
// key, and a flow started again after an asynchronous failover lost its
// row sends the keys its first run sent. [InspectFlow] shows it.
//
// Before fn is called, the step's intent is recorded, committed with the
// local step before it, if that one is still open (see [Local]); once fn
// returns a value, the value (its result, stored as JSON) is recorded with
// the flow's next statement, in its transaction (the next step's, or the
// answer's), or at once for an [AtMostOnce] call. A process that dies
// before then calls again, with the same provider key. A step with a recorded result
// never runs again: when the flow runs again, Call returns the result
// without calling fn.
//
// A step whose intent is recorded without a result, after an attempt that
// may have reached the other system (the process died during the call, or
// fn returned an error), is resolved before anything is called again: by
// its lookup, when given one ([Reconcile]); otherwise it is called again,
// with the same provider key, unless it is [AtMostOnce] or its first such
// attempt is older than [WithProviderWindow], and then the flow is
// stopped for a person's decision and Call returns [ErrFlowStopped] (a
// [BestEffort] call is recorded as unknown instead, and the flow goes
// on). So is
// a flow whose call returned a value that cannot be stored
// ([ErrResponseNotStorable], [ErrResponseTooLarge]): the other system
// applied the call, and calling it again would give the same value.
//
// An error from fn is the call's uncertain outcome: Call returns it,
// wrapped, records nothing but the attempt, and the flow's function should
// return it. An error that wraps [ErrNotSent] says that the attempt surely
// did not reach the other system: when no earlier attempt may have, the
// next one is made as if it were the first. A definite failure (a
// declined card) is a value: return it in T, and it is recorded like any
// result.
//
// fn is called only while the executor's lease surely holds, and its
// context ends when the run's does, when [WithCallTimeout] has passed, or when
// the lease may have run out: it is renewed every third of [WithLease]
// while fn runs (not when the flow runs on a single connection, which the
// call must not hold: its lease then covers one call). fn must stop acting
// when its context ends (an http.Client does): an executor that stalled
// past its lease then calls nobody, and Call returns [ErrLeaseLost].
func Call[T any](s *Steps, name string, fn func(ctx context.Context, providerKey string) (T, error), opts ...CallOption) (T, error) {
	var zero T
	co, err := newCallOptions[T](opts)
	if err != nil {
		return zero, fmt.Errorf("idem: step %q: %w", name, err)
	}
	r := s.run
	seq, rec, err := r.begin(name, stepCall)
	if err != nil {
		return zero, err
	}
	defer r.end()
	if rec != nil && rec.done() {
		return recordedResult[T](r, name, rec.Result)
	}
	if earlier, ok := r.recorded[seq]; ok && earlier.State == stepUnknown {
		return zero, fmt.Errorf("step %q: %w: recorded by an earlier run", name, ErrOutcomeUnknown)
	}
	value, err := runCall(s.ctx, r, seq, name, fn, co)
	if err != nil {
		return zero, fmt.Errorf("step %q: %w", name, err)
	}
	return value, nil
}

// CallOption changes how [Call] treats a call whose outcome is not known:
// [Reconcile], [AtMostOnce] and [BestEffort].
type CallOption interface {
	applyCall(o *callOptions)
}

// callOptions are what a call's options add up to; reconcile is the
// lookup given to Reconcile, of type func(context.Context, string) (T,
// bool, error) for the call's T.
type callOptions struct {
	atMostOnce, bestEffort bool
	reconcile              any
}

type callOptionFunc func(*callOptions)

func (f callOptionFunc) applyCall(o *callOptions) { f(o) }

// Reconcile makes a call to a provider that ignores idempotency keys
// exactly once, given a provider that can tell whether an attempt was
// applied (a lookup by the provider key, or by a reference of the
// caller's sent with the call) and that refuses an attempt past a bound
// the lookup can wait out (or lets the lookup void the reference): then
// lookup, which runs only when the call's intent is recorded and its
// result is not, after an attempt that may have reached the other system
// (the process died during the call, or its outcome was not known), never
// on a call's first attempt, tells an attempt that was applied from one
// that was not. It gets the [Attempt] it resolves, and answers:
//
//   - found, with the call's result: the result is recorded as the call's,
//     and the call is not made again;
//   - not found (found false, no error): the call is made again, with the
//     same provider key, even when it is AtMostOnce or past the provider
//     window, since it was not applied;
//   - an error: nothing is recorded, Call returns the error (wrapped, the
//     flow incomplete), and the next attempt asks again; when the attempt
//     that may have reached the other system is older than
//     [WithProviderWindow], the flow is stopped for a person instead.
//
// lookup must tell the two apart for as long as a flow may resume: a
// lookup by provider key at a provider that forgets keys must return an
// error, not "not found", once the provider may have forgotten. A lookup
// sees what the other system has applied when it asks: an earlier attempt
// still on its way then (sent, timed out by its caller, not yet processed)
// is not found, and is applied after all, along with the call made again.
// So lookup answers not found only when no earlier attempt can arrive any
// more (the requests carry their time and the other system refuses them
// past a bound that has passed since the last attempt, or the lookup
// voids the reference there so that a late request is refused), and an
// error otherwise, which leaves the flow incomplete for its next attempt
// to ask again. Its context is kept alive as a call's is, by the lease.
// [InspectFlow] shows each call's lookups and the last one's outcome; an
// [Observer] counts them (idem.flow.reconciliations). T must be the call's
// result type, or Call returns [ErrInvalidOption] before anything runs.
func Reconcile[T any](lookup func(ctx context.Context, a Attempt) (result T, found bool, err error)) CallOption {
	return callOptionFunc(func(o *callOptions) { o.reconcile = lookup })
}

// Attempt is what a call's lookup ([Reconcile]) is told of the attempts
// it resolves: those of the call that may have reached the other system.
type Attempt struct {
	// ProviderKey is the call's provider key, the same on every attempt.
	ProviderKey string
	// Scope and Key are the flow's operation; Step is the call's name.
	Scope, Key, Step string
	// Attempts counts the attempts that may have reached the other
	// system (at least one).
	Attempts int
	// FirstSentAt is when the first of them was made, by the database's
	// clock (the others were made after it): a lookup by a reference of
	// the caller's need look no further back, less the skew between the
	// database's clock and the other system's.
	FirstSentAt time.Time
}

// AtMostOnce marks a call that must never be made twice, for effects where
// a duplicate is worse than a gap (an email, an SMS): when its intent is
// recorded without a result after an attempt that may have reached the
// other system, no attempt calls again; the flow is stopped for a person
// ([ErrFlowStopped]), unless the call's [Reconcile] lookup finds that the
// attempt was not applied. An attempt whose function returned an error
// wrapping [ErrNotSent] surely did not reach it, and does not count.
func AtMostOnce() CallOption {
	return callOptionFunc(func(o *callOptions) { o.atMostOnce = true })
}

// BestEffort marks a call whose uncertain outcome must not hold up the
// flow's answer: a notification after the charge (an SMS, an email, a
// push). Like an [AtMostOnce] call it is never made twice; but where that
// one stops the flow for a person, a BestEffort call whose attempt may
// have reached the other system (its function returned an error, or an
// earlier run died during it) is recorded as unknown, and Call returns an
// error that wraps [ErrOutcomeUnknown], with the function's own, at once
// and on every later run of the flow, without calling again: the flow's
// function goes on (errors.Is(err, idem.ErrOutcomeUnknown)), and
// [InspectFlow] shows the step as "unknown". An error that wraps
// [ErrNotSent] is returned as it is, the call not made: the next run makes
// it, as if first. With a [Reconcile] lookup, a lookup that fails records
// the outcome as unknown too. A result that cannot be stored stops the
// flow, as for any call (see [Call]).
func BestEffort() CallOption {
	return callOptionFunc(func(o *callOptions) { o.atMostOnce, o.bestEffort = true, true })
}

// newCallOptions applies opts, checking that a lookup returns T.
func newCallOptions[T any](opts []CallOption) (callOptions, error) {
	var co callOptions
	for _, opt := range opts {
		if opt == nil {
			return co, &FieldError{Package: "idem", Field: "Call", Problem: "a nil CallOption"}
		}
		opt.applyCall(&co)
	}
	if co.reconcile != nil {
		if _, ok := co.reconcile.(func(context.Context, Attempt) (T, bool, error)); !ok {
			var zero T
			return co, &FieldError{Package: "idem", Field: "Reconcile",
				Problem: fmt.Sprintf("the lookup is %T; the call's result is %T", co.reconcile, zero)}
		}
	}
	return co, nil
}

// providerKeyContextKey is the key of a call's provider key in its
// context.
type providerKeyContextKey struct{}

// ProviderKeyFromContext returns the provider key of the call whose
// context, or a context derived from it, ctx is ([Call], [Reconcile]), and
// whether there is one: for code a call's function reaches that stamps
// the key on a request by itself, as idemhttp.Transport and idemgrpc's
// client interceptor do when asked to.
func ProviderKeyFromContext(ctx context.Context) (string, bool) {
	key, ok := ctx.Value(providerKeyContextKey{}).(string)
	return key, ok
}

// The outcomes of a call's lookup, as a call's record (its last
// reconcile) and an Observer's idem.outcome spell them.
const (
	reconcileFound    = "found"
	reconcileNotFound = "not_found"
	reconcileFailed   = "failed"
)

// runCall records the call's intent (FlowCallIntent), resolves an earlier
// attempt that may have reached the other system (a lookup, or a stop),
// calls fn while the lease is kept, and records the result (recordCall).
func runCall[T any](ctx context.Context, r *flowRun, seq int32, name string,
	fn func(ctx context.Context, providerKey string) (T, error), co callOptions,
) (T, error) {
	var zero T
	sent := time.Now()
	// The intent commits with what is pending (the local step before, or
	// the call's before), in one round trip, and before the call: the
	// call's record, 'calling', with its attempts counted. A call that an
	// earlier run recorded keeps when its first attempt was made, unless
	// every earlier attempt surely did not reach the other system
	// ('unsent'): its window starts again. The flow's steps were read as
	// the executor claimed it, and only its epoch writes them since.
	rec := stepRecord{Name: name, State: stepCalling, Attempts: 1, FirstCalled: stampNow}
	earlier, hadEarlier := r.recorded[seq]
	resumed := hadEarlier
	if resumed {
		resumed = earlier.State == stepCalling
		rec = earlier
		rec.State = stepCalling
		rec.Attempts++
		if earlier.State == stepUnsent {
			rec.FirstCalled = stampNow
		}
	}
	// A flow not started yet is started by its row carrying the intent.
	var start dbsqlc.FlowCallIntentRow
	var firstCalledAt int64
	var leased bool
	var patch *stepPatch
	err := r.flush(ctx, func(b *pgx.Batch, steps *stepPatch) {
		if patch = steps; steps.starting {
			// The flow's row, written now, carries the intent.
			steps.add(seq, &rec)
			r.scratch = rec.appendInline(r.scratch[:0], r.base.Load())
			r.inline += len(r.scratch)
			steps.carry(name)
			return
		}
		// A record that goes to a row of its own (see maxInlineSteps)
		// returns when the call's first attempt was made; FlowLeaseUntil
		// renews the lease when nothing goes to the flow's row.
		row := r.inRow(seq, &rec)
		steps.put(seq, &rec, row) // over its row if it has one (rec.inRow)
		rec.inRow = row
		r.queueStepRows(b, steps)
		if rec.inRow && steps.empty() {
			dbbatch.QueueFlowLeaseUntil(b, dbsqlc.FlowLeaseUntilParams{Lease: pgtime.Interval(r.o.lease), Step: name,
				Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &start.LeasedUntil, &leased)
			return
		}
		dbbatch.QueueFlowCallIntent(b, dbsqlc.FlowCallIntentParams{Lease: pgtime.Interval(r.o.lease), Step: name,
			Steps: steps.text(), Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch, Seq: seq}, &start, &leased)
	})
	switch {
	case err != nil || patch == nil:
	case patch.carried:
		// The intent's stamp is the transaction's now(), which is also
		// the row's created_at.
		start.LeasedUntil, leased = patch.start.heldRow.LeasedUntil, patch.start.written
		firstCalledAt = patch.start.heldRow.CreatedAt.Time.UnixMicro()
	case rec.inRow:
		// The intent's row says when the first attempt was made; without
		// it, the executor no longer holds the flow.
		found := false
		for _, w := range patch.written {
			if w.Seq == seq {
				firstCalledAt, found = w.FirstCalledAt, true
			}
		}
		leased = leased && found
	case leased:
		// The intent's record, as written, says when, after the flow's
		// created_at.
		r.base.Store(start.CreatedAt.Time.UnixMicro())
		written, perr := parseInline(start.Rec, r.base.Load())
		if perr != nil {
			err = fmt.Errorf("the call's record: %w", perr)
		}
		firstCalledAt = written.FirstCalled
	}
	// An attempt counts once its function is called: one whose intent
	// may have committed though the function was not called (the run's
	// context ended as the intent committed, the lease ran out) is taken
	// back, with the record as it was before (notCalled), so that it
	// neither stops an AtMostOnce call nor starts the provider window.
	notCalled := func() {
		if hadEarlier {
			r.notCalled(ctx, seq, earlier)
		} else {
			r.notCalled(ctx, seq, stepRecord{Name: name, State: stepUnsent})
		}
	}
	switch {
	case errors.Is(err, ErrLeaseLost):
		return zero, err
	case err != nil:
		if !errors.Is(err, errTaken) {
			notCalled()
		}
		return zero, fmt.Errorf("record the call's intent: %w", err)
	case !leased:
		return zero, r.lostError()
	}
	r.lease.renewed(sent)
	rec.FirstCalled = firstCalledAt
	r.setRecorded(seq, rec)
	// Past the provider's window: the first attempt that may have reached
	// the other system is older than the window, by the server's clock at
	// the intent (the lease it renewed, less the lease).
	now := start.LeasedUntil.Time.UnixMicro() - r.o.lease.Microseconds()
	pastWindow := resumed && firstCalledAt <= now-r.o.providerWindow.Microseconds()
	providerKey := r.keys.of(r.k.scope, r.k.key, name)

	if resumed {
		// An earlier attempt may have reached the other system.
		switch {
		case co.reconcile != nil:
			lookup := co.reconcile.(func(context.Context, Attempt) (T, bool, error))
			a := Attempt{ProviderKey: providerKey, Scope: r.k.scope, Key: r.k.key, Step: name, Attempts: int(earlier.Attempts),
				FirstSentAt: microsTime(firstCalledAt)}
			got, _, err := callKeepingLease(ctx, r, name, providerKey, int(rec.Attempts), "idem.Reconcile",
				func(ctx context.Context, key string) (lookedUp[T], error) {
					v, found, err := lookup(ctx, a)
					return lookedUp[T]{v, found}, err
				})
			switch {
			case errors.Is(err, ErrLeaseLost):
				return zero, err
			case err != nil:
				r.obs.reconciled(reconcileFailed)
				r.noteReconcile(ctx, seq, reconcileFailed+": "+err.Error())
				if co.bestEffort {
					return zero, r.recordUnknown(ctx, seq, fmt.Errorf("lookup: %w", err))
				}
				if pastWindow {
					return zero, errors.Join(err, r.stop(ctx, fmt.Sprintf("step %q: the lookup of an attempt older than the provider window (%s) failed (%v): "+
						"find out from the provider whether it was applied", name, r.o.providerWindow, err)))
				}
				return zero, fmt.Errorf("lookup: %w", err)
			case got.found:
				r.obs.reconciled(reconcileFound)
				return recordCall(ctx, r, seq, name, got.value, reconcileFound, co.atMostOnce)
			}
			r.obs.reconciled(reconcileNotFound)
			r.noteReconcile(ctx, seq, reconcileNotFound)
		case co.bestEffort:
			return zero, r.recordUnknown(ctx, seq, errors.New("an earlier attempt may have reached the other system"))
		case co.atMostOnce:
			return zero, r.stop(ctx, fmt.Sprintf("step %q: the call is made at most once, and an earlier attempt may have reached "+
				"the other system: find out whether it was applied", name))
		case pastWindow:
			return zero, r.stop(ctx, fmt.Sprintf("step %q: the call's first attempt is older than the provider window (%s), "+
				"past which calling again with the same key could apply it twice: find out from the provider whether it was applied", name, r.o.providerWindow))
		}
	}

	value, called, err := callKeepingLease(ctx, r, name, providerKey, int(rec.Attempts), "idem.Call", fn)
	if err != nil {
		switch {
		case !called || errors.Is(err, ErrNotSent):
			// This attempt surely did not reach the other system.
			notCalled()
		case co.bestEffort && !errors.Is(err, ErrLeaseLost):
			return zero, r.recordUnknown(ctx, seq, err)
		}
		return zero, err
	}
	return recordCall(ctx, r, seq, name, value, "", co.atMostOnce)
}

// lookedUp is what a call's lookup found.
type lookedUp[T any] struct {
	value T
	found bool
}

// recordCall records the call's result, value, which a lookup found when
// reconciled says so, and returns it as a resumed run would get it. A
// value that cannot be stored stops the flow. The record is sent with the
// flow's next statement (flowRun.flush), in its transaction and its write
// of the flow's row; an AtMostOnce call's (now) commits at once, since
// losing it to a crash would stop the flow.
func recordCall[T any](ctx context.Context, r *flowRun, seq int32, name string, value T, reconciled string, now bool) (T, error) {
	var zero T
	encoded, err := encodeResponse(value, r.k.scope, r.o)
	if err != nil {
		return zero, errors.Join(err, r.stop(ctx, fmt.Sprintf("step %q: the call's result cannot be stored (%v); "+
			"the other system applied the call, and calling it again would give the same result: settle it by hand", name, err)))
	}
	rec := r.recorded[seq]
	rec.State, rec.Result, rec.Completed = "", encoded, stampNow
	if reconciled != "" {
		rec.Reconciles++
		rec.LastReconcile = reconciled
	}
	// The result before this one has been recorded, or the run has
	// ended: its store is free.
	r.resultStore = pendingStep{seq: seq, rec: rec}
	r.result = &r.resultStore
	if !rec.inRow {
		r.inline += len(encoded)
	}
	if now {
		if err := r.flush(ctx, nil); err != nil {
			return zero, err
		}
	}
	return decodedResult[T](r, encoded)
}

// recordUnknown records the outcome of the BestEffort call at seq as
// unknown, at once (it is never made again), and returns the error Call
// returns: ErrOutcomeUnknown, with why. A record that could not be
// written is sent with the flow's next statement (flowRun.result), and
// the next run records it anyway, finding the call's intent.
func (r *flowRun) recordUnknown(ctx context.Context, seq int32, why error) error {
	rec := r.recorded[seq]
	rec.State, rec.Result, rec.Completed = stepUnknown, nil, stampNow
	r.resultStore = pendingStep{seq: seq, rec: rec}
	r.result = &r.resultStore
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	if err := r.flush(ctx, nil); err != nil {
		return errors.Join(why, err)
	}
	r.setRecorded(seq, rec)
	return fmt.Errorf("%w: %w", ErrOutcomeUnknown, why)
}

// noteReconcile records a lookup that did not find the call, for
// operators; it is best effort: a failure records nothing more.
func (r *flowRun) noteReconcile(ctx context.Context, seq int32, outcome string) {
	rec := r.recorded[seq]
	rec.Reconciles++
	rec.LastReconcile = sealText(outcome, r.k.scope, r.o)
	if r.recordSteps(ctx, seq, &rec) {
		r.setRecorded(seq, rec)
	}
}

// recordSteps writes the record of the step at seq (FlowRecordSteps),
// and reports whether it did: not when the executor no longer holds the
// flow, or the write failed.
func (r *flowRun) recordSteps(ctx context.Context, seq int32, rec *stepRecord) bool {
	return r.recordStepsAfter(ctx, seq, rec, false)
}

// recordStepsAfter is recordSteps, after the flow's advisory lock when
// afterClaim is set (FlowWaitClaim): once a claim's transaction, which
// may write the flow's row as it commits, has ended.
func (r *flowRun) recordStepsAfter(ctx context.Context, seq int32, rec *stepRecord, afterClaim bool) bool {
	steps := stepPatch{base: r.base.Load()}
	steps.put(seq, rec, rec.inRow)
	b := &pgx.Batch{}
	if afterClaim {
		dbbatch.Queue(b).FlowWaitClaim(ctx, dbsqlc.FlowWaitClaimParams{LockID: keylock.FlowID(r.k.scope, r.k.key), Scope: r.k.scope, Key: r.k.key})
	}
	var n int64
	if rec.inRow {
		// A step recorded as a row of its own (see maxInlineSteps), its
		// record the JSON object its row takes.
		var written []dbsqlc.FlowStepRowsRow
		dbbatch.QueueFlowStepRowsUpdate(b, dbsqlc.FlowStepRowsUpdateParams{Steps: string(steps.updates) + "}",
			Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &written)
		err := sendBatch(ctx, r.db, b)
		return err == nil && len(written) == 1
	}
	dbbatch.QueueFlowRecordSteps(b, dbsqlc.FlowRecordStepsParams{Steps: steps.text(), Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &n)
	err := sendBatch(ctx, r.db, b)
	return err == nil && n == 1
}

// notCalled records the call at seq as rec, what it was before the
// intent of an attempt that surely did not reach the other system (its
// function was not called, or returned an error wrapping ErrNotSent): an
// earlier attempt's record, or, when there was none, one that says that
// no attempt reached it ('unsent'), after which the next attempt is made
// as the first. It is best effort, on a context that outlives the run's
// for a moment (cleanupContext): a call left 'calling' is only treated
// more carefully.
//
// The intent's round trip may have failed (the run's context ended as it
// ran) with its COMMIT still under way on the server, one that also
// writes the flow's row, for a new flow: the record is written once the
// claim's transaction has ended (FlowWaitClaim), so that it is not lost
// to a row that was not there yet.
func (r *flowRun) notCalled(ctx context.Context, seq int32, rec stepRecord) {
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	rec.inRow = r.recorded[seq].inRow
	if r.recordStepsAfter(ctx, seq, &rec, true) {
		r.setRecorded(seq, rec)
	}
}

// callKeepingLease calls fn with providerKey while the lease is kept (see
// keepLease), as attempt attempt of the call named name, in a span named
// span, and reports whether it called it; a panic of fn stops the
// renewals and ends the span before it goes on. fn is not called when the
// lease may have run out, or ctx has ended, by the time it would be.
func callKeepingLease[T any](ctx context.Context, r *flowRun, name, providerKey string, attempt int, span string,
	fn func(ctx context.Context, providerKey string) (T, error),
) (value T, called bool, err error) {
	if err := r.holdForCall(ctx, name); err != nil {
		return value, false, err
	}
	kept := r.keepLease(ctx, name)
	callCtx := context.WithValue(kept, providerKeyContextKey{}, providerKey)
	callCtx, end := r.obs.step(callCtx, stepCall, span, name, providerKey, attempt)
	defer func() {
		if lost := kept.stop(); lost != nil {
			err = errors.Join(lost, err)
		}
		end(err)
	}()
	// The last look before the call: a process frozen since the lease was
	// renewed wakes here, and must not act.
	if r.lease.left() <= 0 {
		return value, false, r.lostError()
	}
	if err := callCtx.Err(); err != nil {
		return value, false, context.Cause(callCtx)
	}
	value, err = fn(callCtx, providerKey)
	return value, true, err
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
