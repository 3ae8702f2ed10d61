package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// A handler that needs longer than its lease extends it: it is delivered
// once, although another relay polls all the while, and its context does
// not end.
func TestExtendLeaseKeepsASlowDeliveryOnce(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "slow", Destination: dest})
	const lease = time.Second
	got := newCalls()
	handlerErr := make(chan error, 1)
	slow := func(ctx context.Context, msg outbox.Message) error {
		if got.add(msg) > 1 {
			return nil // delivered twice: counted, and the test fails
		}
		first, _ := ctx.Deadline()
		end := time.Now().Add(3 * lease)
		for time.Now().Before(end) {
			if err := outbox.ExtendLease(ctx, lease); err != nil {
				handlerErr <- err
				return err
			}
			time.Sleep(lease / 5)
		}
		if last, _ := ctx.Deadline(); !last.After(first) {
			handlerErr <- fmt.Errorf("deadline %v, not after the first %v", last, first)
			return nil
		}
		handlerErr <- ctx.Err()
		return ctx.Err()
	}
	startRelay(t, ctx, pool, slow, outbox.Config{Destinations: []string{dest}, LeaseDuration: lease, PollInterval: 10 * time.Millisecond})
	startRelay(t, ctx, pool, slow, outbox.Config{Destinations: []string{dest}, LeaseDuration: lease, PollInterval: 2 * time.Millisecond})

	if err := <-handlerErr; err != nil {
		t.Fatalf("slow handler: %v", err)
	}
	waitFor(t, "the slow message delivered", func() bool { return countState(t, pool, dest, "delivered") == 1 })
	if n := got.count(ids[0]); n != 1 {
		t.Errorf("handled %d times, want once", n)
	}
	if r := rows(t, pool, dest)[0]; r.Attempts != 1 {
		t.Errorf("%d attempts, want 1", r.Attempts)
	}
}

func TestExtendLeaseErrors(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	if err := outbox.ExtendLease(ctx, time.Minute); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("ExtendLease outside a handler: %v, want ErrInvalidOption", err)
	}
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "lost", Destination: dest})
	errs := make(chan error, 2)
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		errs <- outbox.ExtendLease(ctx, 0)
		// Another relay leases the message, as if this lease had run out.
		if _, err := pool.Exec(ctx, `UPDATE outbox_message SET attempts = attempts + 1 WHERE id = $1`, msg.ID); err != nil {
			return err
		}
		errs <- outbox.ExtendLease(ctx, time.Minute)
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})
	if err := <-errs; !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("ExtendLease by 0: %v, want ErrInvalidOption", err)
	}
	if err := <-errs; !errors.Is(err, outbox.ErrMessageLeaseLost) {
		t.Errorf("ExtendLease of a lease another relay took: %v, want ErrMessageLeaseLost", err)
	}
}
