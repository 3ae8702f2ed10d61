package idem

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
)

// An executor holds a flow by its epoch, which fences it, and its lease,
// which tells others when they may take the flow over. The database checks
// the epoch on every write an executor makes, and renews the lease with
// it: an executor another has taken the flow from (a new epoch), or whose
// flow an operator stopped, records nothing more. A lease that ran out
// with nobody taking the flow over still belongs to its executor, which
// goes on, more slowly, rather than failing.
//
// What the database cannot check is a call to another system. So an
// executor makes a call, and keeps its context alive, only while its lease
// surely holds by its own clock (flowLease): a process that stalled past
// its lease (frozen, paused, cut off) wakes to find its call's context
// ended and calls nobody.

// flowLease is what an executor knows of its lease, by its own monotonic
// clock: a lease renewed by a statement sent at t holds at least until
// t + the lease, since the server dates it from when it received or ran
// the statement (statement_timestamp() or clock_timestamp(), never the
// transaction's start; see queries/flow.sql). It is held to end a tenth of the lease sooner, for clocks
// that run at slightly different rates.
type flowLease struct {
	d    time.Duration
	base time.Time
	// end is when the lease may run out, in nanoseconds after base.
	end atomic.Int64
}

func (l *flowLease) init(d time.Duration) {
	l.d = d
	l.base = time.Now()
}

// renewed records a renewal whose statement was sent at sent.
func (l *flowLease) renewed(sent time.Time) {
	end := int64(sent.Sub(l.base) + l.d - l.d/10)
	for {
		cur := l.end.Load()
		if end <= cur || l.end.CompareAndSwap(cur, end) {
			return
		}
	}
}

// left returns how long the lease surely holds from now: zero or less
// once it may have run out.
func (l *flowLease) left() time.Duration {
	return time.Duration(l.end.Load()) - time.Since(l.base)
}

// lostError is ErrLeaseLost, saying what may have happened.
func (r *flowRun) lostError() error { return errLeaseLost }

// errLeaseLost is ErrLeaseLost, saying what may have happened; made once,
// since it says the same each time.
var errLeaseLost = fmt.Errorf("%w: its lease ran out, another executor took the flow over, or an operator ended it", ErrLeaseLost)

// renew renews the lease (FlowLease), noting step, and reports
// ErrLeaseLost when the executor no longer holds the flow.
func (r *flowRun) renew(ctx context.Context, step string) error {
	sent := time.Now()
	var n int64
	err := onDB(ctx, r.db, func(q *dbsqlc.Queries) (err error) {
		n, err = q.FlowLease(ctx, dbsqlc.FlowLeaseParams{Lease: pgtime.Interval(r.o.lease), Step: step,
			Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch})
		return err
	})
	switch {
	case err != nil:
		return translate("renew the lease", err)
	case n == 0:
		return r.lostError()
	}
	r.lease.renewed(sent)
	return nil
}

// holdForCall makes sure, before a call, that the lease holds by the
// executor's clock, renewing it once if it may have run out: a call is
// never started on a lease that may have run out.
func (r *flowRun) holdForCall(ctx context.Context, step string) error {
	if r.lease.left() > 0 {
		return nil
	}
	if err := r.renew(ctx, step); err != nil {
		return err
	}
	if r.lease.left() <= 0 {
		return r.lostError() // the renewal took longer than the lease
	}
	return nil
}

