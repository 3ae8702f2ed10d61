//go:build citus

package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestCitusRunOnAKnownConnection runs Run through the coordinator on a
// connection that an earlier claim told the database has Citus, where the
// claim takes the key's lock with KeyLockCitus and Run stores its record
// after KeyStoreBudgetCitus, with COMMIT: a duplicate that waits for the
// key's holder replays what it committed without running fn, the record's
// wait for a transaction that holds the key by a record in progress
// ends with the wait budget, on the worker, and the worker's lock_timeout
// is the same after Run's transaction.
func TestCitusRunOnAKnownConnection(t *testing.T) {
	c, pool := startCitus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// known is a pool of one connection, on which a first Run has said
	// that the database has Citus.
	cfg := pool.Config().Copy()
	cfg.MaxConns, cfg.MinConns = 1, 0
	seen := &sentStatements{}
	cfg.ConnConfig.Tracer = &statementTracer{see: seen.note}
	known, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer known.Close()
	var warm atomic.Int64
	warmScope := testdb.Name("warm")
	if _, err := idem.Run(ctx, known, warmScope, "k", fpA, pay(warmScope, "k", 1, &warm)); err != nil {
		t.Fatal(err)
	}

	t.Run("DuplicateReplaysWhatItsHolderCommitted", func(t *testing.T) {
		scope, key := testdb.Name("wait"), "k"
		var calls atomic.Int64
		release := make(chan struct{})
		first := make(chan error, 1)
		go func() {
			_, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
				p, err := pay(scope, key, 5, &calls)(ctx, tx)
				<-release
				return p, err
			})
			first <- err
		}()
		for calls.Load() == 0 {
			time.Sleep(5 * time.Millisecond)
		}
		second := make(chan struct {
			res idem.Result[payment]
			err error
		}, 1)
		go func() {
			res, err := idem.Run(ctx, known, scope, key, fpA, pay(scope, key, 5, &calls))
			second <- struct {
				res idem.Result[payment]
				err error
			}{res, err}
		}()
		// The duplicate waits on the worker for the holder's lock; the
		// holder then commits, and the duplicate reads its record after
		// the lock is granted.
		waitWaiting(t, ctx, c)
		close(release)
		if err := <-first; err != nil {
			t.Fatal(err)
		}
		got := <-second
		if got.err != nil || !got.res.Replayed || got.res.Value.AmountCents != 5 || calls.Load() != 1 {
			t.Fatalf("duplicate: %+v, %v; fn entered %d times, want a replay and 1", got.res, got.err, calls.Load())
		}
		if n := countPayments(t, pool, scope); n != 1 {
			t.Fatalf("%d payments", n)
		}
		if !seen.sent("KeyLockCitus") {
			t.Fatal("the duplicate's claim did not send KeyLockCitus")
		}
	})

	t.Run("RecordWaitsUnderTheBudgetOnTheWorker", func(t *testing.T) {
		scope, key := testdb.Name("budget"), "k"
		// The holder keeps the key by its record, written complete and not
		// committed (OnceEach's claim), without the key's lock.
		holder, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = holder.Rollback(ctx) }()
		if _, err := idem.OnceEach(ctx, holder, scope, []string{key}, func(context.Context, pgx.Tx, int) error { return nil }); err != nil {
			t.Fatal(err)
		}
		// workerLockTimeout reads lock_timeout on the worker of the
		// scope's shard, over the connection the coordinator uses there.
		workerLockTimeout := func() string {
			var got string
			err := pgx.BeginFunc(ctx, known, func(tx pgx.Tx) error {
				return tx.QueryRow(ctx, `SELECT current_setting('lock_timeout')
					WHERE NOT EXISTS (SELECT FROM idempotency_key WHERE scope = $1 LIMIT 0)`, scope).Scan(&got)
			})
			if err != nil {
				t.Fatal(err)
			}
			return got
		}
		before := workerLockTimeout()
		const wait = 500 * time.Millisecond
		var calls atomic.Int64
		start := time.Now()
		_, err = idem.Run(ctx, known, scope, key, fpA, pay(scope, key, 7, &calls), idem.WithWait(wait))
		took := time.Since(start)
		if !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("Run on a key its holder keeps by a record in progress, WithWait(%s): %v, want ErrInProgress", wait, err)
		}
		// What a wait may take past its budget: the round trips through
		// the coordinator, on a busy machine.
		if took < wait/2 || took > wait+10*time.Second {
			t.Fatalf("Run gave up after %s, with a budget of %s", took, wait)
		}
		if after := workerLockTimeout(); after != before {
			t.Fatalf("the worker's lock_timeout is %s after Run, was %s", after, before)
		}
		if err := holder.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		res, err := idem.Run(ctx, known, scope, key, fpA, pay(scope, key, 7, &calls), idem.WithWait(wait))
		if err != nil || res.Replayed || calls.Load() != 2 {
			t.Fatalf("once the holder rolled back: %+v, %v; fn ran %d times, want 2", res, err, calls.Load())
		}
		if !seen.sent("KeyStoreBudgetCitus") || seen.sent("KeyWaitRestoreCitus") {
			t.Fatal("Run's record was not sent after KeyStoreBudgetCitus alone")
		}
		if n := countPayments(t, pool, scope); n != 1 {
			t.Fatalf("%d payments", n)
		}
	})
}

// sentStatements notes the names of idem's statements a connection sends
// (sqlc's "-- name: X" line), seen by a statementTracer.
type sentStatements struct{ names sync.Map }

func (s *sentStatements) note(sql string) {
	if name, ok := strings.CutPrefix(sql, "-- name: "); ok {
		if i := strings.IndexByte(name, ' '); i > 0 {
			s.names.Store(name[:i], true)
		}
	}
}

// sent reports whether the statement named name was sent.
func (s *sentStatements) sent(name string) bool {
	_, ok := s.names.Load(name)
	return ok
}
