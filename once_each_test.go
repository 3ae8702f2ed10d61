package idem_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// batchOf returns the ids from-(to-1) of a batch, as holdBatch names them.
func batchOf(from, to int) []string {
	ids := make([]string, 0, to-from)
	for i := from; i < to; i++ {
		ids = append(ids, fmt.Sprintf("m-%d", i))
	}
	return ids
}

// applyBatch applies ids in one transaction with OnceEach, each message's
// effect a payment row, and returns ran and how many functions ran.
func applyBatch(ctx context.Context, pool *pgxpool.Pool, scope string, ids []string, opts ...idem.Option) ([]bool, int64, error) {
	var calls atomic.Int64
	var ran []bool
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		calls.Store(0)
		var err error
		ran, err = idem.OnceEach(ctx, tx, scope, ids, payEach(scope, ids, &calls), opts...)
		return err
	})
	return ran, calls.Load(), err
}

// payEach is a batch's function: one payment row per message.
func payEach(scope string, ids []string, calls *atomic.Int64) func(context.Context, pgx.Tx, int) error {
	return func(ctx context.Context, tx pgx.Tx, i int) error {
		calls.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, scope, ids[i])
		return err
	}
}

func count(ran []bool) int {
	n := 0
	for _, r := range ran {
		if r {
			n++
		}
	}
	return n
}

func TestOnceEachRedeliveredBatchIsANoOp(t *testing.T) {
	ctx, pool, scope := setup(t)
	ran, calls, err := applyBatch(ctx, pool, scope, batchOf(0, 50))
	if err != nil || calls != 50 || count(ran) != 50 {
		t.Fatalf("first delivery: %v, %d calls, %d ran; want 50", err, calls, count(ran))
	}
	ran, calls, err = applyBatch(ctx, pool, scope, batchOf(0, 50))
	if err != nil || calls != 0 || count(ran) != 0 {
		t.Fatalf("redelivery: %v, %d calls, %d ran; want none", err, calls, count(ran))
	}
	// A batch half redelivered, half new: only the new half runs.
	ran, calls, err = applyBatch(ctx, pool, scope, batchOf(25, 75))
	if err != nil || calls != 25 || !slices.Equal(ran, append(make([]bool, 25), slices.Repeat([]bool{true}, 25)...)) {
		t.Fatalf("half redelivered: %v, %d calls, ran %v; want the last 25", err, calls, ran)
	}
	// Once sees OnceEach's records, and OnceEach sees Once's.
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		r, err := idem.Once(ctx, tx, scope, "m-74", func(context.Context, pgx.Tx) error { return nil })
		if err == nil && r {
			t.Error("Once ran a message OnceEach had handled")
		}
		if err == nil {
			_, err = idem.Once(ctx, tx, scope, "m-75", func(context.Context, pgx.Tx) error { return nil })
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if ran, calls, err := applyBatch(ctx, pool, scope, batchOf(75, 76)); err != nil || calls != 0 || ran[0] {
		t.Fatalf("a message Once handled: %v, %d calls, ran %v", err, calls, ran)
	}
	if n := countPayments(t, pool, scope); n != 75 {
		t.Fatalf("%d payments, want 75", n)
	}
	if n := countRecords(t, pool, scope); n != 76 {
		t.Fatalf("%d records, want 76", n)
	}
}

func TestOnceEachRunsARepeatedIdOnce(t *testing.T) {
	ctx, pool, scope := setup(t)
	ids := []string{"a", "b", "a", "c", "b", "a"}
	ran, calls, err := applyBatch(ctx, pool, scope, ids)
	if err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, true, false, true, false, false}; !slices.Equal(ran, want) || calls != 3 {
		t.Fatalf("ran %v with %d calls, want %v with 3", ran, calls, want)
	}
	if n := countPayments(t, pool, scope); n != 3 {
		t.Fatalf("%d payments, want 3", n)
	}
}

func TestOnceEachRollbackFreesTheKeys(t *testing.T) {
	ctx, pool, scope := setup(t)
	ids := batchOf(0, 30)
	errRollback := errors.New("roll back")
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		var calls atomic.Int64
		if _, err := idem.OnceEach(ctx, tx, scope, ids, payEach(scope, ids, &calls)); err != nil {
			return err
		}
		return errRollback
	})
	if !errors.Is(err, errRollback) {
		t.Fatal(err)
	}
	if ran, calls, err := applyBatch(ctx, pool, scope, ids); err != nil || calls != 30 || count(ran) != 30 {
		t.Fatalf("after a rollback: %v, %d calls, %d ran; want all 30", err, calls, count(ran))
	}
	if n := countPayments(t, pool, scope); n != 30 {
		t.Fatalf("%d payments, want 30", n)
	}
}

