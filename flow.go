package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
)

// Flow is an operation made exactly-once per (scope, key), as [Run] makes
// one write, whose function takes steps: local steps ([Local]), each a
// transaction of its own that commits the step's writes with its result,
// and calls to other systems ([Call]), made with no transaction open and
// no connection held, each with a provider key that stays the same on
// every attempt. Its record lives in idem's tables, beside the caller's
// data. Create flows once, at start-up, with [MustNewFlow] or [NewFlow]; a
// Flow is safe for concurrent use.
//
// Running a flow again for the same key ([Flow.Run] for a client's retry,
// [Flow.Resume] for one whose client never came back) runs its function
// again: steps that completed return their recorded results without
// running, and the first step that did not continues. A flow that
// completed replays its answer, as Run does. One executor at a time runs a
// flow, under a lease (see [WithLease]) that it renews as it goes; an
// executor that stalled past its lease is fenced: whatever it tries to
// commit afterwards fails with [ErrLeaseLost] and commits nothing.
//
// The flow's answer is its function's value, stored as JSON. A definite
// failure (a declined card, a provider's validation error) is part of
// that value, so that retries get it without calling the provider again.
// An error from the function is never stored: the call returns it, the
// flow stays resumable, and the next attempt continues where it stopped,
// calling again with the same provider key. So the function must turn
// only definite failures into values, and return every uncertain one (a
// timeout, a reset connection, a provider's 5xx) as an error.
//
// See docs/flows.md for when to use a flow rather than Run or the outbox,
// and what exactly it guarantees.
type Flow[In, Out any] struct {
	name string
	fn   func(ctx context.Context, s *Steps, in In) (Out, error)
	opts []FlowOption
}

// NewFlow returns the flow named name, whose function is fn. fn gets ctx,
// the run's context (the one given to [Flow.Run], or to [Flow.Resume]),
// the run's [Steps], and the input. The steps run under ctx itself, not
// under a context fn derives from it: the functions of [Local] and [Call]
// get contexts of their own, derived from ctx. The name
// identifies the flow's operations in idem's tables: [Flow.Resume] resumes
// the operations of its own flow only, and a key whose operation another
// flow recorded gives [ErrFingerprintMismatch]. It follows the rules of
// keys: 1 to 255 bytes of UTF-8 without NUL.
//
// opts apply to every run of the flow, [Flow.Resume]'s included; options
// given to one [Flow.Run] come after them. Give NewFlow what concerns the
// flow's stored values, [WithCodec] above all: Resume opens the stored
// input with the flow's own options only. A flow takes the options that
// are a [FlowOption]: its own ([WithLease], [WithGrace],
// [WithProviderWindow], [WithCallTimeout]) and the [SharedOption]s, which
// mean for a flow: [WithWait] a duplicate's wait for the executor,
// [WithRetention] counted from the flow's completion, [WithTxOptions] and
// [WithIdleTimeout] the local steps' transactions, [WithMaxResponseSize]
// and [WithCodec] the stored input, step results and answer, and
// [WithObserver].
//
// NewFlow refuses an invalid name, a nil fn, or an option made from a
// value that cannot work, with a [*FieldError] that says which and wraps
// [ErrInvalidOption]. Flows are made at start-up, from values written in
// the code: [MustNewFlow] is NewFlow for a package-level variable.
func NewFlow[In, Out any](name string, fn func(ctx context.Context, s *Steps, in In) (Out, error), opts ...FlowOption) (*Flow[In, Out], error) {
	if err := ident.Check(name); err != nil {
		return nil, &FieldError{Package: "idem", Field: "NewFlow", Problem: fmt.Sprintf("name %q: %s", name, err)}
	}
	if fn == nil {
		return nil, &FieldError{Package: "idem", Field: "NewFlow", Problem: fmt.Sprintf("flow %q: the function is nil", name)}
	}
	if err := CheckFlowOptions(opts...); err != nil {
		return nil, fmt.Errorf("idem: NewFlow %q: %w", name, err)
	}
	return &Flow[In, Out]{name: name, fn: fn, opts: slices.Clone(opts)}, nil
}

// MustNewFlow is [NewFlow] that panics with NewFlow's error instead of
// returning it, as regexp.MustCompile does: a flow made at start-up from
// values written in the code that cannot work is a bug, which stops the
// program before it serves anything.
func MustNewFlow[In, Out any](name string, fn func(ctx context.Context, s *Steps, in In) (Out, error), opts ...FlowOption) *Flow[In, Out] {
	f, err := NewFlow(name, fn, opts...)
	if err != nil {
		panic(err)
	}
	return f
}

// options are the flow's options, then opts.
func (f *Flow[In, Out]) options(opts []FlowOption) (options, error) {
	o, err := newOptions(append(slices.Clip(f.opts), opts...))
	if err == nil {
		err = checkFlowOptions(&o)
	}
	return o, err
}