// keepLease returns the context of a call that starts now, and what ends
// it once the call has returned (callLease.stop), which reports
// ErrLeaseLost if the lease was lost meanwhile. The call's context ends
// when ctx does, when the call's timeout ([WithCallTimeout]) passes, or
// when the lease may have run out (flowLease). On a pool (or any
// TxBeginner but a single connection, which the call must leave alone) the
// lease is renewed every third of it (FlowLease) until the call returns or
// its context ends, which pushes that end back; a renewal that finds the
// flow gone ends the context at once.
//
// One timer does both, firing at the lease's end or at the next renewal,
// whichever comes first: a call that returns within a third of the lease
// (most do) costs a timer, and no goroutine; a renewal runs in a goroutine
// of its own, while the timer still ends the call at the lease's end.
func (r *flowRun) keepLease(ctx context.Context, step string) *leaseContext {
	c := &leaseContext{lease: &r.lease, r: r, step: step, endTimeout: noCancel}
	c.Context, c.cancel = context.WithCancelCause(ctx)
	if r.o.callTimeout > 0 {
		c.timeoutCause = callTimeoutError{step, r.o.callTimeout}
		c.Context, c.endTimeout = context.WithTimeoutCause(c.Context, r.o.callTimeout, &c.timeoutCause)
	}
	switch r.db.(type) {
	case *pgx.Conn, *pgxpool.Conn:
	default:
		c.renews = true
		c.renewAt = time.Now().Add(r.o.lease / 3)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.timer = time.AfterFunc(c.next(max(r.lease.left(), 0)), c.fire)
	return c
}

func noCancel() {}

// callTimeoutError is the cause of a call's context that ran past its
// timeout ([WithCallTimeout]).
type callTimeoutError struct {
	step    string
	timeout time.Duration
}

func (e *callTimeoutError) Error() string {
	return fmt.Sprintf("idem: step %q: the call ran past its timeout (%s)", e.step, e.timeout)
}

// leaseContext is a call's context. It ends when the lease may have run
// out by the executor's clock, and says so the moment it is asked (Done,
// Err), not only once the timer that ends it gets to run: a process frozen
// past its lease (SIGSTOP, a paused VM) wakes with that timer still
// pending, and a call's function woken at the same moment would otherwise
// see a live context, derive live contexts from it, and send its request.
// Context is the call's cancelable context; cancel cancels it.
//
// It also keeps the lease while the call runs (see keepLease): timer fires
// at the lease's end, or at renewAt, when renews, to renew it.
type leaseContext struct {
	context.Context
	lease      *flowLease
	cancel     context.CancelCauseFunc
	endTimeout context.CancelFunc
	// timeoutCause is the cause of a context that ran past the call's
	// timeout (kept here, so that it takes no allocation of its own).
	timeoutCause callTimeoutError
	r            *flowRun
	step         string
	renews       bool
	// mu guards what follows; wg counts the renewal running.
	mu       sync.Mutex
	timer    *time.Timer
	renewAt  time.Time
	renewing bool
	stopped  bool
	wg       sync.WaitGroup
}

// lose ends the context: the lease is lost, or may have run out.
func (c *leaseContext) lose() { c.cancel(errLeaseLost) }

// expired ends the context if the lease may have run out.
func (c *leaseContext) expired() {
	if c.lease.left() <= 0 {
		c.lose()
	}
}

func (c *leaseContext) Done() <-chan struct{} {
	c.expired()
	return c.Context.Done()
}

func (c *leaseContext) Err() error {
	c.expired()
	return c.Context.Err()
}

// next is how long from now the timer should fire, the lease holding for
// left: at its end, or at the next renewal if sooner. mu is held.
func (c *leaseContext) next(left time.Duration) time.Duration {
	if c.renews && !c.renewing {
		left = min(left, time.Until(c.renewAt))
	}
	return max(left, 0)
}

// fire is the timer's: it ends the context once the lease may have run
// out, and starts the renewal that is due, if any, unless the call has
// returned or its context has ended.
func (c *leaseContext) fire() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return
	}
	left := c.lease.left()
	if left <= 0 {
		c.lose()
		return
	}
	if c.Context.Err() != nil {
		return // nothing to keep: the call's context has ended
	}
	if c.renews && !c.renewing && !time.Now().Before(c.renewAt) {
		c.renewing = true
		c.wg.Add(1)
		go c.renew()
	}
	c.timer.Reset(c.next(left))
}

// renew renews the lease once, and schedules the next renewal. A renewal
// that has not succeeded by the time the lease may run out is given up: a
// database out of reach must not keep the call going past its lease.
func (c *leaseContext) renew() {
	defer c.wg.Done()
	renewCtx, cancelRenew := context.WithTimeout(c, max(c.lease.left(), 0))
	err := c.r.renew(renewCtx, c.step)
	cancelRenew()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.renewing = false
	if errors.Is(err, ErrLeaseLost) {
		c.renews = false
		c.lose()
		return
	}
	c.renewAt = c.renewAt.Add(c.r.o.lease / 3)
	if !c.stopped && c.Context.Err() == nil {
		c.timer.Reset(c.next(c.lease.left()))
	}
}

