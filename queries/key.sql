-- name: KeyLock :one
-- KeyLock takes the key's lock, a transaction-scoped advisory lock on a hash
-- of (scope, key), if it is free, without waiting. A duplicate waits on it
-- (KeyLockWait) while the first attempt runs, and no record is written
-- until that attempt stores its answer: the lock only keeps duplicates
-- waiting, the primary key still decides which record is written.
--
-- lock says what happened to the lock: lockTaken (1) or lockBusy (2) when
-- it was tried, or lockSkipped (0) when it was not, and the lock table was
-- left alone:
-- - the key has a live, completed record: a replay or a mismatch needs no
--   lock, so that a redelivered batch costs no lock-table entry per key;
-- - the transaction already holds as many key locks as it may on this
--   server. The caller counts them by the start of the transaction that
--   took them (tx_start, now()) and sends in @full_since the starts whose
--   counts are full; a new transaction, whose now() is none of them,
--   starts its count again. On PostgreSQL there is one start; on Citus,
--   where this statement runs on the worker of the scope's shard, each
--   worker's part of the distributed transaction has a start of its own,
--   and so a count of its own: the bound is per node, each node's lock
--   table its own. Advisory
--   locks live in the server's shared lock table, which every session of
--   every database shares: a transaction that took one per key could fill
--   it and make other sessions fail. Past the limit the claim writes its
--   record in progress instead (KeyClaimWait);
-- - the transaction is read-only (or the server is a standby), where
--   nothing can be recorded: the caller refuses it.
-- tx_start is the transaction's start, for the caller's count;
-- read_committed tells it which way to claim (see KeyClaim).
SELECT CASE
           WHEN current_setting('transaction_read_only')::bool THEN 0
           WHEN now() = ANY(@full_since::timestamptz[]) THEN 0
           WHEN EXISTS (
               SELECT FROM idempotency_key
               WHERE scope = @scope::text
                 AND key = @key::text
                 AND expires_at > now()
                 AND state = 'done'
           ) THEN 0
           WHEN pg_try_advisory_xact_lock(@lock_id::bigint) THEN 1
           ELSE 2
       END::int AS lock,
       now()::timestamptz AS tx_start,
       current_setting('transaction_isolation') = 'read committed' AS read_committed,
       current_setting('transaction_read_only')::bool AS read_only,
       -- citus: the database has Citus (see CitusInstalled), where the
       -- statements that wait for a record take their budget from
       -- KeyWaitBudgetCitus and the record is stored by KeyInsertCitus;
       -- asked only when @check_citus is set (a connection's first claim:
       -- the caller keeps the answer), false otherwise, so that a claim
       -- on PostgreSQL looks nothing up in the catalog for Citus.
       CASE WHEN @check_citus::bool
            THEN to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL
            ELSE false
       END::bool AS citus;

-- name: KeyLockCitus :one
-- KeyLockCitus is KeyLock for a connection that knows its database has
-- Citus (a claim before it said so): the same answer, in a statement that
-- Citus plans on its fast path (one table, the scope's equality in the
-- WHERE, no subquery, no CTE), routed whole to the node of the scope's
-- shard, where the lock is taken. KeyLock's EXISTS, a subquery, makes
-- Citus plan it with PostgreSQL's planner and its own router planner, a
-- cost each claim pays on the coordinator. Here the key's record, if any,
-- is read by an aggregate over the primary key, which gives one row
-- whether or not there is a record, and the lock is tried once, in that
-- row's CASE, only when no live completed record is there.
SELECT CASE
           WHEN current_setting('transaction_read_only')::bool THEN 0
           WHEN now() = ANY(@full_since::timestamptz[]) THEN 0
           WHEN coalesce(bool_or(expires_at > now() AND state = 'done'), false) THEN 0
           WHEN pg_try_advisory_xact_lock(@lock_id::bigint) THEN 1
           ELSE 2
       END::int AS lock,
       now()::timestamptz AS tx_start,
       current_setting('transaction_isolation') = 'read committed' AS read_committed,
       current_setting('transaction_read_only')::bool AS read_only,
       true AS citus
