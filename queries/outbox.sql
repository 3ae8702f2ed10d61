-- name: OutboxInsert :one
-- OutboxInsert adds a pending message, or nothing when a message with the
-- same idempotency key is already in the outbox; OutboxGetByKey then reads
-- it.
INSERT INTO outbox_message (scope, key, destination, payload, idempotency_key, ordering_key)
VALUES (@scope::text, @key::text, @destination::text, @payload::bytea,
        @idempotency_key::text, nullif(@ordering_key::text, ''))
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- name: OutboxGetByKey :one
-- OutboxGetByKey reads the message with an idempotency key, with a fresh
-- snapshot, so that Enqueue can compare it with the entry it was given.
SELECT id, scope, key, destination, payload, coalesce(ordering_key, '')::text AS ordering_key
FROM outbox_message
WHERE idempotency_key = @idempotency_key::text;

-- name: OutboxNotify :exec
-- OutboxNotify wakes listening relays when the calling transaction commits.
SELECT pg_notify('idem_outbox', '');

-- name: OutboxListen :exec
-- OutboxListen subscribes the relay's connection to OutboxNotify.
LISTEN idem_outbox;

-- name: OutboxLease :many
-- OutboxLease leases up to @max_messages due messages to the calling relay
-- for @lease and counts an attempt for each. Rows another relay is leasing
-- at this moment are skipped, not waited for, and a row whose lease
-- committed after this statement's snapshot is dropped when its lock is
-- taken, because the lock rechecks the row's newest version.
--
-- A message with an ordering key is due only when no earlier message with
-- the same destination and ordering key is still pending, and no other
-- pending one with them is leased: ids give the order, but a later message
-- can commit, and be leased, before an earlier one commits, which must then
-- wait for it. So at most one of them is leased at a time, except that two
-- relays leasing in the same instant in which the earlier message commits
-- can each lease one, since neither sees the other's uncommitted lease.
WITH due AS MATERIALIZED (
    SELECT candidate.id
    FROM outbox_message AS candidate
    WHERE candidate.state = 'pending'
      AND candidate.next_attempt_at <= now()
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
)
UPDATE outbox_message AS leased
SET attempts = leased.attempts + 1,
    leased_until = now() + @lease::interval
FROM due
WHERE leased.id = due.id
RETURNING leased.id, leased.scope, leased.key, leased.destination, leased.payload,
          leased.idempotency_key, coalesce(leased.ordering_key, '')::text AS ordering_key,
          leased.attempts, leased.created_at;

-- name: OutboxMarkDelivered :execrows
-- OutboxMarkDelivered records successful deliveries. It does not check whose
-- lease is newest: a delivery that succeeded is a fact, whichever relay made
-- it, and a message already delivered or parked is left alone.
UPDATE outbox_message
SET state = 'delivered',
    delivered_at = now(),
    leased_until = NULL,
    last_error = NULL
WHERE id = ANY (@ids::bigint[])
  AND state = 'pending';

-- name: OutboxRetry :execrows
-- OutboxRetry ends a failed attempt and makes the message due again after
-- @delay, if @attempt is still the message's newest lease.
UPDATE outbox_message
SET leased_until = NULL,
    next_attempt_at = now() + @delay::interval,
    last_error = @last_error::text
WHERE id = @id::bigint
  AND attempts = @attempt::int
  AND state = 'pending';

-- name: OutboxRelease :execrows
-- OutboxRelease ends an attempt that a stopping relay interrupted, if
-- @attempt is still the message's newest lease: the message is due again at
-- once, and the attempt is not counted.
UPDATE outbox_message
SET leased_until = NULL,
    attempts = attempts - 1,
    last_error = @last_error::text
WHERE id = @id::bigint
  AND attempts = @attempt::int
  AND state = 'pending';

-- name: OutboxPark :execrows
-- OutboxPark gives up on a message after its last failed attempt, if
-- @attempt is still its newest lease. Parked messages stay in the table,
-- with their last error, until someone deals with them.
UPDATE outbox_message
SET state = 'parked',
    leased_until = NULL,
    last_error = @last_error::text
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

-- name: OutboxStats :one
-- OutboxStats counts messages by state, for operators. It reads every row.
SELECT count(*) FILTER (WHERE state = 'pending') AS pending,
       count(*) FILTER (WHERE state = 'parked') AS parked,
       count(*) FILTER (WHERE state = 'delivered') AS delivered,
       min(created_at) FILTER (WHERE state = 'pending')::timestamptz AS oldest_pending
FROM outbox_message;
