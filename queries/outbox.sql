-- name: OutboxInsert :one
-- OutboxInsert adds a pending message, or nothing when a message with the
-- same idempotency key is already in the outbox; OutboxGetByKey then reads
-- it.
INSERT INTO outbox_message (scope, key, destination, payload, idempotency_key, ordering_key,
                            trace_parent, trace_state)
VALUES (@scope::text, @key::text, @destination::text, @payload::bytea,
        @idempotency_key::text, nullif(@ordering_key::text, ''),
        nullif(@trace_parent::text, ''), nullif(@trace_state::text, ''))
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- name: OutboxInsertMany :many
-- OutboxInsertMany adds many pending messages in one statement, one row of
-- the arrays per message, in their order, and returns the ids and keys of
-- those it added; a message whose idempotency key is already taken (also by
-- an earlier row of the same call) is skipped, for OutboxGetByKeys to read.
INSERT INTO outbox_message (scope, key, destination, payload, idempotency_key, ordering_key,
                            trace_parent, trace_state)
SELECT e.scope, e.key, e.destination, e.payload, e.idempotency_key, nullif(e.ordering_key, ''),
       nullif(@trace_parent::text, ''), nullif(@trace_state::text, '')
FROM (
    -- Set-returning functions side by side in a select list advance
    -- together: one row per index of the arrays, in order.
    SELECT unnest(@scopes::text[]) AS scope,
           unnest(@keys::text[]) AS key,
           unnest(@destinations::text[]) AS destination,
           unnest(@payloads::bytea[]) AS payload,
           unnest(@idempotency_keys::text[]) AS idempotency_key,
           unnest(@ordering_keys::text[]) AS ordering_key
) AS e
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, idempotency_key;

-- name: OutboxGetByKey :one
-- OutboxGetByKey reads the message with an idempotency key, with a fresh
-- snapshot, so that Enqueue can compare it with the entry it was given.
SELECT id, scope, key, destination, payload, coalesce(ordering_key, '')::text AS ordering_key
FROM outbox_message
WHERE idempotency_key = @idempotency_key::text;

-- name: OutboxGetByKeys :many
-- OutboxGetByKeys reads the messages with these idempotency keys, as
-- OutboxGetByKey does one.
SELECT id, scope, key, destination, payload, coalesce(ordering_key, '')::text AS ordering_key,
       idempotency_key
FROM outbox_message
WHERE idempotency_key = ANY (@idempotency_keys::text[]);

-- name: OutboxNotify :exec
-- OutboxNotify wakes listening relays when the calling transaction commits.
SELECT pg_notify('idem_outbox', '');

-- name: OutboxNotifyProbe :exec
-- OutboxNotifyProbe sends a relay's own notification, with a payload that
-- tells it apart, to check that its listening connection hears them.
SELECT pg_notify('idem_outbox', @payload::text);

-- name: OutboxListen :exec
-- OutboxListen subscribes the relay's connection to OutboxNotify.
LISTEN idem_outbox;

