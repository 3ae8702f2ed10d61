-- name: TxCommit :exec
-- TxCommit ends a transaction that Run drives itself, queued behind the
-- stored response so that both travel in one round trip.
COMMIT;

-- name: TxIdleTimeout :exec
-- TxIdleTimeout bounds, for the rest of the transaction only, how long it
-- may sit idle waiting for its client (WithIdleTimeout): a client that
-- vanishes without closing its connection then loses its session, and the
-- key it held, after that long instead of when TCP gives up on it.
SELECT set_config('idle_in_transaction_session_timeout', @timeout::text, true);
