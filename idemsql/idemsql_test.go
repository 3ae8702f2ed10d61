package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testdb"
)

var (
	fpA = idem.Fingerprint([]byte("request A"))
	fpB = idem.Fingerprint([]byte("request B"))

	errBoom = errors.New("boom")
)

func TestRunExecutesOnceThenReplays(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		first, err := idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 100, &calls))
		if err != nil {
			t.Fatal(err)
		}
		if first.Replayed || first.Value.ID == 0 {
			t.Fatalf("first call: %+v, want a fresh payment", first)
		}
		again, err := idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 100, &calls))
		if err != nil {
			t.Fatal(err)
		}
		if !again.Replayed || again.Value != first.Value {
			t.Fatalf("retry: %+v, want the replay of %+v", again, first.Value)
		}
		if n := calls.Load(); n != 1 {
			t.Errorf("fn ran %d times, want 1", n)
		}
		if n := testdb.CountPayments(t, pool, scope); n != 1 {
			t.Errorf("%d payments, want 1", n)
		}
	})
}

// TestAFailedFunctionLeavesNothing is the trap of database/sql users: the
// function's write, made on the *sql.Tx it gets, rolls back with idem's
// record when the function fails, and a retry runs it again.
func TestAFailedFunctionLeavesNothing(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		boom := errors.New("card declined")
		_, err := idemsql.Run(ctx, db, scope, "k", fpA, func(ctx context.Context, tx *sql.Tx) (payment, error) {
			if _, err := pay(scope, "k", 100, &calls)(ctx, tx); err != nil {
				return payment{}, err
			}
			return payment{}, boom
		})
		if !errors.Is(err, boom) {
			t.Fatalf("err = %v, want fn's error", err)
		}
		if n := testdb.CountPayments(t, pool, scope); n != 0 {
			t.Fatalf("%d payments after fn failed, want 0: the write escaped idem's transaction", n)
		}
		if n := testdb.CountRecords(t, pool, scope); n != 0 {
			t.Fatalf("%d records after fn failed, want 0", n)
		}
		res, err := idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 100, &calls))
		if err != nil || res.Replayed {
			t.Fatalf("retry: %+v, %v; want a first execution", res, err)
		}
		if n := testdb.CountPayments(t, pool, scope); n != 1 {
			t.Errorf("%d payments, want 1", n)
		}
	})
}

func TestAReusedKeyWithOtherContentIsRefused(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		if _, err := idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 100, &calls)); err != nil {
			t.Fatal(err)
		}
		_, err := idemsql.Run(ctx, db, scope, "k", fpB, pay(scope, "k", 999, &calls))
		if !errors.Is(err, idem.ErrFingerprintMismatch) {
			t.Fatalf("err = %v, want ErrFingerprintMismatch", err)
		}
		if n := calls.Load(); n != 1 {
			t.Errorf("fn ran %d times, want 1", n)
		}
	})
}

// TestConcurrentDuplicatesWaitAndReplay sends one key from 12 goroutines
// at once, at READ COMMITTED (the key's lock) and SERIALIZABLE (the claim
// written before fn): fn runs once, and every duplicate waits for it and
// gets its answer.
func TestConcurrentDuplicatesWaitAndReplay(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.Serializable} {
			const n = 12
			key := "storm-" + string(iso)
			var calls atomic.Int64
			release := make(chan struct{})
			fn := func(ctx context.Context, tx *sql.Tx) (payment, error) {
				<-release
				return pay(scope, key, 100, &calls)(ctx, tx)
			}
			results := make([]idem.Result[payment], n)
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					results[i], errs[i] = idemsql.Run(ctx, db, scope, key, fpA, fn,
						idem.WithWait(time.Minute), idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso}))
				})
			}
			if iso == pgx.ReadCommitted {
				// Every duplicate waits on the key's lock before fn ends.
				waitForKeyWaiters(t, ctx, pool, scope, key, n-1)
			}
			close(release)
			wg.Wait()
			fresh := 0
			for i := range n {
				if errs[i] != nil {
					t.Fatalf("%s: call %d: %v", iso, i, errs[i])
				}
				if !results[i].Replayed {
					fresh++
				}
				if results[i].Value != results[0].Value {
					t.Errorf("%s: call %d got %+v, call 0 %+v", iso, i, results[i].Value, results[0].Value)
				}
			}
			// At SERIALIZABLE a transaction that ran fn may still fail to
			// commit (SSI's conflicts among the duplicates' reads), and
			// Run retries it: fn's writes roll back with it, so the count
			// that must be one is the effects', as on pgx
			// (TestRunSerializableStormReplays). At READ COMMITTED the
			// key's lock lets one fn run.
			if fresh != 1 || (iso == pgx.ReadCommitted && calls.Load() != 1) {
				t.Errorf("%s: %d first executions, fn ran %d times; want 1 and 1", iso, fresh, calls.Load())
			}
			if n := countPaymentsOfKey(t, ctx, pool, scope, key); n != 1 {
				t.Errorf("%s: %d payments of the key, want 1 (fn ran %d times)", iso, n, calls.Load())
			}
		}
		if n := testdb.CountPayments(t, pool, scope); n != 2 {
			t.Errorf("%d payments, want 2 (one per key)", n)
		}
	})
}