-- name: OutboxRecordAndLease :many
-- OutboxRecordAndLease is the relay's one statement for outcomes: it
-- records the outcomes of the relay's last deliveries (the rows with kind
-- 'recorded' are the ids it changed), and leases up to @max_messages due
-- messages to the relay for @lease, counting an attempt for each (the rows
-- with kind 'leased'): one statement, one round trip and one commit for
-- both. With @max_messages 0 it only records: LIMIT 0 ends the lease's scan
-- before it reads a row, while the recording UPDATE, a data-modifying CTE,
-- always runs to completion. So outcomes are written by this UPDATE alone.
--
-- The outcomes come one row of the arrays per message. @outcomes says what
-- each attempt did:
--   delivered: the handler succeeded. It is recorded whichever relay made
--     it, even under a newer lease: a delivery that succeeded is a fact.
--   retried: the attempt failed; the message is due again after
--     @delays_us microseconds.
--   parked: the message is given up on, kept with its last error.
--   released: a stopping relay interrupted the attempt; the message is due
--     again at once, and the attempt is not counted.
-- All but delivered apply only while @attempts is still the message's
-- newest lease, and nothing changes a message that is no longer pending.
--
-- A lease also moves the message's next_attempt_at to the lease's end, when
-- it is due again if no outcome is recorded: leased messages thus leave the
-- front of the due index, which the relays' leases scan, instead of being
-- passed over by every one of them. Rows another relay is leasing at this
-- moment are skipped, not waited for, and a row whose lease committed after
-- this statement's snapshot is dropped when its lock is taken, because the
-- lock rechecks the row's newest version. A message whose outcome this
-- statement records is not leased by it.
--
-- A message with an ordering key is due only when no earlier message with
-- the same destination and ordering key is still pending, and no other
-- pending one with them is leased: ids give the order, but a later message
-- can commit, and be leased, before an earlier one commits, which must then
-- wait for it. So at most one of them is leased at a time, except that two
-- relays leasing in the same instant in which the earlier message commits
-- can each lease one, since neither sees the other's uncommitted lease.
-- The message after one whose outcome this statement records is due only
-- from the next statement on.
WITH recorded AS (
    UPDATE outbox_message AS m
    SET state = CASE
                    WHEN o.outcome = 'delivered' THEN 'delivered'
                    WHEN o.outcome = 'parked' THEN 'parked'
                    ELSE 'pending'
                END,
        delivered_at = CASE WHEN o.outcome = 'delivered' THEN o.now END,
        leased_until = NULL,
        attempts = CASE WHEN o.outcome = 'released' THEN m.attempts - 1 ELSE m.attempts END,
        next_attempt_at = CASE
                              WHEN o.outcome = 'retried' THEN o.retry_at
                              WHEN o.outcome = 'released' THEN o.now
                              ELSE m.next_attempt_at
                          END,
        last_error = CASE WHEN o.outcome = 'delivered' THEN NULL ELSE o.last_error END
    FROM (
        -- The times are computed here, not in the CASEs above: now() is
        -- the transaction's start either way, but Citus refuses an UPDATE
        -- of one of its tables (docs/citus.sql makes outbox_message one)
        -- whose CASE calls a function that is not IMMUTABLE, or a STABLE
        -- one (timestamptz + interval) with a column. OFFSET 0 keeps the
        -- planner from merging this subquery into the UPDATE, which would
        -- put the calls back into the CASEs; PostgreSQL never merged the
        -- set-returning functions' subquery anyway.
        SELECT u.id, u.attempt, u.outcome, u.last_error, now() AS now,
               now() + u.delay_us * interval '1 microsecond' AS retry_at
        FROM (
            -- Set-returning functions side by side in a select list
            -- advance together: one row per index of the arrays, in order.
            SELECT unnest(@ids::bigint[]) AS id,
                   unnest(@attempts::int[]) AS attempt,
                   unnest(@outcomes::text[]) AS outcome,
                   unnest(@delays_us::bigint[]) AS delay_us,
                   unnest(@last_errors::text[]) AS last_error
        ) AS u
        OFFSET 0
    ) AS o
    WHERE m.id = o.id
      AND m.state = 'pending'
      AND (o.outcome = 'delivered' OR m.attempts = o.attempt)
    RETURNING m.id
),
due AS MATERIALIZED (
    SELECT candidate.id
    FROM outbox_message AS candidate
    WHERE candidate.state = 'pending'
      AND candidate.next_attempt_at <= now()
      -- Read as one array, recorded runs to completion before the first
      -- candidate is locked: this statement never waits for a row while it
      -- holds the locks of its lease, so relays cannot deadlock.
      AND candidate.id <> ALL ((SELECT coalesce(array_agg(r.id), '{}') FROM recorded AS r)::bigint[])
      AND (candidate.leased_until IS NULL OR candidate.leased_until <= now())
      AND (coalesce(cardinality(@destinations::text[]), 0) = 0
           OR candidate.destination = ANY (@destinations::text[]))
      AND (candidate.ordering_key IS NULL OR (
          NOT EXISTS (
              SELECT 1
              FROM outbox_message AS earlier
              WHERE earlier.destination = candidate.destination
                AND earlier.ordering_key = candidate.ordering_key
                AND earlier.state = 'pending'
                AND earlier.id < candidate.id
          )
          AND NOT EXISTS (
              SELECT 1
              FROM outbox_message AS in_flight
              WHERE in_flight.destination = candidate.destination
                AND in_flight.ordering_key = candidate.ordering_key
                AND in_flight.state = 'pending'
                AND in_flight.id <> candidate.id
                AND in_flight.leased_until > now()
          )
      ))
    ORDER BY candidate.next_attempt_at, candidate.id
    LIMIT @max_messages::int
    FOR UPDATE SKIP LOCKED
),
leased AS (
    UPDATE outbox_message AS leased
    SET attempts = leased.attempts + 1,
        leased_until = now() + @lease::interval,
        next_attempt_at = now() + @lease::interval
    FROM due
    WHERE leased.id = due.id
    RETURNING leased.id, leased.scope, leased.key, leased.destination, leased.payload,
              leased.idempotency_key, coalesce(leased.ordering_key, '')::text AS ordering_key,
              leased.attempts, leased.created_at,
              coalesce(leased.trace_parent, '')::text AS trace_parent,
              coalesce(leased.trace_state, '')::text AS trace_state
)
SELECT 'leased'::text AS kind, id, scope, key, destination, payload, idempotency_key, ordering_key,
       attempts, created_at, trace_parent, trace_state, now()::timestamptz AS leased_at