FROM idempotency_key
WHERE scope = @scope::text
  AND key = @key::text;

-- name: KeyLockWait :exec
-- KeyLockWait waits for the key's lock under the wait budget, then restores
-- the caller's lock_timeout, in one statement: reading waited runs the wait
-- before the restore.
--
-- It names the key's row, which it never reads (LIMIT 0), so that Citus
-- runs it on the node of the scope's shard, where KeyLock, whose lookup
-- names the row too, took the lock (see docs/large-deployments.md): on
-- PostgreSQL the lookup is never executed.
WITH budget AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
waited AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(@lock_id::bigint)::text AS done
    FROM budget
    WHERE budget.applied IS NOT NULL
)
SELECT set_config('lock_timeout', budget.saved, waited.done IS NOT NULL)
FROM budget
CROSS JOIN waited
WHERE NOT EXISTS (
    SELECT FROM idempotency_key
    WHERE scope = @scope::text
      AND key = @key::text
    LIMIT 0
);

-- name: KeyGet :one
-- KeyGet reads the key's record, live or expired. Sent after KeyLock or
-- KeyLockWait as a statement of its own, in the same round trip, it reads
-- with a snapshot taken once the lock is held (at READ COMMITTED), so that
-- a record committed by the lock's previous holder is seen: one statement
-- would read with a snapshot taken before its lock. Run's lookup before its
-- transaction (WithLookupFirst) uses it too.
--
-- standby_wait: a record to replay (live, completed) may have been
-- committed on the primary alone, if its COMMIT's wait for a synchronous
-- standby was cut short; a replay must answer only once the standby has it.
-- PostgreSQL makes a COMMIT wait for the synchronous standby only when its
-- transaction has a transaction id and wrote WAL, so when the session's
-- COMMITs wait for one (synchronous_standby_names set, synchronous_commit
-- on, remote_write or remote_apply, a primary), KeyGet writes a
-- transactional logical message (prefix 'idem', empty; with its commit
-- record, two WAL records of 89 bytes) and reports true: the COMMIT of its
-- transaction then waits until the standby has the WAL up to it, the
-- record's commit included. Otherwise it writes nothing and reports false.
SELECT fingerprint, state, response, (expires_at <= now())::bool AS expired,
       CASE
           WHEN state = 'done'
            AND expires_at > now()
            AND current_setting('synchronous_standby_names') <> ''
            AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
            AND NOT pg_is_in_recovery()
           THEN pg_logical_emit_message(true, 'idem'::text, ''::text) IS NOT NULL
           ELSE false
       END::bool AS standby_wait
FROM idempotency_key
WHERE scope = @scope::text
  AND key = @key::text;

-- name: KeyInsert :exec
-- KeyInsert writes the record of a completed operation, once, with its
-- answer, in the transaction that ran it: one heap tuple and its index
-- entries, nothing updated. Its transaction holds the key's lock, so a
-- conflict means a writer that did not take it: a transaction that holds
-- the key by a record in progress (past MaxKeyLocks, see KeyClaimWait) or by
-- a batch's record (KeyClaimBatch), an older idem during a rolling upgrade,
-- or a hand-written statement. The INSERT waits for such a holder's
-- uncommitted record under what is left of the wait budget, @lock_timeout
-- (lock_not_available past it); a committed one gives a unique violation,
-- which aborts the transaction, fn's writes with it, and Run retries into a
-- replay. The caller's lock_timeout is restored once the INSERT is done, as
-- in KeyLockWait.
WITH budget AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
stored AS (
    INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
    SELECT @scope::text, @key::text, @fingerprint::bytea, 'done',
           -- Sent as text: pgx sends a []byte as bytea under the simple
           -- protocol (PgBouncer set-ups), which jsonb would reject.
           sqlc.narg(response)::text::jsonb,
           now() + @retention::interval
    FROM budget
    WHERE budget.applied IS NOT NULL
    RETURNING 1
),
counted AS MATERIALIZED (
    SELECT count(*) AS n FROM stored
)
SELECT set_config('lock_timeout', budget.saved, counted.n >= 0)
FROM budget
CROSS JOIN counted;

