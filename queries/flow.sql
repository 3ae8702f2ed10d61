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

-- name: FlowStartLock :one
-- FlowStartLock begins the first local step of a flow that no one has
-- started, on a connection that keeps its transaction open until the
-- flow's next statement (see flow_pending.go): it takes the flow's
-- advisory lock as FlowStart does, and for the same reasons, and returns
-- the installation's id, but writes nothing. It fails (division by zero,
-- 22012) when another transaction holds the lock, so that the server runs
-- none of the statements sent after it in the same round trip, the
-- step's first included (see flow_steptx.go): the caller looks at the
-- flow again, as a duplicate. FlowStartFree, the next statement, checks
-- that the key has no flow, with a snapshot taken once the lock is held,
-- which sees a row its previous holder committed (one statement's
-- snapshot would be taken before its lock). The row is written once, by
-- FlowStartHeld in the same transaction, with the step's record and what
-- travels with it (the first call's intent), as the transaction commits.
--
-- It names the flow's row, which it never reads (LIMIT 0), so that Citus
-- runs it, lock included, on the node of the scope's shard, whichever
-- node the query came in through (as KeyLockWait does): two runs of one
-- flow through two nodes meet at that lock. There it holds the lock only
-- inside a transaction block, so on Citus the claim sends it after BEGIN
-- (see flow_claim.go). On PostgreSQL the lookup is never executed.
SELECT (SELECT id FROM idem_installation)::uuid AS provider_namespace
WHERE 1 / pg_try_advisory_xact_lock(@lock_id::bigint)::int = 1
  AND NOT EXISTS (
      SELECT FROM idem_flow
      WHERE scope = @scope::text
        AND key = @key::text
      LIMIT 0
  );

-- name: FlowStartFree :exec
-- FlowStartFree fails (division by zero, 22012) when the key has a flow,
-- before the claim's BEGIN and again after FlowStartLock: the server then
-- runs none of the statements sent after it in the same round trip. An
-- aggregate over the flow's primary key, one row whatever is there: a
-- statement of one table with the scope's equality, no subquery, which
-- Citus plans on its fast path and routes whole to the scope's shard.
SELECT 1 / (count(*) = 0)::int
FROM idem_flow
WHERE scope = @scope::text
  AND key = @key::text;

-- name: FlowStartHeld :one
-- FlowStartHeld is FlowStart in a transaction that FlowStartLock began,
-- which holds the flow's advisory lock, with the installation's id that
-- it read (@provider_namespace), and what @steps holds (see
-- FlowLeaseSteps): the step's record, and the intent of the call after
-- it, if that is what the row travels with, so that the row is written
-- once. A plain INSERT, which fails with a unique violation
-- (idem_flow_pkey), and with it the transaction, the step's writes
-- included, should a row be there all the same (FlowStartFree checked):
-- a step's writes never commit without their flow. It returns
-- created_at, the transaction's now(), which the records' times count
-- from (so the stamps in @steps are 0): when the call's first attempt was
-- made, for an intent it carries. (No subquery, which Citus refuses in an
-- INSERT's VALUES.)
INSERT INTO idem_flow (scope, key, name, fingerprint, state, input, provider_namespace, epoch, leased_until, step, runs, retention,
                       steps)
VALUES (@scope::text, @key::text, @flow_name::text, @fingerprint::bytea, 'running',
        sqlc.arg(input)::text::jsonb, @provider_namespace::uuid, @epoch::bigint,
        clock_timestamp() + @lease::interval, sqlc.narg(step)::text, 1, @retention::interval,
        replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), '0')::jsonb)