// TestOnceEachFailureRecordsOnlyWhatRan fails the function at the batch's
// 11th message and commits anyway, as a careless caller would: the first
// ten are recorded with their effects, and the rest are not, so a
// redelivery applies exactly the rest.
func TestOnceEachFailureRecordsOnlyWhatRan(t *testing.T) {
	ctx, pool, scope := setup(t)
	ids := batchOf(0, 20)
	errPoison := errors.New("cannot apply")
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var calls atomic.Int64
	ran, err := idem.OnceEach(ctx, tx, scope, ids, func(ctx context.Context, tx pgx.Tx, i int) error {
		if i == 10 {
			return errPoison
		}
		return payEach(scope, ids, &calls)(ctx, tx, i)
	})
	if !errors.Is(err, errPoison) || count(ran) != 10 || ran[10] {
		t.Fatalf("OnceEach: %v, ran %v; want errPoison after 10", err, ran)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countRecords(t, pool, scope); n != 10 {
		t.Fatalf("%d records committed, want the 10 that ran", n)
	}
	ran, n, err := applyBatch(ctx, pool, scope, ids)
	if err != nil || n != 10 || slices.Contains(ran[:10], true) {
		t.Fatalf("redelivery: %v, %d calls, ran %v; want the last 10", err, n, ran)
	}
	if n := countPayments(t, pool, scope); n != 20 {
		t.Fatalf("%d payments, want 20", n)
	}

	// A panic removes the records of what did not run, and goes on.
	ids = batchOf(100, 110)
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the panic did not go on")
			}
		}()
		_, _ = idem.OnceEach(ctx, tx, scope, ids, func(ctx context.Context, tx pgx.Tx, i int) error {
			if i == 5 {
				panic("handler bug")
			}
			return nil
		})
	}()
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countRecords(t, pool, scope); n != 25 {
		t.Fatalf("%d records after a panic at message 5, want the 20 before and 5 that ran", n)
	}
}

// TestOnceEachOverlapsAnotherConsumersOpenBatch delivers a batch that
// shares messages with another consumer's batch, applied with Once per
// message and still open: messages it holds on its key locks and messages
// past idem.MaxKeyLocks, which it holds on records in progress. While the
// other batch stays open, the batch gives ErrInProgress within its budget
// (the test fails if it returns only once the other batch ended), having
// run nothing. When the other batch commits during the wait, the shared
// messages count as handled and only the others run; when it rolls back,
// all run.
func TestOnceEachOverlapsAnotherConsumersOpenBatch(t *testing.T) {
	ctx, pool, scope := setup(t)
	const held = idem.MaxKeyLocks + 4
	for _, tc := range []struct {
		name string
		ids  []string
	}{
		{"within the lock bound", batchOf(0, 3)},
		{"beyond the lock bound", batchOf(held-3, held)},
	} {
		t.Run(tc.name+", still open", func(t *testing.T) {
			scope := scope + tc.name
			open, end := holdBatch(t, ctx, pool, scope, held)
			watchdog := time.AfterFunc(time.Minute, func() { end(false) })
			defer watchdog.Stop()
			ids := append(slices.Clone(tc.ids), "fresh-1", "fresh-2")
			ran, calls, err := applyBatch(ctx, pool, scope, ids, idem.WithWait(300*time.Millisecond))
			if !open() {
				t.Fatalf("the batch returned (%v) only once the other batch had ended", err)
			}
			if !errors.Is(err, idem.ErrInProgress) || calls != 0 || ran != nil {
				t.Fatalf("batch: %v, %d calls, ran %v; want ErrInProgress and nothing run", err, calls, ran)
			}
		})
		for _, commit := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s, other batch commits=%v", tc.name, commit), func(t *testing.T) {
				scope := fmt.Sprintf("%s %s %v", scope, tc.name, commit)
				_, end := holdBatch(t, ctx, pool, scope, held)
				ids := append(slices.Clone(tc.ids), "fresh-1", "fresh-2")
				type result struct {
					ran   []bool
					calls int64
					err   error
				}
				done := make(chan result, 1)
				go func() {
					ran, calls, err := applyBatch(ctx, pool, scope, ids, idem.WithWait(time.Minute))
					done <- result{ran, calls, err}
				}()
				waitForLockWaiters(t, ctx, pool)
				end(commit)
				r := <-done
				if r.err != nil {
					t.Fatal(r.err)
				}
				want := []bool{!commit, !commit, !commit, true, true}
				if !slices.Equal(r.ran, want) || r.calls != int64(count(want)) {
					t.Fatalf("ran %v with %d calls, want %v", r.ran, r.calls, want)
				}
			})
		}
	}
}

