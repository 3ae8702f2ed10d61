package idem

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestACallContextEndsTheMomentItsLeaseHasRunOut is a process that wakes
// from a freeze past its lease, before the timer that ends its call's
// context has run: the context, and one derived from it as a call's
// function would (a request's timeout), must already have ended, with
// ErrLeaseLost as the cause, so that the function sends nothing.
func TestACallContextEndsTheMomentItsLeaseHasRunOut(t *testing.T) {
	var lease flowLease
	lease.init(time.Second)
	lease.renewed(time.Now()) // holds for 900ms from now
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	lc := &leaseContext{Context: ctx, lease: &lease, cancel: cancel}
	if lc.Err() != nil {
		t.Fatalf("a call's context with its lease held: %v", lc.Err())
	}
	// The freeze: the lease runs out by the executor's clock, and no timer
	// has ended the context.
	lease.base = lease.base.Add(-time.Hour)
	derived, stop := context.WithTimeout(lc, time.Minute)
	defer stop()
	if derived.Err() == nil || !errors.Is(context.Cause(derived), ErrLeaseLost) {
		t.Fatalf("a context derived once the lease ran out: err %v, cause %v; want it ended, ErrLeaseLost", derived.Err(), context.Cause(derived))
	}
	if !errors.Is(context.Cause(lc), ErrLeaseLost) {
		t.Fatalf("the call's context: cause %v, want ErrLeaseLost", context.Cause(lc))
	}
}
