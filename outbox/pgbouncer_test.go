//go:build pgbouncer

// The tests in this file need a PgBouncer in transaction mode in front of
// the test server: .ci/pgbouncer runs them, with
//
//	TEST_PGBOUNCER=1 TEST_PGBOUNCER_MODES=... TEST_DIRECT_DATABASE_URL=... \
//		TEST_DATABASE_URL=<through PgBouncer> go test -tags pgbouncer ./outbox/
//
// (see internal/testdb). Without PgBouncer they fail rather than skip; a
// run without the pgbouncer build tag leaves them out.

package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

// Behind a real PgBouncer in transaction mode, a relay that listens
// through it hears nothing and says so, once in its log and in its
// metrics, and polls; given a direct connection to listen on
// (Config.ListenConnConfig), it is woken by Notify sent through PgBouncer.
func TestRelayBehindPgBouncer(t *testing.T) {
	if !testdb.BehindPooler() {
		t.Fatal("the pgbouncer build tag needs TEST_PGBOUNCER=1, TEST_DATABASE_URL through a PgBouncer in transaction mode " +
			"and TEST_DIRECT_DATABASE_URL: run bash .ci/pgbouncer")
	}
	ctx, pool, scope, dest := setup(t) // pool goes through PgBouncer

	t.Run("listening through PgBouncer", func(t *testing.T) {
		// In a database of its own, dropped at the end: the LISTEN that the
		// relay sends through PgBouncer stays on one of PgBouncer's server
		// connections after the relay's own connection closed, and the
		// notifications of the other tests must not reach it (see
		// listenDirectly).
		pooled := migratedDatabase(t, ctx)
		observer, relays := notifying(t)
		logger, logs := capturingLogger(t)
		delivered := make(chan string, 1)
		startRelay(t, ctx, pooled, func(ctx context.Context, msg outbox.Message) error {
			delivered <- msg.Key
			return nil
		}, outbox.Config{
			Destinations: []string{dest}, PollInterval: 20 * time.Millisecond, Observer: observer, Logger: logger,
			ListenConnConfig: pooled.Config().ConnConfig, // what a relay on a pool listens on by default
		}, time.Minute, time.Second, time.Minute)
		waitFor(t, "the relay to say it hears no notifications", func() bool { return logs.count(notHearing) > 0 })
		if n := logs.count(notHearing); n != 1 {
			t.Errorf("the relay said %d times that it hears no notifications, want once", n)
		}
		if listening, polling := relays(); listening != 0 || polling != 1 {
			t.Errorf("idem.outbox.relays: %d listening, %d polling; want 1 polling", listening, polling)
		}
		enqueueAndAwait(t, ctx, pooled, delivered, entries(scope, dest, 2), 20*time.Second, "the relay does not poll")
	})
	t.Run("listening directly", func(t *testing.T) {
		observer, relays := notifying(t)
		logger, logs := capturingLogger(t)
		delivered := make(chan string, 1)
		startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
			delivered <- msg.Key
			return nil
		}, outbox.Config{
			Destinations: []string{dest}, PollInterval: time.Hour,
			ListenConnConfig: directListen(t), Observer: observer, Logger: logger,
		})
		all := entries(scope, dest, 5)[2:]
		enqueueAndAwait(t, ctx, pool, delivered, all, 20*time.Second, "with an hour between polls, only a notification delivers it")
		if n := logs.count(notHearing); n != 0 {
			t.Errorf("the relay said %d times that it hears no notifications", n)
		}
		if listening, polling := relays(); listening != 1 || polling != 0 {
			t.Errorf("idem.outbox.relays: %d listening, %d polling; want 1 listening", listening, polling)
		}
	})
}
