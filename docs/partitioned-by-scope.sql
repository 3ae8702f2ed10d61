-- idempotency_key, hash-partitioned by scope, for very large deployments.
--
-- Run this before idem's migrations: they create the table only if it does
-- not exist, and create the expiry index on the parent, which PostgreSQL
-- propagates to every partition. The primary key (scope, key) contains the
-- partition key, so PostgreSQL enforces its uniqueness across partitions and
-- the claim works unchanged. Pick the partition count up front: changing it
-- later means moving rows.
CREATE TABLE idempotency_key (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    state       text        NOT NULL,
    response    jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    CONSTRAINT idempotency_key_state_check CHECK (state IN ('in_progress', 'done')),
    CONSTRAINT idempotency_key_scope_check CHECK (octet_length(scope) BETWEEN 1 AND 255),
    CONSTRAINT idempotency_key_key_check CHECK (octet_length(key) BETWEEN 1 AND 255)
) PARTITION BY HASH (scope);

-- Storage parameters belong to the partitions: keep room for the HOT update
-- that stores each response.
CREATE TABLE idempotency_key_p0 PARTITION OF idempotency_key FOR VALUES WITH (MODULUS 4, REMAINDER 0) WITH (fillfactor = 90);
CREATE TABLE idempotency_key_p1 PARTITION OF idempotency_key FOR VALUES WITH (MODULUS 4, REMAINDER 1) WITH (fillfactor = 90);
CREATE TABLE idempotency_key_p2 PARTITION OF idempotency_key FOR VALUES WITH (MODULUS 4, REMAINDER 2) WITH (fillfactor = 90);
CREATE TABLE idempotency_key_p3 PARTITION OF idempotency_key FOR VALUES WITH (MODULUS 4, REMAINDER 3) WITH (fillfactor = 90);
