package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemtest/pgtemp"
	"github.com/pgidem/idem/internal/testdb"
)

// A standby is a server of its own, whatever TEST_DATABASE_URL names:
// these tests start a throwaway primary and a streaming standby of it.

// TestRunOnAStandbyIsErrReadOnly points Run, Do and Once at a real
// standby, as a connection string without target_session_attrs=read-write
// does after a failover: each returns ErrReadOnly, saying that the server
// is a standby, before fn runs, and a transaction of the caller's stays
// usable. A key already recorded on the primary is still replayed from
// the standby by a lookup (WithLookupFirst), which writes nothing. A pool
// that asks for target_session_attrs=read-write never uses the standby.
func TestRunOnAStandbyIsErrReadOnly(t *testing.T) {
	ctx, primary, standby := startStandby(t)
	scope := testdb.Name("standby")
	var calls atomic.Int64

	// A key recorded on the primary, once the standby has it.
	recorded, err := idem.Run(ctx, primary, scope, "recorded", fpA, pay(scope, "recorded", 100, &calls))
	if err != nil {
		t.Fatal(err)
	}
	waitForReplay(t, ctx, primary, standby)

	_, err = idem.Run(ctx, standby, scope, "new", fpA, pay(scope, "new", 100, &calls))
	if !errors.Is(err, idem.ErrReadOnly) || !strings.Contains(err.Error(), "standby") {
		t.Errorf("Run on the standby got %v, want ErrReadOnly saying the server may be a standby", err)
	}
	err = pgx.BeginFunc(ctx, standby, func(tx pgx.Tx) error {
		if _, err := idem.Do(ctx, tx, scope, "new", fpA, pay(scope, "new", 100, &calls)); !errors.Is(err, idem.ErrReadOnly) {
			t.Errorf("Do on the standby got %v, want ErrReadOnly", err)
		}
		ran, err := idem.Once(ctx, tx, scope, "message", func(context.Context, pgx.Tx) error { calls.Add(1); return nil })
		if ran || !errors.Is(err, idem.ErrReadOnly) {
			t.Errorf("Once on the standby got %v, %v; want false, ErrReadOnly", ran, err)
		}
		// The refusals left the transaction usable.
		var one int
		return tx.QueryRow(ctx, `SELECT 1`).Scan(&one)
	})
	if err != nil {
		t.Errorf("the caller's transaction on the standby after the refusals: %v", err)
	}
	replay, err := idem.Run(ctx, standby, scope, "recorded", fpA, pay(scope, "recorded", 100, &calls), idem.WithLookupFirst())
	if err != nil || !replay.Replayed || replay.Value != recorded.Value {
		t.Errorf("a recorded key looked up on the standby: %+v, %v; want the replay of %+v", replay, err, recorded.Value)
	}
	// Without the lookup, the claim comes first: the standby refuses it.
	if _, err := idem.Run(ctx, standby, scope, "recorded", fpA, pay(scope, "recorded", 100, &calls)); !errors.Is(err, idem.ErrReadOnly) {
		t.Errorf("a recorded key claimed on the standby: %v, want ErrReadOnly", err)
	}

	// What the failover docs recommend: a pool that asks for
	// target_session_attrs=read-write refuses the standby, so a call gets
	// a connection error (idemhttp answers 503), never a connection that
	// landed on the standby.
	readWrite, err := pgxpool.New(ctx, standby.Config().ConnString()+"&target_session_attrs=read-write")
	if err != nil {
		t.Fatal(err)
	}
	defer readWrite.Close()
	_, err = idem.Run(ctx, readWrite, scope, "new", fpA, pay(scope, "new", 100, &calls))
	var connectErr *pgconn.ConnectError
	if !errors.As(err, &connectErr) || errors.Is(err, idem.ErrReadOnly) {
		t.Errorf("Run through a read-write pool on the standby got %v, want a connect error", err)
	}
	if calls.Load() != 1 {
		t.Errorf("fn ran %d times on the standby", calls.Load()-1)
	}
}

// startStandby starts a throwaway primary with idem's tables and the
// tests' payment table, and a streaming standby of it, both stopped when
// the test ends, and returns a pool on each. It marks the test parallel.
func startStandby(t *testing.T) (context.Context, *pgxpool.Pool, *pgxpool.Pool) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: database tests are skipped")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	start := func(cfg pgtemp.Config) (*pgtemp.Server, *pgxpool.Pool) {
		srv, err := pgtemp.Start(ctx, cfg)
		if err != nil {
			t.Fatalf("these tests need a throwaway primary and standby, started from a local PostgreSQL installation: %v", err)
		}
		t.Cleanup(func() {
			if err := srv.Stop(); err != nil {
				t.Errorf("stop the throwaway server: %v", err)
			}
		})
		pool, err := pgxpool.New(ctx, srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return srv, pool
	}
	srv, primary := start(pgtemp.Config{Fast: true, MaxConnections: 50})
	sqlDB := stdlib.OpenDBFromPool(primary)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		t.Fatal(err)
	}
	if _, err := primary.Exec(ctx, testdb.AppSchema); err != nil {
		t.Fatal(err)
	}
	_, standby := start(pgtemp.Config{Fast: true, MaxConnections: 50, StandbyOf: srv})
	var inRecovery bool
	if err := standby.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery); err != nil || !inRecovery {
		t.Fatalf("the standby is not in recovery: %v, %v", inRecovery, err)
	}
	return ctx, primary, standby
}

// waitForReplay waits until the standby has replayed everything the
// primary has written so far, committed asynchronously too (the servers
// are Fast): up to the WAL's insert position, not its write position.
func waitForReplay(t *testing.T, ctx context.Context, primary, standby *pgxpool.Pool) {
	t.Helper()
	var lsn string
	if err := primary.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	for {
		var caughtUp bool
		err := standby.QueryRow(ctx, `SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn`, lsn).Scan(&caughtUp)
		if err == nil && caughtUp {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the standby did not replay up to %s: %v", lsn, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
