package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/ident"
	"github.com/pgidem/idem/internal/keylock"
)

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
		// A Do on the key being run joins it (TestADoInsideItsKeysFunctionJoinsIt).
		_, err = idem.Do(ctx, tx, scope, "nested", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
			inner, err := idem.Do(ctx, tx, scope, "nested", fpA, func(context.Context, pgx.Tx) (int, error) { return 2, nil })
			if err != nil || inner.Replayed || inner.Value != 2 {
				t.Errorf("nested Do on the key being run: %+v, %v; want it to join and run", inner, err)
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
	if keylock.ID(scope, a) != keylock.ID(scope, b) {
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

// TestMaxKeyLengthIsTheEnforcedLimit keeps the documented constant and the
// check the calls make the same.
func TestMaxKeyLengthIsTheEnforcedLimit(t *testing.T) {
	if idem.MaxKeyLength != ident.MaxLength {
		t.Fatalf("idem.MaxKeyLength = %d, but keys are checked against %d", idem.MaxKeyLength, ident.MaxLength)
	}
}