// TestADuplicatePastItsWaitGetsErrInProgress holds a key in the caller's
// own transaction (Do) and sends a duplicate with a short wait: the
// driver's lock_not_available becomes ErrInProgress, with lib/pq too.
func TestADuplicatePastItsWaitGetsErrInProgress(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := idemsql.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 100, &calls)); err != nil {
			t.Fatal(err)
		}
		_, err = idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 100, &calls), idem.WithWait(50*time.Millisecond))
		if !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("err = %v, want ErrInProgress", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		res, err := idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 100, &calls))
		if err != nil || !res.Replayed {
			t.Fatalf("after the holder committed: %+v, %v; want a replay", res, err)
		}
	})
}

func TestAnExpiredKeyRunsAgain(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		if _, err := idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 100, &calls)); err != nil {
			t.Fatal(err)
		}
		testdb.Expire(t, pool, scope, "k")
		// The other driver's subtest purges too: either purge may remove
		// this record.
		if _, err := idem.Purge(ctx, idemsql.Beginner(db), 100); err != nil {
			t.Fatalf("Purge on Beginner(db): %v", err)
		}
		if n := testdb.CountRecords(t, pool, scope); n != 0 {
			t.Fatalf("%d records after the purge, want 0", n)
		}
		res, err := idemsql.Run(ctx, db, scope, "k", fpB, pay(scope, "k", 200, &calls))
		if err != nil || res.Replayed {
			t.Fatalf("after expiry: %+v, %v; want a first execution, even with another fingerprint", res, err)
		}
		if n := calls.Load(); n != 2 {
			t.Errorf("fn ran %d times, want 2", n)
		}
	})
}

