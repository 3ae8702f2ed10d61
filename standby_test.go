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

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestRunOnAStandbyIsErrReadOnly points Run, Do and Once at a real
// standby, as a connection string without target_session_attrs=read-write
// does after a failover: each returns ErrReadOnly, saying that the server
// is a standby, before fn runs, and a transaction of the caller's stays
// usable. A key already recorded on the primary is still replayed from
// the standby by a lookup (WithLookupFirst), which writes nothing. A pool
// that asks for target_session_attrs=read-write never uses the standby.
func TestRunOnAStandbyIsErrReadOnly(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pair := testdb.StartPair(t, ctx)
	primary, standby := pair.PrimaryPool, pair.StandbyPool
	scope := testdb.Name("standby")
	var calls atomic.Int64

	// A key recorded on the primary, once the standby has it.
	recorded, err := idem.Run(ctx, primary, scope, "recorded", fpA, pay(scope, "recorded", 100, &calls))
	if err != nil {
		t.Fatal(err)
	}
	pair.WaitForReplay(t, ctx)

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