// waitForLockWaiters waits until a batch claim in the test database wait
// for a lock: progress, not a clock, says that a call is waiting.
func waitForLockWaiters(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	t.Helper()
	waitForStatementToWait(t, ctx, pool, "KeyClaimBatch")
}

// waitForStatementToWait waits until a session of the test database
// running the sqlc query named name waits for a lock. The name is looked
// for anywhere in the session's text: in pgx's simple protocol a batch is
// one multi-statement query that starts with its first statement.
func waitForStatementToWait(t *testing.T, ctx context.Context, pool *pgxpool.Pool, name string) {
	t.Helper()
	for {
		var waiting int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			WHERE NOT l.granted AND a.datname = current_database() AND a.query LIKE '%-- name: ' || $1 || ' %'`, name).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no session waits for a lock in %s: %v", name, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// waitForBackendToWait waits until the server process pid waits for a
// lock.
func waitForBackendToWait(t *testing.T, ctx context.Context, pool *pgxpool.Pool, pid uint32) {
	t.Helper()
	for {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND NOT granted)`, int64(pid)).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("server process %d never waited for a lock: %v", pid, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// TestOnceEachConcurrentOverlappingBatches applies overlapping batches
// from many consumers at once, in shuffled orders: every message must be
// applied once, with no deadlock and no error.
func TestOnceEachConcurrentOverlappingBatches(t *testing.T) {
	ctx, pool, scope := setup(t)
	const consumers, size = 8, 60
	var effects atomic.Int64
	var wg sync.WaitGroup
	for c := range consumers {
		wg.Go(func() {
			ids := batchOf(c*size/3, c*size/3+size)
			// Each consumer sees its batch in another order.
			for i := range ids {
				j := (i*7 + c*13) % len(ids)
				ids[i], ids[j] = ids[j], ids[i]
			}
			_, calls, err := applyBatch(ctx, pool, scope, ids, idem.WithWait(time.Minute))
			if err != nil {
				t.Error(err)
			}
			effects.Add(calls)
		})
	}
	wg.Wait()
	want := (consumers-1)*size/3 + size
	if effects.Load() != int64(want) || countPayments(t, pool, scope) != want || countRecords(t, pool, scope) != want {
		t.Fatalf("%d effects, %d payments, %d records; want %d each",
			effects.Load(), countPayments(t, pool, scope), countRecords(t, pool, scope), want)
	}
}

// TestOnceEachAndOnceOnOneMessage has a Once hold a message on its key
// lock, its function running, when a batch with that message arrives: the
// batch claims it (Once has written no record yet) and applies it; the
// Once, storing its record, waits for the batch within its budget, and
// fails, its writes rolled back. The message is applied once.
func TestOnceEachAndOnceOnOneMessage(t *testing.T) {
	ctx, pool, scope := setup(t)
	inFn, release := make(chan struct{}), make(chan struct{})
	onceErr := make(chan error, 1)
	var effects atomic.Int64
	go func() {
		onceErr <- idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.Once(ctx, tx, scope, "m-0", func(ctx context.Context, tx pgx.Tx) error {
				close(inFn)
				<-release
				return payEach(scope, []string{"m-0"}, &effects)(ctx, tx, 0)
			}, idem.WithWait(300*time.Millisecond))
			return err
		})
	}()
	<-inFn
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	ran, err := idem.OnceEach(ctx, tx, scope, []string{"m-0"}, payEach(scope, []string{"m-0"}, &effects))
	if err != nil || !ran[0] {
		t.Fatalf("batch: %v, ran %v", err, ran)
	}
	close(release)
	if err := <-onceErr; !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("Once: %v, want ErrInProgress", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countPayments(t, pool, scope); n != 1 {
		t.Fatalf("%d payments, want 1", n)
	}
}

// TestOnceEachTakesNoLockTableEntryPerMessage applies a batch of 2,000
// messages and counts the advisory locks its transaction holds: none.
func TestOnceEachTakesNoLockTableEntryPerMessage(t *testing.T) {
	ctx, pool, scope := setup(t)
	ids := batchOf(0, 2000)
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		var calls atomic.Int64
		if _, err := idem.OnceEach(ctx, tx, scope, ids, payEach(scope, ids, &calls)); err != nil {
			return err
		}
		var locks int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'`).Scan(&locks); err != nil {
			return err
		}
		if locks != 0 {
			t.Errorf("the batch's transaction holds %d advisory locks, want 0", locks)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestOnceEachTakesOverExpiredRecordsAndRefusesMismatches(t *testing.T) {
	ctx, pool, scope := setup(t)
	if _, _, err := applyBatch(ctx, pool, scope, batchOf(0, 3)); err != nil {
		t.Fatal(err)
	}
	expire(t, pool, scope, "m-1")
	ran, calls, err := applyBatch(ctx, pool, scope, batchOf(0, 4))
	if err != nil || calls != 2 || !slices.Equal(ran, []bool{false, true, false, true}) {
		t.Fatalf("after m-1 expired: %v, %d calls, ran %v", err, calls, ran)
	}

	var doCalls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "paid", fpA, pay(scope, "paid", 1, &doCalls)); err != nil {
		t.Fatal(err)
	}
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		var calls atomic.Int64
		ids := []string{"new-1", "paid"}
		_, err := idem.OnceEach(ctx, tx, scope, ids, payEach(scope, ids, &calls))
		if !errors.Is(err, idem.ErrFingerprintMismatch) || calls.Load() != 0 {
			t.Errorf("a key Do recorded: %v, %d calls; want ErrFingerprintMismatch and none", err, calls.Load())
		}
		// The transaction stays usable, with nothing of the batch in it.
		var n int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM idempotency_key WHERE scope = $1 AND key = 'new-1'`, scope).Scan(&n); err != nil || n != 0 {
			t.Errorf("after the mismatch: %v, %d records of the batch", err, n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestOnceEachRestoresTheCallersLockTimeout(t *testing.T) {
	ctx, pool, scope := setup(t)
	_, _, _ = applyBatch(ctx, pool, scope, batchOf(0, 5))
	expire(t, pool, scope, "m-0")
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`); err != nil {
			return err
		}
		// New, redelivered and expired messages: all three statements.
		if _, err := idem.OnceEach(ctx, tx, scope, batchOf(0, 10), func(context.Context, pgx.Tx, int) error { return nil },
			idem.WithWait(300*time.Millisecond)); err != nil {
			return err
		}
		var got string
		if err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got); err != nil {
			return err
		}
		if got != "7s" {
			t.Errorf("lock_timeout = %s after OnceEach, want the caller's 7s", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestOnceEachRejectsBadBatchesBeforeTheDatabase(t *testing.T) {
	ctx := context.Background()
	noop := func(context.Context, pgx.Tx, int) error { t.Error("fn ran"); return nil }
	for _, tc := range []struct {
		name  string
		scope string
		ids   []string
		want  []error
	}{
		{"an empty id", "s", []string{"a", ""}, []error{idem.ErrInvalidBatch, idem.ErrInvalidKey}},
		{"an id too long", "s", []string{strings.Repeat("x", idem.MaxKeyLength+1)}, []error{idem.ErrInvalidBatch, idem.ErrInvalidKey}},
		{"an id with a NUL", "s", []string{"a\x00b"}, []error{idem.ErrInvalidBatch, idem.ErrInvalidKey}},
		{"too many ids", "s", batchOf(0, idem.MaxBatch+1), []error{idem.ErrInvalidBatch}},
		{"an empty scope", "", []string{"a"}, []error{idem.ErrInvalidScope}},
	} {
		ran, err := idem.OnceEach(ctx, panicTx{}, tc.scope, tc.ids, noop)
		for _, want := range tc.want {
			if !errors.Is(err, want) {
				t.Errorf("%s: %v, want %v", tc.name, err, want)
			}
		}
		if ran != nil {
			t.Errorf("%s: ran %v, want nil", tc.name, ran)
		}
	}
	if _, err := idem.OnceEach(ctx, panicTx{}, "s", []string{"a"}, noop, idem.WithRetention(0)); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("an invalid option: %v", err)
	}
	if ran, err := idem.OnceEach(ctx, panicTx{}, "s", nil, noop); err != nil || len(ran) != 0 {
		t.Errorf("an empty batch: %v, %v; want nothing sent, nothing run", ran, err)
	}
}
