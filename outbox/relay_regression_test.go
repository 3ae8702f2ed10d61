package outbox_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/outbox"
)

// waitWithin polls cond until it holds, or fails the test after limit: for
// conditions that a working relay meets at once, so that a broken one
// fails the test quickly.
func waitWithin(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s not done within %s", what, limit)
		}
		time.Sleep(5 * time.Millisecond)
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

// The largest durations mean "forever", not a negative interval.
func TestLargestDurationsMeanForever(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	forever := time.Duration(math.MaxInt64)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 2)...)
	old, fresh := ids[0], ids[1]
	if _, err := pool.Exec(ctx, `UPDATE outbox_message SET state = 'delivered', delivered_at = now() - interval '100 years'
		WHERE id = $1`, old); err != nil {
		t.Fatal(err)
	}

	// A relay purges before it leases: once it has delivered the fresh
	// message, it has purged all it was going to.
	release := make(chan struct{})
	got := newCalls()
	var markerDone atomic.Bool
	handler := func(ctx context.Context, msg outbox.Message) error {
		got.add(msg)
		if msg.ID == fresh {
			// Held until release; a relay stopped before that (a check
			// below failed) ends the call, so that the test fails rather
			// than hang. The test closes release before it stops the
			// relays, so a call that sees its context end after release
			// was closed still succeeds.
			select {
			case <-release:
			case <-ctx.Done():
				select {
				case <-release:
				default:
					return ctx.Err()
				}
			}
		} else {
			markerDone.Store(true)
		}
		return nil
	}
	stopFirst := startRelay(t, ctx, pool, handler, outbox.Config{
		Destinations: []string{dest}, DeliveredRetention: forever, LeaseDuration: forever,
	})
	waitFor(t, "the fresh message handled", func() bool { return got.count(fresh) == 1 })

	// Its lease ends in centuries: a second relay, polling often, must not
	// deliver it meanwhile.
	var leasedForCenturies bool
	if err := pool.QueryRow(ctx, `SELECT leased_until > now() + interval '200 years' FROM outbox_message WHERE id = $1`,
		fresh).Scan(&leasedForCenturies); err != nil {
		t.Fatal(err)
	}
	if !leasedForCenturies {
		t.Error("a lease of the largest duration does not run for centuries")
	}
	stopSecond := startRelay(t, ctx, pool, handler, outbox.Config{
		Destinations: []string{dest}, PollInterval: 2 * time.Millisecond, DeliveredRetention: forever,
	})
	// Wait for the second relay to have leased at least once, through an
	// unrelated message that it delivers.
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "marker", Destination: dest})
	waitFor(t, "the marker handled", markerDone.Load)
	close(release)
	stopSecond()
	stopFirst()
	if n := got.count(fresh); n != 1 {
		t.Errorf("fresh message handled %d times, want once", n)
	}

	byID := map[int64]row{}
	for _, r := range rows(t, pool, dest) {
		byID[r.ID] = r
	}
	if r, ok := byID[old]; !ok || r.State != "delivered" {
		t.Errorf("a message delivered a century ago was purged under a retention of %s", forever)
	}
	if r := byID[fresh]; r.State != "delivered" || r.Attempts != 1 {
		t.Errorf("fresh message %+v: want delivered on its first attempt", r)
	}
}

// A later message that commits first may be leased first; an earlier one
// with the same ordering key that commits meanwhile must then wait for it.
func TestOrderingKeyOneInFlightWhenCommittedOutOfOrder(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	earlierEntry := outbox.Entry{Scope: scope, Key: "earlier", Destination: dest, OrderingKey: "account"}
	laterEntry := outbox.Entry{Scope: scope, Key: "later", Destination: dest, OrderingKey: "account"}

	// The earlier message gets its id first, and commits last.
	earlierTx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = earlierTx.Rollback(context.Background()) }()
	earlier, err := outbox.Enqueue(ctx, earlierTx, earlierEntry)
	if err != nil {
		t.Fatal(err)
	}
	later := enqueue(t, ctx, pool, laterEntry)[0]
	if later < earlier {
		t.Fatalf("ids %d, %d out of order", earlier, later)
	}

	var mu sync.Mutex
	inFlight, maxInFlight := 0, 0
	laterStarted := make(chan struct{})
	releaseLater := make(chan struct{})
	var markerDone atomic.Bool
	handler := func(ctx context.Context, msg outbox.Message) error {
		if msg.OrderingKey == "" {
			markerDone.Store(true)
			return nil
		}
		mu.Lock()
		inFlight++
		maxInFlight = max(maxInFlight, inFlight)
		mu.Unlock()
		if msg.ID == later {
			close(laterStarted)
			<-releaseLater
		}
		mu.Lock()
		inFlight--
		mu.Unlock()
		return nil
	}
	// Two relays: one is held up by the later message, the other is free
	// to lease the earlier one, and must not.
	config := outbox.Config{Destinations: []string{dest}, PollInterval: 2 * time.Millisecond}
	startRelay(t, ctx, pool, handler, config)
	startRelay(t, ctx, pool, handler, config)
	<-laterStarted

	if err := earlierTx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Once a relay delivered a message committed after the earlier one,
	// a lease statement has seen the earlier one.
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "marker", Destination: dest})
	waitFor(t, "the marker delivered", markerDone.Load)
	for _, r := range rows(t, pool, dest) {
		if r.ID == earlier && r.Attempts != 0 {
			t.Errorf("earlier message leased (%d attempts) while the later one is in flight", r.Attempts)
		}
	}
	close(releaseLater)
	waitFor(t, "every message delivered", func() bool { return countState(t, pool, dest, "delivered") == 3 })
	mu.Lock()
	defer mu.Unlock()
	if maxInFlight != 1 {
		t.Errorf("max in flight %d for one ordering key, want 1", maxInFlight)
	}
}

// A relay needs no room in its pool to listen: on a pool of one connection
// it still delivers, and the pool still closes once the relay stopped.
func TestRelayOnSingleConnectionPool(t *testing.T) {
	ctx, _, scope, dest := setup(t)
	config, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	config.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	delivered := make(chan string, 1)
	stop := startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		delivered <- msg.Key
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})
	enqueueAndAwait(t, ctx, pool, delivered, entries(scope, dest, 3), 10*time.Second, "a relay on a pool of one connection never delivered it")
	stop()

	closed := make(chan struct{})
	go func() { pool.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the pool does not close after its relay stopped")
	}
}

// Delivering an ordered message makes the next one due at once: the relay
// goes on without waiting for its next poll.
func TestOrderedMessagesDrainWithoutPolling(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	all := entries(scope, dest, 10)
	for i := range all {
		all[i].OrderingKey = "account"
	}
	all[4].Key = "parked" // a parked message lets the next one go too
	enqueue(t, ctx, pool, all...)

	// Not a pool, so no notification wakes the relay: with an hour
	// between polls, only the relay's own progress can drain the key.
	startRelay(t, ctx, &crashable{pool: pool}, func(ctx context.Context, msg outbox.Message) error {
		if msg.Key == "parked" {
			return outbox.Park(errors.New("rejected"))
		}
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: time.Hour})
	waitWithin(t, 10*time.Second, "draining the ordering key", func() bool {
		return countState(t, pool, dest, "delivered") == len(all)-1 && countState(t, pool, dest, "parked") == 1
	})
}