// checkFlowOptions refuses what options allow but a flow cannot use: a
// retention shorter than the provider window, after which a key used
// again could reach the provider, under the same provider keys, while it
// still remembers the operation before. (WithTxOptions refuses a read-only
// transaction itself.)
func checkFlowOptions(o *options) error {
	if o.retention < o.providerWindow {
		return &FieldError{Package: "idem", Field: "WithRetention", Problem: fmt.Sprintf(
			"a flow's retention (%s) must be at least its provider window (%s): "+
				"a key used again after the retention would reach the provider under the keys of the operation before",
			o.retention, o.providerWindow)}
	}
	return nil
}

// Run runs the flow's operation for (scope, key) with input in, once, on
// db (a pool, or an idle connection, as for [Run]).
//
// The first Run for a key records in and runs the flow's function, with
// in as a completer would get it back: decoded from the JSON that was
// stored. A Run for a key whose flow completed returns its stored answer,
// with Replayed set, and commits nothing. Run claims the flow before its
// function runs, in one round trip, so that a replay, a mismatch, a
// stopped flow or a duplicate never runs it: for a key with no flow, the
// run holds the flow's lock in a transaction left open while the function
// runs up to its first step, whose first local step runs in it, and the
// flow's row is written as that transaction commits (see docs/flows.md).
// A Run for a flow that another
// executor holds waits for it, under [WithWait], polling (it waits for no
// lock), and replays its answer, or takes the flow over once that
// executor's lease has run out; past the wait it returns [ErrInProgress].
// A Run for a flow whose earlier run failed (which gave its lease up)
// takes it over at once, and one whose executor died once its lease has
// run out, and continues it from its first incomplete step (see [Flow]).
//
// fp is the request's fingerprint, compared as [Do] compares it: a key
// recorded with another fingerprint, or by another flow, gives
// [ErrFingerprintMismatch] before any step runs. A nil fp is the input's
// own, [FingerprintJSON](in).
//
// When the function returns an error, or ctx ends, Run gives the flow's
// lease up before it returns (within about two seconds after ctx ends:
// one to roll back a local step, one to give the lease up), so that a
// retry continues the flow at once, and returns the error, with
// [ErrFlowIncomplete] in its chain; nothing of it is stored. A flow
// stopped for a person's decision gives [ErrFlowStopped]. The input must
// be storable as JSON ([ErrInputNotStorable] otherwise); a completer
// resumes the flow with it.
func (f *Flow[In, Out]) Run(ctx context.Context, db TxBeginner, scope, key string, fp []byte, in In, opts ...FlowOption) (_ Result[Out], err error) {
	o, err := f.options(opts)
	ctx, obs := o.observer.observeFlow(ctx, "idem.Flow.Run", f.name)
	defer func() { obs.end(scope, key, err) }()
	if err != nil {
		return Result[Out]{}, err
	}
	k, err := newKeyRef(scope, key, fp)
	if err != nil {
		return Result[Out]{}, err
	}
	if err := dberr.CheckIdle(db, "a flow commits transactions of its own: pass the pool or an idle connection"); err != nil {
		return Result[Out]{}, err
	}
	input, err := encodeResponse(in, scope, &o)
	if err != nil {
		if errors.As(err, new(sealError)) { // the codec's failure, not the input's
			return Result[Out]{}, fmt.Errorf("idem: flow %q: input: %w", f.name, err)
		}
		return Result[Out]{}, fmt.Errorf("idem: flow %q: %w: %w", f.name, ErrInputNotStorable, err)
	}
	if fp == nil {
		if fp, err = FingerprintJSON(in); err != nil {
			return Result[Out]{}, fmt.Errorf("idem: flow %q: input: %w", f.name, err)
		}
	}
	k.fp = o.storedFingerprint(scope, fp)
	// An executor that finds it no longer holds the flow (another took it
	// over, or an operator ended it) looks at it again as a duplicate
	// would: it answers its caller what a retry would get, the other
	// executor's answer, rather than an error about leases. One whose
	// first statement found the flow taken by another executor starting
	// it (errTaken: its claim's transaction was lost, see flow_claim.go)
	// looks again too, within the same wait budget.
	deadline := time.Now().Add(o.wait)
	for reclaims := 0; ; {
		r, stored, err := f.claim(ctx, db, k, input, &o, obs, deadline)
		if err != nil {
			return Result[Out]{}, err
		}
		if r == nil {
			return replayed[Out](stored, scope, &o)
		}
		// The function gets the input as a completer would, decoded from
		// what was stored: its own, or, for a flow it took over, the one
		// its first run recorded (a fingerprint need not cover the whole
		// input).
		decoded, err := replayed[In](r.input, scope, &o)
		if err != nil {
			r.release(ctx, err.Error())
			r.discard(ctx)
			return Result[Out]{}, fmt.Errorf("idem: flow %q: input: %w", f.name, err)
		}
		res, err := f.execute(ctx, r, decoded.Value)
		switch {
		case errors.Is(err, errTaken):
			if time.Until(deadline) <= 0 {
				obs.claimDone(outcomeInProgress)
				return Result[Out]{}, fmt.Errorf("%w: flow %q is being started elsewhere past the wait budget", ErrInProgress, f.name)
			}
			continue
		case !errors.Is(err, ErrLeaseLost) || reclaims == maxReclaims || ctx.Err() != nil:
			return res, err
		}
		reclaims++
		deadline = time.Now().Add(o.wait)
	}
}

