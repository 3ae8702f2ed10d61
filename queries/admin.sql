-- What operators list and settle: flows by state (idem.ListFlows), the
-- calls a stopped flow stopped at (idem.ResolveFlow), and the outbox's
-- parked messages (idemconsole).

-- name: FlowList :many
-- FlowList lists up to @max_rows flows in @state, newest first, after the
-- flow (@after_created, @after_scope, @after_key) of the page before (for
-- the first page, a time after every flow's: 'infinity'), by name and
-- scope when given (empty: any). A flow stopped for attention or ended is
-- read from idem_flow_stopped_idx, from the cursor on; a running one from
-- idem_flow_running_idx, then sorted. (Citus runs it on every shard and
-- merges the pages.)
SELECT scope, key, name, state, step, runs, last_error, leased_until,
       coalesce(leased_until > clock_timestamp(), false)::bool AS leased,
       created_at, completed_at
FROM idem_flow
WHERE state = @state::text
  AND (created_at, scope, key) < (@after_created::timestamptz, @after_scope::text, @after_key::text)
  AND (@flow_name::text = '' OR name = @flow_name::text)
  AND (@scope::text = '' OR scope = @scope::text)
ORDER BY created_at DESC, scope DESC, key DESC
LIMIT @max_rows::int;

-- name: FlowResolveTarget :one
-- FlowResolveTarget reads what a resolution of the flow (scope, key)
-- checks: that it is stopped for attention, at which step, under which
-- epoch (FlowResolve writes only that one), and why; and locks its row
-- until the resolution commits, so that the flow's records it reads next
-- are those it writes over. It fails (55P03) rather than wait for a row
-- another transaction holds: another resolution, or a running flow's
-- local step.
SELECT name, state, step, epoch, last_error, created_at
FROM idem_flow
WHERE scope = @scope::text
  AND key = @key::text
FOR NO KEY UPDATE NOWAIT;

-- name: FlowResolve :execrows
-- FlowResolve settles the call a flow stopped at, for a person: it records
-- what @steps holds (the call's record, done with its result or unsent:
-- see FlowLeaseSteps), and @resolution (a JSON array of one entry, its
-- time the byte 0x01, which the server replaces by its now() in
-- microseconds since 1970: see migration 00010), and sets the flow running
-- under a new epoch, @epoch, with its lease run out, so that the next run
-- (a client's retry, which takes the flow over at once, or Flow.Resume,
-- whose wait after a failed run, 2^(runs - 1) - 1 seconds up to an hour,
-- has passed too: see FlowAbandoned) continues it from there. It affects
-- no row unless the flow is still stopped under @stopped_epoch, as the
-- resolution read it: a resolution, or EndFlow, that came first wins. An
-- executor that wakes late, with the epoch it held before the flow
-- stopped, writes nothing: no epoch of an executor's is the new one. (As
-- in FlowComplete, the lease is dated in seconds since 1970: Citus
-- refuses timestamptz - interval on a column in an UPDATE.)
UPDATE idem_flow
SET state = 'running',
    epoch = @epoch::bigint,
    leased_until = to_timestamp((extract(epoch FROM statement_timestamp())
        - least(power(2, least(runs - 1, 12)) - 1, 3600))::float8),
    last_error = NULL,
    steps = coalesce(steps, '{}'::jsonb)
        || replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), (extract(epoch FROM now() - created_at) * 1000000)::bigint::text)::jsonb,
    resolutions = coalesce(resolutions, '[]'::jsonb)
        || replace(@resolution::text, chr(1), (extract(epoch FROM now()) * 1000000)::bigint::text)::jsonb
WHERE scope = @scope::text
  AND key = @key::text
  AND state = 'attention'
  AND epoch = @stopped_epoch::bigint;

-- name: FlowResolutions :one
-- FlowResolutions reads the resolutions of the flow (scope, key), for
-- operators, with the flow's created_at: those older belong to the key's
-- operation before (see migration 00010).
SELECT coalesce(resolutions, '[]'::jsonb)::jsonb AS resolutions, created_at
FROM idem_flow
WHERE scope = @scope::text
  AND key = @key::text;

-- name: OutboxParkedList :many
-- OutboxParkedList lists up to @max_rows parked messages, newest first,
-- with ids below @before_id, for operators, with their payload's size,
-- not the payload.
SELECT id, scope, key, destination, idempotency_key, attempts, created_at, last_error,
       octet_length(payload)::int AS payload_size
FROM outbox_message
WHERE state = 'parked'
  AND id < @before_id::bigint
ORDER BY id DESC
LIMIT @max_rows::int;
