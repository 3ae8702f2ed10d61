package idem_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// holdBatch begins a transaction on its own connection that claims n fresh
// keys of scope with Once, one per message as a consumer applies a batch,
// and leaves it open: keys past the first idem.MaxKeyLocks are held by
// records in progress, not by locks. end rolls it back (or commits it),
// once; it is also registered as the test's cleanup.
func holdBatch(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope string, n int) (open func() bool, end func(commit bool)) {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		ran, err := idem.Once(ctx, tx, scope, fmt.Sprintf("m-%d", i), func(context.Context, pgx.Tx) error { return nil })
		if err != nil || !ran {
			_ = tx.Rollback(ctx)
			t.Fatalf("holder, message %d: ran %v, %v", i, ran, err)
		}
	}
	var ended atomic.Bool
	end = func(commit bool) {
		if ended.Swap(true) {
			return
		}
		var err error
		if commit {
			err = tx.Commit(context.WithoutCancel(ctx))
		} else {
			err = tx.Rollback(context.WithoutCancel(ctx))
		}
		if err != nil {
			t.Errorf("end the holder: %v", err)
		}
	}
	t.Cleanup(func() { end(false) })
	return func() bool { return !ended.Load() }, end
}

// TestOnceDuplicateWaitsWithinItsBudget redelivers a message while another
// consumer's batch holds it in an open transaction, with WithWait(300ms):
// message 0, which the holder keeps on its lock, and the batch's last,
// which it keeps on a record in progress (past idem.MaxKeyLocks). Each
// duplicate must return ErrInProgress while the holder is still open, not
// wait for it to end. The duplicate of the last message does not see the
// holder until it stores its own record: its function runs, as the docs
// say, and its writes roll back with its transaction. If a duplicate is
// still waiting after a minute, the holder is rolled back so that the test
// ends, and it fails.
func TestOnceDuplicateWaitsWithinItsBudget(t *testing.T) {
	ctx, pool, scope := setup(t)
	const batch = idem.MaxKeyLocks + 4
	open, end := holdBatch(t, ctx, pool, scope, batch)
	watchdog := time.AfterFunc(time.Minute, func() { end(false) })
	defer watchdog.Stop()

	for _, tc := range []struct {
		name  string
		id    string
		ranFn bool // whether the duplicate's function runs before it learns of the holder
	}{
		{"within the lock bound", "m-0", false},
		{"beyond the lock bound", fmt.Sprintf("m-%d", batch-1), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var effects atomic.Int64
			err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
				_, err := idem.Once(ctx, tx, scope, tc.id, func(ctx context.Context, tx pgx.Tx) error {
					effects.Add(1)
					_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, scope, tc.id)
					return err
				}, idem.WithWait(300*time.Millisecond))
				return err
			})
			if !open() {
				t.Fatalf("the duplicate returned (%v) only once the holder had ended: its wait was not bounded by its budget", err)
			}
			if !errors.Is(err, idem.ErrInProgress) {
				t.Fatalf("duplicate: %v, want ErrInProgress", err)
			}
			if ran := effects.Load() == 1; ran != tc.ranFn {
				t.Errorf("the duplicate's function ran %d times, want ran = %v", effects.Load(), tc.ranFn)
			}
		})
	}
	end(true)
	if n := countPayments(t, pool, scope); n != 0 {
		t.Fatalf("%d payments of the duplicates were committed, want 0", n)
	}
	if n := countRecords(t, pool, scope); n != batch {
		t.Fatalf("%d records, want the holder's %d", n, batch)
	}
}

// TestOnceStoreRestoresTheCallersLockTimeout checks that the budget the
// record's statement waits under is the key's only: the caller's own
// lock_timeout is in force again once Once returns, for a key within and
// beyond the lock bound, at READ COMMITTED and REPEATABLE READ.
func TestOnceStoreRestoresTheCallersLockTimeout(t *testing.T) {
	ctx, pool, scope := setup(t)
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{IsoLevel: iso}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`); err != nil {
				return err
			}
			for i := range idem.MaxKeyLocks + 2 {
				if _, err := idem.Once(ctx, tx, scope, fmt.Sprintf("%s-%d", iso, i), func(context.Context, pgx.Tx) error { return nil },
					idem.WithWait(300*time.Millisecond)); err != nil {
					return err
				}
				var got string
				if err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got); err != nil {
					return err
				}
				if got != "7s" {
					return fmt.Errorf("%s, message %d: lock_timeout = %s after Once, want the caller's 7s", iso, i, got)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestOncePastTheLockBoundFailsCleanlyAndReplays covers a message claimed
// past a transaction's idem.MaxKeyLocks, whose record Once writes
// complete before fn: when fn fails and the caller commits anyway, no
// record of it is committed; and a duplicate past its own bound waits for
// the holder's record and, once the holder commits, reports it handled.
func TestOncePastTheLockBoundFailsCleanlyAndReplays(t *testing.T) {
	ctx, pool, scope := setup(t)
	errPoison := errors.New("cannot apply")
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := onceEach(ctx, tx, scope, "fill", idem.MaxKeyLocks); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Once(ctx, tx, scope, "poison", func(context.Context, pgx.Tx) error { return errPoison }); !errors.Is(err, errPoison) {
		t.Fatalf("Once: %v, want errPoison", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countRecords(t, pool, scope); n != idem.MaxKeyLocks {
		t.Fatalf("%d records, want the %d that ran", n, idem.MaxKeyLocks)
	}

	_, end := holdBatch(t, ctx, pool, scope+"-held", idem.MaxKeyLocks+1)
	last := fmt.Sprintf("m-%d", idem.MaxKeyLocks)
	done := make(chan error, 1)
	pid := make(chan uint32, 1)
	var effects atomic.Int64
	go func() {
		done <- idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			// The server's own pid: behind PgBouncer the driver's is made up.
			var p uint32
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p); err != nil {
				return err
			}
			pid <- p
			if _, err := onceEach(ctx, tx, scope+"-held", "other", idem.MaxKeyLocks); err != nil {
				return err
			}
			ran, err := idem.Once(ctx, tx, scope+"-held", last, func(context.Context, pgx.Tx) error {
				effects.Add(1)
				return nil
			}, idem.WithWait(time.Minute))
			if err == nil && ran {
				return errors.New("the duplicate ran")
			}
			return err
		})
	}()
	// In pgx's simple protocol the claim's batch is one query whose text
	// pg_stat_activity cuts short: the waiter is found by its pid.
	select {
	case p := <-pid:
		waitForBackendToWait(t, ctx, pool, p)
	case err := <-done:
		t.Fatalf("duplicate ended before it waited: %v", err)
	}
	end(true)
	if err := <-done; err != nil || effects.Load() != 0 {
		t.Fatalf("duplicate: %v, %d effects", err, effects.Load())
	}
}
