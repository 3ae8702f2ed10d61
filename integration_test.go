package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/guard"
	"github.com/pgidem/idem/internal/testdb"
)

var fpA, fpB = idem.Fingerprint([]byte("request A")), idem.Fingerprint([]byte("request B"))

func TestRunReplaysAfterCommit(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64

	first, err := idem.Run(ctx, pool, scope, "k1", fpA, pay(scope, "k1", 500, &calls))
	if err != nil {
		t.Fatalf("first Run: %v", err)
	}
	if first.Replayed {
		t.Fatal("first Run says Replayed")
	}
	second, err := idem.Run(ctx, pool, scope, "k1", fpA, pay(scope, "k1", 500, &calls))
	if err != nil {
		t.Fatalf("second Run: %v", err)
	}
	if !second.Replayed {
		t.Fatal("second Run did not replay")
	}
	if second.Value != first.Value {
		t.Fatalf("replayed %+v, first was %+v", second.Value, first.Value)
	}
	if calls.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("fn ran %d times, %d payments; want 1 and 1", calls.Load(), countPayments(t, pool, scope))
	}
}

func TestDoInCallersTransaction(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64

	do := func() idem.Result[payment] {
		t.Helper()
		var res idem.Result[payment]
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			res, err = idem.Do(ctx, tx, scope, "order-7", fpA, pay(scope, "order-7", 1200, &calls))
			return err
		})
		if err != nil {
			t.Fatalf("Do: %v", err)
		}
		return res
	}
	first, second := do(), do()
	if first.Replayed || !second.Replayed || first.Value != second.Value {
		t.Fatalf("first %+v, second %+v: want a run, then an equal replay", first, second)
	}
	if calls.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("fn ran %d times, %d payments; want 1 and 1", calls.Load(), countPayments(t, pool, scope))
	}
}

func TestRunSimultaneousDuplicates(t *testing.T) {
	ctx, pool, scope := setup(t)
	const clients = 50
	var calls atomic.Int64
	slowPay := func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, "storm", 999, &calls)(ctx, tx)
		time.Sleep(50 * time.Millisecond) // keep the claim open while the others arrive
		return p, err
	}

	firsts := storm(t, clients, func() (idem.Result[payment], error) {
		return idem.Run(ctx, pool, scope, "storm", fpA, slowPay, idem.WithWait(30*time.Second))
	})
	if firsts != 1 || calls.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d non-replays, fn ran %d times, %d payments; want 1, 1, 1", firsts, calls.Load(), countPayments(t, pool, scope))
	}
}

// storm makes n calls of call at once and returns how many were not
// replays. It fails the test on any error, or when two calls got different
// values.
func storm(t *testing.T, n int, call func() (idem.Result[payment], error)) (firsts int) {
	t.Helper()
	start := make(chan struct{})
	results := make([]idem.Result[payment], n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			results[i], errs[i] = call()
		})
	}
	close(start)
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if !results[i].Replayed {
			firsts++
		}
		if results[i].Value != results[0].Value {
			t.Fatalf("call %d got %+v, call 0 got %+v", i, results[i].Value, results[0].Value)
		}
	}
	return firsts
}

func TestRunFingerprintMismatch(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls)); err != nil {
		t.Fatal(err)
	}
	_, err := idem.Run(ctx, pool, scope, "k", fpB, pay(scope, "k", 200, &calls))
	if !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("err = %v, want ErrFingerprintMismatch", err)
	}
	if calls.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("fn ran %d times; want once", calls.Load())
	}
}

func TestScopesAreIsolated(t *testing.T) {
	ctx, pool, scope := setup(t)
	tenantA, tenantB := scope+"-a", scope+"-b"
	var calls atomic.Int64

	a, err := idem.Run(ctx, pool, tenantA, "shared-key", fpA, pay(tenantA, "shared-key", 100, &calls))
	if err != nil {
		t.Fatal(err)
	}
	// Another tenant, same key, other content: not a mismatch, not a replay
	// of tenant A's response, but its own first execution.
	b, err := idem.Run(ctx, pool, tenantB, "shared-key", fpB, pay(tenantB, "shared-key", 200, &calls))
	if err != nil {
		t.Fatalf("tenant B: %v", err)
	}
	if b.Replayed || b.Value.AmountCents != 200 || b.Value.ID == a.Value.ID {
		t.Fatalf("tenant B got %+v; tenant A had %+v", b, a)
	}
	if calls.Load() != 2 {
		t.Fatalf("fn ran %d times, want 2", calls.Load())
	}
}

func TestRollbackLeavesKeyFree(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) // on failure; a no-op after the rollback below
	if _, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 100, &calls)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls))
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed || calls.Load() != 2 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("after rollback: %+v, fn ran %d times, %d payments", res, calls.Load(), countPayments(t, pool, scope))
	}
}

