package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

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
