-- name: KeyLock :one
-- KeyLock takes the key's lock and reads its record (see idem_key_claim in
-- the migrations). No record is fingerprint NULL; expired says whether the
-- record in the way has expired.
SELECT c.nested::bool AS nested,
       c.read_committed::bool AS read_committed,
       c.fingerprint,
       c.state,
       c.response,
       coalesce(c.expired, false)::bool AS expired
FROM idem_key_claim(@lock_id::bigint, @scope::text, @key::text, @lock_timeout::text) AS c;

-- name: KeyGet :one
-- KeyGet reads the key's record, live or expired, outside the lock: for
-- Run's lookup before its transaction (WithLookupFirst).
SELECT fingerprint, state, response, (expires_at <= now())::bool AS expired
FROM idempotency_key
WHERE scope = @scope::text
  AND key = @key::text;

-- name: KeyInsert :exec
-- KeyInsert writes the record of a completed operation, once, with its
-- answer, in the transaction that ran it: one heap tuple and its index
-- entries, nothing updated. Its transaction holds the key's lock, so a
-- conflict means a writer that did not take it (an older idem during a
-- rolling upgrade, or a hand-written statement): the unique violation aborts
-- the transaction, fn's writes with it, and Run retries into a replay.
INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
VALUES (@scope::text, @key::text, @fingerprint::bytea, 'done',
        -- Sent as text: pgx sends a []byte as bytea under the simple
        -- protocol (PgBouncer set-ups), which jsonb would reject.
        sqlc.narg(response)::text::jsonb,
        now() + @retention::interval);

-- name: KeyReplace :exec
-- KeyReplace is KeyInsert for a key whose record has expired: it takes the
-- expired record over. When the record is live again (a writer that did not
-- take the key's lock), it fails with division_by_zero instead of
-- succeeding quietly, so that a COMMIT pipelined behind it keeps nothing.
WITH stored AS (
    INSERT INTO idempotency_key AS existing (scope, key, fingerprint, state, response, expires_at)
    VALUES (@scope::text, @key::text, @fingerprint::bytea, 'done',
            sqlc.narg(response)::text::jsonb, now() + @retention::interval)
    ON CONFLICT (scope, key) DO UPDATE
    SET fingerprint = excluded.fingerprint,
        state = excluded.state,
        response = excluded.response,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at
    WHERE existing.expires_at <= now()
    RETURNING 1
)
SELECT 1 / count(*) FROM stored;

-- name: KeyClaim :one
-- KeyClaim writes a claim in progress before fn runs, for transactions at
-- REPEATABLE READ or SERIALIZABLE. Their snapshot may predate the commit of
-- the key's previous holder, so KeyGet cannot see its record; an INSERT can:
-- a conflict with a row the snapshot cannot see aborts with a serialization
-- failure, and Run retries into a replay, before fn is ever called. An
-- expired record is taken over. claimed is false only when a live record
-- the snapshot can see is in the way.
WITH claimed AS (
    INSERT INTO idempotency_key AS existing (scope, key, fingerprint, state, expires_at)
    VALUES (@scope::text, @key::text, @fingerprint::bytea, 'in_progress',
            now() + @retention::interval)
    ON CONFLICT (scope, key) DO UPDATE
    SET fingerprint = excluded.fingerprint,
        state = excluded.state,
        response = NULL,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at
    WHERE existing.expires_at <= now()
    RETURNING 1
)
SELECT (count(*) > 0)::bool AS claimed FROM claimed;

-- name: KeyStoreResponse :exec
-- KeyStoreResponse completes a claim that KeyClaim wrote in the same
-- transaction. When the claim is gone (fn itself deleted or completed the
-- record), it fails with division_by_zero instead of succeeding quietly.
WITH stored AS (
    UPDATE idempotency_key
    SET state = 'done',
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

-- name: KeyInFlight :one
-- KeyInFlight counts the operations running in this database now (the
-- locks held), and the duplicates waiting for them (see idem_key_lock):
-- for every key, or with @lock_id not zero, for that key's lock.
SELECT count(*) FILTER (WHERE l.granted) AS running,
       count(*) FILTER (WHERE NOT l.granted) AS waiting,
       min(l.xact_start) FILTER (WHERE l.granted)::timestamptz AS oldest_start
FROM idem_key_lock(@lock_tag::bigint) AS l
WHERE @lock_id::bigint IN (0, l.lock_id);
