package idem_test

import (
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// An executor of the version before migration 00008 reads a flow's steps
// only from idem_flow_step: one still running during a rolling deploy,
// after the migration, would take over a flow this version runs, find
// none of its steps, and run them (and its calls) again. The migration
// renames that table, so that such an executor's claim (which reads the
// steps), its local steps' records and its calls' intents fail instead,
// even as statements it prepared before the migration; nothing of the
// flow runs. The statements are the older version's, verbatim.
func TestOlderExecutorsFlowStatementsFailAfterTheUpgrade(t *testing.T) {
	t.Parallel()
	url := env.EmptyDatabase(t)
	ctx := t.Context()
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := idemGoose(t, db).UpTo(ctx, 7); err != nil {
		t.Fatal(err)
	}
	// The older executor, running before the migration, its statements
	// prepared (pgx's statement cache).
	old, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close(ctx)
	statements := []struct{ name, sql string }{{"FlowSteps", olderFlowSteps}, {"FlowStepRecord", olderFlowStepRecord}, {"FlowCallStart", olderFlowCallStart}}
	for _, s := range statements {
		if _, err := old.Prepare(ctx, s.name, s.sql); err != nil {
			t.Fatalf("the older version's %s before the upgrade: %v", s.name, err)
		}
	}
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	fresh, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close(ctx)
	args := map[string][]any{
		"FlowSteps":      {"s", "k"},
		"FlowStepRecord": {"s", "k", 0, "reserve", `{"id":1}`},
		"FlowCallStart":  {"1 minute", "1 minute", "charge", "s", "k", 1, 0},
	}
	for _, s := range statements {
		for conn, as := range map[*pgx.Conn]string{old: s.name, fresh: s.sql} {
			rows, err := conn.Query(ctx, as, args[s.name]...)
			if err == nil {
				rows.Close()
				err = rows.Err()
			}
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "42P01" {
				t.Errorf("the older version's %s after the upgrade (prepared before: %v): %v; want undefined_table",
					s.name, conn == old, err)
			}
		}
	}
}

// The older version's statements (before migration 00008), verbatim from
// its internal/dbsqlc/flow.sql.go.

const olderFlowSteps = `-- name: FlowSteps :many
SELECT s.seq, s.name, s.kind, s.state, s.result
FROM idem_flow_step AS s
JOIN idem_flow AS f ON f.scope = s.scope AND f.key = s.key
WHERE s.scope = $1::text
  AND s.key = $2::text
  AND f.state = 'running'
ORDER BY s.seq
`

const olderFlowStepRecord = `-- name: FlowStepRecord :exec
INSERT INTO idem_flow_step (scope, key, seq, name, kind, state, result, attempts, completed_at)
VALUES ($1::text, $2::text, $3::int, $4::text, 'local', 'done',
        $5::text::jsonb, 1, now())
`

const olderFlowCallStart = `-- name: FlowCallStart :one
WITH leased AS (
    UPDATE idem_flow
    SET leased_until = statement_timestamp() + $2::interval,
        step = $3::text
    WHERE scope = $4::text
      AND key = $5::text
      AND epoch = $6::bigint
      AND state = 'running'
    RETURNING 1
),
earlier AS (
    SELECT state, first_called_at
    FROM idem_flow_step
    WHERE scope = $4::text
      AND key = $5::text
      AND seq = $7::int
),
called AS (
    INSERT INTO idem_flow_step AS s (scope, key, seq, name, kind, state, attempts, first_called_at)
    SELECT $4::text, $5::text, $7::int, $3::text, 'call', 'calling', 1, now()
    FROM leased
    ON CONFLICT (scope, key, seq) DO UPDATE
    SET attempts = s.attempts + 1,
        state = 'calling',
        first_called_at = CASE WHEN s.state = 'unsent' THEN excluded.first_called_at ELSE s.first_called_at END
    WHERE s.state IN ('calling', 'unsent')
    RETURNING s.attempts
)
SELECT EXISTS (SELECT FROM leased)::bool AS leased,
       coalesce((SELECT attempts FROM called), 0)::int AS attempts,
       coalesce((SELECT state = 'calling' FROM earlier), false)::bool AS resumed,
       coalesce((SELECT state = 'calling' AND first_called_at <= now() - $1::interval FROM earlier), false)::bool AS past_window
`