func TestCancelledContextMidFnLeavesKeyFree(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64

	callCtx, cancel := context.WithCancel(ctx)
	_, err := idem.Run(callCtx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, "k", 100, &calls)(ctx, tx)
		if err != nil {
			return p, err
		}
		cancel()
		_, err = tx.Exec(ctx, `SELECT pg_sleep(5)`)
		return p, err
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if countPayments(t, pool, scope) != 0 || countRecords(t, pool, scope) != 0 {
		t.Fatal("a cancelled call left a payment or a record behind")
	}
	res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls))
	if err != nil || res.Replayed || countPayments(t, pool, scope) != 1 {
		t.Fatalf("retry: %+v, %v", res, err)
	}
}

func TestTerminatedBackendMidFnLeavesKeyFree(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64

	_, err := idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, "k", 100, &calls)(ctx, tx)
		if err != nil {
			return p, err
		}
		var pid int32
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return p, err
		}
		// Another session kills this one while the claim and the payment
		// are written but not committed: a crash before commit.
		if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
			return p, err
		}
		_, err = tx.Exec(ctx, `SELECT 1`)
		return p, err
	})
	if err == nil {
		t.Fatal("Run succeeded on a terminated backend")
	}
	if countPayments(t, pool, scope) != 0 || countRecords(t, pool, scope) != 0 {
		t.Fatal("a crash before commit left a payment or a record behind")
	}
	res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls))
	if err != nil || res.Replayed || countPayments(t, pool, scope) != 1 {
		t.Fatalf("retry: %+v, %v", res, err)
	}
}

func TestFnErrorReleasesClaimEvenIfCallerCommits(t *testing.T) {
	ctx, pool, scope := setup(t)
	errDeclined := errors.New("card declined")

	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := idem.Do(ctx, tx, scope, "k", fpA, func(context.Context, pgx.Tx) (payment, error) {
			return payment{}, errDeclined
		})
		if !errors.Is(err, errDeclined) {
			t.Errorf("Do err = %v, want it to wrap errDeclined", err)
		}
		return nil // commit anyway
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := countRecords(t, pool, scope); n != 0 {
		t.Fatalf("%d records committed after fn failed; want none", n)
	}
	var calls atomic.Int64
	res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls))
	if err != nil || res.Replayed || calls.Load() != 1 {
		t.Fatalf("retry after failure: %+v, %v", res, err)
	}
}

func TestFnPanicReleasesClaimEvenIfCallerCommits(t *testing.T) {
	ctx, pool, scope := setup(t)

	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		func() {
			defer func() { _ = recover() }()
			_, _ = idem.Do(ctx, tx, scope, "k", fpA, func(context.Context, pgx.Tx) (int, error) {
				panic("boom")
			})
		}()
		return nil // commit anyway
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := countRecords(t, pool, scope); n != 0 {
		t.Fatalf("%d records committed after fn panicked; want none", n)
	}
}

func TestSameKeyTwiceInOneTransaction(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64

	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		first, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 100, &calls))
		if err != nil {
			return err
		}
		second, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 100, &calls))
		if err != nil {
			return err
		}
		if !second.Replayed || second.Value != first.Value {
			t.Errorf("second Do in the same transaction: %+v, want a replay of %+v", second, first)
		}
		_, err = idem.Do(ctx, tx, scope, "nested", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := idem.Do(ctx, tx, scope, "nested", fpA, func(context.Context, pgx.Tx) (int, error) { return 2, nil })
			if !errors.Is(err, idem.ErrInProgress) {
				t.Errorf("nested Do on the key being run: %v, want ErrInProgress", err)
			}
			return 1, nil
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 1 {
		t.Fatalf("fn ran %d times, want 1", calls.Load())
	}
}

// TestKeysWhoseLocksCollideAreNotNested nests a Do on one key inside the fn
// of another whose lock id is the same (a 48-bit hash collision): the
// inner call is a different key, and runs.
func TestKeysWhoseLocksCollideAreNotNested(t *testing.T) {
	ctx, pool, _ := setup(t)
	// A pair found by brute force; the scope is part of the hash.
	scope, a, b := "s", "5c38ed5d79a66352ebf7", "47a4f6b5e87317ccd6db"
	if guard.LockID(scope, a) != guard.LockID(scope, b) {
		t.Fatal("the keys no longer collide: find another pair")
	}
	var calls atomic.Int64
	_, err := idem.Run(ctx, pool, scope, a, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		inner, err := idem.Do(ctx, tx, scope, b, fpA, pay(scope, b, 2, &calls))
		if err != nil || inner.Replayed {
			return payment{}, fmt.Errorf("inner Do on a colliding key: %+v, %w", inner, err)
		}
		return pay(scope, a, 1, &calls)(ctx, tx)
	})
	if err != nil || calls.Load() != 2 {
		t.Fatalf("Run: %v, %d calls; want both keys run", err, calls.Load())
	}
}

