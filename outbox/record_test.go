package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem/outbox"
)

// Outcomes recorded on their own go through the statement that leases,
// asked for no messages: it must record, and lease nothing.
func TestRecordingAloneLeasesNothing(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 3)...)
	relay, err := outbox.NewRelay(pool, func(context.Context, outbox.Message) error { return nil },
		&outbox.Config{Destinations: []string{dest}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	outbox.RecordDelivered(ctx, relay, ids[0], 1)
	got := rows(t, pool, dest)
	if len(got) != 3 || got[0].State != "delivered" {
		t.Fatalf("rows %+v: want the first of 3 delivered", got)
	}
	for _, r := range got[1:] {
		if r.State != "pending" || r.Leased || r.Attempts != 0 {
			t.Errorf("message %+v: recording an outcome leased it, want it pending, unleased, never attempted", r)
		}
	}
}

func TestCrashedRelayMessagesAreDeliveredAfterLease(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 3)...)
	const lease = 300 * time.Millisecond
	config := outbox.Config{Destinations: []string{dest}, BatchSize: 3, LeaseDuration: lease, PollInterval: 10 * time.Millisecond}

	// The first relay leases all three, delivers them, and dies before it
	// can record anything.
	got := newCalls()
	db := &crashable{pool: pool}
	var handled sync.WaitGroup
	handled.Add(len(ids))
	crashed := make(chan struct{})
	stopFirst := startRelay(t, ctx, db, func(ctx context.Context, msg outbox.Message) error {
		got.add(msg)
		handled.Done()
		handled.Wait() // all three are in flight
		db.dead.Store(true)
		<-crashed
		return nil
	}, config)
	handled.Wait()
	close(crashed)
	stopFirst()
	for _, r := range rows(t, pool, dest) {
		if r.State != "pending" || !r.Leased || r.Attempts != 1 {
			t.Fatalf("after the crash: %+v; want pending, leased, one attempt", r)
		}
	}

	// Another relay delivers them again once the lease runs out: nothing
	// is lost, and the handler sees them twice (at least once, not once).
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		if msg.Attempt != 2 {
			t.Errorf("message %d redelivered as attempt %d, want 2", msg.ID, msg.Attempt)
		}
		got.add(msg)
		return nil
	}, config)
	waitFor(t, "every message delivered", func() bool { return countState(t, pool, dest, "delivered") == len(ids) })
	for _, id := range ids {
		if n := got.count(id); n != 2 {
			t.Errorf("message %d handled %d times, want twice", id, n)
		}
	}
}

func TestOrderingKeyDeliversInOrder(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	const perKey = 15
	orderingKeys := []string{"account-1", "account-2", "account-3"}
	var all []outbox.Entry
	for i := range perKey {
		for _, ok := range orderingKeys {
			all = append(all, outbox.Entry{Scope: scope, Key: fmt.Sprintf("%s-%02d", ok, i), Destination: dest, OrderingKey: ok})
		}
		all = append(all, outbox.Entry{Scope: scope, Key: fmt.Sprintf("unordered-%02d", i), Destination: dest})
	}
	enqueue(t, ctx, pool, all...)

	var mu sync.Mutex
	inFlight := map[string]int{}
	delivered := map[string][]string{}
	failedOnce := map[string]bool{}
	handler := func(ctx context.Context, msg outbox.Message) error {
		if msg.OrderingKey == "" {
			return nil
		}
		mu.Lock()
		inFlight[msg.OrderingKey]++
		if inFlight[msg.OrderingKey] > 1 {
			t.Errorf("two messages of %s in flight at once", msg.OrderingKey)
		}
		mu.Unlock()
		time.Sleep(time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		inFlight[msg.OrderingKey]--
		// Every fourth message fails once: its retry must still come
		// before the messages after it.
		if n := len(delivered[msg.OrderingKey]); n%4 == 1 && !failedOnce[msg.Key] {
			failedOnce[msg.Key] = true
			return errors.New("transient")
		}
		delivered[msg.OrderingKey] = append(delivered[msg.OrderingKey], msg.Key)
		return nil
	}
	config := outbox.Config{
		Destinations: []string{dest}, BatchSize: 5, PollInterval: 10 * time.Millisecond,
		RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 20 * time.Millisecond,
	}
	for range 3 {
		startRelay(t, ctx, pool, handler, config)
	}
	waitFor(t, "every message delivered", func() bool { return countState(t, pool, dest, "delivered") == len(all) })

	mu.Lock()
	defer mu.Unlock()
	for _, ok := range orderingKeys {
		var want []string
		for i := range perKey {
			want = append(want, fmt.Sprintf("%s-%02d", ok, i))
		}
		if !slices.Equal(delivered[ok], want) {
			t.Errorf("%s delivered in order %v, want %v", ok, delivered[ok], want)
		}
	}
	if len(failedOnce) == 0 {
		t.Fatal("no delivery failed: the test did not exercise retries")
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
