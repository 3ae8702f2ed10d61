package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
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