// TestCommitFailureIsNotTakenForTheRecords fails the COMMIT that Run sends
// with the record, through a deferred constraint fn violates: the error is
// COMMIT's, reported once, not retried as a record that changed.
func TestCommitFailureIsNotTakenForTheRecords(t *testing.T) {
	ctx, pool, scope := setup(t)
	table := pgx.Identifier{"deferred_" + strings.ReplaceAll(scope, "-", "_")}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (v int, CONSTRAINT `+strings.Trim(table, `"`)+`_uq UNIQUE (v) DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	_, err := idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
		calls.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES (1), (1)`)
		return 1, err
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || errors.Is(err, idem.ErrSerialization) || calls.Load() != 1 {
		t.Fatalf("err = %v after %d calls; want COMMIT's unique violation, once, not ErrSerialization", err, calls.Load())
	}
	if countRecords(t, pool, scope) != 0 {
		t.Fatal("a record committed although COMMIT failed")
	}
}

func TestExpiredKeyIsReclaimedWithoutFingerprintCheck(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64

	first, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls))
	if err != nil {
		t.Fatal(err)
	}
	expire(t, pool, scope, "k")

	second, err := idem.Run(ctx, pool, scope, "k", fpB, pay(scope, "k", 200, &calls))
	if err != nil {
		t.Fatalf("reclaim with another fingerprint: %v", err)
	}
	if second.Replayed || second.Value.ID == first.Value.ID || calls.Load() != 2 {
		t.Fatalf("expired key: %+v, fn ran %d times; want a fresh run", second, calls.Load())
	}
	// The reclaimed record is live again, with the new fingerprint.
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls)); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("old fingerprint after reclaim: %v, want ErrFingerprintMismatch", err)
	}
}

func TestExpiredKeyConcurrentReclaimRunsOnce(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls)); err != nil {
		t.Fatal(err)
	}
	expire(t, pool, scope, "k")
	calls.Store(0)

	const clients = 20
	start := make(chan struct{})
	var wg sync.WaitGroup
	var runs atomic.Int64
	errs := make(chan error, clients)
	for range clients {
		wg.Go(func() {
			<-start
			res, err := idem.Run(ctx, pool, scope, "k", fpB, func(ctx context.Context, tx pgx.Tx) (payment, error) {
				p, err := pay(scope, "k", 200, &calls)(ctx, tx)
				time.Sleep(20 * time.Millisecond)
				return p, err
			}, idem.WithWait(30*time.Second))
			if err != nil {
				errs <- err
				return
			}
			if !res.Replayed {
				runs.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if runs.Load() != 1 || calls.Load() != 1 || countPayments(t, pool, scope) != 2 {
		t.Fatalf("%d reclaimers ran fn (%d calls, %d payments in all); want exactly 1 reclaim", runs.Load(), calls.Load(), countPayments(t, pool, scope))
	}
}

// holdKey claims key in a transaction of its own and keeps it open until
// the test ends, or until after has passed, when it commits or rolls back.
// The test does not end before the transaction has.
func holdKey(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string, after time.Duration, commit bool) {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := idem.Do(ctx, tx, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
		_ = tx.Rollback(ctx) // or the pool never gets its connection back
		t.Fatal(err)
	}
	done := make(chan struct{})
	// The test's own context ends with the test: finish on one that does not.
	finishCtx := context.WithoutCancel(ctx)
	release := make(chan struct{})
	t.Cleanup(func() {
		close(release)
		<-done
	})
	go func() {
		defer close(done)
		select {
		case <-time.After(after):
		case <-release:
			commit = false
		}
		if !commit {
			_ = tx.Rollback(finishCtx)
			return
		}
		if err := tx.Commit(finishCtx); err != nil {
			t.Errorf("holder's commit: %v", err)
		}
	}()
}

func TestWaitBudgetExpires(t *testing.T) {
	ctx, pool, scope := setup(t)
	holdKey(t, ctx, pool, scope, "k", time.Hour, false)

	var calls atomic.Int64
	started := time.Now()
	_, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls), idem.WithWait(200*time.Millisecond))
	waited := time.Since(started)
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("err = %v, want ErrInProgress", err)
	}
	if waited < 200*time.Millisecond {
		t.Fatalf("gave up after %s, before the 200ms budget", waited)
	}
	if calls.Load() != 0 {
		t.Fatal("fn ran while another attempt held the key")
	}

	_, err = idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls), idem.WithWait(0))
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("WithWait(0): err = %v, want ErrInProgress", err)
	}
	// The message says it once, in idem's words; the driver's error stays
	// in the chain for those who want it.
	var pgErr *pgconn.PgError
	if msg := err.Error(); strings.Count(msg, "idem:") != 1 || strings.Contains(msg, "ERROR:") || !errors.As(err, &pgErr) {
		t.Fatalf("ErrInProgress reads %q; want one idem: prefix, no driver wording, and the driver's error in the chain", msg)
	}
}

func TestWaitBudgetReplaysWhenFirstCommits(t *testing.T) {
	ctx, pool, scope := setup(t)
	holdKey(t, ctx, pool, scope, "k", 300*time.Millisecond, true)

	var calls atomic.Int64
	res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls), idem.WithWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if !res.Replayed || calls.Load() != 0 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%+v, fn ran %d times: want the first attempt's replay", res, calls.Load())
	}
}

func TestWaitBudgetClaimsWhenFirstRollsBack(t *testing.T) {
	ctx, pool, scope := setup(t)
	holdKey(t, ctx, pool, scope, "k", 300*time.Millisecond, false)

	var calls atomic.Int64
	res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls), idem.WithWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed || calls.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%+v, fn ran %d times: want this call to run fn", res, calls.Load())
	}
}

func TestWaitBudgetDoesNotLeakIntoTransaction(t *testing.T) {
	ctx, pool, scope := setup(t)
	lockTimeout := func(ctx context.Context, tx pgx.Tx) string {
		var v string
		if err := tx.QueryRow(ctx, `SELECT current_setting('lock_timeout')`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`); err != nil {
			return err
		}
		var inFn string
		_, err := idem.Do(ctx, tx, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
			inFn = lockTimeout(ctx, tx)
			return 1, nil
		}, idem.WithWait(123*time.Millisecond))
		if err != nil {
			return err
		}
		if inFn != "7s" {
			t.Errorf("lock_timeout in fn = %q, want the caller's 7s", inFn)
		}
		if after := lockTimeout(ctx, tx); after != "7s" {
			t.Errorf("lock_timeout after Do = %q, want the caller's 7s", after)
		}
		// A replay restores it too.
		if _, err := idem.Do(ctx, tx, scope, "k", fpA, func(context.Context, pgx.Tx) (int, error) { return 2, nil },
			idem.WithWait(123*time.Millisecond)); err != nil {
			return err
		}
		if after := lockTimeout(ctx, tx); after != "7s" {
			t.Errorf("lock_timeout after a replay = %q, want the caller's 7s", after)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestRunSerializableStormReplays(t *testing.T) {
	ctx, pool, scope := setup(t)
	const clients = 20
	var calls atomic.Int64
	firsts := storm(t, clients, func() (idem.Result[payment], error) {
		return idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			p, err := pay(scope, "k", 700, &calls)(ctx, tx)
			time.Sleep(10 * time.Millisecond)
			return p, err
		}, idem.WithTxOptions(pgx.TxOptions{IsoLevel: pgx.Serializable}), idem.WithWait(30*time.Second))
	})
	if firsts != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d first executions, %d payments; want 1 and 1", firsts, countPayments(t, pool, scope))
	}
}