FROM leased
UNION ALL
SELECT 'recorded'::text, id, ''::text, ''::text, ''::text, ''::bytea, ''::text, ''::text,
       0::int, now()::timestamptz, ''::text, ''::text, now()::timestamptz
FROM recorded;

-- name: OutboxExtendLease :execrows
-- OutboxExtendLease moves the lease of a message being delivered to @lease
-- from now, if @attempt is still its newest lease and it is still pending.
UPDATE outbox_message
SET leased_until = now() + @lease::interval,
    next_attempt_at = now() + @lease::interval
WHERE id = @id::bigint
  AND attempts = @attempt::int
  AND state = 'pending';

-- name: OutboxPurgeDelivered :execrows
-- OutboxPurgeDelivered deletes up to @max_rows messages to @destinations
-- (all when empty) delivered more than @retention ago, oldest first,
-- skipping rows another purge holds.
DELETE FROM outbox_message
WHERE id IN (
    SELECT old.id
    FROM outbox_message AS old
    WHERE old.state = 'delivered'
      AND old.delivered_at < now() - @retention::interval
      AND (coalesce(cardinality(@destinations::text[]), 0) = 0
           OR old.destination = ANY (@destinations::text[]))
    ORDER BY old.delivered_at
    LIMIT @max_rows::int
    FOR UPDATE SKIP LOCKED
);

-- name: OutboxRequeue :execrows
-- OutboxRequeue sends a parked message again, from its first attempt, as
-- soon as a relay looks. It affects no row unless the message is parked.
UPDATE outbox_message
SET state = 'pending',
    attempts = 0,
    next_attempt_at = now(),
    leased_until = NULL
WHERE id = @id::bigint
  AND state = 'parked';

-- name: OutboxBacklog :many
-- OutboxBacklog counts the pending and parked messages per destination, to
-- @destinations only when not empty, for the relay's metrics. It reads every
-- message that is not delivered.
SELECT destination,
       count(*) FILTER (WHERE state = 'pending') AS pending,
       count(*) FILTER (WHERE state = 'parked') AS parked
FROM outbox_message
WHERE state IN ('pending', 'parked')
  AND (coalesce(cardinality(@destinations::text[]), 0) = 0
       OR destination = ANY (@destinations::text[]))
GROUP BY destination;

-- name: OutboxStats :one
-- OutboxStats counts messages by state, for operators. It reads every row.
SELECT count(*) FILTER (WHERE state = 'pending') AS pending,
       count(*) FILTER (WHERE state = 'parked') AS parked,
       count(*) FILTER (WHERE state = 'delivered') AS delivered,
       min(created_at) FILTER (WHERE state = 'pending')::timestamptz AS oldest_pending
FROM outbox_message;
