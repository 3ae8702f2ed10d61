-- name: TxCommit :exec
-- TxCommit ends a transaction that Run drives itself, queued behind the
-- stored response so that both travel in one round trip.
COMMIT;