// TestDoInTheCallersTransaction uses idem inside a transaction the caller
// (an ORM) began: the claim, the write and a nested Do of the same key by
// repository code all commit with the caller's COMMIT, or vanish with its
// ROLLBACK.
func TestDoInTheCallersTransaction(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		attempt := func(commit bool) idem.Result[payment] {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			res, err := idemsql.Do(ctx, tx, scope, "k", fpA, func(ctx context.Context, tx *sql.Tx) (payment, error) {
				// Repository code that guards itself with the same key
				// joins the enclosing call.
				inner, err := idemsql.Do(ctx, tx, scope, "k", nil, pay(scope, "k", 100, &calls))
				if err != nil {
					return payment{}, err
				}
				if inner.Replayed {
					t.Error("the nested Do replayed: want it to join the enclosing call")
				}
				return inner.Value, nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if commit {
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			return res
		}
		attempt(false)
		if n := testdb.CountPayments(t, pool, scope) + testdb.CountRecords(t, pool, scope); n != 0 {
			t.Fatalf("%d rows after the caller rolled back, want 0", n)
		}
		first := attempt(true)
		again := attempt(true)
		if first.Replayed || !again.Replayed || again.Value != first.Value {
			t.Fatalf("first %+v, again %+v: want a first execution, then its replay", first, again)
		}
		if n := testdb.CountPayments(t, pool, scope); n != 1 {
			t.Errorf("%d payments, want 1", n)
		}
	})
}

func TestOnceAndAdvance(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var handled atomic.Int64
		for i := range 3 {
			err := idemsql.WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx *sql.Tx) error {
				ran, err := idemsql.Once(ctx, tx, scope, "event-1", func(ctx context.Context, tx *sql.Tx) error {
					handled.Add(1)
					_, err := tx.ExecContext(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'event-1', 1)`, scope)
					return err
				})
				if ran != (i == 0) {
					t.Errorf("delivery %d: ran = %v", i, ran)
				}
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		if handled.Load() != 1 || testdb.CountPayments(t, pool, scope) != 1 {
			t.Errorf("handled %d times, %d payments; want 1 and 1", handled.Load(), testdb.CountPayments(t, pool, scope))
		}

		for _, step := range []struct {
			version int64
			applied bool
		}{{1, true}, {1, false}, {3, true}, {2, false}} {
			err := idemsql.WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx *sql.Tx) error {
				applied, err := idemsql.Advance(ctx, tx, scope, "order-1", step.version)
				if applied != step.applied {
					t.Errorf("version %d: applied = %v, want %v", step.version, applied, step.applied)
				}
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		err := idemsql.WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx *sql.Tx) error {
			_, err := idemsql.Advance(ctx, tx, scope, "order-1", -1)
			return err
		})
		if !errors.Is(err, idem.ErrInvalidVersion) {
			t.Errorf("version -1: %v, want ErrInvalidVersion", err)
		}
	})
}

// TestWhatDatabaseSQLCannotCarryIsRefused: transaction options database/sql
// cannot express are refused before anything is sent, and bad input as on
// pgx.
func TestWhatDatabaseSQLCannotCarryIsRefused(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		for _, o := range []pgx.TxOptions{
			{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly, DeferrableMode: pgx.Deferrable},
			{BeginQuery: "begin isolation level serializable"},
			{CommitQuery: "commit and chain"},
		} {
			_, err := idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 1, &calls), idem.WithTxOptions(o))
			if !errors.Is(err, idem.ErrInvalidOption) {
				t.Errorf("%+v: err = %v, want ErrInvalidOption", o, err)
			}
		}
		_, err := idemsql.Run(ctx, db, scope, "", fpA, pay(scope, "k", 1, &calls))
		if !errors.Is(err, idem.ErrInvalidKey) {
			t.Errorf("empty key: %v, want ErrInvalidKey", err)
		}
		_, err = idemsql.Run(ctx, db, scope, "k", fpA, pay(scope, "k", 1, &calls),
			idem.WithTxOptions(pgx.TxOptions{AccessMode: pgx.ReadOnly}))
		if !errors.Is(err, idem.ErrReadOnly) {
			t.Errorf("read-only transaction: %v, want ErrReadOnly", err)
		}
		if calls.Load() != 0 {
			t.Errorf("fn ran %d times, want 0", calls.Load())
		}

		// What a pgx.Tx does beyond statements has no database/sql form.
		tx, err := idemsql.Beginner(db).BeginTx(ctx, pgx.TxOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Begin(ctx); !errors.Is(err, idemsql.ErrUnsupported) {
			t.Errorf("Begin (a savepoint): %v, want ErrUnsupported", err)
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"payment"}, []string{"scope"}, pgx.CopyFromRows(nil)); !errors.Is(err, errors.ErrUnsupported) {
			t.Errorf("CopyFrom: %v, want errors.ErrUnsupported", err)
		}
	})
}

// TestATransactionHoldsAtMostMaxKeyLocks claims more keys than
// idem.MaxKeyLocks in one *sql.Tx: the count of key locks lives with the
// *sql.Tx, so the rest are claimed without a lock, as on pgx.
func TestATransactionHoldsAtMostMaxKeyLocks(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		for i := range idem.MaxKeyLocks + 8 {
			key := "k" + strconv.Itoa(i)
			if _, err := idemsql.Do(ctx, tx, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
				t.Fatal(err)
			}
		}
		var held int
		if err := tx.QueryRowContext(ctx,
			`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&held); err != nil {
			t.Fatal(err)
		}
		if held != idem.MaxKeyLocks {
			t.Errorf("%d key locks held, want %d", held, idem.MaxKeyLocks)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if n := testdb.CountRecords(t, pool, scope); n != idem.MaxKeyLocks+8 {
			t.Errorf("%d records, want %d", n, idem.MaxKeyLocks+8)
		}
	})
}

// TestOptionsActAsOnPgx: the options that shape a call's statements work
// through database/sql as on pgx.
func TestOptionsActAsOnPgx(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var calls atomic.Int64
		for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
			key := "idle-" + string(iso)
			opts := []idem.Option{idem.WithIdleTimeout(time.Minute), idem.WithRetention(time.Hour),
				idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso})}
			first, err := idemsql.Run(ctx, db, scope, key, fpA, pay(scope, key, 1, &calls), opts...)
			if err != nil || first.Replayed {
				t.Fatalf("%s: %+v, %v; want a first execution", iso, first, err)
			}
			again, err := idemsql.Run(ctx, db, scope, key, fpA, pay(scope, key, 1, &calls), opts...)
			if err != nil || !again.Replayed || again.Value != first.Value {
				t.Fatalf("%s: %+v, %v; want the replay of %+v", iso, again, err, first.Value)
			}
		}
		var hours float64
		if err := pool.QueryRow(ctx, `SELECT extract(epoch FROM expires_at - created_at) / 3600 FROM idempotency_key WHERE scope = $1 AND key = 'idle-read committed'`,
			scope).Scan(&hours); err != nil {
			t.Fatal(err)
		}
		if hours < 0.99 || hours > 1.01 {
			t.Errorf("the record lives %.2f hours, want WithRetention's 1", hours)
		}
		info, err := idem.Inspect(ctx, idemsql.Beginner(db), scope, "idle-read committed")
		if err != nil || !info.Found || info.State != "done" || string(info.Fingerprint) != string(fpA) {
			t.Errorf("Inspect on Beginner(db): %+v, %v; want the done record", info, err)
		}
		stats, err := idem.ReadStats(ctx, idemsql.Beginner(db))
		if err != nil || stats.Done < 3 {
			t.Errorf("ReadStats on Beginner(db): %+v, %v; want at least this test's 3 keys", stats, err)
		}
		_, err = idemsql.Run(ctx, db, scope, "big", fpA, func(context.Context, *sql.Tx) (string, error) {
			return strings.Repeat("x", 2048), nil
		}, idem.WithMaxResponseSize(1024))
		if !errors.Is(err, idem.ErrResponseTooLarge) {
			t.Errorf("a value over WithMaxResponseSize: %v, want ErrResponseTooLarge", err)
		}
	})
}