// maxReclaims bounds how often a Run that lost the flow looks at it again.
const maxReclaims = 3

// The states of a flow, as idem_flow.state spells them.
const (
	flowRunning   = "running"
	flowDone      = "done"
	flowAttention = "attention"
	flowEnded     = "ended"
)

// newEpoch returns a random epoch for an executor's claim. Epochs are
// random, not drawn from a sequence, so that none is given twice even by a
// standby promoted after an asynchronous failover, whose sequences may
// hand out numbers the lost primary already gave, and so that no sequence
// is needed on a distributed database.
func newEpoch() int64 { return int64(rand.Uint64()>>1) | 1 }

// pollDelay is how long a duplicate waits before it looks at a flow that
// another executor holds again: 5ms, doubling to 100ms, jittered.
func pollDelay(attempt int) time.Duration {
	return backoff.Jitter(attempt+1, 5*time.Millisecond, 100*time.Millisecond)
}

// execute runs the flow's function as the executor r, and records its
// answer, or gives the lease up when it fails.
func (f *Flow[In, Out]) execute(ctx context.Context, r *flowRun, in In) (res Result[Out], err error) {
	// Whatever is still pending when it returns (its lease lost, the flow
	// stopped) is not the executor's to commit.
	defer r.discard(ctx)
	defer func() {
		if p := recover(); p != nil {
			r.returned.Store(true)
			r.release(ctx, fmt.Sprintf("panic: %v", p))
			panic(p)
		}
	}()
	r.steps = Steps{ctx: ctx, run: r}
	out, err := f.fn(ctx, &r.steps, in)
	r.returned.Store(true)
	if taken := r.takenError(); taken != nil {
		// Another executor was starting the flow: this run committed
		// nothing, and holds nothing to give up, whatever its function
		// made of the error its step returned.
		return Result[Out]{}, taken
	}
	switch {
	case errors.Is(err, ErrLeaseLost), errors.Is(err, ErrFlowStopped):
		// Not this executor's flow any more, or stopped: nothing to give up.
		return Result[Out]{}, fmt.Errorf("idem: flow %q: %w", f.name, err)
	case errors.Is(err, ErrFlowChanged):
		r.release(ctx, err.Error())
		return Result[Out]{}, fmt.Errorf("idem: flow %q: %w", f.name, err)
	case err != nil:
		if !r.release(ctx, err.Error()) {
			// The run failed after another executor took the flow over (a
			// call that hung past its timeout and lease): the flow is the
			// other's, and so is its answer.
			return Result[Out]{}, fmt.Errorf("idem: flow %q: %w", f.name, errors.Join(r.lostError(), err))
		}
		return Result[Out]{}, fmt.Errorf("idem: flow %q: %w", f.name, incomplete{err})
	}
	output, err := encodeResponse(out, r.k.scope, r.o)
	if err != nil {
		r.release(ctx, err.Error())
		return Result[Out]{}, fmt.Errorf("idem: flow %q: answer: %w", f.name, err)
	}
	// The answer commits with what is pending: the last local step, or
	// the last call's result.
	var n int64
	err = r.flush(ctx, func(b *pgx.Batch, steps *stepPatch) {
		answer := pgtype.Text{String: string(output), Valid: true}
		if steps.empty() {
			dbsqlc.QueueFlowCompleteBare(b, dbsqlc.FlowCompleteBareParams{Output: answer, Scope: r.k.scope, Key: r.k.key,
				Epoch: r.epoch}, &n)
			return
		}
		dbsqlc.QueueFlowComplete(b, dbsqlc.FlowCompleteParams{Output: answer, Steps: steps.text(), Scope: r.k.scope,
			Key: r.k.key, Epoch: r.epoch}, &n)
	})
	switch {
	case errors.Is(err, ErrLeaseLost):
		return Result[Out]{}, fmt.Errorf("idem: flow %q: record answer: %w", f.name, err)
	case err != nil:
		r.release(ctx, err.Error())
		return Result[Out]{}, fmt.Errorf("idem: flow %q: record answer: %w", f.name, err)
	case n == 0:
		return Result[Out]{}, fmt.Errorf("idem: flow %q: record answer: %w", f.name, r.lostError())
	}
	r.obs.flowCompleted()
	// As Run's first execution: a context that ended before the COMMIT
	// returned may have cut its wait for a synchronous standby short, and
	// the answer is then not given (a retry replays it).
	if err := commitConfirmed(ctx); err != nil {
		return Result[Out]{}, fmt.Errorf("idem: flow %q: %w", f.name, err)
	}
	return Result[Out]{Value: out}, nil
}

