//go:build pgbouncer

// The tests in this file need a PgBouncer: run them with
//
//	TEST_PGBOUNCER_URL=postgres://postgres@127.0.0.1:6432/postgres?sslmode=disable \
//		go test -tags pgbouncer -run PgBouncer ./outbox/
//
// where PgBouncer (pool_mode = transaction) listens in front of the server
// of TEST_DATABASE_URL, with a wildcard database entry (* = host=... port=...)
// so that it reaches the tests' throwaway database.

package outbox_test

import (
	"context"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/outbox"
)

// Behind a real PgBouncer in transaction mode (TEST_PGBOUNCER_URL, with
// PgBouncer in front of the test server, and the pgbouncer build tag), a
// relay that listens through it
// hears nothing and says so; given a direct connection to listen on, it is
// woken by Notify sent through PgBouncer.
func TestRelayBehindPgBouncer(t *testing.T) {
	ctx, _, scope, dest := setup(t)
	bouncer := os.Getenv("TEST_PGBOUNCER_URL")
	if bouncer == "" {
		t.Fatal("the pgbouncer build tag needs TEST_PGBOUNCER_URL: a PgBouncer in transaction mode in front of the test server")
	}
	// The test database, through PgBouncer.
	direct, err := url.Parse(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	via, err := url.Parse(bouncer)
	if err != nil {
		t.Fatal(err)
	}
	via.Path = direct.Path
	config, err := pgxpool.ParseConfig(via.String())
	if err != nil {
		t.Fatal(err)
	}
	// PgBouncer before 1.21 keeps no prepared statement across
	// transactions: pgx's statement cache does not work through it.
	config.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	pool, err := pgxpool.NewWithConfig(ctx, config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	t.Run("listening through PgBouncer", func(t *testing.T) {
		observer, relays := notifying(t)
		logger, logs := capturingLogger(t)
		delivered := make(chan string, 1)
		runRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
			delivered <- msg.Key
			return nil
		}, outbox.Config{Destinations: []string{dest}, PollInterval: 20 * time.Millisecond, Observer: observer, Logger: logger},
			time.Minute, time.Second, time.Minute)
		waitFor(t, "the relay to say it hears no notifications", func() bool { return logs.count(notHearing) > 0 })
		if listening, polling := relays(); listening != 0 || polling != 1 {
			t.Errorf("idem.outbox.relays: %d listening, %d polling; want 1 polling", listening, polling)
		}
		enqueueAndAwait(t, ctx, pool, delivered, entries(scope, dest, 2), 20*time.Second, "the relay does not poll")
	})
	t.Run("listening directly", func(t *testing.T) {
		listen, err := pgx.ParseConfig(env.URL(t))
		if err != nil {
			t.Fatal(err)
		}
		observer, relays := notifying(t)
		logger, logs := capturingLogger(t)
		delivered := make(chan string, 1)
		runRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
			delivered <- msg.Key
			return nil
		}, outbox.Config{Destinations: []string{dest}, PollInterval: time.Hour, ListenConnConfig: listen, Observer: observer, Logger: logger})
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
