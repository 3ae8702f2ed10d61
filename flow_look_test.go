package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestFlowWhoseFunctionSwallowsItsFirstStepsErrorReplays runs, for a key
// whose flow completed, a function that answers something else when its
// first step fails. The step found the flow there as it began (the run's
// look travels with it): the run commits nothing, whatever the function
// returned, and the caller gets the answer replayed.
func TestFlowWhoseFunctionSwallowsItsFirstStepsErrorReplays(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	var ran atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("swallow"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		v, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (string, error) {
			var v string
			err := tx.QueryRow(ctx, `SELECT $1::text`, "first").Scan(&v)
			if err == nil {
				ran.Add(1)
			}
			return v, err
		})
		if err != nil {
			return "swallowed", nil
		}
		return v, nil
	})
	first, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1})
	if err != nil || first.Value != "first" || first.Replayed {
		t.Fatalf("first run: %+v, %v", first, err)
	}
	again, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1})
	if err != nil || again.Value != "first" || !again.Replayed {
		t.Fatalf("retry: %+v, %v; want first, replayed", again, err)
	}
	if other, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2}); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("retry with other input: %+v, %v; want ErrFingerprintMismatch", other, err)
	}
	if ran.Load() != 1 {
		t.Fatalf("the step's statement ran %d times, want 1", ran.Load())
	}
}

// TestFlowStepsRunAtReadCommittedWhereSessionsDefaultToAnotherLevel runs
// flows on a database whose sessions' transactions are repeatable read.
// A local step's BEGIN (read committed, idem's default), sent after the
// flow's lock, fails there ("must be called before any query"), and
// nothing of its round trip runs: it is sent again, BEGIN first, as it is
// on that connection from then on. Every step runs once, at read
// committed, and the flow replays.
func TestFlowStepsRunAtReadCommittedWhereSessionsDefaultToAnotherLevel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := env.EmptyDatabase(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	var name string
	if err := db.QueryRowContext(ctx, `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `ALTER DATABASE `+pgx.Identifier{name}.Sanitize()+` SET default_transaction_isolation = 'repeatable read'`); err != nil {
		t.Fatal(err)
	}
	// Sessions of the database's settings: behind a transaction pooler,
	// the server's own (the pooler's were opened before the ALTER).
	cfg, err := pgxpool.ParseConfig(testdb.DirectURL(t, url))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var level string
	if err := pool.QueryRow(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&level); err != nil || level != "repeatable read" {
		t.Fatalf("the session's transactions are %q, %v; want repeatable read", level, err)
	}
	var ran atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("isolation"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		levels := ""
		for _, step := range []string{"a", "b"} {
			level, err := idem.Local(s, step, func(ctx context.Context, tx pgx.Tx) (string, error) {
				var level string
				err := tx.QueryRow(ctx, `SELECT current_setting($1)`, "transaction_isolation").Scan(&level)
				if err == nil {
					ran.Add(1)
				}
				return level, err
			})
			if err != nil {
				return "", err
			}
			levels += level + ";"
		}
		return levels, nil
	})
	const want = "read committed;read committed;"
	for i, key := range []string{"k1", "k2", "k1"} {
		res, err := flow.Run(ctx, pool, "isolation", key, nil, chargeIn{Amount: 1})
		if err != nil || res.Value != want || res.Replayed != (i == 2) {
			t.Fatalf("run %d, %s: %+v, %v; want %q, replayed %v", i, key, res, err, want, i == 2)
		}
	}
	if ran.Load() != 4 {
		t.Fatalf("the steps' statements ran %d times, want 4", ran.Load())
	}
}

// TestFlowStepWritingThroughItsConnectionCommitsNothingItShouldNot runs a
// local step that writes through tx.Conn(), on a replay (its look found
// the flow there) and in a fenced executor (its flow taken over during a
// call). The flow's lock failed before BEGIN, so that no transaction was
// open: the connection is left in one that failed, as with BEGIN first,
// and the write fails rather than commits on its own.
func TestFlowStepWritingThroughItsConnectionCommitsNothingItShouldNot(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	write := func(ctx context.Context, s *idem.Steps, tx pgx.Tx, amount int64) (string, error) {
		_, err := tx.Conn().Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, s.Scope(), s.Key(), amount)
		return "ok", err
	}
	replayed := idem.MustNewFlow(testdb.Name("conn"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		return idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (string, error) { return write(ctx, s, tx, in.Amount) })
	})
	for i := range 2 {
		if res, err := replayed.Run(ctx, pool, scope, "replayed", nil, chargeIn{Amount: 1}); err != nil || res.Replayed != (i == 1) {
			t.Fatalf("run %d: %+v, %v", i, res, err)
		}
	}
	if n := countPayments(t, pool, scope); n != 1 {
		t.Fatalf("%d payments after a run and its replay, want 1", n)
	}

	var fenced error
	taken := idem.MustNewFlow(testdb.Name("conn-fenced"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		if _, err := idem.Call(s, "charge", func(ctx context.Context, _ string) (int, error) {
			// Another executor takes the flow over meanwhile.
			_, err := pool.Exec(ctx, `UPDATE idem_flow SET epoch = epoch + 1 WHERE scope = $1 AND key = $2`, s.Scope(), s.Key())
			return 1, err
		}); err != nil {
			return "", err
		}
		return idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (string, error) {
			v, err := write(ctx, s, tx, in.Amount)
			fenced = err
			return v, err
		})
	})
	if _, err := taken.Run(ctx, pool, scope, "fenced", nil, chargeIn{Amount: 1}, idem.WithWait(0)); err == nil || fenced == nil {
		t.Fatalf("the fenced executor: %v, its write %v; want both to fail", err, fenced)
	}
	if n := countPayments(t, pool, scope); n != 1 {
		t.Fatalf("%d payments, want 1: the fenced executor's write committed", n)
	}
	var idle int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction (aborted)'`).Scan(&idle); err != nil || idle != 0 {
		t.Fatalf("%d connections left in a failed transaction, %v; want none", idle, err)
	}
}

