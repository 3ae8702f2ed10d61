-- +goose Up
-- One row per entity and scope: the newest version that Advance applied.
-- The primary key is the guard: a delivery that inserts or raises the
-- version is the one that applies; a delivery that finds the row at its
-- version or newer changes nothing. Versions are never negative, so a
-- sentinel such as -1 or a uint64 that overflowed cannot slip in.
CREATE TABLE entity_version (
    scope      text        NOT NULL,
    entity     text        NOT NULL,
    version    bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, entity),
    CONSTRAINT entity_version_scope_check CHECK (octet_length(scope) BETWEEN 1 AND 255),
    CONSTRAINT entity_version_entity_check CHECK (octet_length(entity) BETWEEN 1 AND 255),
    CONSTRAINT entity_version_version_check CHECK (version >= 0)
) WITH (fillfactor = 90);

-- +goose Down
DROP TABLE entity_version;
