package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// Run and WithTx begin a transaction of their own. On a connection that is
// already in one, BEGIN is only a warning, and their COMMIT or ROLLBACK
// would end the caller's transaction part-way: they refuse such a
// connection before sending anything.

// acquire returns a connection of pool's for the test alone, released when
// the test ends.
func acquire(t *testing.T, ctx context.Context, pool *pgxpool.Pool) *pgxpool.Conn {
	t.Helper()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	return conn
}

// stillOpen checks that the caller's transaction tx is still open and runs
// statements, and that committed payments in scope are still as many as
// before: none of tx's writes was committed behind its back.
func stillOpen(t *testing.T, ctx context.Context, tx pgx.Tx, pool *pgxpool.Pool, scope string, committed int) {
	t.Helper()
	if status := tx.Conn().PgConn().TxStatus(); status != 'T' {
		t.Errorf("the caller's transaction has status %q, want T: it was ended under the caller", status)
	}
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Errorf("the caller's transaction no longer runs statements: %v", err)
	}
	if n := countPayments(t, pool, scope); n != committed {
		t.Errorf("%d payments committed while the caller's transaction is open, want %d", n, committed)
	}
}

// paymentExists reports whether the payment with id was committed.
func paymentExists(t *testing.T, ctx context.Context, pool *pgxpool.Pool, id int64) bool {
	t.Helper()
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM payment WHERE id = $1)`, id).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	return exists
}

// A Run inside a Run's fn, on the same connection and key, used to join the
// outer transaction, run fn a second time and commit both payments; the
// outer call then replayed the inner one's record, without an error.
func TestRunNestedInRunOnItsConnectionSameKey(t *testing.T) {
	ctx, pool, scope := setup(t)
	conn := acquire(t, ctx, pool)
	var calls atomic.Int64
	var inner error
	res, err := idem.Run(ctx, conn, scope, "order", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, "order", 100, &calls)(ctx, tx)
		if err != nil {
			return p, err
		}
		_, inner = idem.Run(ctx, conn, scope, "order", fpA, pay(scope, "order", 100, &calls))
		stillOpen(t, ctx, tx, pool, scope, 0)
		return p, nil
	})
	if err != nil || res.Replayed {
		t.Errorf("outer Run: %+v, %v; want a first execution", res, err)
	}
	if !errors.Is(inner, idem.ErrConnInTransaction) {
		t.Errorf("inner Run: %v, want ErrConnInTransaction", inner)
	}
	if calls.Load() != 1 || countPayments(t, pool, scope) != 1 || countRecords(t, pool, scope) != 1 {
		t.Errorf("fn ran %d times, %d payments, %d records; want 1, 1, 1",
			calls.Load(), countPayments(t, pool, scope), countRecords(t, pool, scope))
	}
	if !paymentExists(t, ctx, pool, res.Value.ID) {
		t.Errorf("Run returned payment %d, which was not committed", res.Value.ID)
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'I' {
		t.Errorf("connection left with status %q, want I", status)
	}
}

// A Run on another key inside a Run's fn, on the same connection, used to
// commit the outer transaction part-way: an attempt whose fn then failed
// left its payment committed without a record, and on the retry the inner
// call's replay rolled back the outer payment, whose answer was stored and
// returned all the same.
func TestRunNestedInRunOnItsConnectionOtherKey(t *testing.T) {
	ctx, pool, scope := setup(t)
	conn := acquire(t, ctx, pool)
	var calls atomic.Int64
	declined := errors.New("declined")
	attempt := func(fail bool) (idem.Result[payment], error) {
		t.Helper()
		var inner error
		res, err := idem.Run(ctx, conn, scope, "order", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			p, err := pay(scope, "order", 100, &calls)(ctx, tx)
			if err != nil {
				return p, err
			}
			_, inner = idem.Run(ctx, conn, scope, "fee", fpA, pay(scope, "fee", 1, &calls))
			stillOpen(t, ctx, tx, pool, scope, 0)
			if fail {
				return payment{}, declined
			}
			return p, nil
		})
		if !errors.Is(inner, idem.ErrConnInTransaction) {
			t.Errorf("inner Run: %v, want ErrConnInTransaction", inner)
		}
		return res, err
	}

	// The client's first attempt fails after the inner call.
	if _, err := attempt(true); !errors.Is(err, declined) {
		t.Errorf("failed attempt: %v, want its fn's error", err)
	}
	if n, r := countPayments(t, pool, scope), countRecords(t, pool, scope); n != 0 || r != 0 {
		t.Errorf("after the failed attempt: %d payments, %d records committed; want none", n, r)
	}

	// Its retry succeeds: one payment, the one its answer names.
	res, err := attempt(false)
	if err != nil || res.Replayed {
		t.Errorf("retry: %+v, %v; want a first execution", res, err)
	}
	if n, r := countPayments(t, pool, scope), countRecords(t, pool, scope); n != 1 || r != 1 {
		t.Errorf("after the retry: %d payments, %d records; want 1 and 1", n, r)
	}
	if !paymentExists(t, ctx, pool, res.Value.ID) {
		t.Errorf("the retry returned payment %d, which was not committed", res.Value.ID)
	}
	replay, err := idem.Run(ctx, pool, scope, "order", fpA, pay(scope, "order", 100, &calls))
	if err != nil || !replay.Replayed || replay.Value != res.Value {
		t.Errorf("replay: %+v, %v; want %+v replayed", replay, err, res.Value)
	}
	if calls.Load() != 2 {
		t.Errorf("fn ran %d times, want 2: once per attempt, never for the inner key", calls.Load())
	}
}

// A Run inside WithTx's fn on the same *pgxpool.Conn used to commit
// WithTx's transaction: WithTx returned fn's error, yet its writes before
// and after the Run were committed.
func TestRunInsideWithTxOnItsConnection(t *testing.T) {
	ctx, pool, scope := setup(t)
	conn := acquire(t, ctx, pool)
	var calls atomic.Int64
	declined := errors.New("declined")
	var inner error
	insert := `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`
	err := idem.WithTx(ctx, conn, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, insert, scope, "before"); err != nil {
			return err
		}
		_, inner = idem.Run(ctx, conn, scope, "order", fpA, pay(scope, "order", 100, &calls))
		stillOpen(t, ctx, tx, pool, scope, 0)
		if _, err := tx.Exec(ctx, insert, scope, "after"); err != nil {
			return err
		}
		return declined
	})
	if !errors.Is(err, declined) {
		t.Errorf("WithTx: %v, want fn's error", err)
	}
	if !errors.Is(inner, idem.ErrConnInTransaction) {
		t.Errorf("inner Run: %v, want ErrConnInTransaction", inner)
	}
	if calls.Load() != 0 || countPayments(t, pool, scope) != 0 || countRecords(t, pool, scope) != 0 {
		t.Errorf("fn ran %d times, %d payments, %d records committed; want none",
			calls.Load(), countPayments(t, pool, scope), countRecords(t, pool, scope))
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'I' {
		t.Errorf("connection left with status %q, want I", status)
	}
}

// refusesBusyConn checks that call, given a connection in a caller's
// transaction, open or failed, as a *pgx.Conn and as a *pgxpool.Conn,
// returns ErrConnInTransaction and leaves that transaction as it was: in
// the same state, its write not committed, and still the caller's to
// commit or roll back. call gets a scope of its own for each case.
func refusesBusyConn(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope string,
	call func(db idem.TxBeginner, scope string) error,
) {
	t.Helper()
	for _, kind := range []string{"pgx.Conn", "pgxpool.Conn"} {
		for _, state := range []string{"open", "failed"} {
			t.Run(kind+"/"+state, func(t *testing.T) {
				scope := scope + "/" + kind + "/" + state
				conn, db, tx, want := testdb.CallersTx(t, ctx, pool, kind, state, scope)

				err := call(db, scope)
				if !errors.Is(err, idem.ErrConnInTransaction) {
					t.Errorf("%v, want ErrConnInTransaction", err)
				} else if !strings.Contains(err.Error(), "pass the pool") {
					t.Errorf("%q does not say what to do instead", err)
				}
				if status := conn.Conn().PgConn().TxStatus(); status != want {
					t.Fatalf("the caller's transaction has status %q, want %q", status, want)
				}
				if n, r := countPayments(t, pool, scope), countRecords(t, pool, scope); n != 0 || r != 0 {
					t.Errorf("%d payments, %d records committed under the caller's open transaction; want none", n, r)
				}
				if state == "failed" {
					if err := tx.Rollback(ctx); err != nil {
						t.Fatalf("the caller's rollback: %v", err)
					}
					if n := countPayments(t, pool, scope); n != 0 {
						t.Errorf("%d payments after the caller's rollback, want none", n)
					}
					return
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatalf("the caller's commit: %v", err)
				}
				if n, r := countPayments(t, pool, scope), countRecords(t, pool, scope); n != 1 || r != 0 {
					t.Errorf("after the caller's commit: %d payments, %d records; want its own 1 and none", n, r)
				}
			})
		}
	}
}

func TestRunRefusesAConnectionInATransaction(t *testing.T) {
	ctx, pool, scope := setup(t)
	observer, rec, _ := setupObserver(t, false)
	var calls atomic.Int64
	refusesBusyConn(t, ctx, pool, scope, func(db idem.TxBeginner, scope string) error {
		_, err := idem.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 1, &calls), idem.WithObserver(observer))
		return err
	})
	if calls.Load() != 0 {
		t.Errorf("fn ran %d times, want never", calls.Load())
	}
	if got := rec.Count("idem.calls"); got["invalid"] != 4 || len(got) != 1 {
		t.Errorf("outcomes %v, want 4 invalid", got)
	}
}

func TestWithTxRefusesAConnectionInATransaction(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	refusesBusyConn(t, ctx, pool, scope, func(db idem.TxBeginner, scope string) error {
		return idem.WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := pay(scope, "k", 1, &calls)(ctx, tx)
			return err
		})
	})
	if calls.Load() != 0 {
		t.Errorf("fn ran %d times, want never", calls.Load())
	}
}