func TestDoUnderRepeatableReadReportsSerialization(t *testing.T) {
	ctx, pool, scope := setup(t)
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil { // take the snapshot now
		t.Fatal(err)
	}
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls)); err != nil {
		t.Fatal(err)
	}
	_, err = idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 1, &calls))
	if !errors.Is(err, idem.ErrSerialization) {
		t.Fatalf("err = %v, want ErrSerialization", err)
	}
	if calls.Load() != 1 {
		t.Fatalf("fn ran %d times, want 1", calls.Load())
	}
}

// panicTx is a transaction that fails the test on any use: passing it proves
// that a call was rejected before it reached the database.
type panicTx struct{ pgx.Tx }

func TestInvalidScopesAndKeysNeverReachTheDatabase(t *testing.T) {
	ctx, pool, scope := setup(t)
	long := strings.Repeat("k", 256)
	cases := []struct {
		name, scope, key string
		want             error
	}{
		{"empty key", scope, "", idem.ErrInvalidKey},
		{"key over 255 bytes", scope, long, idem.ErrInvalidKey},
		{"key over 255 bytes in multibyte runes", scope, strings.Repeat("é", 128), idem.ErrInvalidKey},
		{"key not UTF-8", scope, "k\xff", idem.ErrInvalidKey},
		{"key with NUL", scope, "k\x00", idem.ErrInvalidKey},
		{"empty scope", "", "k", idem.ErrInvalidScope},
		{"scope over 255 bytes", long, "k", idem.ErrInvalidScope},
		{"scope not UTF-8", "\xc3\x28", "k", idem.ErrInvalidScope},
		{"scope with NUL", "a\x00b", "k", idem.ErrInvalidScope},
	}
	for _, c := range cases {
		var calls atomic.Int64
		_, err := idem.Do(ctx, panicTx{}, c.scope, c.key, fpA, pay(c.scope, c.key, 1, &calls))
		if !errors.Is(err, c.want) {
			t.Errorf("%s: Do err = %v, want %v", c.name, err, c.want)
		}
		_, err = idem.Run(ctx, pool, c.scope, c.key, fpA, pay(c.scope, c.key, 1, &calls))
		if !errors.Is(err, c.want) {
			t.Errorf("%s: Run err = %v, want %v", c.name, err, c.want)
		}
		if calls.Load() != 0 {
			t.Errorf("%s: fn ran", c.name)
		}
	}
	if countRecords(t, pool, scope) != 0 || countPayments(t, pool, scope) != 0 {
		t.Fatal("invalid input wrote something")
	}

	// The bounds are inclusive: 255 bytes, multibyte runes included, work.
	var calls atomic.Int64
	edge := strings.Repeat("k", 253) + "é"
	if _, err := idem.Run(ctx, pool, scope, edge, fpA, pay(scope, edge, 1, &calls)); err != nil {
		t.Fatalf("255-byte key: %v", err)
	}
}

