-- name: FlowStart :one
-- FlowStart writes a new flow's row, running, leased to the executor under
-- @epoch (a random number: see Flow), at @step, with the installation's id
-- as the namespace of its provider keys (idem_installation; a missing row
-- fails the CHECK). The claim does not send it: it travels with the flow's
-- first statement (its first local step's BEGIN, in that step's
-- transaction; or its first call's intent, or its answer), so that the
-- row commits with the first step, not alone. Until then the row is not
-- visible to others, so the inserting transaction holds the flow's
-- advisory lock (@lock_id: keylock.FlowID) until it ends, and a duplicate,
-- which sees no row, tries that lock rather than the unique index, which
-- would wait for the uncommitted row: it returns no row, inserting
-- nothing, when another transaction holds the lock, or when a flow holds
-- the key; a row committed between this statement's snapshot and its lock
-- fails it with a unique violation (idem_flow_pkey). Either way the
-- caller commits nothing of its transaction and looks at the flow again,
-- as a duplicate. Leases are dated by the clock, not by the start of the
-- transaction, which may have waited: clock_timestamp() here and in
-- SELECTs; in UPDATEs, statement_timestamp(), when the server received
-- the statement, since Citus refuses volatile functions in an UPDATE of a
-- distributed table (it evaluates statement_timestamp() on the
-- coordinator). Either is no earlier than the moment the executor sent
-- the statement, from which it counts its lease (flow_lease.go). Stored
-- values are sent as text, as KeyInsert's are. A plain INSERT, without ON
-- CONFLICT's speculative insertion and its confirmation in the WAL.
INSERT INTO idem_flow (scope, key, name, fingerprint, state, input, provider_namespace, epoch, leased_until, step, runs, retention)
SELECT @scope::text, @key::text, @flow_name::text, @fingerprint::bytea, 'running',
       sqlc.arg(input)::text::jsonb, (SELECT id FROM idem_installation), @epoch::bigint,
       clock_timestamp() + @lease::interval, sqlc.narg(step)::text, 1, @retention::interval
-- Without a row to see, the INSERT is not tried: the unique index would
-- otherwise wait for a transaction that holds the row (a local step's).
WHERE NOT EXISTS (
    SELECT FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
)
  AND pg_try_advisory_xact_lock(@lock_id::bigint)
RETURNING provider_namespace, operation;

-- name: FlowRestart :one
-- FlowRestart starts again, as a new operation, a finished flow whose
-- retention has passed: its row taken over, its steps deleted, and a new
-- epoch, so that nothing of its old executors can commit into the new
-- operation. Its calls get the provider keys of the key's first operation
-- (see Flow: a retention at least the provider's window keeps the two
-- apart). A row another transaction holds is skipped, not waited for.
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
        provider_namespace = (SELECT id FROM idem_installation),
        operation = NULL,
        epoch = @epoch::bigint,
        leased_until = statement_timestamp() + @lease::interval,
        step = NULL,
        runs = 1,
        last_error = NULL,
        retention = @retention::interval,
        created_at = now(),
        completed_at = NULL,
        expires_at = NULL
    FROM expired
    WHERE f.scope = expired.scope
      AND f.key = expired.key
    RETURNING f.provider_namespace, f.operation
),
cleared AS (
    DELETE FROM idem_flow_step AS s
    USING restarted
    WHERE s.scope = @scope::text
      AND s.key = @key::text
)
SELECT provider_namespace, operation FROM restarted;

-- name: FlowTakeOver :one
-- FlowTakeOver takes a running flow whose lease has run out, for a caller
-- with the same request (name and fingerprint), under a new epoch that
-- fences the executor that held it, and returns the input its first run
-- recorded, which the flow continues with. A flow whose row another
-- transaction holds (the executor's local step, still open) is skipped,
-- not waited for: the caller keeps waiting under its own budget. It
-- returns no row when the flow is not running, its lease holds, or the
-- request differs.
UPDATE idem_flow AS f
SET epoch = @epoch::bigint,
    leased_until = statement_timestamp() + @lease::interval,
    runs = f.runs + 1
FROM (
    SELECT scope, key
    FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
      AND name = @flow_name::text
      AND fingerprint = @fingerprint::bytea
      AND state = 'running'
      AND leased_until <= statement_timestamp()
    FOR UPDATE SKIP LOCKED
) AS free
WHERE f.scope = free.scope
  AND f.key = free.key
RETURNING f.provider_namespace, f.operation, f.input;

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
-- affects no row when the executor no longer holds the flow: another
-- executor took it over (a new epoch), or an operator stopped it. A lease
-- that ran out with nobody taking the flow over is the same executor's
-- still: the epoch alone fences, so that a slow executor slows down
-- rather than fails. As the first statement of a local step's transaction
-- it also locks the flow's row until that transaction ends, so that no
-- one takes the flow over while the step's writes are open.
UPDATE idem_flow
SET leased_until = statement_timestamp() + @lease::interval,
    step = @step::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

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
-- a call whose intent an earlier run recorded, its attempts counted again
-- (and, when every earlier attempt surely did not reach the other system,
-- 'unsent', its window started again). It returns leased, false when the
-- executor no longer holds the flow (see FlowLease); attempts, the call's
-- attempts with this one, 0 when the call has a result already; resumed,
-- true when an earlier attempt may have reached the other system (the
-- row was 'calling'); and past_window, true when such an attempt is older
-- than the provider's window (@call_window), past which the provider may
-- have forgotten the key, and calling again could apply the call twice.
WITH leased AS (
    UPDATE idem_flow
    SET leased_until = statement_timestamp() + @lease::interval,
        step = @step::text
    WHERE scope = @scope::text
      AND key = @key::text
      AND epoch = @epoch::bigint
      AND state = 'running'
    RETURNING 1
),
earlier AS (
    SELECT state, first_called_at
    FROM idem_flow_step
    WHERE scope = @scope::text
      AND key = @key::text
      AND seq = @seq::int
),
called AS (
    INSERT INTO idem_flow_step AS s (scope, key, seq, name, kind, state, attempts, first_called_at)
    SELECT @scope::text, @key::text, @seq::int, @step::text, 'call', 'calling', 1, now()
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
       coalesce((SELECT state = 'calling' AND first_called_at <= now() - @call_window::interval FROM earlier), false)::bool AS past_window;

-- name: FlowCallStartNew :one
-- FlowCallStartNew is FlowCallStart for a call that no earlier run
-- recorded (the executor read the flow's steps as it claimed it, and only
-- its epoch writes steps since): a plain INSERT, without ON CONFLICT's
-- speculative insertion and its confirmation in the WAL. A row that is
-- there after all fails it with a unique violation, and nothing is called.
WITH leased AS (
    UPDATE idem_flow
    SET leased_until = statement_timestamp() + @lease::interval,
        step = @step::text
    WHERE scope = @scope::text
      AND key = @key::text
      AND epoch = @epoch::bigint
      AND state = 'running'
    RETURNING 1
),
called AS (
    INSERT INTO idem_flow_step (scope, key, seq, name, kind, state, attempts, first_called_at)
    SELECT @scope::text, @key::text, @seq::int, @step::text, 'call', 'calling', 1, now()
    FROM leased
    RETURNING attempts
)
SELECT EXISTS (SELECT FROM leased)::bool AS leased,
       coalesce((SELECT attempts FROM called), 0)::int AS attempts;

-- name: FlowCallDone :execrows
-- FlowCallDone records a call's result once the other system answered, or
-- a lookup found it (@reconciled, 'found', counted with the call's
-- lookups), renewing the lease; it affects no row when the executor no
-- longer holds the flow (see FlowLease), and then records nothing.
WITH leased AS (
    UPDATE idem_flow
    SET leased_until = statement_timestamp() + @lease::interval
    WHERE scope = @scope::text
      AND key = @key::text
      AND epoch = @epoch::bigint
      AND state = 'running'
    RETURNING 1
)
UPDATE idem_flow_step AS s
SET state = 'done',
    result = sqlc.narg(result)::text::jsonb,
    completed_at = now(),
    reconciles = s.reconciles + CASE WHEN sqlc.narg(reconciled)::text IS NULL THEN 0 ELSE 1 END,
    last_reconcile = coalesce(sqlc.narg(reconciled)::text, s.last_reconcile)
FROM leased
WHERE s.scope = @scope::text
  AND s.key = @key::text
  AND s.seq = @seq::int
  AND s.state = 'calling';

-- name: FlowCallDoneHeld :execrows
-- FlowCallDoneHeld records a call's result as FlowCallDone does, in a
-- transaction whose FlowLease, sent before it, already renewed the lease
-- and holds the flow's row (a local step's): it renews nothing, so that
-- the flow's row is written once, not twice. It affects no row when the
-- executor no longer holds the flow.
UPDATE idem_flow_step AS s
SET state = 'done',
    result = sqlc.narg(result)::text::jsonb,
    completed_at = now(),
    reconciles = s.reconciles + CASE WHEN sqlc.narg(reconciled)::text IS NULL THEN 0 ELSE 1 END,
    last_reconcile = coalesce(sqlc.narg(reconciled)::text, s.last_reconcile)
FROM idem_flow AS f
WHERE f.scope = @scope::text
  AND f.key = @key::text
  AND f.epoch = @epoch::bigint
  AND f.state = 'running'
  AND s.scope = f.scope
  AND s.key = f.key
  AND s.seq = @seq::int
  AND s.state = 'calling';

-- name: FlowCallReconciled :execrows
-- FlowCallReconciled counts a lookup made for a call found 'calling' that
-- did not find it (@outcome 'not_found', and the call is made again) or
-- failed (the outcome says how), for operators; it affects no row when
-- the executor no longer holds the flow.
UPDATE idem_flow_step AS s
SET reconciles = s.reconciles + 1,
    last_reconcile = @outcome::text
FROM idem_flow AS f
WHERE f.scope = @scope::text
  AND f.key = @key::text
  AND f.epoch = @epoch::bigint
  AND f.state = 'running'
  AND s.scope = f.scope
  AND s.key = f.key
  AND s.seq = @seq::int
  AND s.state = 'calling';

-- name: FlowCallUnsent :execrows
-- FlowCallUnsent records that a call's attempt surely did not reach the
-- other system (its function said so: a refused connection), when no
-- earlier attempt may have either: the call is then 'unsent', and the
-- next attempt is made whatever the provider's window or AtMostOnce say.
UPDATE idem_flow_step AS s
SET state = 'unsent'
FROM idem_flow AS f
WHERE f.scope = @scope::text
  AND f.key = @key::text
  AND f.epoch = @epoch::bigint
  AND f.state = 'running'
  AND s.scope = f.scope
  AND s.key = f.key
  AND s.seq = @seq::int
  AND s.state = 'calling';

-- name: FlowComplete :execrows
-- FlowComplete records the flow's answer: from now on retries replay it,
-- until its retention (counted from now) has passed. It affects no row
-- when the executor no longer holds the flow (see FlowLease).
UPDATE idem_flow
SET state = 'done',
    output = sqlc.narg(output)::text::jsonb,
    leased_until = NULL,
    step = NULL,
    last_error = NULL,
    completed_at = now(),
    expires_at = to_timestamp((extract(epoch FROM now()) + extract(epoch FROM retention))::float8)
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- (FlowComplete and FlowEnd date the expiry as now() + retention in
-- seconds: Citus refuses timestamptz + interval, a stable operator, on a
-- column in an UPDATE of a distributed table. A retention is a duration,
-- with no days or months, so the two are the same.)

-- name: FlowRelease :execrows
-- FlowRelease gives the lease up when the flow's function returned an
-- error or its context ended, so that a retry takes the flow over at once
-- instead of waiting for the lease to run out; the error is kept for
-- operators. It affects no row when the executor no longer holds the flow
-- (see FlowLease).
UPDATE idem_flow
SET leased_until = least(leased_until, statement_timestamp()),
    last_error = @last_error::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowStop :execrows
-- FlowStop stops a running flow that needs a person's decision (a call
-- past the provider's window, a result that cannot be stored), so that
-- nothing runs it again. It affects no row when the executor no longer
-- holds the flow (see FlowLease).
UPDATE idem_flow
SET state = 'attention',
    leased_until = NULL,
    last_error = @last_error::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

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
SET epoch = @epoch::bigint,
    leased_until = statement_timestamp() + @lease::interval,
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
RETURNING f.provider_namespace, f.operation, f.input;

-- name: FlowEnd :execrows
-- FlowEnd ends a flow that is running or needs attention, for an
-- operator: nothing runs it again, its executor (if one still runs)
-- commits nothing more, and its record answers retries until its
-- retention has passed.
UPDATE idem_flow
SET state = 'ended',
    leased_until = NULL,
    completed_at = now(),
    expires_at = to_timestamp((extract(epoch FROM now()) + extract(epoch FROM retention))::float8),
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

-- name: FlowPurgeExpiredCitus :one
-- FlowPurgeExpiredCitus is FlowPurgeExpired for a database with Citus (see
-- KeyPurgeExpiredCitus): no row locks, the expiry checked again on the row
-- it deletes.
WITH purged AS (
    DELETE FROM idem_flow AS f
    WHERE (f.scope, f.key) IN (
        SELECT expired.scope, expired.key
        FROM idem_flow AS expired
        WHERE expired.expires_at <= now()
        ORDER BY expired.expires_at
        LIMIT @max_rows::int
    )
      AND f.expires_at <= now()
    RETURNING f.scope, f.key
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
SELECT name, fingerprint, state, input, output, provider_namespace, operation, leased_until, step, runs, last_error,
       created_at, completed_at, expires_at,
       coalesce(expires_at <= now(), false)::bool AS expired,
       coalesce(leased_until > now(), false)::bool AS leased
FROM idem_flow
WHERE scope = @scope::text
  AND key = @key::text;

-- name: FlowInspectSteps :many
-- FlowInspectSteps reads one flow's steps, for operators.
SELECT seq, name, kind, state, result, attempts, first_called_at, completed_at, reconciles, last_reconcile
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