// TestFlowFirstStepOfAnotherKindLooksOnTheConnectionItHolds runs a flow
// whose first local step begins its own transaction (serializable, or a
// BeginQuery of the caller's) on a pool of one connection: the run's look
// at the flow goes alone, on the connection the step holds, not on the
// pool, which would wait for it.
func TestFlowFirstStepOfAnotherKindLooksOnTheConnectionItHolds(t *testing.T) {
	ctx, _, scope, _ := setupFlow(t)
	pool := countedPool(t, ctx, new(testdb.WireCount), nil) // one connection
	for name, opts := range map[string]pgx.TxOptions{
		"serializable": {IsoLevel: pgx.Serializable},
		"BeginQuery":   {BeginQuery: "begin isolation level read committed"},
	} {
		flow := idem.MustNewFlow(testdb.Name("held"), func(ctx context.Context, s *idem.Steps, in chargeIn) (int64, error) {
			return idem.Local(s, "a", func(ctx context.Context, tx pgx.Tx) (int64, error) {
				var v int64
				err := tx.QueryRow(ctx, `SELECT $1::bigint`, in.Amount).Scan(&v)
				return v, err
			})
		}, idem.WithTxOptions(opts))
		runCtx, cancel := context.WithTimeout(ctx, time.Minute)
		for i := range 2 {
			if res, err := flow.Run(runCtx, pool, scope, name, nil, chargeIn{Amount: 7}); err != nil || res.Value != 7 || res.Replayed != (i == 1) {
				t.Fatalf("%s, run %d: %+v, %v", name, i, res, err)
			}
		}
		cancel()
	}
}

// stepHoldsTheFlowsRow runs a flow whose second local step, while its
// transaction is open, has another session try to take the flow over (a
// new epoch, as FlowTakeOver writes): the step's lock of the flow's row
// (FlowLock) holds until the step commits, so the takeover waits, and
// times out. The lock follows BEGIN (see newStepTx): on Citus, a
// statement before it would run on its worker as a transaction of its
// own, and its row lock would end with it.
func stepHoldsTheFlowsRow(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope string) {
	t.Helper()
	var takeErr error
	flow := idem.MustNewFlow(testdb.Name("rowlock"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		if _, err := idem.Local(s, "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
			var v int
			err := tx.QueryRow(ctx, `SELECT $1::int`, 1).Scan(&v)
			return v, err
		}); err != nil {
			return "", err
		}
		return idem.Local(s, "b", func(ctx context.Context, tx pgx.Tx) (string, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, s.Scope(), s.Key(), in.Amount); err != nil {
				return "", err
			}
			tctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			_, takeErr = pool.Exec(tctx, `UPDATE idem_flow SET epoch = epoch + 1 WHERE scope = $1 AND key = $2`, s.Scope(), s.Key())
			return "b", nil
		})
	})
	res, err := flow.Run(ctx, pool, scope, "rowlock", nil, chargeIn{Amount: 1})
	if takeErr == nil {
		t.Fatalf("another session took the flow over while its step's transaction was open (the run: %+v, %v)", res, err)
	}
	if err != nil || res.Value != "b" {
		t.Fatalf("the run: %+v, %v; want b", res, err)
	}
}

func TestFlowLocalStepHoldsTheFlowsRowUntilItCommits(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	stepHoldsTheFlowsRow(t, ctx, pool, scope)
}
