/*
Package idem makes a write happen once per client key on PostgreSQL.

A client sends a write, the server commits, and the response is lost; the
client cannot tell this from a request that never arrived, so it retries, and
the effect happens twice. idem records each client key in the same local
transaction as the write it protects, with the response, so that a retry is
answered from the record instead of running again.

# Claiming a key

[Do] takes the caller's transaction, a scope (the tenant or client the key
belongs to), the key, a fingerprint of the request ([Fingerprint],
[FingerprintJSON]), and the function that performs the write:

	res, err := idem.Do(ctx, tx, tenantID, idempotencyKey, idem.Fingerprint(body),
		func(ctx context.Context, tx pgx.Tx) (Payment, error) {
			return insertPayment(ctx, tx, order)
		})

Do claims (scope, key) in the transaction, runs the function in it, and
records the key with the function's value, as JSON, in the same
transaction: the write and the record commit together or not at all. The
record is a row of the table idempotency_key, written by an INSERT that the
table's primary key arbitrates. So:

  - a retry after COMMIT does not run the function: it gets the stored
    value, with Result.Replayed set;
  - a retry with the same key but another fingerprint gets
    [ErrFingerprintMismatch];
  - a duplicate that arrives while the first attempt's transaction is open
    waits for it (see [WithWait]), then replays its outcome, or runs the
    function if the first attempt rolled back, or gives [ErrInProgress]
    when the wait budget runs out;
  - a rollback, a failed function, a cancelled context or a closed
    connection leaves nothing behind, and the retry runs the function
    again; a client that vanishes without closing its connection holds its
    key until the server ends its session (see [WithIdleTimeout]);
  - a record older than its retention (see [WithRetention]) counts as
    absent.

Do's documentation says how a key is held while its function runs (see
also [MaxKeyLocks], which bounds what a transaction of many keys takes of
the server's lock table) and what each error leaves of the caller's
transaction.

[Run] is Do in a transaction of its own, for callers without one; [WithTx]
runs any function in a transaction the same way. Both retry serialization
failures and deadlocks, and both refuse a connection that is already in a
transaction ([ErrConnInTransaction]): inside the caller's transaction, use
Do.

# Calls to other systems: flows

A write that calls another system in the middle (charge the card at the
payment provider, then record the charge) is a [Flow]: an operation,
identified by (scope, key) like Run's, whose function gets the run's
context and takes steps. A local step ([Local]) is a transaction of its
own whose writes commit with the step's result; a call ([Call]) runs with
no transaction open and no connection held, its intent recorded before and
its result after, with a provider key (the call function's argument, and
[ProviderKeyFromContext]) that stays the same on every attempt, for the
provider's own idempotency mechanism. A retry, another process, or a
completer ([Flow.Resume]) continues the operation where it stopped:
completed steps return their results without running again. One executor
at a time holds a flow, under a lease it renews; one that lost the lease
commits nothing more ([ErrLeaseLost]). An uncertain failure is never
stored; a definite one is part of the flow's answer. The repository's
docs/flows.md says when to use a flow rather than Run or the outbox, and
what exactly it guarantees.

# Consumers and other boundaries

[Once] is Do for a message consumer: it records a message's identity beside
the consumer's own write, so a redelivered message is a no-op; [OnceEach]
does it for a batch of messages in one transaction, claiming the batch in
one statement, at about the cost of the batch's own writes. [Advance]
guards updates that carry an entity's version: it applies a version only if
it is newer than the last one applied, so redelivered and reordered
messages are skipped.

Subpackages cover the other ends: idemhttp turns an HTTP handler into an
exactly-once endpoint for the Idempotency-Key header, and its client
Transport retries with one key; idemhttp/webhook receives signed webhooks,
each event applied once; outbox delivers messages to systems outside the
database, at least once, each with an idempotency key the receiver can
deduplicate on; idemsql gives the same calls to code on database/sql (an
ORM such as GORM or sqlx); and idemtest gives an application's tests
PostgreSQL databases of their own, with idem's migrations applied. The
gRPC interceptors, idemgrpc, are a module of their own, so that no other
user downloads gRPC. The idem command (cmd/idem) migrates, purges, shows
stats, inspects records and flows, ends flows, and prints the schema.

# Options and errors

Calls and flows take options, each of which says its default, and each
typed by where it applies, so that the compiler refuses one given where it
would mean nothing: [WithWait], [WithRetention], [WithTxOptions],
[WithIdleTimeout], [WithMaxResponseSize], [WithCodec] and [WithObserver]
are a [SharedOption], taken by both; [WithLookupFirst] an [Option], of
calls only; [WithLease], [WithGrace], [WithProviderWindow] and [WithCallTimeout] a
[FlowOption], of flows only. An option made from a value that cannot work
makes every call given it fail with [ErrInvalidOption] before anything is
sent; [CheckOptions] and [CheckFlowOptions] check options once, when a
program sets them up.

One rule for zero and negative values holds in idem and every subpackage.
In a configuration struct ([PurgerConfig], [ObserverConfig],
idemhttp.Config, outbox.Config) the zero value of a field means its
default, stated on the field, and a nil Logger means slog.Default(). An
option is an explicit choice, so its zero means zero: WithWait(0) does not
wait, and leaving the option out gives the default. In both, a negative
value means "none" where the field or option says so (no wait, no bound,
no limit) and is refused elsewhere. A configuration is checked once, where
it is built (StartPurger, idemhttp.NewMiddleware, outbox.StartRelay), and
each invalid field is refused with a [FieldError] that names it and wraps
[ErrInvalidOption].

The package's own failures are sentinel values, checked with errors.Is, and
each one's documentation says when it is returned and what to do:
[ErrInvalidScope], [ErrInvalidKey], [ErrInvalidOption], [ErrInvalidVersion],
[ErrFingerprintMismatch], [ErrInProgress], [ErrSerialization],
[ErrReadOnly], [ErrConnInTransaction], [ErrResponseTooLarge] and
[ErrResponseNotStorable]; [OnceEach] adds [ErrInvalidBatch]; flows add [ErrLeaseLost], [ErrFlowChanged],
[ErrFlowIncomplete], [ErrFlowStopped] and [ErrInputNotStorable], and
[ErrNotSent] for a call's function to say that its request never left,
and [ErrOutcomeUnknown] for a [BestEffort] call's; resolving a stopped
flow adds [ErrFlowNotStopped], [ErrStepMismatch] and [ErrFlowSealed].
A value that cannot work is a [*FieldError], which names it. Driver errors
that mean one of them (a wait that ran out, a serialization failure, a
deadlock) are translated, so callers
never inspect SQLSTATE codes for those. Other driver errors come back
wrapped with what idem was doing, the driver's error in the chain.

# Set-up and operations

The tables live in embedded goose migrations. [Migrate] applies them with
their own version table ([MigrationTable]) and advisory lock, so they never
meet an application's own goose migrations; [Migrations] returns the files
for applications that run goose themselves. [Purge] and [StartPurger]
delete expired records in small batches, to keep the table small.
[WithObserver] records metrics, spans and log lines through OpenTelemetry's
API and log/slog; [WithCodec] seals stored responses, to encrypt or redact
them. The idem command (cmd/idem) migrates, purges and inspects.

A key's advisory lock has a bigint id with 0x1de0 in its top 16 bits and a
48-bit hash of scope and key below: the ids 0x1de0000000000000 to
0x1de0ffffffffffff, which pg_locks shows as locktype advisory, objsubid 1,
classid >> 16 = 7648. idem stats and idem inspect count every advisory lock
in that range as an operation, so their counts are an estimate. An
application that takes advisory locks by bigint id should keep them out of
the range; ids spread over all bigints, as hashtextextended's are, land in
it once in 65,536.

The repository's docs directory explains how a call works, operations,
PgBouncer, very large deployments (the table hash-partitioned by scope),
performance and the proof under faults:
https://github.com/pgidem/idem/tree/main/docs.
*/
package idem
