package idem_test

import (
	"database/sql"
	"errors"
	"sync/atomic"
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

// An executor of the version before migration 00009 reads a flow's step
// records as JSON objects, and cannot read this version's: still running
// during a rolling deploy, it would take over a flow this version
// recorded steps of, fail each step, and a function that turned that
// failure into an answer would finish the flow with it. Each write of the
// records carries a key that is no place ("v"), so that its claim, the
// takeover and the steps' read in one implicit transaction, fails (22P02)
// before it runs anything, and takes nothing over. The statements are
// that version's, verbatim.
func TestOlderExecutorsClaimFailsOnAFlowOfShortRecords(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	abandon(t, ctx, pool, flow, p, scope, "k")
	var name string
	var fp []byte
	var epoch int64
	var runs int
	if err := pool.QueryRow(ctx, `SELECT name, fingerprint, epoch, runs FROM idem_flow WHERE scope = $1`, scope).
		Scan(&name, &fp, &epoch, &runs); err != nil {
		t.Fatal(err)
	}
	b := &pgx.Batch{}
	b.Queue(older00008FlowTakeOver, int64(42), "1 minute", scope, "k", name, fp)
	b.Queue(older00008FlowSteps, scope, "k")
	err := pool.SendBatch(ctx, b).Close()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "22P02" {
		t.Fatalf("the older version's claim: %v; want invalid_text_representation", err)
	}
	var nowEpoch int64
	var nowRuns int
	if err := pool.QueryRow(ctx, `SELECT epoch, runs FROM idem_flow WHERE scope = $1`, scope).Scan(&nowEpoch, &nowRuns); err != nil ||
		nowEpoch != epoch || nowRuns != runs {
		t.Fatalf("after the older claim: epoch %d, runs %d, %v; want %d, %d (nothing taken over)", nowEpoch, nowRuns, err, epoch, runs)
	}
	// This version resumes it.
	if res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil || res.Value.ChargeID == "" {
		t.Fatalf("this version's run: %+v, %v", res, err)
	}
}

// The claim of the version before migration 00009, verbatim from its
// internal/dbsqlc/flow.sql.go (FlowRestart and FlowGet, which read no
// steps, left out).

const older00008FlowTakeOver = `-- name: FlowTakeOver :one
UPDATE idem_flow AS f
SET epoch = $1::bigint,
    leased_until = statement_timestamp() + $2::interval,
    runs = f.runs + 1
FROM (
    SELECT scope, key
    FROM idem_flow
    WHERE scope = $3::text
      AND key = $4::text
      AND name = $5::text
      AND fingerprint = $6::bytea
      AND state = 'running'
      AND leased_until <= statement_timestamp()
    FOR UPDATE SKIP LOCKED
) AS free
WHERE f.scope = free.scope
  AND f.key = free.key
RETURNING f.provider_namespace, f.operation, f.input
`

const older00008FlowSteps = `-- name: FlowSteps :many
SELECT seq::int AS seq, rec::jsonb AS rec, in_row::boolean AS in_row
FROM (
    SELECT s.key::int AS seq, s.value AS rec, false AS in_row
    FROM idem_flow AS f, jsonb_each(f.steps) AS s(key, value)
    WHERE f.scope = $1::text
      AND f.key = $2::text
      AND f.state = 'running'
    UNION ALL
    -- (An absent field is null here: a call's result while it has none.)
    SELECT s.seq, jsonb_build_object(
               'n', s.name,
               's', CASE WHEN s.state = 'done' THEN NULL ELSE s.state END,
               'r', s.result,
               'a', CASE WHEN s.kind = 'call' THEN s.attempts END,
               'f', (extract(epoch FROM s.first_called_at) * 1000000)::bigint,
               'c', (extract(epoch FROM s.completed_at) * 1000000)::bigint,
               'x', s.reconciles,
               'l', s.last_reconcile), true
    FROM idem_flow_step_row AS s
    JOIN idem_flow AS f ON f.scope = s.scope AND f.key = s.key
    WHERE s.scope = $1::text
      AND s.key = $2::text
      AND f.state = 'running'
      AND NOT coalesce(f.steps ? s.seq::text, false)
) AS recorded
ORDER BY seq
`

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