func TestInvalidOptionsAreRejected(t *testing.T) {
	ctx := context.Background()
	fn := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	for _, opt := range []idem.Option{
		idem.WithRetention(0), idem.WithRetention(500 * time.Nanosecond), idem.WithWait(-time.Second), idem.WithMaxResponseSize(0),
		idem.WithWait(25 * 24 * time.Hour), idem.WithWait(time.Duration(math.MaxInt64)),
	} {
		if _, err := idem.Do(ctx, panicTx{}, "s", "k", nil, fn, opt); !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("err = %v, want ErrInvalidOption", err)
		}
		// CheckOptions tells beforehand what the call would say.
		if err := idem.CheckOptions(idem.WithLookupFirst(), opt); !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("CheckOptions: %v, want ErrInvalidOption", err)
		}
	}
	if err := idem.CheckOptions(idem.WithRetention(time.Microsecond), idem.WithWait(0), idem.WithMaxResponseSize(1)); err != nil {
		t.Errorf("CheckOptions of the smallest values that work: %v", err)
	}
	if err := idem.CheckOptions(); err != nil {
		t.Errorf("CheckOptions of none: %v", err)
	}
}

func TestResponseTooLargeStoresNothing(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	_, err := idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, "k", 1, &calls)(ctx, tx)
		p.Note = strings.Repeat("x", 200)
		return p, err
	}, idem.WithMaxResponseSize(100))
	if !errors.Is(err, idem.ErrResponseTooLarge) {
		t.Fatalf("err = %v, want ErrResponseTooLarge", err)
	}
	if countRecords(t, pool, scope) != 0 || countPayments(t, pool, scope) != 0 {
		t.Fatal("an oversized response left a record or a payment")
	}

	// Inside the caller's transaction the claim is released and the
	// transaction stays usable.
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := idem.Do(ctx, tx, scope, "k2", fpA, func(context.Context, pgx.Tx) (string, error) {
			return strings.Repeat("x", 200), nil
		}, idem.WithMaxResponseSize(100))
		if !errors.Is(err, idem.ErrResponseTooLarge) {
			t.Errorf("Do err = %v, want ErrResponseTooLarge", err)
		}
		_, err = tx.Exec(ctx, `SELECT 1`)
		return err
	})
	if err != nil {
		t.Fatalf("transaction after ErrResponseTooLarge: %v", err)
	}
	if countRecords(t, pool, scope) != 0 {
		t.Fatal("an oversized response left a record")
	}
}

type richValue struct {
	Int      int64             `json:"int"`
	Big      uint64            `json:"big"`
	Float    float64           `json:"float"`
	Text     string            `json:"text"`
	Bytes    []byte            `json:"bytes"`
	Map      map[string]int    `json:"map"`
	Nested   *richValue        `json:"nested"`
	List     []string          `json:"list"`
	Empty    map[string]string `json:"empty"`
	Time     time.Time         `json:"time"`
	Nothing  *int              `json:"nothing"`
	Escaping string            `json:"escaping"`
}