// TestOnceEachClaimsABatch: a batch of messages in one *sql.Tx runs each
// id not handled before once, in order; a redelivery runs only the new
// ones; a failure for one id leaves nothing of the batch once rolled
// back, and the redelivery runs it all.
func TestOnceEachClaimsABatch(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		deliver := func(ids []string, failAt string) ([]bool, []string, error) {
			var ran []bool
			var order []string
			err := idemsql.WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx *sql.Tx) error {
				order = nil
				var err error
				ran, err = idemsql.OnceEach(ctx, tx, scope, ids, func(ctx context.Context, tx *sql.Tx, i int) error {
					order = append(order, ids[i])
					if ids[i] == failAt {
						return errBoom
					}
					_, err := tx.ExecContext(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, scope, ids[i])
					return err
				})
				return err
			})
			return ran, order, err
		}

		ran, order, err := deliver([]string{"m1", "m2", "m1", "m3"}, "")
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ran, []bool{true, true, false, true}) || !slices.Equal(order, []string{"m1", "m2", "m3"}) {
			t.Errorf("first delivery: ran %v, order %v; want [true true false true], [m1 m2 m3]", ran, order)
		}
		ran, order, err = deliver([]string{"m2", "m4", "m3"}, "")
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ran, []bool{false, true, false}) || !slices.Equal(order, []string{"m4"}) {
			t.Errorf("redelivery: ran %v, order %v; want [false true false], [m4]", ran, order)
		}

		_, _, err = deliver([]string{"m5", "m6", "m7"}, "m6")
		if !errors.Is(err, errBoom) {
			t.Fatalf("a failing message: %v, want errBoom", err)
		}
		ran, order, err = deliver([]string{"m5", "m6", "m7"}, "")
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ran, []bool{true, true, true}) || !slices.Equal(order, []string{"m5", "m6", "m7"}) {
			t.Errorf("after the failed batch: ran %v, order %v; want all three", ran, order)
		}
		if n := testdb.CountPayments(t, pool, scope); n != 7 {
			t.Errorf("%d payments, want 7: one per message", n)
		}
		if n := testdb.CountRecords(t, pool, scope); n != 7 {
			t.Errorf("%d records, want 7", n)
		}
	})
}

