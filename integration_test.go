package idem_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// The properties idem exists for, end to end: however many duplicates
// arrive at once, and whatever dies mid-call, each operation has exactly
// one effect. Tests of one file's behaviour live next to it (idem_test.go,
// claim_test.go, run_test.go, ...).

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
