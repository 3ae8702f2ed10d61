-- name: EntityAdvance :execrows
-- EntityAdvance records @version as the entity's newest applied version and
-- affects one row, unless the entity already stands at that version or a
-- newer one, in which case it affects none.
--
-- Under READ COMMITTED a concurrent delivery of the same entity waits for
-- the row, then judges the version that transaction committed, not the one
-- in its own snapshot: of two deliveries of one version, one applies. Under
-- REPEATABLE READ and SERIALIZABLE, a row committed after the snapshot makes
-- the statement fail with a serialization failure instead.
INSERT INTO entity_version (scope, entity, version)
VALUES (@scope::text, @entity::text, @version::bigint)
ON CONFLICT (scope, entity) DO UPDATE
SET version = excluded.version,
    updated_at = excluded.updated_at
WHERE entity_version.version < excluded.version;
