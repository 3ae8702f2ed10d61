-- +goose Up
-- Flows that a person settles, and calls whose outcome stays unknown.
--
-- resolutions records what people decided about the calls a flow stopped
-- at (idem.ResolveFlow): a JSON array of objects, one per resolution, in
-- order: the step ("step"), the outcome ("outcome": applied or
-- not_applied), who ("by") and why ("reason"), why the flow had stopped
-- ("stopped", its last error then, sealed as it was) and when ("at",
-- microseconds since 1970). A flow started again after its retention
-- (FlowRestart) keeps the entries of the operation before, which are older
-- than its created_at: they are not shown. A nullable column without a
-- default: adding it rewrites nothing.
ALTER TABLE idem_flow ADD COLUMN resolutions jsonb;

-- A call made with idem.BestEffort whose attempt may have reached the other
-- system is recorded as unknown, rather than stopping its flow: in a step's
-- compact record (migration 00009) the state ?, in a step's row the state
-- 'unknown'.
ALTER TABLE idem_flow_step_row
    DROP CONSTRAINT idem_flow_step_state_check,
    ADD CONSTRAINT idem_flow_step_state_check CHECK (state IN ('calling', 'unsent', 'unknown', 'done'));

-- Operators list the flows that stopped for them (attention) and those they
-- ended, newest first, a page at a time (idem.ListFlows): a partial index,
-- which holds only those rows, rare among the finished ones, and which a
-- flow's start and its lease's renewals never write. (Running flows are
-- listed from idem_flow_running_idx, and sorted: they are the flows in
-- progress.) On a large table, create it first, CONCURRENTLY, so that
-- building it does not hold up the flows' writes (docs/migrations.md).
CREATE INDEX IF NOT EXISTS idem_flow_stopped_idx ON idem_flow (state, created_at, scope, key)
    WHERE state IN ('attention', 'ended');

-- +goose Down
-- The version before reads no unknown call: such a call becomes 'calling'
-- again, and a flow in progress that holds one stops for a person, so that
-- the version before, which would call it again, does not.
UPDATE idem_flow AS f
SET state = 'attention',
    leased_until = NULL,
    last_error = 'migration 00010 rolled back: a call''s outcome is unknown (idem.BestEffort); find out whether it was applied'
WHERE f.state = 'running'
  AND (EXISTS (
          SELECT FROM jsonb_each(f.steps) AS s
          WHERE s.key <> 'v'
            AND jsonb_typeof(s.value) = 'string'
            AND split_part(split_part(s.value #>> '{}', ';', 1), ',', 3) = '?'
      )
      OR EXISTS (
          SELECT FROM idem_flow_step_row AS r
          WHERE r.scope = f.scope
            AND r.key = f.key
            AND r.state = 'unknown'
      ));
UPDATE idem_flow AS f
SET steps = (
    SELECT jsonb_object_agg(s.key, CASE
        WHEN jsonb_typeof(s.value) = 'string'
        THEN to_jsonb(regexp_replace(s.value #>> '{}', '^([^,;]*,[^,;]*,)\?([,;])', '\1c\2'))
        ELSE s.value
        END)
    FROM jsonb_each(f.steps) AS s
)
WHERE EXISTS (
    SELECT FROM jsonb_each(f.steps) AS s
    WHERE s.key <> 'v'
      AND jsonb_typeof(s.value) = 'string'
      AND split_part(split_part(s.value #>> '{}', ';', 1), ',', 3) = '?'
);
UPDATE idem_flow_step_row SET state = 'calling' WHERE state = 'unknown';
ALTER TABLE idem_flow_step_row
    DROP CONSTRAINT idem_flow_step_state_check,
    ADD CONSTRAINT idem_flow_step_state_check CHECK (state IN ('calling', 'unsent', 'done'));
DROP INDEX idem_flow_stopped_idx;
ALTER TABLE idem_flow DROP COLUMN resolutions;
