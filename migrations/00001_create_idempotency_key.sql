-- +goose Up
-- One row per client key. The primary key arbitrates: of two INSERTs of one
-- (scope, key), one conflicts. fillfactor leaves room on each page so that
-- completing a claim written early (at REPEATABLE READ and SERIALIZABLE)
-- is a HOT update and writes no new index entries.
--
-- IF NOT EXISTS lets a deployment create the table itself first, for example
-- hash-partitioned by scope (see docs/partitioned-by-scope.sql).
CREATE TABLE IF NOT EXISTS idempotency_key (
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
) WITH (fillfactor = 90);

-- Purging walks this index from the oldest expiry forward.
CREATE INDEX IF NOT EXISTS idempotency_key_expires_at_idx ON idempotency_key (expires_at);

-- +goose Down
DROP TABLE idempotency_key;