func TestStoredValuesReplayEqual(t *testing.T) {
	ctx, pool, scope := setup(t)
	values := map[string]any{
		"rich": richValue{
			Int: -42, Big: 1<<64 - 1, Float: 0.1 + 0.2, Text: "größe ✓ 🚀 \"quoted\" \\ </script>",
			Bytes: []byte{0, 1, 2, 255}, Map: map[string]int{"b": 2, "a": 1},
			Nested: &richValue{Int: 1, List: []string{}}, List: []string{"x", ""},
			Empty: map[string]string{}, Time: time.Date(2026, 11, 29, 12, 0, 0, 123456789, time.UTC),
			Escaping: `\u0000 is text here, not a NUL`,
		},
		"float extremes": []float64{1e21, 5e-324, math.Copysign(0, -1), 1.7976931348623157e308},
		"null":           nil,
		"string":         "plain",
	}
	for name, v := range values {
		key := "k-" + strings.ReplaceAll(name, " ", "-")
		run := func() (idem.Result[any], error) {
			return idem.Run(ctx, pool, scope, key, fpA, func(context.Context, pgx.Tx) (any, error) { return v, nil })
		}
		if _, err := run(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		replay, err := run()
		if err != nil || !replay.Replayed {
			t.Fatalf("%s: replay %+v, %v", name, replay, err)
		}
		// Compare through the same decoding the first caller would apply.
		if got, want := normalize(t, replay.Value), normalize(t, v); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: replayed %v, want %v", name, got, want)
		}
	}

	typed, err := idem.Run(ctx, pool, scope, "typed", fpA, func(context.Context, pgx.Tx) (richValue, error) {
		return values["rich"].(richValue), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	replayed, err := idem.Run(ctx, pool, scope, "typed", fpA, func(context.Context, pgx.Tx) (richValue, error) {
		return richValue{}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(normalize(t, replayed.Value), normalize(t, typed.Value)) || !replayed.Value.Time.Equal(typed.Value.Time) ||
		replayed.Value.Big != typed.Value.Big || replayed.Value.Float != typed.Value.Float {
		t.Fatalf("typed replay differs:\n got %+v\nwant %+v", replayed.Value, typed.Value)
	}
}

// rawMarshaler is a Marshaler that answers its own bytes, as a hand-written
// MarshalJSON may.
type rawMarshaler string

func (m rawMarshaler) MarshalJSON() ([]byte, error) { return []byte(m), nil }

func TestUnstorableValuesFailTyped(t *testing.T) {
	ctx, pool, scope := setup(t)
	cases := map[string]any{
		"NUL in a string":                       "a\x00b",
		"NUL in a key":                          map[string]int{"a\x00": 1},
		"channel":                               make(chan int),
		"lone surrogate":                        json.RawMessage(`"\ud800"`),
		"number beyond numeric, integer":        json.RawMessage(`1e1000000`),
		"number beyond numeric, fraction":       json.Number("1.5e-16383"),
		"number beyond numeric, json.Number":    json.Number("1e200000"),
		"zero with an exponent numeric rejects": json.RawMessage(`0e1073741823`),
		"zero with a huge negative exponent":    json.RawMessage(`-0E-1073741823`),
		"invalid UTF-8 in a json.RawMessage":    json.RawMessage("\"\xff\""),
		"invalid UTF-8 from a Marshaler":        rawMarshaler("{\"name\": \"\xc3\x28\"}"),
	}
	for name, v := range cases {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, "k", fpA, func(context.Context, pgx.Tx) (any, error) { return v, nil })
			if !errors.Is(err, idem.ErrResponseNotStorable) {
				t.Errorf("%s: err = %v, want ErrResponseNotStorable", name, err)
			}
			_, err = tx.Exec(ctx, `SELECT 1`)
			return err
		})
		if err != nil {
			t.Fatalf("%s: transaction unusable afterwards: %v", name, err)
		}
	}
	if countRecords(t, pool, scope) != 0 {
		t.Fatal("an unstorable value left a record")
	}
}

// beginnerOnly hides the pool's type, so Run takes its general path for
// TxBeginners it cannot drive directly.
type beginnerOnly struct{ pool *pgxpool.Pool }

func (b beginnerOnly) BeginTx(ctx context.Context, o pgx.TxOptions) (pgx.Tx, error) {
	return b.pool.BeginTx(ctx, o)
}

func TestRunWithAnyTxBeginner(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	beginners := map[string]idem.TxBeginner{
		"custom":       beginnerOnly{pool},
		"pgxpool.Conn": conn,
		"pgx.Conn":     conn.Conn(),
	}
	for name, b := range beginners {
		first, err := idem.Run(ctx, b, scope, name, fpA, pay(scope, name, 1, &calls))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		second, err := idem.Run(ctx, b, scope, name, fpA, pay(scope, name, 1, &calls))
		if err != nil || !second.Replayed || second.Value != first.Value {
			t.Fatalf("%s: replay %+v, %v", name, second, err)
		}
	}
	if calls.Load() != 3 || countPayments(t, pool, scope) != 3 {
		t.Fatalf("fn ran %d times, want 3", calls.Load())
	}
	// The connection is back to idle, fit for reuse.
	if status := conn.Conn().PgConn().TxStatus(); status != 'I' {
		t.Fatalf("connection left in transaction status %q", status)
	}
}

func TestWithTxRetriesSerializationFailures(t *testing.T) {
	ctx, pool, scope := setup(t)
	attempts := 0
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		attempts++
		if attempts < 3 {
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40001'; END $$`)
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 1)`, scope)
		return err
	})
	if err != nil || attempts != 3 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("err %v after %d attempts; want success on the third", err, attempts)
	}

	errOther := errors.New("not retryable")
	attempts = 0
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		attempts++
		return errOther
	})
	if !errors.Is(err, errOther) || attempts != 1 {
		t.Fatalf("err %v after %d attempts; want errOther after one", err, attempts)
	}
}

func TestPurgeDeletesOnlyExpired(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	var calls atomic.Int64
	for i := range 7 {
		key := fmt.Sprintf("k%d", i)
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
		if i < 5 {
			expire(t, pool, scope, key)
		}
	}
	if n, err := idem.Purge(ctx, pool, 2); err != nil || n != 5 {
		t.Fatalf("Purge deleted %d, %v; want the 5 expired", n, err)
	}
	if n := countRecords(t, pool, scope); n != 2 {
		t.Fatalf("%d records left, want the 2 live ones", n)
	}
	if _, err := idem.Purge(ctx, pool, 0); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("batch 0: %v, want ErrInvalidOption", err)
	}
}

// normalize decodes v's JSON into plain maps, slices and float64s, so that
// values compare by meaning rather than by spelling.
func normalize(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestRunLookupFirst(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	lookupFirst := idem.WithLookupFirst()

	first, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls), lookupFirst)
	if err != nil || first.Replayed {
		t.Fatalf("first: %+v, %v", first, err)
	}
	second, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls), lookupFirst)
	if err != nil || !second.Replayed || second.Value != first.Value {
		t.Fatalf("replay: %+v, %v; want %+v", second, err, first.Value)
	}
	if _, err := idem.Run(ctx, pool, scope, "k", fpB, pay(scope, "k", 100, &calls), lookupFirst); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("other fingerprint: %v, want ErrFingerprintMismatch", err)
	}
	expire(t, pool, scope, "k")
	third, err := idem.Run(ctx, pool, scope, "k", fpB, pay(scope, "k", 300, &calls), lookupFirst)
	if err != nil || third.Replayed || third.Value.AmountCents != 300 {
		t.Fatalf("after expiry: %+v, %v; want a fresh run", third, err)
	}
	if calls.Load() != 2 || countPayments(t, pool, scope) != 2 {
		t.Fatalf("fn ran %d times, want 2", calls.Load())
	}
}

func TestNumbersAtJsonbsLimitsAreStored(t *testing.T) {
	ctx, pool, scope := setup(t)
	for i, n := range []string{`1e131071`, `1e-16383`, `1.5e-16382`, `-0.0e131073`, `0e1073741822`} {
		key := fmt.Sprintf("n%d", i)
		run := func() (idem.Result[json.RawMessage], error) {
			return idem.Run(ctx, pool, scope, key, nil, func(context.Context, pgx.Tx) (json.RawMessage, error) {
				return json.RawMessage(n), nil
			})
		}
		if _, err := run(); err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		replay, err := run()
		if err != nil || !replay.Replayed {
			t.Fatalf("%s: replay %v", n, err)
		}
		if !bytes.Equal(fingerprintOf(t, replay.Value), fingerprintOf(t, json.RawMessage(n))) {
			t.Fatalf("%s replayed as another number", n)
		}
	}
}

func fingerprintOf(t *testing.T, doc json.RawMessage) []byte {
	t.Helper()
	fp, err := idem.FingerprintJSON(doc)
	if err != nil {
		t.Fatal(err)
	}
	return fp
}

// poolInMode opens a pool on the test database in one exec mode, closed
// when the test ends. The mode is set on the config: TEST_DATABASE_URL may
// name one already.
func poolInMode(t *testing.T, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func TestRunInEveryQueryExecMode(t *testing.T) {
	ctx, _, scope := setup(t)
	// Every mode, or behind a pooler those it carries.
	for _, mode := range testdb.ExecModes(t) {
		pool := poolInMode(t, mode)
		var calls atomic.Int64
		key := "k-" + strings.ReplaceAll(mode.String(), " ", "-")
		first, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls))
		if err != nil {
			t.Fatalf("%s: first: %v", mode, err)
		}
		replay, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls))
		if err != nil || !replay.Replayed || replay.Value != first.Value {
			t.Fatalf("%s: replay %+v, %v", mode, replay, err)
		}
		err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.Once(ctx, tx, scope, "once-"+key, func(context.Context, pgx.Tx) error { return nil })
			return err
		})
		if err != nil {
			t.Fatalf("%s: Once: %v", mode, err)
		}
	}
}

// TestRunHonoursAMultiStatementBeginQuery gives Run a BeginQuery of two
// statements, which WithTx accepts, in every exec mode: Run must run it as
// given (fn sees its setting), and read its own results right after it.
func TestRunHonoursAMultiStatementBeginQuery(t *testing.T) {
	ctx, _, scope := setup(t)
	begin := idem.WithTxOptions(pgx.TxOptions{
		BeginQuery: `BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = '4321ms'`,
	})
	for _, mode := range testdb.ExecModes(t) {
		pool := poolInMode(t, mode)
		var calls atomic.Int64
		key := "k-" + strings.ReplaceAll(mode.String(), " ", "-")
		fn := func(ctx context.Context, tx pgx.Tx) (payment, error) {
			var timeout string
			if err := tx.QueryRow(ctx, `SHOW statement_timeout`).Scan(&timeout); err != nil {
				return payment{}, err
			}
			if timeout != "4321ms" {
				t.Errorf("%s: fn runs with statement_timeout %s; BeginQuery set 4321ms", mode, timeout)
			}
			return pay(scope, key, 1, &calls)(ctx, tx)
		}
		first, err := idem.Run(ctx, pool, scope, key, fpA, fn, begin)
		if err != nil || first.Replayed {
			t.Fatalf("%s: first: %+v, %v", mode, first, err)
		}
		replay, err := idem.Run(ctx, pool, scope, key, fpA, fn, begin)
		if err != nil || !replay.Replayed || replay.Value != first.Value {
			t.Fatalf("%s: replay: %+v, %v; want %+v", mode, replay, err, first.Value)
		}
		if calls.Load() != 1 {
			t.Fatalf("%s: fn ran %d times", mode, calls.Load())
		}
	}
}

// TestRecordChangedInsideFnCommitsNothing misuses fn to write the key's
// own record: at READ COMMITTED the record Run writes at the end collides
// with it, at REPEATABLE READ fn deletes the claim written before it. Run's
// COMMIT travels with the record; in neither case may it keep the payment
// without a record of its own.
func TestRecordChangedInsideFnCommitsNothing(t *testing.T) {
	ctx, pool, scope := setup(t)
	misuse := map[pgx.TxIsoLevel]string{
		pgx.ReadCommitted: `INSERT INTO idempotency_key (scope, key, fingerprint, state, expires_at)
			VALUES ($1, $2, '', 'done', now() + interval '1 hour')`,
		pgx.RepeatableRead: `DELETE FROM idempotency_key WHERE scope = $1 AND key = $2`,
	}
	for iso, stmt := range misuse {
		key := "k-" + string(iso)
		var calls atomic.Int64
		_, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			p, err := pay(scope, key, 1, &calls)(ctx, tx)
			if err != nil {
				return p, err
			}
			_, err = tx.Exec(ctx, stmt, scope, key)
			return p, err
		}, idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso}))
		if err == nil {
			t.Fatalf("%s: Run succeeded although fn changed its record", iso)
		}
		// fn's own change to a claim written before it is not a race a
		// retry can win: it is reported, not retried.
		if iso == pgx.RepeatableRead && (calls.Load() != 1 || errors.Is(err, idem.ErrSerialization)) {
			t.Fatalf("%s: %d calls, %v; want one call and no retry", iso, calls.Load(), err)
		}
	}
	if countPayments(t, pool, scope) != 0 || countRecords(t, pool, scope) != 0 {
		t.Fatalf("committed %d payments, %d records; want none", countPayments(t, pool, scope), countRecords(t, pool, scope))
	}
}

// TestMaxKeyLengthIsTheEnforcedLimit keeps the documented constant and the
// check the calls make the same.
func TestMaxKeyLengthIsTheEnforcedLimit(t *testing.T) {
	if idem.MaxKeyLength != guard.MaxIdentifierLength {
		t.Fatalf("idem.MaxKeyLength = %d, but keys are checked against %d", idem.MaxKeyLength, guard.MaxIdentifierLength)
	}
}