-- name: KeyInsertLast :exec
-- KeyInsertLast is KeyInsert for a record that is the last statement of
-- its transaction, sent with the transaction's COMMIT (Run's): it sets
-- the wait budget, @lock_timeout, for what is left of the transaction,
-- the INSERT and the COMMIT, and leaves it set, since nothing of the
-- caller's runs after it: a plain INSERT, with no statement of its own to
-- read and restore the caller's lock_timeout.
INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
SELECT @scope::text, @key::text, @fingerprint::bytea, 'done',
       sqlc.narg(response)::text::jsonb, now() + @retention::interval
FROM (SELECT set_config('lock_timeout', @lock_timeout::text, true)) AS budget;

-- name: KeyReplace :exec
-- KeyReplace is KeyInsert for a key whose record has expired: it takes the
-- expired record over, waiting as KeyInsert does under @lock_timeout for a
-- transaction that holds it. When the record is live again (a writer that
-- did not take the key's lock), it fails with division_by_zero instead of
-- succeeding quietly, so that a COMMIT pipelined behind it keeps nothing.
WITH budget AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
stored AS (
    INSERT INTO idempotency_key AS existing (scope, key, fingerprint, state, response, expires_at)
    SELECT @scope::text, @key::text, @fingerprint::bytea, 'done',
           sqlc.narg(response)::text::jsonb, now() + @retention::interval
    FROM budget
    WHERE budget.applied IS NOT NULL
    ON CONFLICT (scope, key) DO UPDATE
    SET fingerprint = excluded.fingerprint,
        state = excluded.state,
        response = excluded.response,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at
    -- An expired record is taken over, and so is one committed in
    -- progress, which idem never commits (see KeyClaim). The new row's
    -- created_at is now(), the column's default: here and in the claims
    -- below it stands for now(), since Citus refuses a function in this
    -- WHERE on a distributed table.
    WHERE existing.expires_at <= excluded.created_at
       OR existing.state = 'in_progress'
    RETURNING 1
),
counted AS MATERIALIZED (
    SELECT 1 / count(*) AS n FROM stored
)
SELECT set_config('lock_timeout', budget.saved, counted.n >= 0)
FROM budget
CROSS JOIN counted;

-- name: KeyClaim :one
-- KeyClaim writes a claim in progress before fn runs, for transactions at
-- REPEATABLE READ or SERIALIZABLE. Their snapshot may predate the commit of
-- the key's previous holder, so KeyGet cannot see its record; an INSERT can:
-- a conflict with a row the snapshot cannot see aborts with a serialization
-- failure, and Run retries into a replay, before fn is ever called. An
-- expired record is taken over, and so is a record committed in progress:
-- idem never commits one (a claim written early is completed or removed
-- in its transaction), so it was left by a writer that is not idem (a
-- hand-written statement, an older version, a restore of such data), and
-- stands for an operation that recorded no answer. claimed is false only
-- when a live record the snapshot can see is in the way.
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
    WHERE existing.expires_at <= excluded.created_at
       OR existing.state = 'in_progress'
    RETURNING 1
)
SELECT (count(*) > 0)::bool AS claimed FROM claimed;

-- name: KeyClaimWait :one
-- KeyClaimWait is KeyClaim for a transaction that holds as many key locks as
-- it may (see KeyLock), at any isolation level: the record in progress,
-- written before fn, is what keeps the key, and it holds no entry in the
-- server's shared lock table. A duplicate's INSERT waits on it, under the
-- wait budget, as it would on the key's lock: at READ COMMITTED, when the
-- holder commits, claimed is false and the caller reads the record again
-- (KeyGet) to replay it; when it rolls back, the INSERT goes ahead. The
-- caller's lock_timeout is restored once the INSERT is done, as in
-- KeyLockWait.
WITH budget AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
claimed AS (
    INSERT INTO idempotency_key AS existing (scope, key, fingerprint, state, expires_at)
    SELECT @scope::text, @key::text, @fingerprint::bytea, 'in_progress',
           now() + @retention::interval
    FROM budget
    WHERE budget.applied IS NOT NULL
    ON CONFLICT (scope, key) DO UPDATE
    SET fingerprint = excluded.fingerprint,
        state = excluded.state,
        response = NULL,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at
    WHERE existing.expires_at <= excluded.created_at
       OR existing.state = 'in_progress'
    RETURNING 1
),
counted AS MATERIALIZED (
    SELECT count(*) AS n FROM claimed
)
SELECT (counted.n > 0)::bool AS claimed,
       (set_config('lock_timeout', budget.saved, counted.n >= 0) IS NOT NULL)::bool AS restored
