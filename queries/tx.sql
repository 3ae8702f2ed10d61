-- name: TxCommit :exec
COMMIT;
