-- +goose Up
-- idem_key_claim is how a call claims (scope, key) before its function runs:
-- it takes the key's lock, a transaction-scoped advisory lock on a hash of
-- (scope, key), and reads the key's record, in one statement. A duplicate
-- that finds the lock taken and no record to replay waits for the lock
-- under the wait budget (lock_timeout, restored afterwards), then reads the
-- record again. The lock only keeps duplicates waiting while the first
-- attempt runs; the primary key still decides which record is written.
--
-- It is a function, not a statement, for its snapshots: at READ COMMITTED
-- each query of a volatile function takes a new one, so the record is read
-- after the lock is held, and a record committed by the lock's previous
-- holder is seen. One statement would read with a snapshot taken before
-- its lock.
--
-- Advisory locks are reentrant, so the lock alone cannot tell a Do inside
-- the function of a Do on the same key from a free key: the transaction
-- keeps the keys it locked in the transaction-local setting idem.held, and
-- nested says whether this key was among them.
-- +goose StatementBegin
CREATE FUNCTION idem_key_claim(lock_id bigint, claim_scope text, claim_key text, wait_budget text,
    OUT nested boolean, OUT read_committed boolean,
    OUT fingerprint bytea, OUT state text, OUT response jsonb, OUT expired boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    mark text := '[' || lock_id || ']';
    held text := coalesce(current_setting('idem.held', true), '');
    saved text;
BEGIN
    nested := strpos(held, mark) > 0;
    read_committed := current_setting('transaction_isolation') = 'read committed';
    IF pg_try_advisory_xact_lock(lock_id) THEN
        IF NOT nested THEN
            PERFORM set_config('idem.held', held || mark, true);
        END IF;
        SELECT k.fingerprint, k.state, k.response, k.expires_at <= now()
        INTO fingerprint, state, response, expired
        FROM idempotency_key AS k
        WHERE k.scope = claim_scope AND k.key = claim_key;
        RETURN;
    END IF;
    -- Taken: a completed record needs no wait.
    SELECT k.fingerprint, k.state, k.response, k.expires_at <= now()
    INTO fingerprint, state, response, expired
    FROM idempotency_key AS k
    WHERE k.scope = claim_scope AND k.key = claim_key;
    IF FOUND AND NOT expired THEN
        RETURN;
    END IF;
    saved := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', wait_budget, true);
    PERFORM pg_advisory_xact_lock(lock_id);
    PERFORM set_config('lock_timeout', saved, true);
    PERFORM set_config('idem.held', held || mark, true);
    SELECT k.fingerprint, k.state, k.response, k.expires_at <= now()
    INTO fingerprint, state, response, expired
    FROM idempotency_key AS k
    WHERE k.scope = claim_scope AND k.key = claim_key;
END
$$;
-- +goose StatementEnd

-- idem_key_lock lists the sessions of this database that hold or wait for
-- a key's lock: at READ COMMITTED a running operation writes its record
-- only when it commits, so this is where operators see what is in flight.
-- idem's lock ids carry lock_tag in their top 16 bits, which pg_locks
-- shows as classid >> 16.
-- +goose StatementBegin
CREATE FUNCTION idem_key_lock(lock_tag bigint,
    OUT lock_id bigint, OUT pid integer, OUT granted boolean, OUT xact_start timestamptz,
    OUT state text, OUT application_name text)
RETURNS SETOF record
LANGUAGE sql STABLE AS $$
    SELECT (l.classid::bigint << 32) | l.objid::bigint, l.pid, l.granted, a.xact_start,
           coalesce(a.state, ''), coalesce(a.application_name, '')
    FROM pg_locks AS l
    LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'advisory'
      AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid::bigint >> 16 = lock_tag
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION idem_key_lock(bigint);
DROP FUNCTION idem_key_claim(bigint, text, text, text);
