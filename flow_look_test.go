package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"

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
	cfg, err := pgxpool.ParseConfig(url)
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
