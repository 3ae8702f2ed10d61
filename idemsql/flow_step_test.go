package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/testdb"
)

// TestAFlowsStepWhoseRecordFailsOnDatabaseSQL runs, on Beginner(db), a
// flow whose first local step leaves its transaction unable to record it
// (a statement failed, and the function returned nil all the same): the
// step's record fails with the transaction, and Run returns that error,
// the flow incomplete; it does not panic (the step's connection is no
// pgx connection: there is none to look at).
func TestAFlowsStepWhoseRecordFailsOnDatabaseSQL(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		flow := idem.MustNewFlow(testdb.Name("aborted"), func(ctx context.Context, s *idem.Steps, _ int) (int, error) {
			return idemsql.Local(s, "ignores-its-error", func(ctx context.Context, tx *sql.Tx) (int, error) {
				_, _ = tx.ExecContext(ctx, `SELECT 1/0`) // its error ignored: the transaction is aborted
				return 1, nil
			})
		})
		_, err := flow.Run(ctx, idemsql.Beginner(db), scope, "k", nil, 0)
		if !errors.Is(err, idem.ErrFlowIncomplete) {
			t.Fatalf("Run: %v, want ErrFlowIncomplete", err)
		}
	})
}

// TestAFlowsClaimGivesItsConnectionBackOnDatabaseSQL ends a new flow's
// run on Beginner(db) while it holds its claim's transaction (the
// function panics, fails, takes no step, or finds its context ended
// before its first step, or in it): each time the run gives its
// connection back to db, and leaves the flow's lock free.
func TestAFlowsClaimGivesItsConnectionBackOnDatabaseSQL(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		step := func(ctx context.Context, tx *sql.Tx) (int, error) {
			_, err := tx.ExecContext(ctx, `SELECT 1`)
			return 1, err
		}
		cases := map[string]func(ctx context.Context, s *idem.Steps, cancel context.CancelFunc) (int, error){
			"panics":     func(context.Context, *idem.Steps, context.CancelFunc) (int, error) { panic("before any step") },
			"fails":      func(context.Context, *idem.Steps, context.CancelFunc) (int, error) { return 0, errors.New("no") },
			"takes none": func(context.Context, *idem.Steps, context.CancelFunc) (int, error) { return 1, nil },
			"ends before": func(ctx context.Context, s *idem.Steps, cancel context.CancelFunc) (int, error) {
				cancel()
				return idemsql.Local(s, "a", step)
			},
			"ends in": func(ctx context.Context, s *idem.Steps, cancel context.CancelFunc) (int, error) {
				return idemsql.Local(s, "a", func(ctx context.Context, tx *sql.Tx) (int, error) {
					cancel()
					return step(ctx, tx)
				})
			},
		}
		for name, fn := range cases {
			runCtx, cancel := context.WithCancel(ctx)
			flow := idem.MustNewFlow(testdb.Name("claim"), func(ctx context.Context, s *idem.Steps, _ int) (int, error) {
				return fn(ctx, s, cancel)
			})
			func() {
				defer func() { _ = recover() }()
				_, _ = flow.Run(runCtx, idemsql.Beginner(db), scope, name, nil, 0)
			}()
			cancel()
			if n := db.Stats().InUse; n != 0 {
				t.Fatalf("%s: %d connections in use after the run", name, n)
			}
			var free bool
			if err := pool.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1)`, keylock.FlowID(scope, name)).Scan(&free); err != nil || !free {
				t.Fatalf("%s: the flow's lock free: %t, %v", name, free, err)
			}
		}
	})
}
