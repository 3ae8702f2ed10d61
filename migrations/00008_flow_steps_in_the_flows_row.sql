-- +goose Up
-- A flow's steps are recorded in its own row from now on: steps holds them
-- as one JSON object, by place ("0", "1", ...), each step's record an
-- object of short fields (see queries/flow.sql), so that a local step,
-- whose transaction writes the flow's row anyway (its lease, its lock),
-- records its result in that same write, and a call's intent and result
-- ride on the flow's row the same way: no row, and no primary-key entry,
-- per step. Steps recorded before this migration stay as rows, and are
-- read from there as before; a step recorded in both (a call whose intent
-- an older version recorded, resumed by this one) is the one in steps. A
-- nullable column without a default: adding it rewrites nothing.
ALTER TABLE idem_flow ADD COLUMN steps jsonb;
-- The steps' rows are renamed, so that an executor of an older version,
-- still running during a rolling deploy, fails every flow statement it
-- sends ("relation idem_flow_step does not exist": each one reads or
-- writes that table, its claim too) instead of taking over a flow this
-- version runs, finding none of its steps, and running them again. Its
-- Run and Do are unaffected (docs/migrations.md, "Rolling deploys").
ALTER TABLE idem_flow_step RENAME TO idem_flow_step_row;

-- +goose Down
-- The steps recorded in the flows' rows go back to idem_flow_step, for the
-- version before this one to find.
ALTER TABLE idem_flow_step_row RENAME TO idem_flow_step;
INSERT INTO idem_flow_step (scope, key, seq, name, kind, state, result, attempts, first_called_at, completed_at,
                            reconciles, last_reconcile)
SELECT f.scope, f.key, s.key::int, s.value->>'n',
       CASE WHEN s.value ? 'a' THEN 'call' ELSE 'local' END,
       coalesce(s.value->>'s', 'done'), s.value->'r', coalesce((s.value->>'a')::int, 1),
       timestamptz 'epoch' + (s.value->>'f')::bigint * interval '1 microsecond',
       timestamptz 'epoch' + (s.value->>'c')::bigint * interval '1 microsecond',
       coalesce((s.value->>'x')::int, 0), s.value->>'l'
FROM idem_flow AS f, jsonb_each(f.steps) AS s
WHERE f.steps IS NOT NULL
ON CONFLICT (scope, key, seq) DO UPDATE
SET name = excluded.name, kind = excluded.kind, state = excluded.state, result = excluded.result,
    attempts = excluded.attempts, first_called_at = excluded.first_called_at, completed_at = excluded.completed_at,
    reconciles = excluded.reconciles, last_reconcile = excluded.last_reconcile;
ALTER TABLE idem_flow DROP COLUMN steps;
