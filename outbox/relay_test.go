package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

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

// A relay given one connection must use it one statement at a time: it
// used to record outcomes from several goroutines at once on it ("conn
// busy", a data race), record none, and break the connection for good.
func TestRelayOnOneConnection(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"pgx.Conn", "pgxpool.Conn"} {
		t.Run(kind, func(t *testing.T) {
			ctx, pool, scope, dest := setup(t)
			var db idem.TxBeginner
			var ping func() error
			switch kind {
			case "pgx.Conn":
				conn, err := pgx.Connect(ctx, env.URL(t))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { conn.Close(context.Background()) })
				db, ping = conn, func() error { return conn.Ping(ctx) }
			case "pgxpool.Conn":
				conn, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(conn.Release)
				db, ping = conn, func() error { return conn.Ping(ctx) }
			}
			const messages = 40
			all := entries(scope, dest, messages)
			all = append(all, outbox.Entry{Scope: scope, Key: "in-flight-at-stop", Destination: dest})
			got := newCalls()
			inFlight := make(chan struct{})
			logger, logs := capturingLogger(t)
			stop := startRelay(t, ctx, db, func(ctx context.Context, msg outbox.Message) error {
				got.add(msg)
				if msg.Key == "in-flight-at-stop" {
					close(inFlight)
					<-ctx.Done()
					return ctx.Err()
				}
				return nil
			}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond, Logger: logger})
			enqueue(t, ctx, pool, all[:messages]...)
			waitWithin(t, 30*time.Second, "every message recorded as delivered", func() bool {
				return countState(t, pool, dest, "delivered") == messages
			})
			enqueue(t, ctx, pool, all[messages])
			<-inFlight
			stop()

			for _, r := range rows(t, pool, dest) {
				if n := got.count(r.ID); n != 1 {
					t.Errorf("message %d handled %d times, want once", r.ID, n)
				}
				if r.ID == rows(t, pool, dest)[messages].ID {
					// Interrupted by the stop: released, not counted.
					if r.State != "pending" || r.Attempts != 0 || r.Leased {
						t.Errorf("message in flight at stop: %+v, want released", r)
					}
				}
			}
			if n := logs.count("level=ERROR"); n != 0 {
				t.Errorf("the relay logged %d errors", n)
			}
			if err := ping(); err != nil {
				t.Errorf("the relay's connection after Run: %v", err)
			}
		})
	}
}

// A relay on a connection in a caller's transaction used to run its
// statements in that transaction: it leased messages and handed them to
// the handler with leases no other relay could see, and recorded outcomes
// that the caller's commit or rollback would keep or undo, whenever it
// came. In a failed transaction every statement failed, and Run logged it
// at every poll. Run now refuses the connection before sending anything.
func TestRelayRefusesAConnectionInATransaction(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"pgx.Conn", "pgxpool.Conn"} {
		for _, state := range []string{"open", "failed"} {
			t.Run(kind+"/"+state, func(t *testing.T) {
				ctx, pool, scope, dest := setup(t)
				enqueue(t, ctx, pool, entries(scope, dest, 1)...)
				conn, db, tx, want := testdb.CallersTx(t, ctx, pool, kind, state, scope)

				var handled atomic.Int64
				relay, err := outbox.NewRelay(db, func(context.Context, outbox.Message) error {
					handled.Add(1)
					return nil
				}, &outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond, Logger: testLogger(t)})
				if err != nil {
					t.Fatal(err)
				}
				runCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				err = relay.Run(runCtx)
				if !errors.Is(err, idem.ErrConnInTransaction) {
					t.Errorf("Run: %v, want ErrConnInTransaction", err)
				} else if !strings.Contains(err.Error(), "pass the pool") {
					t.Errorf("Run: %q does not say what to do instead", err)
				}
				if n := handled.Load(); n != 0 {
					t.Errorf("the handler ran %d times, want never", n)
				}
				if status := conn.Conn().PgConn().TxStatus(); status != want {
					t.Fatalf("the caller's transaction has status %q, want %q", status, want)
				}
				if rs := rows(t, pool, dest); len(rs) != 1 || rs[0].State != "pending" || rs[0].Attempts != 0 || rs[0].Leased {
					t.Errorf("message %+v, want pending and untouched", rs)
				}
				if n := countPayments(t, pool, scope); n != 0 {
					t.Errorf("%d payments committed under the caller's open transaction, want none", n)
				}
				if state == "failed" {
					if err := tx.Rollback(ctx); err != nil {
						t.Fatalf("the caller's rollback: %v", err)
					}
					return
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatalf("the caller's commit: %v", err)
				}
				if n := countPayments(t, pool, scope); n != 1 {
					t.Errorf("%d payments after the caller's commit, want its own 1", n)
				}
			})
		}
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
