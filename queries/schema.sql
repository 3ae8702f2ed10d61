-- name: SchemaTableExists :one
-- SchemaTableExists reports whether a table is visible on the search path,
-- so that tools can tell an unmigrated database without creating anything.
SELECT (to_regclass(@table_name::text) IS NOT NULL)::bool AS exists;
