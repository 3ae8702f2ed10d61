-- name: KeyClaim :one
-- KeyClaim claims (scope, key) for the calling transaction in one
-- statement: it sets the wait budget, inserts the claim, restores the
-- caller's lock_timeout, and returns the record that blocked the claim, if
-- the statement's snapshot can see it.
--
-- A record committed by another transaction while this statement waited on
-- it is invisible to this statement's snapshot: the caller then gets neither
-- claimed nor a record, and reads it again with KeyGet. An expired record
-- comes back with expired set; the caller takes it over with KeyReclaim.
WITH budget AS (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
inserted AS (
    INSERT INTO idempotency_key (scope, key, fingerprint, state, expires_at)
    SELECT @scope::text, @key::text, @fingerprint::bytea, 'in_progress',
           now() + @retention::interval
    FROM budget
    WHERE budget.applied IS NOT NULL
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 1
),
outcome AS (
    SELECT count(*) > 0 AS claimed FROM inserted
)
SELECT outcome.claimed::bool AS claimed,
       existing.fingerprint,
       existing.state,
       existing.response,
       coalesce(existing.expires_at <= now(), false)::bool AS expired,
       -- Reading outcome runs the insert, and with it any wait, before the
       -- caller's lock_timeout comes back.
       set_config('lock_timeout', budget.saved, outcome.claimed IS NOT NULL) AS restored
FROM budget
CROSS JOIN outcome
LEFT JOIN idempotency_key AS existing
    ON existing.scope = @scope::text
   AND existing.key = @key::text;

-- name: KeyReclaim :one
-- KeyReclaim takes over an expired record for the calling transaction, with
-- the same wait budget as KeyClaim. Two concurrent reclaimers queue on the
-- row lock; the second finds the record live again and takes nothing.
WITH budget AS (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
reclaimed AS (
    UPDATE idempotency_key
    SET fingerprint = @fingerprint::bytea,
        state = 'in_progress',
        response = NULL,
        created_at = now(),
        expires_at = now() + @retention::interval
    FROM budget
    WHERE idempotency_key.scope = @scope::text
      AND idempotency_key.key = @key::text
      AND idempotency_key.expires_at <= now()
      AND budget.applied IS NOT NULL
    RETURNING 1
),
outcome AS (
    SELECT count(*) > 0 AS claimed FROM reclaimed
)
SELECT outcome.claimed::bool AS claimed,
       set_config('lock_timeout', budget.saved, outcome.claimed IS NOT NULL) AS restored
FROM budget
CROSS JOIN outcome;

-- name: KeyGet :one
-- KeyGet reads the live record for (scope, key) with a fresh snapshot.
SELECT fingerprint, state, response
FROM idempotency_key
WHERE scope = @scope::text
  AND key = @key::text
  AND expires_at > now();

-- name: KeyStoreResponse :exec
-- KeyStoreResponse completes a claim made by the same transaction. When the
-- claim is gone (fn itself deleted or completed the record), it fails with
-- division_by_zero instead of succeeding quietly: Run sends COMMIT in the
-- same pipeline, and only a failure stops that COMMIT from keeping fn's
-- writes without a record. It leaves expires_at alone, so that the update
-- touches no indexed column and stays a HOT update: retention counts from
-- the start of the claiming transaction.
WITH stored AS (
    UPDATE idempotency_key
    SET state = 'done',
        -- Sent as text: pgx sends a []byte as bytea under the simple
        -- protocol (PgBouncer set-ups), which jsonb would reject.
        response = sqlc.narg(response)::text::jsonb
    WHERE scope = @scope::text
      AND key = @key::text
      AND state = 'in_progress'
    RETURNING 1
)
SELECT 1 / count(*) FROM stored;

-- name: KeyRelease :exec
-- KeyRelease removes a claim whose work failed, so that a committed record is
-- never left in progress.
DELETE FROM idempotency_key
WHERE scope = @scope::text
  AND key = @key::text
  AND state = 'in_progress';

-- name: KeyPurgeExpired :execrows
-- KeyPurgeExpired deletes up to @max_rows expired records, oldest expiry
-- first, skipping rows another transaction holds (a reclaim in flight).
DELETE FROM idempotency_key
WHERE (scope, key) IN (
    SELECT expired.scope, expired.key
    FROM idempotency_key AS expired
    WHERE expired.expires_at <= now()
    ORDER BY expired.expires_at
    LIMIT @max_rows::int
    FOR UPDATE SKIP LOCKED
);

-- name: KeyStats :one
-- KeyStats summarizes the table for operators. It reads every row: run it
-- from a console, not from a hot path.
SELECT count(*) FILTER (WHERE state = 'in_progress' AND expires_at > now()) AS in_progress,
       count(*) FILTER (WHERE state = 'done' AND expires_at > now()) AS done,
       count(*) FILTER (WHERE expires_at <= now()) AS expired,
       count(DISTINCT scope) AS scopes,
       min(created_at) FILTER (WHERE expires_at > now())::timestamptz AS oldest_live,
       pg_table_size('idempotency_key'::regclass) AS table_bytes,
       pg_indexes_size('idempotency_key'::regclass) AS index_bytes
FROM idempotency_key;

-- name: KeyInspect :one
-- KeyInspect reads one record whatever its state or expiry, for operators.
SELECT fingerprint, state, response, created_at, expires_at,
       (expires_at <= now())::bool AS expired
FROM idempotency_key
WHERE scope = @scope::text
  AND key = @key::text;