FROM budget
CROSS JOIN counted;

-- name: KeyClaimIfFull :one
-- KeyClaimIfFull is KeyClaimWait sent in the claim's own round trip, behind
-- KeyLock and KeyGet, by a caller whose count of key locks is full: it
-- writes the record in progress only when KeyLock did not try the lock for
-- that reason (now() is in @full_since, as in KeyLock), the transaction is
-- read-write, and no live completed record is in the way (a replay needs
-- no claim); attempted says whether it did. Otherwise it does nothing,
-- and the claim goes on from KeyLock's and KeyGet's answers. A key past a
-- transaction's MaxKeyLocks then costs the claim one round trip, not two.
-- @state is 'in_progress', or 'done' for a call that stores no answer
-- (Once): its record is then complete once written, and a duplicate that
-- waited for it replays it once it commits, as it would the completed one.
WITH budget AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
    WHERE now() = ANY(@full_since::timestamptz[])
      AND NOT current_setting('transaction_read_only')::bool
      AND NOT EXISTS (
          SELECT FROM idempotency_key
          WHERE scope = @scope::text
            AND key = @key::text
            AND expires_at > now()
            AND state = 'done'
      )
),
claimed AS (
    INSERT INTO idempotency_key AS existing (scope, key, fingerprint, state, expires_at)
    SELECT @scope::text, @key::text, @fingerprint::bytea, @state::text,
           now() + @retention::interval
    FROM budget
    WHERE budget.applied IS NOT NULL
    ON CONFLICT (scope, key) DO UPDATE
    SET fingerprint = excluded.fingerprint,
        state = excluded.state,
        response = NULL,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at
    WHERE existing.expires_at <= excluded.created_at
       OR existing.state = 'in_progress'
    RETURNING 1
),
counted AS MATERIALIZED (
    SELECT count(*) AS n FROM claimed
)
SELECT EXISTS (SELECT FROM budget)::bool AS attempted,
       (counted.n > 0)::bool AS claimed,
       COALESCE((SELECT set_config('lock_timeout', budget.saved, counted.n >= 0) FROM budget), '')::text AS restored
FROM counted;

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

-- name: KeyPurgeExpired :one
-- KeyPurgeExpired deletes up to @max_rows expired records whose expiry is
-- @after or later, oldest expiry first, and returns how many it deleted
-- and the latest expiry among them (NULL when none). A purge passes that
-- back as the next batch's @after, so that each batch starts where the
-- last one stopped: the entries of the rows a batch deleted stay in the
-- expiry index until VACUUM, and a batch that started from the oldest
-- expiry would walk over all of them again, a cost that grows with every
-- batch. Records of the same expiry as the last one deleted are looked at
-- again, so none is missed.
--
-- Rows another transaction holds (a claim written early at REPEATABLE READ
-- over an expired record) are skipped, not waited for; the next pass, which
-- starts from the oldest expiry, finds them. A reclaim at READ COMMITTED
-- holds no row until it writes: if this deletes the expired record first,
-- the reclaim's KeyReplace inserts instead. The rows are deleted by the
-- (tableoid, ctid) under which they were locked, which no one can change
-- while the lock holds: the DELETE fetches each row directly instead of
-- through the primary key (tableoid tells apart the partitions of a
-- partitioned table, whose ctids repeat).
WITH purged AS (
    DELETE FROM idempotency_key AS doomed
    WHERE (doomed.tableoid, doomed.ctid) IN (
        SELECT expired.tableoid, expired.ctid
        FROM idempotency_key AS expired
        WHERE expired.expires_at <= now()
          AND expired.expires_at >= @after::timestamptz
        ORDER BY expired.expires_at
        LIMIT @max_rows::int
        FOR UPDATE SKIP LOCKED
    )
    RETURNING doomed.expires_at
)
SELECT count(*) AS deleted, max(purged.expires_at)::timestamptz AS reached
FROM purged;