RETURNING provider_namespace, operation, created_at, leased_until;

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
        expires_at = NULL,
        steps = NULL
    FROM expired
    WHERE f.scope = expired.scope
      AND f.key = expired.key
    RETURNING f.provider_namespace, f.operation
),
cleared AS (
    DELETE FROM idem_flow_step_row AS s
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
       -- once a synchronous standby has it. With @mark false (the claim's
       -- look in a round trip that rolls back when it finds the flow, see
       -- flow_claim.go) it only says so, and writes no marker, which
       -- would not commit: the claim reads the flow again, alone.
       CASE
           WHEN state = 'done'
            AND expires_at > now()
            AND current_setting('synchronous_standby_names') <> ''
            AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
            AND NOT pg_is_in_recovery()
           THEN NOT @mark::bool OR pg_logical_emit_message(true, 'idem'::text, ''::text) IS NOT NULL
           ELSE false
       END::bool AS standby_wait
FROM idem_flow
WHERE scope = @scope::text
  AND key = @key::text;

-- name: FlowSteps :many
-- FlowSteps reads the recorded steps of a running flow, in order, each as
-- its record in idem_flow.steps (see FlowLeaseSteps), for the executor that
-- resumes it; for any other flow it reads nothing, so that a replay does
-- not pay for them. A step that a version before migration 00008 recorded
-- in idem_flow_step_row is read from there, as a record of the same fields,
-- unless the flow's row records it too (a call resumed since); so is one
-- that this version recorded as a row (FlowStepRecord, FlowStepRows):
-- in_row says which, for the step's further records to go there too;
-- base is the flow's created_at, which the times of the records in its
-- row count from.
SELECT seq::int AS seq, rec::jsonb AS rec, in_row::boolean AS in_row, base::timestamptz AS base
FROM (
    SELECT s.key::int AS seq, s.value AS rec, false AS in_row, f.created_at AS base
    FROM idem_flow AS f, jsonb_each(f.steps) AS s(key, value)
    WHERE f.scope = @scope::text
      AND f.key = @key::text
      AND f.state = 'running'
      AND s.key <> 'v'
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
               'l', s.last_reconcile), true, f.created_at
    FROM idem_flow_step_row AS s
    JOIN idem_flow AS f ON f.scope = s.scope AND f.key = s.key
    WHERE s.scope = @scope::text
      AND s.key = @key::text
      AND f.state = 'running'
      AND NOT coalesce(f.steps ? s.seq::text, false)
) AS recorded
ORDER BY seq;

-- name: FlowLease :execrows
-- FlowLease renews the executor's lease and notes the step it is at. It
-- affects no row when the executor no longer holds the flow: another
-- executor took it over (a new epoch), or an operator stopped it. A lease
-- that ran out with nobody taking the flow over is the same executor's
-- still: the epoch alone fences, so that a slow executor slows down
-- rather than fails.
UPDATE idem_flow
SET leased_until = statement_timestamp() + @lease::interval,
    step = @step::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowLeaseSteps :execrows
-- FlowLeaseSteps is FlowLease that also records what @steps holds (see
-- below): a local step's record, as its transaction commits alone, a
-- call's result with nothing else to send. It affects no row, and records
-- nothing, when the executor no longer holds the flow (see FlowLease).
--
-- A flow's steps are recorded in its row (idem_flow.steps, migration
-- 00008), in the write of that row that each statement of the executor
-- makes anyway: a local step's record with the statement after its writes
-- (the next call's intent, the answer, the lease given up), before its
-- transaction commits; a call's intent before the call; its result with
-- the flow's next statement. So every step costs the flow's row one
-- write, and that write is fenced by the epoch like the rest. @steps is
-- a JSON object of the records to write, by place ("0", "1", ...), each
-- one whole: the executor holds the flow and knows each record. A record
-- is a JSON string of a compact form (appendInline in flow_inline.go, and
-- the comment of migration 00009): the step's name, its result, when it
-- was done, and a call's state, attempts, first attempt that may have
-- reached the other system, lookups (Reconcile) and what the last found.
-- Its times are microseconds after the flow's created_at; the byte 0x01
-- in @steps stands for the statement's own now(), which the server writes
-- in. Every write's @steps begins with the key "v", the records' form,
-- which is no place (formMark in flow_records.go). (No CASE: Citus
-- refuses a function that is not immutable, now() here, in a CASE or
-- COALESCE of an UPDATE of a distributed table; a NULL @steps merges
-- '{}', which changes nothing.)
UPDATE idem_flow
SET leased_until = statement_timestamp() + @lease::interval,
    step = @step::text,
    steps = coalesce(steps, '{}'::jsonb)
        || replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), (extract(epoch FROM now() - created_at) * 1000000)::bigint::text)::jsonb
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowLock :exec
-- FlowLock locks the flow's row, as the first statement of a local step's
-- transaction, until that transaction ends, so that no one takes the flow
-- over while the step's writes are open. It fails (division by zero,
-- 22012) when the executor no longer holds the flow (see FlowLease), so
-- that the server runs none of the statements sent after it in the same
-- round trip, the step's first included (see flow_steptx.go). It renews
-- nothing and writes no new version of the row (only the lock): the
-- step's one write of the row, FlowLeaseSteps (FlowLease when its record
-- is a row of its own, FlowStepRecord) or the flow's next statement,
-- renews the lease and records the step (and a call's result still to
-- record) once the step's function has returned.
SELECT 1 / count(*)::int
FROM (
    SELECT
    FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
      AND epoch = @epoch::bigint
      AND state = 'running'
    FOR NO KEY UPDATE
) AS held;