// stop is called once the call has returned: it stops the timer, waits for
// a renewal under way, ends the context, and reports ErrLeaseLost if the
// lease was lost meanwhile.
func (c *leaseContext) stop() error {
	c.mu.Lock()
	c.stopped = true
	c.timer.Stop()
	c.mu.Unlock()
	c.wg.Wait()
	cause := context.Cause(c)
	c.endTimeout()
	c.cancel(nil)
	return leaseCause(cause)
}

// leaseCause is cause when it says the lease was lost, else nil.
func leaseCause(cause error) error {
	if errors.Is(cause, ErrLeaseLost) {
		return cause
	}
	return nil
}

// release gives the lease up, recording why, so that a retry takes the
// flow over at once, and reports whether the executor still held the
// flow. It runs even when ctx has ended, for at most cleanupTimeout; when
// the database cannot be reached it reports that it held it.
func (r *flowRun) release(ctx context.Context, why string) (held bool) {
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	// What is pending commits with it: a local step that returned, a
	// call's result.
	var n int64
	err := r.flush(ctx, func(b *pgx.Batch, steps *stepPatch) {
		if steps.empty() {
			dbbatch.QueueFlowReleaseBare(b, dbsqlc.FlowReleaseBareParams{LastError: sealText(why, r.k.scope, r.o),
				Step: steps.atText(), Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &n)
			return
		}
		dbbatch.QueueFlowRelease(b, dbsqlc.FlowReleaseParams{LastError: sealText(why, r.k.scope, r.o),
			Step: steps.atText(), Steps: steps.text(), Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &n)
	})
	if errors.Is(err, ErrLeaseLost) || errors.Is(err, errTaken) {
		return false // another executor's flow (errTaken: one that started it meanwhile)
	}
	return err != nil || n == 1
}

// stop stops the flow for a person's decision (FlowStop), and returns the
// error that says so: ErrFlowStopped, or ErrLeaseLost when the executor no
// longer held it.
func (r *flowRun) stop(ctx context.Context, why string) error {
	var n int64
	err := r.flush(ctx, func(b *pgx.Batch, steps *stepPatch) {
		if steps.empty() {
			dbbatch.QueueFlowStopBare(b, dbsqlc.FlowStopBareParams{LastError: sealText(why, r.k.scope, r.o), Step: steps.atText(),
				Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &n)
			return
		}
		dbbatch.QueueFlowStop(b, dbsqlc.FlowStopParams{LastError: sealText(why, r.k.scope, r.o), Step: steps.atText(), Steps: steps.text(),
			Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}, &n)
	})
	switch {
	case errors.Is(err, ErrLeaseLost):
		return err
	case err != nil:
		return translate("stop the flow", err)
	case n == 0:
		return r.lostError()
	}
	r.obs.flowStopped()
	return fmt.Errorf("%w: it needs attention: %s", ErrFlowStopped, why)
}

// sealedTextPrefix starts a flow's last error sealed by its codec.
const sealedTextPrefix = "sealed:"

// sealText is the text of an error as a flow stores it for operators: cut
// to suit an operator's screen, valid UTF-8 without NUL, and sealed by the
// flow's codec, if it has one, since it may hold what the call's provider
// said (a card number in a message), as the input and answer may.
func sealText(s, scope string, o *options) string {
	s = storableText(s)
	if o.codec == nil {
		return s
	}
	sealed, err := o.codec.Seal(scope, []byte(s))
	if err != nil {
		return "(not stored: the codec could not seal it)"
	}
	return sealedTextPrefix + base64.StdEncoding.EncodeToString(sealed)
}

// openText opens what sealText stored, for the error that tells a caller
// why a flow stopped.
func openText(s, scope string, o *options) string {
	b64, ok := strings.CutPrefix(s, sealedTextPrefix)
	if !ok || o.codec == nil {
		return s
	}
	sealed, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return s
	}
	opened, err := o.codec.Open(scope, sealed)
	if err != nil {
		return "(sealed; the codec could not open it)"
	}
	return string(opened)
}

// storableText is s as a text column can hold it, cut to a size that
// suits an operator's screen: valid UTF-8, without NUL.
func storableText(s string) string {
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "")
	const limit = 2000
	if len(s) > limit {
		cut := limit
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}