-- name: KeyPurgeExpiredCitus :one
-- KeyPurgeExpiredCitus is KeyPurgeExpired for a database with Citus,
-- where row locks are refused in a statement that spans shards: it
-- deletes by primary key what its subquery found, without locking it
-- first, and checks the expiry again on the row it deletes, so that a
-- record a claim took over (at REPEATABLE READ, with a new expiry) after
-- the subquery saw it is left alone. Such a row is waited for, not
-- skipped. It works on tables Citus distributes and on tables it does
-- not.
WITH purged AS (
    DELETE FROM idempotency_key AS doomed
    WHERE (doomed.scope, doomed.key) IN (
        SELECT expired.scope, expired.key
        FROM idempotency_key AS expired
        WHERE expired.expires_at <= now()
          AND expired.expires_at >= @after::timestamptz
        ORDER BY expired.expires_at
        LIMIT @max_rows::int
    )
      AND doomed.expires_at <= now()
    RETURNING doomed.expires_at
)
SELECT count(*) AS deleted, max(purged.expires_at)::timestamptz AS reached
FROM purged;

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

-- name: KeyClaimBatch :many
-- KeyClaimBatch claims a batch of keys of one scope for OnceEach in one
-- statement: it writes each key's record, completed and without an answer
-- (what Once records), before the batch's functions run, and returns the
-- keys it wrote, the new ones, whose functions are then to run. A key
-- with a record, live or not, committed or not, is skipped: DO NOTHING
-- takes no row lock, so a redelivered batch writes nothing. The INSERT
-- waits for a transaction that holds a key's uncommitted record (another
-- consumer's open batch, or a claim past MaxKeyLocks) under the wait
-- budget, @lock_timeout (lock_not_available past it): when it commits,
-- the key is skipped; when it rolls back, the key is written. The caller
-- sends @keys without repeats and sorted, so that two batches that share
-- keys wait for each other in one order, never in a cycle. Under
-- REPEATABLE READ, a record committed after the snapshot gives a
-- serialization failure. The caller's lock_timeout is restored once the
-- INSERT is done, as in KeyLockWait. No advisory lock is taken: however
-- large the batch, it takes no entry per key in the lock table.
WITH budget AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
claimed AS (
    INSERT INTO idempotency_key (scope, key, fingerprint, state, expires_at)
    SELECT @scope::text, ids.key, @fingerprint::bytea, 'done', now() + @retention::interval
    FROM budget
    CROSS JOIN unnest(@keys::text[]) AS ids(key)
    WHERE budget.applied IS NOT NULL
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING key
),
restored AS MATERIALIZED (
    SELECT set_config('lock_timeout', budget.saved, (SELECT count(*) FROM claimed) >= 0) AS setting
    FROM budget
)
SELECT claimed.key::text AS key
FROM claimed
CROSS JOIN restored
WHERE restored.setting IS NOT NULL;

-- name: KeyGetBatch :many
-- KeyGetBatch reads the records of the keys of a batch that KeyClaimBatch
-- skipped, sent after it as a statement of its own, so that at READ
-- COMMITTED it sees what the holders it waited for committed. As KeyGet
-- does, when the session's COMMITs wait for a synchronous standby and a
-- record is to be replayed, it writes one transactional logical message,
-- so that the batch's COMMIT waits until the standby has the records that
-- made it skip keys.
WITH found AS MATERIALIZED (
    SELECT key, fingerprint, state, (expires_at <= now())::bool AS expired
    FROM idempotency_key
    WHERE scope = @scope::text
      AND key = ANY(@keys::text[])
),
standby AS MATERIALIZED (
    SELECT CASE
               WHEN EXISTS (SELECT FROM found WHERE found.state = 'done' AND NOT found.expired)
                AND current_setting('synchronous_standby_names') <> ''
                AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
                AND NOT pg_is_in_recovery()
               THEN pg_logical_emit_message(true, 'idem'::text, ''::text) IS NOT NULL
               ELSE false
           END::bool AS standby_wait
)
SELECT found.key::text AS key, found.fingerprint::bytea AS fingerprint, found.state::text AS state,
       found.expired::bool AS expired, standby.standby_wait::bool AS standby_wait