-- name: FlowRecordSteps :execrows
-- FlowRecordSteps records what @steps holds (see FlowLeaseSteps) and nothing
-- else: a call's lookup that did not find it, an attempt that surely did
-- not reach the other system. It affects no row when the executor no
-- longer holds the flow.
UPDATE idem_flow
SET steps = coalesce(steps, '{}'::jsonb)
        || replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), (extract(epoch FROM now() - created_at) * 1000000)::bigint::text)::jsonb
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowStepRecord :exec
-- FlowStepRecord records a local step's result as a row of its own, in
-- the transaction of its writes, which holds the flow's row (FlowLock):
-- both commit together or not at all. Only a flow whose row already
-- records many steps, or large ones, records a local step this way
-- (maxInlineSteps in flow_records.go), and then every further step, its
-- calls too (FlowStepRows): the flow's row is written without its
-- records from then on, so that no write of it copies them again. The
-- step's row is read as the steps of older versions are (FlowSteps).
INSERT INTO idem_flow_step_row (scope, key, seq, name, kind, state, result, attempts, completed_at)
VALUES (@scope::text, @key::text, @seq::int, @step::text, 'local', 'done',
        sqlc.narg(result)::text::jsonb, 1, now());

-- name: FlowLeaseUntil :one
-- FlowLeaseUntil is FlowLease that returns the lease it renewed (no row
-- when the executor no longer holds the flow): a call's intent recorded
-- as a row (FlowStepRows), which FlowCallIntent would return.
UPDATE idem_flow
SET leased_until = statement_timestamp() + @lease::interval,
    step = @step::text
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running'
RETURNING leased_until;