// TestOncePastMaxKeyLocksThatFailsLeavesNoRecord: past idem.MaxKeyLocks
// keys a Once writes its record complete before fn; when fn fails the
// record is removed, so that a caller who commits anyway has not marked
// the message handled.
func TestOncePastMaxKeyLocksThatFailsLeavesNoRecord(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		for i := range idem.MaxKeyLocks {
			if _, err := idemsql.Once(ctx, tx, scope, "m"+strconv.Itoa(i), func(context.Context, *sql.Tx) error { return nil }); err != nil {
				t.Fatal(err)
			}
		}
		ran, err := idemsql.Once(ctx, tx, scope, "failing", func(context.Context, *sql.Tx) error { return errBoom })
		if ran || !errors.Is(err, errBoom) {
			t.Fatalf("ran %v, %v; want fn's error", ran, err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if n := testdb.CountRecords(t, pool, scope); n != idem.MaxKeyLocks {
			t.Errorf("%d records, want %d: none for the message whose fn failed", n, idem.MaxKeyLocks)
		}
		err = idemsql.WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx *sql.Tx) error {
			ran, err = idemsql.Once(ctx, tx, scope, "failing", func(context.Context, *sql.Tx) error { return nil })
			return err
		})
		if err != nil || !ran {
			t.Errorf("redelivery: ran %v, %v; want it to run", ran, err)
		}
	})
}

// countPaymentsOfKey counts the payments written for one key of scope.
func countPaymentsOfKey(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payment WHERE scope = $1 AND key = $2`, scope, key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestASerializationFailureInTheFunctionIsRetried: a serialization failure
// raised by the function's own statement, returned as the driver's error
// (lib/pq's *pq.Error), is retried by Run and WithTx as on pgx, and the
// driver's error stays in the chain.
func TestASerializationFailureInTheFunctionIsRetried(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		const raise = `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$`
		var calls atomic.Int64
		res, err := idemsql.Run(ctx, db, scope, "k", fpA, func(ctx context.Context, tx *sql.Tx) (payment, error) {
			if calls.Load() == 0 {
				calls.Add(1)
				_, err := tx.ExecContext(ctx, raise)
				return payment{}, err
			}
			return pay(scope, "k", 100, &calls)(ctx, tx)
		})
		if err != nil || res.Replayed || calls.Load() != 2 {
			t.Errorf("Run: %+v, %v, fn ran %d times; want a first execution on the second attempt", res, err, calls.Load())
		}
		calls.Store(0)
		err = idemsql.WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx *sql.Tx) error {
			if calls.Add(1) == 1 {
				_, err := tx.ExecContext(ctx, raise)
				return err
			}
			return nil
		})
		if err != nil || calls.Load() != 2 {
			t.Errorf("WithTx: %v, fn ran %d times; want success on the second attempt", err, calls.Load())
		}
		// Once in the caller's transaction: not retried, but recognised.
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		_, err = idemsql.Once(ctx, tx, scope, "m", func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, raise)
			return err
		})
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "40001" {
			t.Errorf("Once: %v; want the failure with its SQLSTATE as a *pgconn.PgError", err)
		}
	})
}
