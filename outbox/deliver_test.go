package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem/outbox"
)

func TestFailuresBackOffThenPark(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool,
		outbox.Entry{Scope: scope, Key: "always-fails", Destination: dest},
		outbox.Entry{Scope: scope, Key: "fails-twice", Destination: dest},
		outbox.Entry{Scope: scope, Key: "rejected", Destination: dest},
		outbox.Entry{Scope: scope, Key: "panics-once", Destination: dest},
	)
	alwaysFails, failsTwice, rejected, panicsOnce := ids[0], ids[1], ids[2], ids[3]

	got := newCalls()
	errUnavailable := errors.New("provider unavailable")
	handler := func(ctx context.Context, msg outbox.Message) error {
		n := got.add(msg)
		if n != msg.Attempt {
			t.Errorf("message %s: call %d says attempt %d", msg.Key, n, msg.Attempt)
		}
		switch msg.Key {
		case "always-fails":
			return errUnavailable
		case "fails-twice":
			if n <= 2 {
				return errUnavailable
			}
		case "rejected":
			return outbox.Park(errors.New("400 invalid amount"))
		case "panics-once":
			if n == 1 {
				panic("handler bug")
			}
		}
		return nil
	}
	const maxAttempts = 4
	retryDelay, maxRetryDelay := 40*time.Millisecond, 100*time.Millisecond
	stop := startRelay(t, ctx, pool, handler, outbox.Config{
		Destinations:  []string{dest},
		MaxAttempts:   maxAttempts,
		RetryDelay:    retryDelay,
		MaxRetryDelay: maxRetryDelay,
		PollInterval:  10 * time.Millisecond,
	})
	waitFor(t, "every message delivered or parked", func() bool {
		return countState(t, pool, dest, "delivered")+countState(t, pool, dest, "parked") == len(ids)
	})
	stop()

	want := map[int64]struct {
		state    string
		attempts int32
		lastErr  string
	}{
		alwaysFails: {"parked", maxAttempts, "provider unavailable"},
		failsTwice:  {"delivered", 3, ""},
		rejected:    {"parked", 1, "400 invalid amount"},
		panicsOnce:  {"delivered", 2, ""},
	}
	for _, r := range rows(t, pool, dest) {
		w := want[r.ID]
		if r.State != w.state || r.Attempts != w.attempts || !strings.Contains(r.LastError, w.lastErr) || r.Leased {
			t.Errorf("message %d: %+v; want state %s after %d attempts, last error %q", r.ID, r, w.state, w.attempts, w.lastErr)
		}
		if n := got.count(r.ID); n != int(w.attempts) {
			t.Errorf("message %d handled %d times, want %d", r.ID, n, w.attempts)
		}
	}

	// Each retry waited at least half its delay, which doubles per attempt
	// up to the cap: 40ms, 80ms, then 100ms.
	times := got.times[alwaysFails]
	for i := 1; i < len(times); i++ {
		delay := min(retryDelay<<(i-1), maxRetryDelay)
		if gap := times[i].Sub(times[i-1]); gap < delay/2 {
			t.Errorf("attempt %d came %s after attempt %d; the backoff is at least %s", i+1, gap, i, delay/2)
		}
	}

	// Parked messages stay visible: a relay's purge takes the delivered
	// ones and leaves them alone.
	startRelay(t, ctx, pool, handler, outbox.Config{Destinations: []string{dest}, DeliveredRetention: time.Nanosecond})
	waitFor(t, "delivered messages purged", func() bool { return countState(t, pool, dest, "delivered") == 0 })
	if n := countState(t, pool, dest, "parked"); n != 2 {
		t.Fatalf("%d parked messages after a purge, want 2", n)
	}
}

func TestCrashOnLastAttemptParks(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 1)...)
	config := outbox.Config{Destinations: []string{dest}, MaxAttempts: 1, LeaseDuration: 200 * time.Millisecond, PollInterval: 10 * time.Millisecond}

	// The only attempt crashes its relay (a message that kills its
	// process, say): there is no outcome to record.
	db := &crashable{pool: pool}
	handled := make(chan struct{})
	stop := startRelay(t, ctx, db, func(ctx context.Context, msg outbox.Message) error {
		db.dead.Store(true)
		close(handled)
		return errCrashed
	}, config)
	<-handled
	stop()

	// The next relay does not try again past MaxAttempts, and does not
	// drop the message either: it parks it, with the reason.
	var calls atomic.Int64
	startRelay(t, ctx, pool, func(context.Context, outbox.Message) error {
		calls.Add(1)
		return nil
	}, config)
	waitFor(t, "the message parked", func() bool { return countState(t, pool, dest, "parked") == 1 })
	if r := rows(t, pool, dest)[0]; r.ID != ids[0] || !strings.Contains(r.LastError, "lease ran out") || calls.Load() != 0 {
		t.Fatalf("%+v, handler called %d times; want parked for want of attempts, without another call", r, calls.Load())
	}
}

// A handler that runs until its context ends must not hold back the
// outcomes of its batch-mates, and must leave its relay time to record its
// own before the lease runs out; otherwise another relay leases the
// finished messages again.
func TestSlowHandlerDoesNotDelayBatchOutcomes(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 10)...)
	slow := ids[0]
	const lease = time.Second

	got := newCalls()
	var inFlight sync.WaitGroup
	inFlight.Add(len(ids))
	slowReturned := make(chan struct{})
	stopFirst := startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		if got.add(msg) > 1 {
			return nil // a second delivery: counted, and the test fails
		}
		inFlight.Done()
		if msg.ID != slow {
			return nil
		}
		<-ctx.Done()
		time.Sleep(5 * time.Millisecond)
		close(slowReturned)
		return ctx.Err()
	}, outbox.Config{
		Destinations: []string{dest}, BatchSize: len(ids), LeaseDuration: lease,
		RetryDelay: time.Hour, MaxRetryDelay: time.Hour,
	})
	inFlight.Wait() // the first relay has leased the whole batch

	// A second relay polls often, ready to take any message whose lease
	// runs out before its outcome is recorded.
	stopSecond := startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		got.add(msg)
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 2 * time.Millisecond})

	<-slowReturned
	// The slow message's outcome is recorded by the first relay (no longer
	// leased, one attempt), or it was leased again by the second.
	waitFor(t, "the slow message's attempt to end", func() bool {
		r := rows(t, pool, dest)[0]
		return (r.Attempts == 1 && !r.Leased) || r.Attempts > 1
	})
	stopSecond()
	stopFirst()

	for _, r := range rows(t, pool, dest) {
		if n := got.count(r.ID); n != 1 || r.Attempts != 1 {
			t.Errorf("message %d handled %d times over %d attempts, want once", r.ID, n, r.Attempts)
		}
		if r.ID != slow && r.State != "delivered" {
			t.Errorf("message %d: %+v, want delivered", r.ID, r)
		}
	}
	// The timed-out attempt failed like any other: it waits out its retry
	// delay instead of being leased again at once.
	var state, lastError string
	var backingOff bool
	err := pool.QueryRow(ctx, `SELECT state, coalesce(last_error, ''), next_attempt_at > now() + interval '10 minutes'
		FROM outbox_message WHERE id = $1`, slow).Scan(&state, &lastError, &backingOff)
	if err != nil {
		t.Fatal(err)
	}
	if state != "pending" || !strings.Contains(lastError, "deadline") || !backingOff {
		t.Errorf("slow message: state %s, last error %q, backing off %t; want a pending retry after the deadline", state, lastError, backingOff)
	}
}