-- name: FlowStepRows :many
-- FlowStepRows records what @steps holds (see FlowLeaseSteps), steps not
-- recorded yet, as rows of idem_flow_step_row, instead of in the flow's row:
-- the records of a flow whose row already records many steps, or large
-- ones (maxInlineSteps in flow_records.go), so that no write of
-- the flow's row copies them again. It is fenced as the statements that
-- write the flow's row are: it records nothing when the executor no
-- longer holds the flow (see FlowLease), and is sent before the
-- statement of the same transaction that ends the flow. It returns each
-- record's place and when its call's first attempt was made (f: the
-- statement's now() where @steps stands it in), which FlowCallIntent
-- returns for a call recorded in the flow's row.
INSERT INTO idem_flow_step_row AS t (scope, key, seq, name, kind, state, result, attempts, first_called_at, completed_at,
                                     reconciles, last_reconcile)
SELECT f.scope, f.key, r.key::int, r.value->>'n',
       CASE WHEN r.value ? 'a' THEN 'call' ELSE 'local' END,
       coalesce(r.value->>'s', 'done'), r.value->'r', coalesce((r.value->>'a')::int, 1),
       timestamptz 'epoch' + (r.value->>'f')::bigint * interval '1 microsecond',
       timestamptz 'epoch' + (r.value->>'c')::bigint * interval '1 microsecond',
       coalesce((r.value->>'x')::int, 0), r.value->>'l'
FROM idem_flow AS f,
     jsonb_each(replace(@steps::text, chr(1), (extract(epoch FROM now()) * 1000000)::bigint::text)::jsonb) AS r(key, value)
WHERE f.scope = @scope::text
  AND f.key = @key::text
  AND f.epoch = @epoch::bigint
  AND f.state = 'running'
RETURNING t.seq, coalesce((extract(epoch FROM t.first_called_at) * 1000000)::bigint, 0)::bigint AS first_called_at;

-- name: FlowStepRowsUpdate :many
-- FlowStepRowsUpdate is FlowStepRows for steps already recorded as rows
-- (a call's result after its intent, a call resumed): it writes each
-- record whole over its row. (Citus refuses a function that is not
-- immutable, timestamptz + interval or extract from one, with a column in
-- an UPDATE: to_timestamp is immutable, and exact to the microsecond for
-- these times.)
UPDATE idem_flow_step_row AS t
SET name = r.value->>'n',
    state = coalesce(r.value->>'s', 'done'),
    result = r.value->'r',
    attempts = coalesce((r.value->>'a')::int, 1),
    first_called_at = to_timestamp((r.value->>'f')::bigint / 1000000.0),
    completed_at = to_timestamp((r.value->>'c')::bigint / 1000000.0),
    reconciles = coalesce((r.value->>'x')::int, 0),
    last_reconcile = r.value->>'l'
FROM idem_flow AS f,
     jsonb_each(replace(@steps::text, chr(1), (extract(epoch FROM now()) * 1000000)::bigint::text)::jsonb) AS r(key, value)
WHERE t.scope = @scope::text
  AND t.key = @key::text
  AND t.seq = r.key::int
  AND f.scope = @scope::text
  AND f.key = @key::text
  AND f.epoch = @epoch::bigint
  AND f.state = 'running'
RETURNING t.seq, coalesce((r.value->>'f')::bigint, 0)::bigint AS first_called_at;

-- name: FlowCallIntent :one
-- FlowCallIntent records the intent of a call before the other system is
-- called, renewing the lease: @steps holds the call's record, 'calling',
-- its attempts counted (see FlowLeaseSteps), with what is pending before it.
-- It returns, when the executor holds the flow (no row otherwise), the
-- call's record as written, which says when its first attempt was made
-- (the transaction's now() for a new call, or one whose earlier attempts
-- surely did not reach the other system), after the flow's created_at,
-- which it returns too; and the lease it renewed, which ends @lease after
-- the statement's time: a call resumed past the provider's window is one
-- whose first attempt is older than that time minus the window (an empty
-- record when the call's record went to a row of its own: FlowStepRows
-- returns when).
-- (Citus refuses a function that is not immutable in RETURNING, now()
-- among them.)
UPDATE idem_flow
SET leased_until = statement_timestamp() + @lease::interval,
    step = @step::text,
    steps = coalesce(steps, '{}'::jsonb)
        || replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), (extract(epoch FROM now() - created_at) * 1000000)::bigint::text)::jsonb
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running'
RETURNING coalesce(steps ->> (@seq::int)::text, '')::text AS rec, created_at, leased_until;