FROM found
CROSS JOIN standby;

-- name: KeyReclaimBatch :many
-- KeyReclaimBatch is KeyClaimBatch for the keys of a batch whose records
-- KeyGetBatch found expired, or committed in progress (which idem never
-- commits, see KeyClaim), or gone: it takes those records over, and
-- returns the keys it wrote. A key whose record is live and completed
-- again (another batch claimed it since) is skipped.
WITH budget AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
),
claimed AS (
    INSERT INTO idempotency_key AS existing (scope, key, fingerprint, state, expires_at)
    SELECT @scope::text, ids.key, @fingerprint::bytea, 'done', now() + @retention::interval
    FROM budget
    CROSS JOIN unnest(@keys::text[]) AS ids(key)
    WHERE budget.applied IS NOT NULL
    ON CONFLICT (scope, key) DO UPDATE
    SET fingerprint = excluded.fingerprint,
        state = excluded.state,
        response = NULL,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at
    WHERE existing.expires_at <= excluded.created_at
       OR existing.state = 'in_progress'
    RETURNING existing.key
),
restored AS MATERIALIZED (
    SELECT set_config('lock_timeout', budget.saved, (SELECT count(*) FROM claimed) >= 0) AS setting
    FROM budget
)
SELECT claimed.key::text AS key
FROM claimed
CROSS JOIN restored
WHERE restored.setting IS NOT NULL;

-- name: KeyReleaseBatch :exec
-- KeyReleaseBatch removes the records that KeyClaimBatch or
-- KeyReclaimBatch (or KeyClaimIfFull, completed) wrote in this transaction
-- for keys whose functions did not run or failed, so that a caller who commits anyway never commits a
-- key as handled that was not. Only this transaction can have written
-- them, and no one else can change them before it ends.
DELETE FROM idempotency_key
WHERE scope = @scope::text
  AND key = ANY(@keys::text[]);

-- name: KeyInFlightCitus :one
-- KeyInFlightCitus is KeyInFlight for the workers of a Citus coordinator,
-- which holds no lock of a key whose record is distributed: a call takes
-- it on the node of its scope's shard (see KeyLockWait). It asks every
-- worker (run_command_on_workers, which runs the text of a query on each
-- on a connection of its own, the lock tag and id written into it as
-- numbers) and adds their counts up; unanswered counts the workers that
-- failed to answer.
WITH nodes AS (
    SELECT (to_jsonb(n)->>'success')::bool AS answered, (to_jsonb(n)->>'result') AS counts
    FROM run_command_on_workers(format(
        'SELECT json_build_array(count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted), '
        'min(xact_start) FILTER (WHERE granted)) FROM idem_key_lock(%s) WHERE %s IN (0, lock_id)',
        @lock_tag::bigint, @lock_id::bigint)) AS n
)
SELECT coalesce(sum((nodes.counts::jsonb->>0)::bigint) FILTER (WHERE nodes.answered), 0)::bigint AS running,
       coalesce(sum((nodes.counts::jsonb->>1)::bigint) FILTER (WHERE nodes.answered), 0)::bigint AS waiting,
       min((nodes.counts::jsonb->>2)::timestamptz) FILTER (WHERE nodes.answered)::timestamptz AS oldest_start,
       count(*) FILTER (WHERE NOT nodes.answered)::bigint AS unanswered
FROM nodes;

-- name: KeySizesCitus :one
-- KeySizesCitus is the size of idempotency_key's shards, on every node,
-- for KeyStats on a Citus coordinator, whose own table is an empty shell.
-- It fails when the table is not distributed.
SELECT citus_table_size('idempotency_key'::regclass)::bigint AS table_bytes,
       (citus_total_relation_size('idempotency_key'::regclass) - citus_table_size('idempotency_key'::regclass))::bigint AS index_bytes;

