-- name: FlowStart :one
-- FlowStart writes a new flow's row, running, leased to the caller, with an
-- operation number and an epoch that no flow had before (idem_flow_seq).
-- It locks nothing that exists, nor waits for it: when a flow holds the
-- key, it returns no row, and the caller restarts the flow if it expired (FlowRestart), takes
-- it over if its lease ran out (FlowTakeOver), or judges it (FlowGet), in
-- the same round trip. Leases are dated by the clock, not by the start of
-- the transaction, which may have waited. Stored values are sent as text,
-- as KeyInsert's are.
INSERT INTO idem_flow (scope, key, name, fingerprint, state, input, operation, epoch, leased_until, runs, retention)
SELECT @scope::text, @key::text, @flow_name::text, @fingerprint::bytea, 'running',
       sqlc.arg(input)::text::jsonb, n.number, n.number, clock_timestamp() + @lease::interval, 1, @retention::interval
FROM (SELECT nextval('idem_flow_seq') AS number) AS n
-- Without a row to see, the INSERT is not tried: the unique index would
-- otherwise wait for a transaction that holds the row (a local step's).
WHERE NOT EXISTS (
    SELECT FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
)
ON CONFLICT (scope, key) DO NOTHING
RETURNING operation, epoch;

-- name: FlowRestart :one
-- FlowRestart starts again, as a new operation, a finished flow whose
-- retention has passed: its row taken over, its steps deleted, and a new
-- operation number and epoch, so that nothing of its old executors can
-- commit into the new operation, and its calls get new provider keys. A
-- row another transaction holds is skipped, not waited for.
WITH expired AS (
    SELECT scope, key
    FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
      AND expires_at <= now()
    FOR UPDATE SKIP LOCKED
),
restarted AS (
    UPDATE idem_flow AS f
    SET name = @flow_name::text,
        fingerprint = @fingerprint::bytea,
        state = 'running',
        input = sqlc.arg(input)::text::jsonb,
        output = NULL,
        operation = n.number,
        epoch = n.number,
        leased_until = clock_timestamp() + @lease::interval,
        step = NULL,
        runs = 1,
        last_error = NULL,
        retention = @retention::interval,
        created_at = now(),
        completed_at = NULL,
        expires_at = NULL
    FROM expired, (SELECT nextval('idem_flow_seq') AS number) AS n
    WHERE f.scope = expired.scope
      AND f.key = expired.key
    RETURNING f.operation, f.epoch
),
cleared AS (
    DELETE FROM idem_flow_step AS s
    USING restarted
    WHERE s.scope = @scope::text
      AND s.key = @key::text
)
SELECT operation, epoch FROM restarted;

-- name: FlowTakeOver :one
-- FlowTakeOver takes a running flow whose lease has run out, for a caller
-- with the same request (name and fingerprint), under a new epoch that
-- fences the executor that held it. A flow whose row another transaction
-- holds (the executor's local step, still open) is skipped, not waited
-- for: the caller keeps waiting under its own budget. It returns no row
-- when the flow is not running, its lease holds, or the request differs.
UPDATE idem_flow AS f
SET epoch = nextval('idem_flow_seq'),
    leased_until = clock_timestamp() + @lease::interval,
    runs = f.runs + 1
FROM (
    SELECT scope, key
    FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
      AND name = @flow_name::text
      AND fingerprint = @fingerprint::bytea
      AND state = 'running'
      AND leased_until <= clock_timestamp()
    FOR UPDATE SKIP LOCKED
) AS free
WHERE f.scope = free.scope
  AND f.key = free.key
RETURNING f.operation, f.epoch;

-- name: FlowGet :one
-- FlowGet reads what a caller who neither started nor took the flow over
-- must judge: a replay, a mismatch, a stopped flow, or one that another
-- executor runs (leased). It locks nothing. An expired flow is the old
-- operation's, which another caller is starting again (FlowRestart
-- skipped its row): neither to replay nor to judge.
SELECT name, fingerprint, state, output, last_error,
       coalesce(leased_until > clock_timestamp(), false)::bool AS leased,
       coalesce(expires_at <= now(), false)::bool AS expired,
       -- As KeyGet's standby_wait: a completed flow's answer is replayed
       -- once a synchronous standby has it.
       CASE
           WHEN state = 'done'
            AND expires_at > now()
            AND current_setting('synchronous_standby_names') <> ''
            AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
            AND NOT pg_is_in_recovery()
           THEN pg_logical_emit_message(true, 'idem'::text, ''::text) IS NOT NULL
           ELSE false
       END::bool AS standby_wait
FROM idem_flow
WHERE scope = @scope::text
  AND key = @key::text;

-- name: FlowSteps :many
-- FlowSteps reads the recorded steps of a running flow, in order, for the
-- executor that resumes it; for any other flow it reads nothing, so that a
-- replay does not pay for them.
SELECT s.seq, s.name, s.kind, s.state, s.result
FROM idem_flow_step AS s
JOIN idem_flow AS f ON f.scope = s.scope AND f.key = s.key
WHERE s.scope = @scope::text
  AND s.key = @key::text
  AND f.state = 'running'
ORDER BY s.seq;

-- name: FlowLease :execrows
-- FlowLease renews the executor's lease and notes the step it is at. It
-- affects no row when the lease was lost: another executor took the flow
-- over (epoch), the lease ran out, or an operator stopped the flow. As the
-- first statement of a local step's transaction it also locks the flow's
-- row until that transaction ends, so that no one takes the flow over
-- while the step's writes are open; sent again with the step's record
-- (@held), it renews the lease for the steps after it without looking at
-- the time: the row stayed locked since, so the lease could not be lost.
UPDATE idem_flow
SET leased_until = clock_timestamp() + @lease::interval,
    step = @step::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running'
  AND (@held::bool OR leased_until > clock_timestamp());

-- name: FlowStepRecord :exec
-- FlowStepRecord records a local step's result in the transaction of its
-- writes, which holds the flow's row (FlowLease): both commit together or
-- not at all.
INSERT INTO idem_flow_step (scope, key, seq, name, kind, state, result, attempts, completed_at)
VALUES (@scope::text, @key::text, @seq::int, @step::text, 'local', 'done',
        sqlc.narg(result)::text::jsonb, 1, now());

-- name: FlowCallStart :one
-- FlowCallStart records the intent of a call before the other system is
-- called, renewing the lease: the call's row is written 'calling', or, for
-- a call an earlier executor started and never recorded, its attempts
-- counted again, unless its first attempt is older than the provider's
-- window (@call_window; NULL for none), past which the provider may have
-- forgotten the key, and calling again could apply the call twice. leased
-- is false when the lease was lost; attempts, the call's attempts with
-- this one, is 0 when the window has passed.
WITH leased AS (
    UPDATE idem_flow
    SET leased_until = clock_timestamp() + @lease::interval,
        step = @step::text
    WHERE scope = @scope::text
      AND key = @key::text
      AND epoch = @epoch::bigint
      AND state = 'running'
      AND leased_until > clock_timestamp()
    RETURNING 1
),
called AS (
    INSERT INTO idem_flow_step AS s (scope, key, seq, name, kind, state, attempts, first_called_at)
    SELECT @scope::text, @key::text, @seq::int, @step::text, 'call', 'calling', 1, now()
    FROM leased
    ON CONFLICT (scope, key, seq) DO UPDATE
    SET attempts = s.attempts + 1
    WHERE s.state = 'calling'
      AND (sqlc.narg(call_window)::interval IS NULL OR s.first_called_at > now() - sqlc.narg(call_window)::interval)
    RETURNING s.attempts
)
SELECT EXISTS (SELECT FROM leased)::bool AS leased,
       coalesce((SELECT attempts FROM called), 0)::int AS attempts;

-- name: FlowCallDone :execrows
-- FlowCallDone records a call's result once the other system answered,
-- renewing the lease; it affects no row when the lease was lost, and then
-- records nothing.
WITH leased AS (
    UPDATE idem_flow
    SET leased_until = clock_timestamp() + @lease::interval
    WHERE scope = @scope::text
      AND key = @key::text
      AND epoch = @epoch::bigint
      AND state = 'running'
      AND leased_until > clock_timestamp()
    RETURNING 1
)
UPDATE idem_flow_step AS s
SET state = 'done',
    result = sqlc.narg(result)::text::jsonb,
    completed_at = now()
FROM leased
WHERE s.scope = @scope::text
  AND s.key = @key::text
  AND s.seq = @seq::int
  AND s.state = 'calling';

-- name: FlowComplete :execrows
-- FlowComplete records the flow's answer: from now on retries replay it,
-- until its retention (counted from now) has passed. It affects no row
-- when the lease was lost.
UPDATE idem_flow
SET state = 'done',
    output = sqlc.narg(output)::text::jsonb,
    leased_until = NULL,
    step = NULL,
    last_error = NULL,
    completed_at = now(),
    expires_at = now() + retention
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running'
  AND leased_until > clock_timestamp();

-- name: FlowRelease :exec
-- FlowRelease gives the lease up when the flow's function returned an
-- error or its context ended, so that a retry takes the flow over at once
-- instead of waiting for the lease to run out; the error is kept for
-- operators.
UPDATE idem_flow
SET leased_until = clock_timestamp(),
    last_error = @last_error::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running'
  AND leased_until > clock_timestamp();

-- name: FlowStop :execrows
-- FlowStop stops a running flow that needs a person's decision (a call
-- past the provider's window), so that nothing runs it again. It affects
-- no row when the lease was lost.
UPDATE idem_flow
SET state = 'attention',
    leased_until = NULL,
    last_error = @last_error::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running'
  AND leased_until > clock_timestamp();

-- name: FlowAbandoned :many
-- FlowAbandoned lists up to @max_rows running flows named @name whose
-- lease ran out at least @grace ago, longest abandoned first, for a
-- completer (Flow.Resume). A flow that was run and failed again waits
-- longer each time, 2^(runs - 1) - 1 seconds (0, 1, 3, 7, 15, ... up to an
-- hour), so that a flow that keeps failing does not take every pass.
SELECT scope, key
FROM idem_flow
WHERE name = @flow_name::text
  AND state = 'running'
  AND leased_until <= now() - @grace::interval
  AND leased_until + least(interval '1 second' * (power(2, least(runs - 1, 12)) - 1), interval '1 hour')
      <= now() - @grace::interval
ORDER BY leased_until, scope, key
LIMIT @max_rows::int;

-- name: FlowAdopt :one
-- FlowAdopt takes over an abandoned flow for a completer, as FlowTakeOver
-- does for a caller, skipping a row another transaction holds, and returns
-- the input to run it with.
UPDATE idem_flow AS f
SET epoch = nextval('idem_flow_seq'),
    leased_until = clock_timestamp() + @lease::interval,
    runs = f.runs + 1
FROM (
    SELECT scope, key
    FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
      AND name = @flow_name::text
      AND state = 'running'
      AND leased_until <= now() - @grace::interval
      AND leased_until + least(interval '1 second' * (power(2, least(runs - 1, 12)) - 1), interval '1 hour')
          <= now() - @grace::interval
    FOR UPDATE SKIP LOCKED
) AS free
WHERE f.scope = free.scope
  AND f.key = free.key
RETURNING f.operation, f.epoch, f.input;

-- name: FlowEnd :execrows
-- FlowEnd ends a flow that is running or needs attention, for an
-- operator: nothing runs it again, its executor (if one still runs)
-- commits nothing more, and its record answers retries until its
-- retention has passed.
UPDATE idem_flow
SET state = 'ended',
    leased_until = NULL,
    completed_at = now(),
    expires_at = now() + retention,
    last_error = @reason::text
WHERE scope = @scope::text
  AND key = @key::text
  AND state IN ('running', 'attention');

-- name: FlowPurgeExpired :one
-- FlowPurgeExpired deletes up to @max_rows flows whose retention has
-- passed, with their steps, oldest expiry first, and returns how many
-- flows it deleted. Only finished flows expire: a running flow, or one
-- that needs attention, is never purged.
WITH purged AS (
    DELETE FROM idem_flow
    WHERE (scope, key) IN (
        SELECT expired.scope, expired.key
        FROM idem_flow AS expired
        WHERE expired.expires_at <= now()
        ORDER BY expired.expires_at
        LIMIT @max_rows::int
        FOR UPDATE SKIP LOCKED
    )
    RETURNING scope, key
),
steps AS (
    DELETE FROM idem_flow_step AS s
    USING purged
    WHERE s.scope = purged.scope
      AND s.key = purged.key
)
SELECT count(*) FROM purged;

-- name: FlowInspect :one
-- FlowInspect reads one flow whatever its state, for operators.
SELECT name, fingerprint, state, input, output, operation, epoch, leased_until, step, runs, last_error,
       created_at, completed_at, expires_at,
       coalesce(expires_at <= now(), false)::bool AS expired,
       coalesce(leased_until > now(), false)::bool AS leased
FROM idem_flow
WHERE scope = @scope::text
  AND key = @key::text;

-- name: FlowInspectSteps :many
-- FlowInspectSteps reads one flow's steps, for operators.
SELECT seq, name, kind, state, result, attempts, first_called_at, completed_at
FROM idem_flow_step
WHERE scope = @scope::text
  AND key = @key::text
ORDER BY seq;

-- name: FlowStats :one
-- FlowStats summarizes the flows for operators. It reads every row.
SELECT count(*) FILTER (WHERE state = 'running' AND leased_until > now()) AS running,
       count(*) FILTER (WHERE state = 'running' AND leased_until <= now()) AS abandoned,
       count(*) FILTER (WHERE state = 'attention') AS attention,
       count(*) FILTER (WHERE state IN ('done', 'ended') AND expires_at > now()) AS finished,
       count(*) FILTER (WHERE expires_at <= now()) AS expired,
       min(created_at) FILTER (WHERE state = 'running')::timestamptz AS oldest_running
FROM idem_flow;