// flowRun is one executor's run of a flow: what it holds (the flow at
// epoch, leased), what earlier runs recorded, and where its function is.
type flowRun struct {
	db   TxBeginner
	k    keyRef
	flow string
	// keys derives the provider keys of the operation's calls; epoch is
	// the executor's own (see newEpoch).
	keys  providerKeys
	epoch int64
	// input is the flow's input as stored, which the function gets.
	input []byte
	o     *options
	obs   *flowObservation
	// lease is what the executor knows of its lease (see flowLease).
	lease flowLease
	// recorded are the steps that earlier runs recorded, by place (a
	// step whose function failed leaves its place empty), and the calls
	// this run recorded, as recorded (see flow_records.go); unreadable is
	// the error of records that could not be read, which every step
	// returns.
	recorded   map[int32]stepRecord
	unreadable error
	// inline is the size of the steps the flow's row records, as far as
	// the executor knows; spilled is set once a step went to a row of its
	// own, after which every new step does (see maxInlineSteps).
	inline  int
	spilled bool
	// base is the flow's created_at, in microseconds since 1970, once
	// the executor knows it (0 before): the times of the records in the
	// flow's row count from it (see appendInline). Set as the statements
	// that return it are read, which a timer's commit (commitIdle) may do.
	base atomic.Int64
	// scratch is room to measure a record in (inRow), and patch for the
	// records a write of the flow's row carries (flushLocked's stepPatch),
	// reused from one write to the next; records is where both start,
	// the records of a few small steps (see maxInlineSteps).
	scratch, patch []byte
	records        [maxInlineSteps + 128]byte
	// next is the place of the function's next step; names are the steps
	// it took (see took).
	next  int32
	names stepNames
	// stepping is set while a step runs, returned once the function has
	// returned: steps run one at a time, inside the function.
	stepping, returned atomic.Bool
	// open is the last local step's transaction, left open, and result
	// the last call's result, not recorded yet (see flow_pending.go).
	// failed is the error of an open step that committed alone
	// (commitIdle). start is the flow's row, for a flow that no one had
	// started when the executor claimed it: written by the flow's first
	// statement, in the claim's transaction (FlowStartHeld), or, once
	// that is lost, in a transaction that takes the flow's lock again
	// (FlowStart), and nil once it committed; taken is errTaken once
	// that statement found the flow taken. mu guards the five.
	mu     sync.Mutex
	open   *openStep
	failed error
	result *pendingStep
	start  *dbsqlc.FlowStartParams
	taken  error
	// flushLeased and commitTag are what flush's statements read
	// (noteCommit the latter).
	flushLeased bool
	commitTag   pgconn.CommandTag
	noteCommit  func(pgconn.CommandTag) error
	// stepLeased is what a local step's renewal of the lease found;
	// steps is what the function takes its steps with.
	stepLeased bool
	steps      Steps
	// resultStore holds result, the call's result not recorded yet.
	resultStore pendingStep
}

// newFlowRun returns the run of the executor that claimed the flow under
// epoch with the statement sent at sent, which leased it.
func newFlowRun(db TxBeginner, k keyRef, flow string, keys providerKeys, epoch int64, input []byte, sent time.Time,
	recorded []dbsqlc.FlowStepsRow, o *options, obs *flowObservation,
) *flowRun {
	r := &flowRun{db: db, k: k, flow: flow, keys: keys, epoch: epoch, input: input, o: o, obs: obs}
	r.noteCommit = func(tag pgconn.CommandTag) error {
		r.commitTag = tag
		return nil
	}
	r.scratch, r.patch = r.records[:0:128], r.records[128:128]
	r.lease.init(o.lease)
	r.lease.renewed(sent)
	var base int64
	r.recorded, r.inline, r.spilled, base, r.unreadable = recordedSteps(recorded)
	r.base.Store(base)
	return r
}

// incomplete is the error of a flow's function: the flow did not
// complete, and stays resumable ([ErrFlowIncomplete]).
type incomplete struct{ err error }

func (e incomplete) Error() string   { return e.err.Error() }
func (e incomplete) Unwrap() []error { return []error{ErrFlowIncomplete, e.err} }
