package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// calls counts a handler's calls per message.
type calls struct {
	mu    sync.Mutex
	byID  map[int64]int
	times map[int64][]time.Time
}

func newCalls() *calls {
	return &calls{byID: map[int64]int{}, times: map[int64][]time.Time{}}
}

func (c *calls) add(msg outbox.Message) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.byID[msg.ID]++
	c.times[msg.ID] = append(c.times[msg.ID], time.Now())
	return c.byID[msg.ID]
}

func (c *calls) count(id int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byID[id]
}

func TestRelaysDeliverEveryMessageOnce(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	const messages = 200
	all := entries(scope, dest, messages)
	ids := enqueue(t, ctx, pool, all[:messages/2]...)

	got := newCalls()
	handler := func(ctx context.Context, msg outbox.Message) error {
		if want := outbox.IdempotencyKey(msg.Scope, msg.Key, msg.Destination); msg.IdempotencyKey != want ||
			string(msg.Payload) != "payload of "+msg.Key || msg.Attempt != 1 {
			t.Errorf("message %+v: unexpected content", msg)
		}
		got.add(msg)
		return nil
	}
	// Several relays at once on one pool, each listening; and one that only
	// polls, on a TxBeginner that is not a pool.
	config := outbox.Config{Destinations: []string{dest}, BatchSize: 7, PollInterval: 50 * time.Millisecond}
	for range 3 {
		startRelay(t, ctx, pool, handler, config)
	}
	startRelay(t, ctx, &crashable{pool: pool}, handler, config)

	// The second half arrives while the relays run, announced by Notify.
	for _, e := range all[messages/2:] {
		var id int64
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			if id, err = outbox.Enqueue(ctx, tx, e); err != nil {
				return err
			}
			return outbox.Notify(ctx, tx)
		})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}

	waitFor(t, "every message delivered", func() bool { return countState(t, pool, dest, "delivered") == messages })
	for _, id := range ids {
		if n := got.count(id); n != 1 {
			t.Errorf("message %d handled %d times, want once", id, n)
		}
	}
	if len(got.byID) != messages {
		t.Fatalf("%d messages handled, want %d", len(got.byID), messages)
	}
}

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

func TestRelayPurgesDeliveredAfterRetention(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 5)...)
	handler := func(context.Context, outbox.Message) error { return nil }
	config := outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond, DeliveredRetention: time.Hour}
	stop := startRelay(t, ctx, pool, handler, config)
	waitFor(t, "every message delivered", func() bool { return countState(t, pool, dest, "delivered") == len(ids) })
	stop()

	// Three were delivered two hours ago, two just now.
	if _, err := pool.Exec(ctx, `UPDATE outbox_message SET delivered_at = now() - interval '2 hours' WHERE id = ANY($1)`, ids[:3]); err != nil {
		t.Fatal(err)
	}
	startRelay(t, ctx, pool, handler, config) // a relay purges as it starts
	waitFor(t, "old deliveries purged", func() bool { return countState(t, pool, dest, "delivered") < len(ids) })
	var left []int64
	for _, r := range rows(t, pool, dest) {
		left = append(left, r.ID)
	}
	if !slices.Equal(left, ids[3:]) {
		t.Fatalf("messages %v left, want the recent %v", left, ids[3:])
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

func TestNotifyWakesListeningRelays(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	delivered := make(chan string, 1)
	// As in production (the README's "Behind PgBouncer"): the relay's
	// statements and Notify's transactions go through the pool, which
	// behind a transaction pooler reaches PostgreSQL through it, while the
	// relay listens on a direct connection, since LISTEN needs a session of
	// its own. A relay that would not poll again for an hour: only a
	// notification can make it deliver within the test.
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		delivered <- msg.Key
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: time.Hour, ListenConnConfig: directListen(t)})
	enqueueAndAwait(t, ctx, pool, delivered, entries(scope, dest, 3), time.Minute, "the notification did not wake the relay")
}

func TestRelayStopsCleanlyOnCancel(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 2)...)
	slow, quick := ids[0], ids[1]

	var inFlight sync.WaitGroup
	inFlight.Add(2)
	var quickDone atomic.Bool
	stop := startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		inFlight.Done()
		if msg.ID == quick {
			quickDone.Store(true)
			return nil
		}
		<-ctx.Done() // a call cut short by the shutdown
		return ctx.Err()
	}, outbox.Config{Destinations: []string{dest}, BatchSize: 2})
	inFlight.Wait()
	waitFor(t, "the quick message handled", quickDone.Load)
	stop() // returns once Run has returned

	byID := map[int64]row{}
	for _, r := range rows(t, pool, dest) {
		byID[r.ID] = r
	}
	if r := byID[quick]; r.State != "delivered" {
		t.Errorf("quick message %+v: want its success recorded on the way out", r)
	}
	if r := byID[slow]; r.State != "pending" || r.Leased || r.Attempts != 0 {
		t.Errorf("interrupted message %+v: want pending, released at once, the attempt not counted", r)
	}

	// The next relay takes it at once, as a first attempt.
	var attempt atomic.Int64
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		attempt.Store(int64(msg.Attempt))
		return nil
	}, outbox.Config{Destinations: []string{dest}})
	waitFor(t, "the interrupted message delivered", func() bool { return countState(t, pool, dest, "delivered") == 2 })
	if attempt.Load() != 1 {
		t.Fatalf("redelivered as attempt %d, want 1", attempt.Load())
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

func TestRelayRunsOnceAtATime(t *testing.T) {
	ctx, pool, _, dest := setup(t)
	relay, err := outbox.NewRelay(pool, func(context.Context, outbox.Message) error { return nil },
		&outbox.Config{Destinations: []string{dest}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	results := make(chan error, 2)
	for range 2 {
		go func() { results <- relay.Run(runCtx) }()
	}
	// The running call returns only once cancelled: the first result is
	// the other call's refusal.
	if err := <-results; err == nil {
		t.Fatal("a second concurrent Run did not refuse")
	}
	cancel()
	if err := <-results; err != nil {
		t.Fatalf("Run: %v", err)
	}
	// After it stopped, it may run again.
	again, stopAgain := context.WithCancel(ctx)
	go func() { time.Sleep(50 * time.Millisecond); stopAgain() }()
	if err := relay.Run(again); err != nil {
		t.Fatalf("Run after a stop: %v", err)
	}
}

func TestRequeueDeliversAParkedMessage(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "k", Destination: dest})
	var fixed atomic.Bool
	var delivered atomic.Int64
	handler := func(ctx context.Context, msg outbox.Message) error {
		if !fixed.Load() {
			return outbox.Park(errors.New("400 unknown account"))
		}
		delivered.Add(1)
		return nil
	}
	startRelay(t, ctx, pool, handler, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})
	waitFor(t, "the message parked", func() bool { return countState(t, pool, dest, "parked") == 1 })

	requeue := func() bool {
		var requeued bool
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			requeued, err = outbox.Requeue(ctx, tx, ids[0])
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return requeued
	}
	fixed.Store(true)
	if !requeue() {
		t.Fatal("Requeue of a parked message reported false")
	}
	waitFor(t, "the requeued message delivered", func() bool { return countState(t, pool, dest, "delivered") == 1 })
	if delivered.Load() != 1 {
		t.Fatalf("delivered %d times, want once", delivered.Load())
	}
	if requeue() {
		t.Fatal("Requeue of a delivered message reported true")
	}
}
