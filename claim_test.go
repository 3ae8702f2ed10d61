package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// keyLocksHeld counts the advisory locks tx's own session holds.
func keyLocksHeld(t *testing.T, ctx context.Context, tx pgx.Tx) int {
	t.Helper()
	var n int
	if err := tx.QueryRow(ctx,
		`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted`,
	).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// onceAll runs Once for n keys named prefix-i in tx, counting the runs.
func onceAll(t *testing.T, ctx context.Context, tx pgx.Tx, scope, prefix string, n int, ran *atomic.Int64) {
	t.Helper()
	for i := range n {
		if _, err := idem.Once(ctx, tx, scope, fmt.Sprintf("%s-%d", prefix, i), func(context.Context, pgx.Tx) error {
			ran.Add(1)
			return nil
		}); err != nil {
			t.Fatalf("Once %s-%d: %v", prefix, i, err)
		}
	}
}

// TestATransactionHoldsAtMostMaxKeyLocks claims many more keys than
// MaxKeyLocks in one transaction, at every isolation level, and then
// replays them all: the first holds MaxKeyLocks advisory locks, the replay
// none, and every key is recorded once.
func TestATransactionHoldsAtMostMaxKeyLocks(t *testing.T) {
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			ctx, pool, scope := setup(t)
			const keys = 10 * idem.MaxKeyLocks
			var ran atomic.Int64
			opts := pgx.TxOptions{IsoLevel: iso}
			err := pgx.BeginTxFunc(ctx, pool, opts, func(tx pgx.Tx) error {
				onceAll(t, ctx, tx, scope, "k", keys, &ran)
				if n := keyLocksHeld(t, ctx, tx); n != idem.MaxKeyLocks {
					t.Errorf("after %d claims the transaction holds %d advisory locks, want %d", keys, n, idem.MaxKeyLocks)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if got := countRecords(t, pool, scope); got != keys {
				t.Errorf("%d records, want %d", got, keys)
			}
			err = pgx.BeginTxFunc(ctx, pool, opts, func(tx pgx.Tx) error {
				onceAll(t, ctx, tx, scope, "k", keys, &ran)
				if n := keyLocksHeld(t, ctx, tx); n != 0 {
					t.Errorf("replaying %d keys holds %d advisory locks, want 0", keys, n)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if got := ran.Load(); got != keys {
				t.Errorf("fn ran %d times for %d keys, want once each", got, keys)
			}
		})
	}
}

// TestANewTransactionCountsItsLocksAfresh runs two full transactions one
// after the other on one connection: the second may lock again.
func TestANewTransactionCountsItsLocksAfresh(t *testing.T) {
	ctx, pool, scope := setup(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var ran atomic.Int64
	for round := range 2 {
		err := pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{}, func(tx pgx.Tx) error {
			onceAll(t, ctx, tx, scope, fmt.Sprintf("r%d", round), 2*idem.MaxKeyLocks, &ran)
			if n := keyLocksHeld(t, ctx, tx); n != idem.MaxKeyLocks {
				t.Errorf("round %d holds %d advisory locks, want %d", round, n, idem.MaxKeyLocks)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// holdPastTheLocks begins a transaction on pool that claims MaxKeyLocks
// filler keys, then key with fn: that claim is a record in progress. It
// returns the transaction, still open.
func holdPastTheLocks(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string, calls *atomic.Int64) pgx.Tx {
	t.Helper()
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var filler atomic.Int64
	onceAll(t, ctx, tx, scope, "filler-"+key, idem.MaxKeyLocks, &filler)
	if _, err := idem.Do(ctx, tx, scope, key, fpA, pay(scope, key, 100, calls)); err != nil {
		t.Fatal(err)
	}
	return tx
}

// TestADuplicateWaitsOnARecordInProgress holds a key claimed past the lock
// limit, so by its record in progress, and sends duplicates that are past
// the limit too: they wait, then replay when the holder commits, or run
// when it rolls back, or give up past their wait budget.
func TestADuplicateWaitsOnARecordInProgress(t *testing.T) {
	for _, end := range []string{"commit", "rollback", "budget"} {
		t.Run(end, func(t *testing.T) {
			ctx, pool, scope := setup(t)
			var calls atomic.Int64
			holder := holdPastTheLocks(t, ctx, pool, scope, "k", &calls)

			type outcome struct {
				res idem.Result[payment]
				err error
			}
			started := make(chan struct{})
			done := make(chan outcome, 1)
			go func() {
				tx, err := pool.BeginTx(ctx, pgx.TxOptions{})
				if err != nil {
					done <- outcome{err: err}
					return
				}
				defer func() { _ = tx.Rollback(context.Background()) }()
				var filler atomic.Int64
				onceAll(t, ctx, tx, scope, "dup-filler", idem.MaxKeyLocks, &filler)
				close(started)
				wait := idem.WithWait(time.Minute)
				if end == "budget" {
					wait = idem.WithWait(50 * time.Millisecond)
				}
				res, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 100, &calls), wait)
				if err == nil {
					err = tx.Commit(ctx)
				}
				done <- outcome{res, err}
			}()
			<-started
			if end == "budget" {
				got := <-done
				if !errors.Is(got.err, idem.ErrInProgress) {
					t.Fatalf("a duplicate past its wait budget got %v, want ErrInProgress", got.err)
				}
				return
			}
			waitForWaiters(t, ctx, pool, 1)
			if end == "commit" {
				if err := holder.Commit(ctx); err != nil {
					t.Fatal(err)
				}
			} else {
				if err := holder.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
			}
			got := <-done
			if got.err != nil {
				t.Fatalf("duplicate: %v", got.err)
			}
			wantCalls, wantReplayed := int64(1), true
			if end == "rollback" {
				wantCalls, wantReplayed = 2, false
			}
			if got.res.Replayed != wantReplayed || calls.Load() != wantCalls {
				t.Errorf("duplicate after %s: replayed %v with fn run %d times, want %v and %d", end, got.res.Replayed, calls.Load(), wantReplayed, wantCalls)
			}
			if n := countPayments(t, pool, scope); n != 1 {
				t.Errorf("%d payments, want 1", n)
			}
		})
	}
}

// TestADuplicateOnItsLockFindsARecordInProgressWhenItStores holds a key by
// its record in progress, and sends Run for it, which claims on the key's
// lock: it cannot see the record until it stores its own, so its fn runs,
// but its transaction rolls back, and its retry replays the holder's
// answer. One payment.
func TestADuplicateOnItsLockFindsARecordInProgressWhenItStores(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	holder := holdPastTheLocks(t, ctx, pool, scope, "k", &calls)
	ran := make(chan struct{}, 10)
	done := make(chan error, 1)
	var res idem.Result[payment]
	go func() {
		var err error
		res, err = idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			ran <- struct{}{}
			return pay(scope, "k", 100, &calls)(ctx, tx)
		})
		done <- err
	}()
	<-ran
	waitForWaiters(t, ctx, pool, 1)
	if err := holder.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !res.Replayed {
		t.Error("the duplicate was not replayed")
	}
	if n := countPayments(t, pool, scope); n != 1 {
		t.Errorf("%d payments, want 1", n)
	}
}

// waitForWaiters waits until n sessions of the test's database wait for a
// lock (a row's transaction or a key's lock).
func waitForWaiters(t *testing.T, ctx context.Context, pool *pgxpool.Pool, n int) {
	t.Helper()
	for {
		var waiting int
		if err := pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			 WHERE NOT l.granted AND a.datname = current_database()`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting >= n {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d sessions waiting, want %d: %v", waiting, n, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// TestARecordCommittedInProgressIsTakenOver writes a record in progress and
// commits it, as no idem call does (a hand-written statement, an older
// version): the next call runs fn and records its answer, at every
// isolation level, rather than failing for the record's whole retention.
func TestARecordCommittedInProgressIsTakenOver(t *testing.T) {
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		t.Run(string(iso), func(t *testing.T) {
			ctx, pool, scope := setup(t)
			if _, err := pool.Exec(ctx,
				`INSERT INTO idempotency_key (scope, key, fingerprint, state, expires_at)
				 VALUES ($1, 'k', $2, 'in_progress', now() + interval '1 day')`, scope, fpB); err != nil {
				t.Fatal(err)
			}
			var calls atomic.Int64
			res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls),
				idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso}))
			if err != nil {
				t.Fatalf("a call over a record committed in progress: %v", err)
			}
			if res.Replayed || calls.Load() != 1 {
				t.Errorf("replayed %v, fn ran %d times; want a first execution", res.Replayed, calls.Load())
			}
			again, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls))
			if err != nil || !again.Replayed || again.Value != res.Value {
				t.Errorf("the retry got %+v, %v; want a replay of %+v", again, err, res.Value)
			}
		})
	}
}

// TestReadOnlyTransactionsAreRefused calls Do in read-only transactions,
// including the SERIALIZABLE READ ONLY DEFERRABLE one that used to fail
// with a raw driver error: each gets ErrReadOnly, nothing is locked, and
// the transaction stays usable.
func TestReadOnlyTransactionsAreRefused(t *testing.T) {
	ctx, pool, scope := setup(t)
	for _, opts := range []pgx.TxOptions{
		{AccessMode: pgx.ReadOnly},
		{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly},
		{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly, DeferrableMode: pgx.Deferrable},
	} {
		var calls atomic.Int64
		err := pgx.BeginTxFunc(ctx, pool, opts, func(tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 1, &calls))
			if !errors.Is(err, idem.ErrReadOnly) {
				t.Errorf("%+v: Do got %v, want ErrReadOnly", opts, err)
			}
			if n := keyLocksHeld(t, ctx, tx); n != 0 {
				t.Errorf("%+v: %d advisory locks held after the refusal", opts, n)
			}
			return nil
		})
		if err != nil {
			t.Errorf("%+v: the transaction was not usable after the refusal: %v", opts, err)
		}
		if calls.Load() != 0 {
			t.Errorf("%+v: fn ran", opts)
		}
	}
	_, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, new(atomic.Int64)),
		idem.WithTxOptions(pgx.TxOptions{AccessMode: pgx.ReadOnly}))
	if !errors.Is(err, idem.ErrReadOnly) {
		t.Errorf("Run in a read-only transaction got %v, want ErrReadOnly", err)
	}
}

// TestAReadOnlyTransactionAfterAFullOneIsRefusedCleanly runs, on one
// connection, a transaction that fills its count of key locks and then a
// read-only one: the count left from the first must not make the second's
// claim send the statement that writes a record past MaxKeyLocks, which a
// read-only transaction refuses with a raw error that aborts it.
func TestAReadOnlyTransactionAfterAFullOneIsRefusedCleanly(t *testing.T) {
	ctx, pool, scope := setup(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var ran atomic.Int64
	if err := pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{}, func(tx pgx.Tx) error {
		onceAll(t, ctx, tx, scope, "full", idem.MaxKeyLocks+1, &ran)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	err = pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 1, &calls)); !errors.Is(err, idem.ErrReadOnly) {
			t.Errorf("Do got %v, want ErrReadOnly", err)
		}
		return nil
	})
	if err != nil {
		t.Errorf("the read-only transaction was not usable after the refusal: %v", err)
	}
	if calls.Load() != 0 {
		t.Errorf("fn ran %d times, want 0", calls.Load())
	}
}

// TestIdleTimeoutFreesTheKeyOfAClientThatVanished claims a key through a
// proxy that then stops forwarding, without closing anything: the client
// is gone, its session is not. With WithIdleTimeout the server ends that
// session, and a duplicate that waits gets the key and runs; without it,
// the key stays held past the duplicate's wait.
func TestIdleTimeoutFreesTheKeyOfAClientThatVanished(t *testing.T) {
	for _, bounded := range []bool{true, false} {
		t.Run(fmt.Sprintf("bounded=%v", bounded), func(t *testing.T) {
			ctx, frozenPool, scope, f := setupFrozen(t)
			pool := env.Pool(t)
			var calls atomic.Int64
			var opts []idem.Option
			if bounded {
				opts = append(opts, idem.WithIdleTimeout(2*time.Second))
			}
			tx, err := frozenPool.BeginTx(ctx, pgx.TxOptions{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				// The rollback cannot get through: it gives the vanished
				// client's connection back to its pool, closed.
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
				defer cancel()
				_ = tx.Rollback(ctx)
			})
			if _, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 100, &calls), opts...); err != nil {
				t.Fatal(err)
			}
			f.Freeze() // the client vanishes with its transaction open

			wait := time.Minute
			if !bounded {
				wait = time.Second
			}
			res, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 100, &calls), idem.WithWait(wait))
			switch {
			case bounded && err != nil:
				t.Fatalf("the duplicate did not get the key after the idle timeout: %v", err)
			case bounded && (res.Replayed || calls.Load() != 2):
				t.Errorf("replayed %v, fn ran %d times; want the duplicate to run", res.Replayed, calls.Load())
			case !bounded && !errors.Is(err, idem.ErrInProgress):
				t.Errorf("without a bound the duplicate got %v, want ErrInProgress", err)
			}
		})
	}
}

// TestADoInsideItsKeysFunctionJoinsIt nests Do and Once on the enclosing
// call's own key, with the same and with another fingerprint, as
// repository code under an idemhttp handler does: each joins the
// enclosing call (its fn runs, once, as part of it), only the enclosing
// call's record is written, and a retry replays it without running
// anything, at every isolation level.
func TestADoInsideItsKeysFunctionJoinsIt(t *testing.T) {
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			ctx, pool, scope := setup(t)
			var calls atomic.Int64
			outer := func(ctx context.Context, tx pgx.Tx) (payment, error) {
				inner, err := idem.Do(ctx, tx, scope, "k", fpB, pay(scope, "k", 100, &calls))
				if err != nil || inner.Replayed {
					return payment{}, fmt.Errorf("inner Do: %+v, %w", inner, err)
				}
				ran, err := idem.Once(ctx, tx, scope, "k", func(context.Context, pgx.Tx) error {
					calls.Add(1)
					return nil
				})
				if err != nil || !ran {
					return payment{}, fmt.Errorf("inner Once: ran %v, %w", ran, err)
				}
				return inner.Value, nil
			}
			opts := idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso})
			first, err := idem.Run(ctx, pool, scope, "k", fpA, outer, opts)
			if err != nil {
				t.Fatal(err)
			}
			again, err := idem.Run(ctx, pool, scope, "k", fpA, outer, opts)
			if err != nil || !again.Replayed || again.Value != first.Value {
				t.Fatalf("retry: %+v, %v; want a replay of %+v", again, err, first.Value)
			}
			if calls.Load() != 2 || countPayments(t, pool, scope) != 1 || countRecords(t, pool, scope) != 1 {
				t.Errorf("fn calls %d, payments %d, records %d; want 2, 1, 1",
					calls.Load(), countPayments(t, pool, scope), countRecords(t, pool, scope))
			}
		})
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

// TestAConnectionAsksWhetherItsDatabaseHasCitusOnce runs three claims on
// one connection: only the first asks the catalog whether the database
// has Citus (KeyLock's check_citus); the others use its answer.
func TestAConnectionAsksWhetherItsDatabaseHasCitusOnce(t *testing.T) {
	ctx, _, scope := setup(t)
	tracer := &keyLockArgs{}
	pool := countedPool(t, ctx, new(testdb.WireCount), func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = tracer })
	var calls atomic.Int64
	for _, key := range []string{"k1", "k2", "k1"} {
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
	}
	if got := fmt.Sprint(tracer.checks); got != "[true false false]" {
		t.Fatalf("KeyLock's check_citus on the connection's claims: %s, want [true false false]", got)
	}
}

// keyLockArgs records the last argument (check_citus) of each KeyLock a
// batch sends.
type keyLockArgs struct {
	mu     sync.Mutex
	checks []bool
}

func (k *keyLockArgs) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (k *keyLockArgs) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (k *keyLockArgs) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (k *keyLockArgs) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	if strings.Contains(data.SQL, "name: KeyLock :one") && len(data.Args) > 0 {
		k.mu.Lock()
		defer k.mu.Unlock()
		check, _ := data.Args[len(data.Args)-1].(bool)
		k.checks = append(k.checks, check)
	}
}
func (k *keyLockArgs) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