-- name: FlowComplete :execrows
-- FlowComplete records the flow's answer, with what @steps holds (see
-- FlowLeaseSteps): from now on retries replay it, until its retention
-- (counted from now) has passed. It affects no row when the executor no longer
-- holds the flow (see FlowLease).
UPDATE idem_flow
SET state = 'done',
    output = sqlc.narg(output)::text::jsonb,
    steps = coalesce(steps, '{}'::jsonb)
        || replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), (extract(epoch FROM now() - created_at) * 1000000)::bigint::text)::jsonb,
    leased_until = NULL,
    step = NULL,
    last_error = NULL,
    completed_at = now(),
    expires_at = to_timestamp((extract(epoch FROM now()) + extract(epoch FROM retention))::float8)
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowCompleteBare :execrows
-- FlowCompleteBare is FlowComplete with nothing to record in the flow's
-- row, which it leaves as it is: its steps are not written again.
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
-- operators, what @steps holds recorded (see FlowLeaseSteps), and @step, if
-- any, noted as the step it is at (a local step's, which FlowLock did not
-- note). It affects no row when the executor no longer holds the flow
-- (see FlowLease).
UPDATE idem_flow
SET leased_until = least(leased_until, statement_timestamp()),
    last_error = @last_error::text,
    step = coalesce(sqlc.narg(step)::text, step),
    steps = coalesce(steps, '{}'::jsonb)
        || replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), (extract(epoch FROM now() - created_at) * 1000000)::bigint::text)::jsonb
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowReleaseBare :execrows
-- FlowReleaseBare is FlowRelease with nothing to record in the flow's
-- row, which it leaves as it is: its steps are not written again.
UPDATE idem_flow
SET leased_until = least(leased_until, statement_timestamp()),
    last_error = @last_error::text,
    step = coalesce(sqlc.narg(step)::text, step)
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowStop :execrows
-- FlowStop stops a running flow that needs a person's decision (a call
-- past the provider's window, a result that cannot be stored), so that
-- nothing runs it again, recording what @steps holds and noting @step,
-- as FlowRelease does. It affects no row when the executor no longer
-- holds the flow (see FlowLease).
UPDATE idem_flow
SET state = 'attention',
    leased_until = NULL,
    last_error = @last_error::text,
    step = coalesce(sqlc.narg(step)::text, step),
    steps = coalesce(steps, '{}'::jsonb)
        || replace(coalesce(sqlc.narg(steps)::text, '{}'), chr(1), (extract(epoch FROM now() - created_at) * 1000000)::bigint::text)::jsonb
WHERE scope = @scope::text
  AND key = @key::text
  AND epoch = @epoch::bigint
  AND state = 'running';

-- name: FlowStopBare :execrows
-- FlowStopBare is FlowStop with nothing to record in the flow's row,
-- which it leaves as it is: its steps are not written again.
UPDATE idem_flow
SET state = 'attention',
    leased_until = NULL,
    last_error = @last_error::text,
    step = coalesce(sqlc.narg(step)::text, step)
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
    DELETE FROM idem_flow_step_row AS s
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
    DELETE FROM idem_flow_step_row AS s
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
-- FlowInspectSteps reads one flow's steps, for operators, as FlowSteps
-- reads a running flow's: those its row records (see FlowLeaseSteps), and
-- those recorded in idem_flow_step_row that its row does not.
SELECT seq::int AS seq, rec::jsonb AS rec, in_row::boolean AS in_row, base::timestamptz AS base
FROM (
    SELECT s.key::int AS seq, s.value AS rec, false AS in_row, f.created_at AS base
    FROM idem_flow AS f, jsonb_each(f.steps) AS s(key, value)
    WHERE f.scope = @scope::text
      AND f.key = @key::text
      AND s.key <> 'v'
    UNION ALL
    SELECT s.seq, jsonb_build_object(
               'n', s.name,
               's', CASE WHEN s.state = 'done' THEN NULL ELSE s.state END,
               'r', s.result,
               'a', CASE WHEN s.kind = 'call' THEN s.attempts END,
               'f', (extract(epoch FROM s.first_called_at) * 1000000)::bigint,
               'c', (extract(epoch FROM s.completed_at) * 1000000)::bigint,
               'x', s.reconciles,
               'l', s.last_reconcile), true, NULL
    FROM idem_flow_step_row AS s
    WHERE s.scope = @scope::text
      AND s.key = @key::text
      AND NOT EXISTS (
          SELECT FROM idem_flow AS f
          WHERE f.scope = s.scope
            AND f.key = s.key
            AND f.steps ? s.seq::text
      )
) AS recorded
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

-- name: FlowWaitClaim :exec
-- FlowWaitClaim waits until no transaction holds the flow's advisory lock
-- (@lock_id: keylock.FlowID), then holds it until its own transaction
-- ends: sent before a statement that must see the outcome of a claim's
-- transaction whose COMMIT may still be under way (a run whose context
-- ended as it committed): that statement, sent after it in the same
-- transaction, reads with a snapshot taken once the claim committed or
-- rolled back. It names the flow's row, which it never reads, so that
-- Citus runs it on the node of the scope's shard, where the claim took
-- the lock (see FlowStartLock).
SELECT pg_advisory_xact_lock(@lock_id::bigint)
WHERE NOT EXISTS (
    SELECT FROM idem_flow
    WHERE scope = @scope::text
      AND key = @key::text
    LIMIT 0
);
