package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
)

// ErrMessageLeaseLost is returned by [ExtendLease] when the message's lease
// can no longer be extended: it ran out and another relay leased the
// message, or the message is no longer pending (someone else recorded its
// outcome). The handler should stop: another attempt delivers the message,
// or has. (idem.ErrLeaseLost is a flow's lease, another matter.)
var ErrMessageLeaseLost = errors.New("outbox: the message's lease is lost")

// ExtendLease extends the lease of the message whose delivery ctx belongs
// to, to d from now by the database's clock, and moves the end of the
// handler's context to match, keeping back the same margin as the first
// lease (a tenth of d, at most 5s) for recording the outcome. A handler
// that may need longer than [Config.LeaseDuration] calls it before its
// context ends, as often as it needs: a slow but healthy delivery then
// keeps its message from other relays and is not delivered twice.
//
// A context derived from the handler's with a deadline of its own
// (context.WithTimeout) keeps the deadline it was given: derive such
// contexts after extending.
//
// ctx must be the context the relay passed to the handler, or one derived
// from it; otherwise, or when d is not positive, ExtendLease returns
// [idem.ErrInvalidOption]. It returns the context's error once the
// context has ended, and [ErrMessageLeaseLost] when the lease is no longer the
// message's newest.
func ExtendLease(ctx context.Context, d time.Duration) error {
	dl, _ := ctx.Value(deliveryKey{}).(*delivery)
	if dl == nil {
		return &idem.FieldError{Package: "outbox", Field: "ExtendLease", Problem: "ctx must be a handler call's context"}
	}
	if d <= 0 {
		return &idem.FieldError{Package: "outbox", Field: "ExtendLease", Problem: fmt.Sprintf("d must be positive, got %s", d)}
	}
	if err := dl.ctx.Err(); err != nil {
		return err
	}
	start := time.Now()
	var n int64
	err := dl.relay.do(ctx, func(ctx context.Context, q *dbsqlc.Queries) error {
		var err error
		n, err = q.OutboxExtendLease(ctx, dbsqlc.OutboxExtendLeaseParams{Lease: pgtime.Interval(d), ID: dl.id, Attempt: dl.attempt})
		if err != nil {
			return dberr.Translate("outbox: extend lease", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("%w (message %d, attempt %d)", ErrMessageLeaseLost, dl.id, dl.attempt)
	}
	// As for the first lease, the extension began by the server's clock
	// after start.
	return dl.ctx.extend(start.Add(d - leaseMargin(d)))
}

// deliveryKey is the context key of the delivery a handler call makes.
type deliveryKey struct{}

// delivery is one attempt at a message, as ExtendLease finds it.
type delivery struct {
	relay   *Relay
	id      int64
	attempt int32
	ctx     *leaseContext
}

// leaseContext is a handler's context: it ends when its parent does, or at
// its deadline, which ExtendLease moves later. Its Err is
// context.DeadlineExceeded once the deadline passed, as with
// context.WithDeadline, whose deadline cannot move.
type leaseContext struct {
	context.Context
	delivery *delivery
	done     chan struct{}
	timer    *time.Timer
	stop     func() bool

	mu       sync.Mutex
	deadline time.Time
	err      error
}

func newLeaseContext(parent context.Context, d *delivery, deadline time.Time) *leaseContext {
	c := &leaseContext{Context: parent, delivery: d, done: make(chan struct{}), deadline: deadline}
	d.ctx = c
	c.mu.Lock()
	defer c.mu.Unlock()
	c.timer = time.AfterFunc(time.Until(deadline), c.expire)
	c.stop = context.AfterFunc(parent, func() { c.end(parent.Err()) })
	return c
}

func (c *leaseContext) Deadline() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p, ok := c.Context.Deadline(); ok && p.Before(c.deadline) {
		return p, true
	}
	return c.deadline, true
}

func (c *leaseContext) Done() <-chan struct{} { return c.done }

func (c *leaseContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *leaseContext) Value(key any) any {
	if key == (deliveryKey{}) {
		return c.delivery
	}
	return c.Context.Value(key)
}

// expire ends the context, unless ExtendLease moved its deadline since the
// timer fired.
func (c *leaseContext) expire() {
	c.mu.Lock()
	moved := time.Now().Before(c.deadline)
	c.mu.Unlock()
	if !moved {
		c.end(context.DeadlineExceeded)
	}
}

// end ends the context with err, once, and frees its timer.
func (c *leaseContext) end(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return
	}
	c.err = err
	close(c.done)
	c.timer.Stop()
	if c.stop != nil {
		c.stop()
	}
}

// extend moves the deadline, unless the context has ended.
func (c *leaseContext) extend(deadline time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return c.err
	}
	c.deadline = deadline
	c.timer.Reset(time.Until(deadline))
	return nil
}
