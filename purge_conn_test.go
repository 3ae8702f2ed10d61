package idem_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// expiredRecord commits an expired record in a scope of its own, for the
// tests to check that a refused purge deleted nothing, and returns a
// function that checks it is still there.
func expiredRecord(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope string) (stillThere func()) {
	t.Helper()
	scope += "/expired"
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls)); err != nil {
		t.Fatal(err)
	}
	expire(t, pool, scope, "k")
	return func() {
		t.Helper()
		if n := countRecords(t, pool, scope); n != 1 {
			t.Errorf("the expired record was deleted: %d left, want 1", n)
		}
	}
}

// Purge on a connection in a caller's transaction used to delete expired
// records in it and commit it.
func TestPurgeRefusesAConnectionInATransaction(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	stillThere := expiredRecord(t, ctx, pool, scope)
	refusesBusyConn(t, ctx, pool, scope, func(db idem.TxBeginner, _ string) error {
		_, err := idem.Purge(ctx, db, idem.DefaultPurgeBatch)
		return err
	})
	stillThere()
}

// StartPurger on a connection in a caller's transaction used to start a
// purger that deleted expired records in it and committed it.
func TestStartPurgerRefusesAConnectionInATransaction(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	stillThere := expiredRecord(t, ctx, pool, scope)
	refusesBusyConn(t, ctx, pool, scope, func(db idem.TxBeginner, _ string) error {
		p, err := idem.StartPurger(ctx, db, idem.PurgerConfig{Interval: time.Hour})
		if err == nil {
			// Let its first pass run: what it does is what is checked.
			deadline := time.Now().Add(time.Second)
			for p.Deleted() == 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			p.Stop()
		}
		return err
	})
	stillThere()
}
