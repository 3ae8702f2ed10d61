/*
Package idem makes a write happen once per client key on PostgreSQL.

A client sends a write, the server commits, and the response is lost; the
client cannot tell this from a request that never arrived, so it retries, and
the effect happens twice. idem records each client key in the same local
transaction as the write it protects, with the response, so that a retry is
answered from the record instead of running again.

# Claiming a key

[Do] takes the caller's transaction, a scope (the tenant or client the key
belongs to), the key, a fingerprint of the request, and the function that
performs the write:

	res, err := idem.Do(ctx, tx, tenantID, idempotencyKey, idem.Fingerprint(body),
		func(ctx context.Context, tx pgx.Tx) (Payment, error) {
			return insertPayment(ctx, tx, order)
		})

Do claims (scope, key) for the transaction, runs the function in it, and
records the key with the function's value, as JSON, in the same transaction:
the write and the record commit together or not at all. The claim is a
transaction-scoped advisory lock on the key, taken together with a read of
the key's record; the record itself is written once, complete, after the
function, by an INSERT that the table's primary key arbitrates. So:

  - a crash, a cancelled context, a rollback or a failed function leaves
    nothing behind: the lock ends with the transaction, and the retry runs
    the function again;
  - a retry after COMMIT does not run the function: it gets the stored value
    with Result.Replayed set;
  - a retry with the same key but another fingerprint gets
    [ErrFingerprintMismatch];
  - a duplicate that arrives while the first attempt is still open waits for
    its lock (see [WithWait]) and then replays its outcome, or runs the
    function if the first attempt rolled back, or gives [ErrInProgress] when
    the wait budget runs out;
  - a record older than its retention (see [WithRetention]) counts as absent.

At REPEATABLE READ and SERIALIZABLE, whose snapshot may predate a record
committed by the lock's previous holder, the claim also writes the record
in progress before the function runs, and a conflict with a record the
snapshot cannot see becomes [ErrSerialization] before the function is
called.

[Run] is Do in a transaction of its own, for callers without one. It retries
serialization failures and deadlocks, and on a pool or a connection it drives
itself it saves round trips: BEGIN travels with the claim and the record
with COMMIT. [WithTx] is the same transaction runner for any function.

# Consumers and other boundaries

[Once] is Do for a message consumer: it records a message's identity beside
the consumer's own write, so a redelivered message is a no-op. [Advance]
guards updates that carry an entity's version: it applies a version only if
it is newer than the last one applied, so redelivered and reordered
messages are skipped.

Two subpackages cover the other ends: idemhttp turns an HTTP handler into an
exactly-once endpoint for the Idempotency-Key header, and outbox delivers
messages to systems outside the database, at least once, each with an
idempotency key the receiver can deduplicate on.

# Operations

[WithObserver] records metrics, spans and log lines through OpenTelemetry's
API and log/slog. [WithCodec] seals stored responses, to encrypt or redact
them. [StartPurger] keeps the table small in the background. The idem
command (cmd/idem) migrates, purges, inspects and measures; idem stats and
idem inspect show the operations running now, which at READ COMMITTED have
no record yet, from the advisory locks in pg_locks.

Each call holds a transaction-scoped advisory lock on its key, from its
claim until its transaction ends. Its bigint id is 0x1de0 in the top 16
bits and a 48-bit hash of scope and key below: the ids 0x1de0000000000000
to 0x1de0ffffffffffff, which pg_locks shows as locktype advisory, objsubid
1, classid >> 16 = 7648. idem stats and idem inspect count every advisory
lock in that range as an operation, so their counts are an estimate: an
application's own lock with an id there counts too. An application that
takes advisory locks by bigint id should keep them out of the range; ids
spread over all bigints, as hashtextextended's are, land in it once in
65,536.

# Set-up

The table lives in embedded goose migrations. [Migrate] applies them with
their own version table and advisory lock, so they never meet an
application's own goose migrations; [Migrations] returns the files for
applications that run goose themselves. [Purge] deletes expired records in
small batches; the table can also be created hash-partitioned by scope
first (see docs/partitioned-by-scope.sql in the repository).

# Errors

Scopes and keys are checked before anything reaches the database: 1 to
[MaxKeyLength] bytes of UTF-8 without NUL, or [ErrInvalidScope] and
[ErrInvalidKey]. Values that cannot be stored give [ErrResponseTooLarge] or
[ErrResponseNotStorable]. The package's own failures are sentinel values,
checked with errors.Is; driver errors that mean one of them (a wait that ran
out, a serialization failure) are translated, so callers never inspect
SQLSTATE codes for those. Other driver errors come back wrapped, the
driver's error in the chain.
*/
package idem