-- name: CitusInstalled :one
-- CitusInstalled reports whether the database has the citus extension (and
-- with it Citus's catalog of distributed tables): idem then purges and
-- measures in the forms Citus runs (docs/citus.sql).
SELECT (to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL)::bool AS installed;

-- name: KeyWaitBudgetCitus :exec
-- KeyWaitBudgetCitus sets the wait budget, @lock_timeout, on the node
-- that holds the scope's shard, for the statement sent after it, which
-- waits there for a transaction that holds a key's record (on a Citus
-- coordinator, whose own session the set_config of KeyInsert, KeyClaimWait
-- or KeyClaimBatch does not reach: Citus runs their INSERT on that node,
-- over the connection this statement used). It keeps the node's own
-- lock_timeout in idem.saved_lock_timeout, for KeyWaitRestoreCitus, which
-- follows the waiting statement. It names the scope's rows, which it
-- never reads (LIMIT 0), so that Citus runs it on that node, as
-- KeyLockWait does. On PostgreSQL it sets the budget in the session
-- (the waiting statement then sets and restores the same value).
WITH budget AS MATERIALIZED (
    SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved,
           set_config('lock_timeout', @lock_timeout::text, true) AS applied
)
SELECT FROM budget
WHERE NOT EXISTS (
    SELECT FROM idempotency_key
    WHERE scope = @scope::text
    LIMIT 0
);

-- name: KeyStoreBudgetCitus :exec
-- KeyStoreBudgetCitus is KeyWaitBudgetCitus for a record sent with its
-- transaction's COMMIT (Run's): it sets the wait budget, @lock_timeout,
-- on the node of the scope's shard for what is left of the transaction,
-- the record's INSERT and the COMMIT, and keeps nothing to restore, as
-- KeyInsertLast does on PostgreSQL. It is a statement Citus plans on its
-- fast path, routed whole to that node: an aggregate over the key's
-- primary key, one row whatever is there, whose set_config runs once.
SELECT set_config('lock_timeout', @lock_timeout::text, true) AS applied,
       count(*) AS n
FROM idempotency_key
WHERE scope = @scope::text
  AND key = @key::text;

-- name: KeyWaitRestoreCitus :exec
-- KeyWaitRestoreCitus gives the node of the scope's shard back the
-- lock_timeout that KeyWaitBudgetCitus kept, once the waiting statement is
-- done, so that the rest of the transaction's statements there run under
-- it.
SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true)
WHERE NOT EXISTS (
    SELECT FROM idempotency_key
    WHERE scope = @scope::text
    LIMIT 0
);

-- name: KeyInsertCitus :exec
-- KeyInsertCitus is KeyInsert for a database with Citus, sent between
-- KeyWaitBudgetCitus and KeyWaitRestoreCitus, which bound its wait: an
-- INSERT of one row of values, which Citus routes whole to the node of the
-- scope's shard. KeyInsert's CTE makes Citus plan it in three steps
-- through the coordinator (INSERT ... SELECT pulled to the coordinator).
INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
VALUES (@scope::text, @key::text, @fingerprint::bytea, 'done',
        sqlc.narg(response)::text::jsonb, now() + @retention::interval);

-- name: KeyReplaceCitus :exec
-- KeyReplaceCitus is KeyReplace for a database with Citus, routed whole
-- to one node as KeyInsertCitus is. When the record is live again, its
-- conflict's WHERE divides by zero: division_by_zero, as KeyReplace, so
-- that a COMMIT pipelined behind it keeps nothing.
INSERT INTO idempotency_key AS existing (scope, key, fingerprint, state, response, expires_at)
VALUES (@scope::text, @key::text, @fingerprint::bytea, 'done',
        sqlc.narg(response)::text::jsonb, now() + @retention::interval)
ON CONFLICT (scope, key) DO UPDATE
SET fingerprint = excluded.fingerprint,
    state = excluded.state,
    response = excluded.response,
    created_at = excluded.created_at,
    expires_at = excluded.expires_at
WHERE 1 / (existing.expires_at <= excluded.created_at
           OR existing.state = 'in_progress')::int = 1;
