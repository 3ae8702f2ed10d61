package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// notifying returns an Observer recording into a new meter provider, and a
// function that reads the idem.outbox.relays count of relays listening and
// polling.
func notifying(t *testing.T) (*idem.Observer, func() (listening, polling int64)) {
	t.Helper()
	mp := newMeterProvider()
	observer, err := idem.NewObserver(idem.ObserverConfig{MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	return observer, func() (int64, int64) {
		return mp.meter.sum("idem.outbox.relays", attribute.String("idem.outbox.notifications", "listening")),
			mp.meter.sum("idem.outbox.relays", attribute.String("idem.outbox.notifications", "polling"))
	}
}

// The warning a relay logs, once, when it hears no notifications.
const notHearing = "the relay does not hear notifications"

// A relay given a connection to listen on hears Notify whatever its db is:
// here a single connection, which on its own only polls.
func TestRelayListensOnListenConnConfig(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	conn, err := pgx.Connect(ctx, env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	observer, relays := notifying(t)
	delivered := make(chan string, 1)
	startRelay(t, ctx, conn, func(ctx context.Context, msg outbox.Message) error {
		delivered <- msg.Key
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: time.Hour, ListenConnConfig: directListen(t), Observer: observer})
	enqueueAndAwait(t, ctx, pool, delivered, entries(scope, dest, 3), 20*time.Second,
		"with an hour between polls, only a notification delivers it")
	// The relay counts itself as listening once it has heard its own probe,
	// which may come after the message it woke for.
	waitFor(t, "the relay counted as listening", func() bool {
		listening, polling := relays()
		return listening == 1 && polling == 0
	})
}

// A relay whose listening connection never hears a notification (here it
// listens in another database, as a relay behind PgBouncer in transaction
// mode listens on a server connection that is lent to others) says so once
// in its log and in its metrics, however often it tries again, and polls.
func TestRelaySaysOnceWhenItHearsNoNotifications(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	elsewhere := env.EmptyDatabase(t)
	listen, err := pgx.ParseConfig(elsewhere)
	if err != nil {
		t.Fatal(err)
	}
	observer, relays := notifying(t)
	logger, logs := capturingLogger(t)
	delivered := make(chan string, 1)
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		delivered <- msg.Key
		return nil
	}, outbox.Config{
		Destinations: []string{dest}, PollInterval: 20 * time.Millisecond,
		ListenConnConfig: listen, Observer: observer, Logger: logger,
	}, time.Minute, 100*time.Millisecond, 20*time.Millisecond)

	// Each probe connects to the other database, listens and gives up:
	// wait for several.
	dbName := listen.Database
	waitFor(t, "several probes", func() bool {
		var n int64
		err := pool.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = $1`, dbName).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n >= 10
	})
	if n := logs.count(notHearing); n != 1 {
		t.Errorf("the relay said %d times that it hears no notifications, want once", n)
	}
	if listening, polling := relays(); listening != 0 || polling != 1 {
		t.Errorf("idem.outbox.relays: %d listening, %d polling; want 1 polling", listening, polling)
	}
	enqueueAndAwait(t, ctx, pool, delivered, entries(scope, dest, 2), 20*time.Second, "the relay does not poll")
}

// A relay with no connection to listen on says so once, and counts as
// polling.
func TestRelayWithoutListeningConnectionSaysSo(t *testing.T) {
	ctx, pool, _, dest := setup(t)
	observer, relays := notifying(t)
	logger, logs := capturingLogger(t)
	stop := startRelay(t, ctx, &crashable{pool: pool}, func(context.Context, outbox.Message) error { return nil },
		outbox.Config{Destinations: []string{dest}, PollInterval: 5 * time.Millisecond, Observer: observer, Logger: logger})
	waitFor(t, "the relay to say it only polls", func() bool { return logs.count("it only polls") > 0 })
	time.Sleep(50 * time.Millisecond) // several polls
	if n := logs.count("it only polls"); n != 1 {
		t.Errorf("said %d times that it only polls, want once", n)
	}
	if listening, polling := relays(); listening != 0 || polling != 1 {
		t.Errorf("idem.outbox.relays: %d listening, %d polling; want 1 polling", listening, polling)
	}
	stop()
	if listening, polling := relays(); listening != 0 || polling != 0 {
		t.Errorf("idem.outbox.relays after Run: %d listening, %d polling; want none", listening, polling)
	}
}

func TestNotifyWakesListeningRelays(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	delivered := make(chan string, 1)
	// As in production (docs/pgbouncer.md): the relay's
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
