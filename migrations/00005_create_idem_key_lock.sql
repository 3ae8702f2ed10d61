-- +goose Up
-- idem_key_lock lists the sessions of this database that hold or wait for
-- a key's lock, the transaction-scoped advisory lock a call holds on a hash
-- of (scope, key) from its claim until its transaction ends (see KeyLock in
-- queries/key.sql). At READ COMMITTED a running operation writes its record
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
