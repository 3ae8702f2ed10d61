package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/pgtime"
)

// MaxKeyLength is the longest key or scope accepted, in bytes.
const MaxKeyLength = ident.MaxLength

// Result is what [Do] and [Run] return on success.
type Result[T any] struct {
	// Value is the function's result, or on a replay the stored result
	// decoded again from JSON. Only what survives a JSON round trip is
	// replayed: unexported fields and fields tagged `json:"-"` come back as
	// zero values.
	Value T

	// Replayed is true when the function did not run in this call because
	// the key's operation had already completed.
	Replayed bool
}

// Do makes fn's effect happen once per (scope, key), inside the caller's
// transaction tx.
//
// Do claims the key in tx, runs fn with tx, and records the key with fn's
// value (as JSON) in tx, so that fn's writes and the record commit together
// or not at all. A call for a key whose operation already committed does not
// run fn: it returns the stored value with Replayed set; under synchronous
// replication, tx's COMMIT then waits until the standby has the record
// (docs/failover.md), so answer once tx committed. Scopes are separate
// namespaces: pass the tenant or client identity, so that two tenants using
// the same key never see each other's records.
//
// fp is the request's fingerprint (see [Fingerprint] and [FingerprintJSON]).
// A live key recorded with another fingerprint gives
// [ErrFingerprintMismatch]. A nil fp matches only another nil or empty fp.
//
// A Do on a key inside that key's own function, in the same transaction
// (repository code that calls Do with the request's key, under an idemhttp
// handler that already claimed it), joins the enclosing call: fn runs as
// part of the enclosing operation, Replayed is false, and nothing is
// recorded but the enclosing call's record, which a retry replays. Its
// fingerprint is not compared: the enclosing call's was, and no second
// request is involved. A key claimed by one layer belongs to it: a later
// call on it with another fingerprint, from another layer, gets
// [ErrFingerprintMismatch]; give each layer a scope of its own when both
// must record.
//
// A duplicate that arrives while another transaction holds the key waits
// for it (see [WithWait]): it replays what that transaction committed, or
// runs fn itself if it rolled back, or gives up with [ErrInProgress]. A
// transaction holds a key on its lock, an advisory lock, for up to
// [MaxKeyLocks] keys, and beyond that on a record in progress; replays and
// mismatches hold nothing. The one case where a duplicate learns of the
// holder only when it stores its own record is a key held by a record in
// progress (past the holder's MaxKeyLocks, or by an [OnceEach] batch) and
// claimed by a transaction on its lock: fn runs, then the record's INSERT
// waits for the holder under what is left of the wait budget, and the
// duplicate fails with [ErrInProgress] if the holder is still open then,
// or with [ErrSerialization] if it committed, which [Run] and [WithTx]
// retry into a replay; either way fn's writes roll back with tx. Under
// REPEATABLE READ or SERIALIZABLE, a key completed after tx's snapshot gives
// [ErrSerialization]: retry the whole transaction, or use [Run], which does.
//
// When fn returns an error, Do returns it wrapped (errors.Is works) and
// records nothing; roll back. What each error leaves of tx: after a wait
// that ran out ([ErrInProgress]), a serialization failure or deadlock
// ([ErrSerialization]) or another database error, tx is aborted and can only
// roll back. After [ErrInvalidScope], [ErrInvalidKey] and [ErrInvalidOption]
// nothing was sent; after [ErrFingerprintMismatch], [ErrResponseTooLarge], [ErrResponseNotStorable]
// and fn's own errors, tx is as fn left it, and a key it claimed stays
// held by tx until tx ends, or until a ROLLBACK TO SAVEPOINT taken before
// the claim undoes it. In a read-only transaction, or on a standby, Do
// returns [ErrReadOnly] and tx stays usable. Invalid scopes, keys and
// options are rejected before anything is sent to the database.
func Do[T any](ctx context.Context, tx pgx.Tx, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), opts ...Option,
) (_ Result[T], err error) {
	o, err := newOptions(opts)
	ctx, obs := o.observer.observe(ctx, "idem.Do")
	defer func() { obs.end(ctx, scope, key, err) }()
	if err != nil {
		return Result[T]{}, err
	}
	return do(ctx, tx, scope, key, fp, fn, &o, obs)
}

func do[T any](ctx context.Context, tx pgx.Tx, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), o *options, obs *observation,
) (Result[T], error) {
	k, err := newKeyRef(scope, key, fp)
	if err != nil {
		return Result[T]{}, err
	}
	k.fp = o.storedFingerprint(scope, k.fp)
	c, _, err := claim(ctx, tx, nil, nil, k, o)
	obs.claimDone(c.outcome)
	if err != nil {
		return Result[T]{}, err
	}
	switch c.outcome {
	case outcomeReplayed:
		return replayed[T](c.stored, scope, o)
	case outcomeJoined:
		// The enclosing call holds the key and records it: fn is part of
		// its operation.
		value, err := fn(ctx, tx)
		if err != nil {
			return Result[T]{}, fmt.Errorf("idem: %w", err)
		}
		return Result[T]{Value: value}, nil
	}
	res, s, err := execute(ctx, tx, k, c, fn, o)
	if err != nil {
		return Result[T]{}, err
	}
	if c.complete {
		return res, nil
	}
	// A failed statement aborts tx: nothing of it can commit.
	if err := s.send(ctx, tx); err != nil {
		return Result[T]{}, translateStore(c, err)
	}
	return res, nil
}

// keyRef is a validated (scope, key) with the fingerprint it is claimed
// with and the id of its lock.
type keyRef struct {
	scope, key string
	fp         []byte
	lockID     int64
}

// newKeyRef validates scope and key before anything reaches the database:
// out-of-bounds input is rejected, never truncated, because truncation turns
// distinct keys into collisions.
func newKeyRef(scope, key string, fp []byte) (keyRef, error) {
	if err := ident.Check(scope); err != nil {
		return keyRef{}, fmt.Errorf("%w: %s", ErrInvalidScope, err)
	}
	if err := ident.Check(key); err != nil {
		return keyRef{}, fmt.Errorf("%w: %s", ErrInvalidKey, err)
	}
	if fp == nil {
		fp = []byte{}
	}
	return keyRef{scope: scope, key: key, fp: fp, lockID: keylock.ID(scope, key)}, nil
}

// The outcomes of a call, as the idem.outcome attribute of an [Observer]'s
// metrics and spans spells them.
const (
	outcomeClaimed    = "claimed"           // the key was free; fn ran and its value was stored
	outcomeReclaimed  = "expired_reclaimed" // the key's record had expired; fn ran and replaced it
	outcomeReplayed   = "replayed"          // the key's operation had completed; its value was returned
	outcomeMismatch   = "mismatch"          // the key is live with another fingerprint
	outcomeInProgress = "in_progress"       // another attempt held the key past the wait budget
	outcomeJoined     = "joined"            // a call inside the key's own function: fn ran as part of it
	outcomeInvalid    = "invalid"           // the scope, key or an option was rejected
	outcomeFailed     = "failed"            // fn, the database or the stored value failed
)

// claimed is what the claim found: the key is this transaction's to run
// (claimed, reclaimed), or its stored value is to be replayed.
type claimed struct {
	outcome string
	stored  []byte
	// expired: the record in the way had expired; fn's record replaces it.
	expired bool
	// early: the transaction is not READ COMMITTED, so the claim wrote a
	// record in progress before fn (KeyClaim), to be completed after it.
	early bool
	// waited is how long the claim waited for the key's lock: the record's
	// statement waits under what is left of the budget.
	waited time.Duration
	// complete: the claim wrote the record completed, with no answer, for
	// a call that stores none (Once past MaxKeyLocks, KeyClaimIfFull):
	// nothing is stored after fn.
	complete bool
	// citus: the database has Citus (KeyLock), where the record is stored
	// by a statement Citus routes to one node, under a budget set there
	// (see store.routed).
	citus bool
}

// claim takes the key's lock (KeyLock) and reads its record (KeyGet), two
// statements in one round trip, waiting for the lock under the wait budget
// (KeyLockWait, KeyGet again) when it is taken and there is no record to
// replay. A key with a live record takes no lock. A transaction that holds
// MaxKeyLocks key locks already claims with a record in progress instead
// (claimRow). It runs in tx; with tx nil, it begins a transaction with
// begin on conn, in the same round trip. It returns the transaction, the
// one it began if so, also on error.
func claim(ctx context.Context, tx pgx.Tx, conn *pgx.Conn, begin *pgx.TxOptions, k keyRef, o *options) (claimed, pgx.Tx, error) {
	if tx != nil {
		if running(tx, k) {
			// Advisory locks are reentrant: only the connection's list of
			// keys whose functions are running tells a Do inside fn on fn's
			// own key. It joins that call (see Do).
			return claimed{outcome: outcomeJoined}, tx, nil
		}
		conn = tx.Conn()
	}
	data := stateOf(tx, conn)
	held := heldLocks(data)
	// Whether the database has Citus is read by a connection's first
	// claim, and kept (citusOf): the claims after it ask nothing.
	citus, citusKnown := citusOf(data)
	lockArg := dbsqlc.KeyLockParams{FullSince: held.fullSince(), Scope: k.scope, Key: k.key, LockID: k.lockID, CheckCitus: !citusKnown}
	var got struct {
		lock  dbsqlc.KeyLockRow
		rec   dbsqlc.KeyGetRow
		found bool
	}
	// A caller's transaction whose count of key locks is full (on Citus,
	// one of its workers' counts) claims the key by its record in progress
	// in the claim's own round trip (KeyClaimIfFull), where its count is
	// full, then reads the record again (again, foundAgain).
	full := tx != nil && len(lockArg.FullSince) > 0 && held.of(tx, conn)
	var ifFull dbsqlc.KeyClaimIfFullRow
	var again dbsqlc.KeyGetRow
	var foundAgain bool
	var err error
	b := &pgx.Batch{}
	if tx == nil {
		b.BeginTx(*begin)
	}
	if o.idleTimeout > 0 {
		_ = dbbatch.Queue(b).TxIdleTimeout(ctx, millis(o.idleTimeout))
	}
	if citusKnown && citus && !citusStatementsAsBefore {
		dbbatch.QueueKeyLockCitus(b, dbsqlc.KeyLockCitusParams{
			FullSince: lockArg.FullSince, LockID: k.lockID, Scope: k.scope, Key: k.key,
		}, &got.lock)
	} else {
		dbbatch.QueueKeyLock(b, lockArg, &got.lock)
	}
	dbbatch.QueueKeyGet(b, dbsqlc.KeyGetParams{Scope: k.scope, Key: k.key}, &got.rec, &got.found)
	if full {
		// A call that stores no answer (Once) writes its record
		// complete: nothing is left to store after fn.
		state := "in_progress"
		if o.noResponse {
			state = stateDone
		}
		// The transaction's earlier claims read whether the
		// database has Citus.
		queueWaiting(ctx, b, citus, k.scope, millis(o.wait), func() {
			dbbatch.QueueKeyClaimIfFull(b, dbsqlc.KeyClaimIfFullParams{
				LockTimeout: millis(o.wait), FullSince: lockArg.FullSince,
				Scope: k.scope, Key: k.key, Fingerprint: k.fp, State: state, Retention: o.retentionInterval(),
			}, &ifFull)
		})
		dbbatch.QueueKeyGet(b, dbsqlc.KeyGetParams{Scope: k.scope, Key: k.key}, &again, &foundAgain)
	}
	if tx == nil {
		results := conn.SendBatch(ctx, b)
		tx = results.Tx()
		err = results.Close()
	} else {
		err = tx.SendBatch(ctx, b).Close()
	}
	if err != nil {
		return claimed{outcome: outcomeFailed}, tx, translate("idem: claim key", err)
	}
	lock, rec, found := got.lock, &got.rec, &got.found
	var waited time.Duration
	get := dbsqlc.KeyGetParams{Scope: k.scope, Key: k.key}
	if !citusKnown {
		citus = lock.Citus
		setCitus(data, citus)
	}
	held.count(lock, tx, citus)
	if lock.ReadOnly {
		return claimed{outcome: outcomeInvalid}, tx, errReadOnly
	}

	// A record committed in progress was not written by idem, which never
	// commits one: its operation recorded no answer, and it is taken over
	// like an expired record (see KeyClaim).
	done := func() bool { return *found && !rec.Expired && rec.State == stateDone }
	if done() {
		c, err := replayOrMismatch(rec.Fingerprint, rec.Response, k.fp)
		return c, tx, err
	}
	if full && lock.Lock == lockSkipped {
		if ifFull.Attempted {
			c, err := claimedRow(ifFull.Claimed, *found, &again, foundAgain, k)
			c.complete = ifFull.Claimed && o.noResponse
			return c, tx, err
		}
		// A record completed since KeyLock read none.
		if foundAgain && !again.Expired && again.State == stateDone {
			c, err := replayOrMismatch(again.Fingerprint, again.Response, k.fp)
			return c, tx, err
		}
	}
	switch lock.Lock {
	case lockSkipped:
		c, err := claimRow(ctx, tx, k, o, *found, citus)
		return c, tx, err
	case lockBusy:
		started := time.Now()
		wait := &pgx.Batch{}
		_ = dbbatch.Queue(wait).KeyLockWait(ctx, dbsqlc.KeyLockWaitParams{LockTimeout: millis(o.wait), LockID: k.lockID, Scope: k.scope, Key: k.key})
		dbbatch.QueueKeyGet(wait, get, rec, found)
		err := tx.SendBatch(ctx, wait).Close()
		waited = time.Since(started)
		if err != nil {
			return claimed{outcome: outcomeFailed}, tx, translate("idem: wait for key", err)
		}
		if done() {
			c, err := replayOrMismatch(rec.Fingerprint, rec.Response, k.fp)
			return c, tx, err
		}
	}

	c := claimed{outcome: outcomeClaimed, expired: *found, waited: waited, citus: citus}
	if *found {
		c.outcome = outcomeReclaimed
	}
	if !lock.ReadCommitted {
		c.early = true
		ok, err := dbsqlc.New(tx).KeyClaim(ctx, dbsqlc.KeyClaimParams{
			Scope: k.scope, Key: k.key, Fingerprint: k.fp, Retention: o.retentionInterval(),
		})
		if err != nil {
			return claimed{outcome: outcomeFailed}, tx, translate("idem: claim key", err)
		}
		if !ok {
			// Only a writer that took no lock can have put a live record
			// in the way since KeyGet read none.
			return claimed{outcome: outcomeFailed}, tx, fmt.Errorf("idem: claim key: %w: the record changed while the key was locked", ErrSerialization)
		}
	}
	return c, tx, nil
}

// The lock column of KeyLock.
const (
	lockSkipped = 0 // not tried: a live record, a full count, or read-only
	lockTaken   = 1
	lockBusy    = 2 // another transaction holds it
)

// MaxKeyLocks is the most key locks one transaction holds. A key's lock is
// a transaction-scoped advisory lock, and advisory locks take entries in
// the server's shared lock table, whose size all sessions of all databases
// share (max_locks_per_transaction × (max_connections +
// max_prepared_transactions) entries, 64 × 100 at the defaults). A
// transaction that claims more keys than this claims the rest by writing
// each key's record in progress before its function runs, which takes no
// lock-table entry per key: a duplicate then waits on that record, under
// the same wait budget, instead of on the lock. Replays and mismatches take
// no lock at all. So however many keys a transaction claims, and however
// many transactions do, idem holds at most MaxKeyLocks entries per
// connection, well under max_locks_per_transaction. On Citus, where the
// key locks are taken on the workers, a transaction holds at most
// MaxKeyLocks on each worker (docs/large-deployments.md).
const MaxKeyLocks = 16

// claimRow claims k in tx by writing its record in progress (KeyClaimWait),
// waiting under the wait budget for a transaction that holds the record,
// then reading it again (KeyGet), in one round trip. When the holder
// committed, its record is replayed; when it rolled back, the claim goes
// ahead. expired says whether the claim's first read found a record that
// is no longer live; citus whether the database has Citus.
func claimRow(ctx context.Context, tx pgx.Tx, k keyRef, o *options, expired, citus bool) (claimed, error) {
	var row dbsqlc.KeyClaimWaitRow
	var rec dbsqlc.KeyGetRow
	var found bool
	b := &pgx.Batch{}
	queueWaiting(ctx, b, citus, k.scope, millis(o.wait), func() {
		dbbatch.QueueKeyClaimWait(b, dbsqlc.KeyClaimWaitParams{
			LockTimeout: millis(o.wait), Scope: k.scope, Key: k.key, Fingerprint: k.fp, Retention: o.retentionInterval(),
		}, &row)
	})
	dbbatch.QueueKeyGet(b, dbsqlc.KeyGetParams{Scope: k.scope, Key: k.key}, &rec, &found)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return claimed{outcome: outcomeFailed}, translate("idem: claim key", err)
	}
	return claimedRow(row.Claimed, expired, &rec, found, k)
}

// queueWaiting queues on b, by calling queue, a statement that may wait
// for a transaction that holds a record of scope, under the wait budget
// lockTimeout, which the statement sets with set_config in its own
// session. On a Citus coordinator (citus) that session is not where the
// statement waits: Citus runs its INSERT on the node of the scope's shard,
// over a connection of its own. There it is sent between
// KeyWaitBudgetCitus and KeyWaitRestoreCitus, which set the budget on that
// node's connection and restore its lock_timeout, in the same round trip.
func queueWaiting(ctx context.Context, b *pgx.Batch, citus bool, scope, lockTimeout string, queue func()) {
	if !citus {
		queue()
		return
	}
	q := dbbatch.Queue(b)
	_ = q.KeyWaitBudgetCitus(ctx, dbsqlc.KeyWaitBudgetCitusParams{LockTimeout: lockTimeout, Scope: scope})
	queue()
	_ = q.KeyWaitRestoreCitus(ctx, scope)
}

// claimedRow decides what a claim by the key's record in progress got:
// the key, when it wrote the record; else the record it then read, to
// replay.
func claimedRow(written, expired bool, rec *dbsqlc.KeyGetRow, found bool, k keyRef) (claimed, error) {
	if written {
		c := claimed{outcome: outcomeClaimed, early: true}
		if expired {
			c.outcome = outcomeReclaimed
		}
		return c, nil
	}
	if found && !rec.Expired && rec.State == stateDone {
		return replayOrMismatch(rec.Fingerprint, rec.Response, k.fp)
	}
	// Under REPEATABLE READ a record committed since the snapshot fails
	// the INSERT itself; at READ COMMITTED, KeyGet sees what was in the way.
	return claimed{outcome: outcomeFailed}, fmt.Errorf("idem: claim key: %w: the record changed while it was claimed", ErrSerialization)
}

// same compares keys by scope and key, not by their lock's hash.
func (k keyRef) same(other keyRef) bool { return k.scope == other.scope && k.key == other.key }

// replayOrMismatch decides what a duplicate gets from the live, completed
// record in its way: its stored value to replay when the fingerprints
// match, ErrFingerprintMismatch when they do not.
func replayOrMismatch(storedFP, response, fp []byte) (claimed, error) {
	if !bytes.Equal(storedFP, fp) {
		return claimed{outcome: outcomeMismatch}, ErrFingerprintMismatch
	}
	return claimed{outcome: outcomeReplayed, stored: response}, nil
}

// stateDone marks a record whose operation committed with its answer.
const stateDone = "done"

// execute runs fn in tx, which holds the key, and returns its value with the
// statement that records it, for the caller to send: on its own (Do) or
// with COMMIT (Run).
func execute[T any](ctx context.Context, tx pgx.Tx, k keyRef, c claimed,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), o *options,
) (res Result[T], s store, err error) {
	if c.early {
		// A claim written before fn must not survive a panic in fn either:
		// a caller that recovers and commits would leave the key blocked.
		defer func() {
			if p := recover(); p != nil {
				_ = c.releaseOnFailure(ctx, tx, k, o, nil)
				panic(p)
			}
		}()
	}
	r := enter(tx, k)
	value, err := func() (T, error) {
		defer r.leave(k)
		return fn(ctx, tx)
	}()
	if err != nil {
		return res, s, c.releaseOnFailure(ctx, tx, k, o, fmt.Errorf("idem: %w", err))
	}
	s = store{k: k, c: c, retention: o.retentionInterval(), lockTimeout: millis(max(o.wait-c.waited, 0))}
	// Once stores no response: a SQL NULL, the zero pgtype.Text.
	if !o.noResponse {
		encoded, err := encodeResponse(value, k.scope, o)
		if err != nil {
			return res, s, c.releaseOnFailure(ctx, tx, k, o, err)
		}
		s.response = pgtype.Text{String: string(encoded), Valid: true}
	}
	res.Value = value
	return res, s, nil
}

// store is the statement that records a key's completed operation.
type store struct {
	k         keyRef
	c         claimed
	response  pgtype.Text
	retention pgtype.Interval
	// lockTimeout is what is left of the wait budget once the claim has
	// waited: KeyInsert and KeyReplace wait under it for a transaction
	// that holds the key without its lock (see KeyInsert).
	lockTimeout string
}

// queue runs, or with a queue as q's DBTX queues, the statement that records
// the operation: the record written once, complete (KeyInsert, or
// KeyReplace over an expired record), or the early claim completed
// (KeyStoreResponse). On Citus (routed), it queues the statements of
// queueRouted instead; q must then queue.
//
// last is set when the statement goes with the transaction's COMMIT, in
// its round trip: nothing of the caller's runs after it, and a record
// inserted sets its wait budget for the rest of the transaction without
// restoring the caller's (KeyInsertLast).
func (s store) queue(ctx context.Context, q *dbsqlc.Queries, last bool) error {
	switch {
	case s.routed():
		s.queueRouted(ctx, q, last)
		return nil
	case s.c.early:
		return q.KeyStoreResponse(ctx, dbsqlc.KeyStoreResponseParams{Scope: s.k.scope, Key: s.k.key, Response: s.response})
	case s.c.expired:
		return q.KeyReplace(ctx, dbsqlc.KeyReplaceParams{
			LockTimeout: s.lockTimeout, Scope: s.k.scope, Key: s.k.key, Fingerprint: s.k.fp, Response: s.response, Retention: s.retention,
		})
	case last:
		return q.KeyInsertLast(ctx, dbsqlc.KeyInsertLastParams{
			LockTimeout: s.lockTimeout, Scope: s.k.scope, Key: s.k.key, Fingerprint: s.k.fp, Response: s.response, Retention: s.retention,
		})
	}
	return q.KeyInsert(ctx, dbsqlc.KeyInsertParams{
		LockTimeout: s.lockTimeout, Scope: s.k.scope, Key: s.k.key, Fingerprint: s.k.fp, Response: s.response, Retention: s.retention,
	})
}

// routed reports whether the record is stored in the statements that
// Citus routes whole to the node of the scope's shard (queueRouted): on a
// Citus coordinator, for a record written once (the early claim's UPDATE
// waits for no one).
func (s store) routed() bool { return s.c.citus && !s.c.early }

// queueRouted queues the statements that store the record on Citus:
// KeyInsertCitus, or KeyReplaceCitus over an expired record, which Citus
// routes whole to the node of the scope's shard (KeyInsert's CTE it runs
// in three steps through the coordinator), between the statements that
// set the wait budget there and restore that node's lock_timeout
// (queueWaiting): three statements, in the round trip of KeyInsert's one.
// With last (Run's, the transaction's COMMIT behind it in the round
// trip) there are two: the budget is set by KeyStoreBudgetCitus, and not
// restored, as KeyInsertLast does on PostgreSQL. Set with
// set_config(..., true), it ends with the transaction, and nothing of the
// caller's runs before that. Each statement the coordinator sends costs a
// round trip to the worker, and its planning on the coordinator.
func (s store) queueRouted(ctx context.Context, q *dbsqlc.Queries, last bool) {
	last = last && !citusStatementsAsBefore
	if last {
		_ = q.KeyStoreBudgetCitus(ctx, dbsqlc.KeyStoreBudgetCitusParams{LockTimeout: s.lockTimeout, Scope: s.k.scope, Key: s.k.key})
	} else {
		_ = q.KeyWaitBudgetCitus(ctx, dbsqlc.KeyWaitBudgetCitusParams{LockTimeout: s.lockTimeout, Scope: s.k.scope})
	}
	arg := dbsqlc.KeyInsertCitusParams{Scope: s.k.scope, Key: s.k.key, Fingerprint: s.k.fp, Response: s.response, Retention: s.retention}
	if s.c.expired {
		_ = q.KeyReplaceCitus(ctx, dbsqlc.KeyReplaceCitusParams(arg))
	} else {
		_ = q.KeyInsertCitus(ctx, arg)
	}
	if !last {
		_ = q.KeyWaitRestoreCitus(ctx, s.k.scope)
	}
}

// citusStatementsAsBefore is set only by BenchmarkCitusRatios, to measure
// Run on Citus with the statements it sent before KeyLockCitus and
// KeyStoreBudgetCitus (KeyLock; KeyWaitBudgetCitus, the record and
// KeyWaitRestoreCitus) against the ones it sends now (export_test.go).
var citusStatementsAsBefore = false

// run runs the statement that records the operation in tx, through pgx:
// on Citus, the statements of queueRouted in one round trip.
func (s store) run(ctx context.Context, tx pgx.Tx) error {
	if !s.routed() {
		return s.queue(ctx, dbsqlc.New(tx), false)
	}
	b := &pgx.Batch{}
	s.queueRouted(ctx, dbbatch.Queue(b), false)
	return tx.SendBatch(ctx, b).Close()
}

// send runs the statement that records the operation in tx.
func (s store) send(ctx context.Context, tx pgx.Tx) error { return s.run(ctx, tx) }

// translateStore translates the errors of the statement that records an
// operation. At READ COMMITTED a unique violation (KeyInsert) or
// division_by_zero (KeyReplace) means the key was completed while fn ran,
// although the transaction held its lock: by a writer that takes no lock
// (an older idem during a rolling upgrade, a hand-written statement), or by
// fn itself. The transaction is aborted, so nothing of fn's commits, and a
// retry of the whole transaction (ErrSerialization) finds the record and
// replays it. A claim written early (KeyStoreResponse) can only have been
// changed by fn itself, in the same transaction: retrying would do it again.
func translateStore(c claimed, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "22012") {
		if c.early {
			return fmt.Errorf("idem: store response: the claim was removed or completed while its function ran (did fn write to the key's record?): %w", err)
		}
		return &recordChanged{err: err}
	}
	return translate("idem: store response", err)
}

// recordChanged is a record that a writer which took no lock completed
// while fn ran (see translateStore).
type recordChanged struct{ err error }

func (r *recordChanged) Error() string {
	return ErrSerialization.Error() + " (store response: the key was completed while its function ran, by a writer that took no lock, or by fn itself)"
}

func (r *recordChanged) Unwrap() []error { return []error{ErrSerialization, r.err} }

// releaseOnFailure ends a claim whose operation failed with cause, and
// returns the error to report. At READ COMMITTED nothing was written: the
// transaction holds only the key's lock, which ends with it. A record
// written early is removed, so that a caller who commits anyway never
// commits a record stuck in progress; the removal is bounded by
// cleanupTimeout even when ctx has ended or the connection is dead, and if
// it fails the transaction cannot commit anything.
func (c claimed) releaseOnFailure(ctx context.Context, tx pgx.Tx, k keyRef, o *options, cause error) error {
	if !c.early {
		return cause
	}
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	var err error
	if c.complete {
		// Written complete by this transaction, which holds it: removed
		// whatever its state.
		err = dbsqlc.New(tx).KeyReleaseBatch(ctx, dbsqlc.KeyReleaseBatchParams{Scope: k.scope, Keys: []string{k.key}})
	} else {
		err = dbsqlc.New(tx).KeyRelease(ctx, dbsqlc.KeyReleaseParams{Scope: k.scope, Key: k.key})
	}
	// A connection closed by a cancelled context still reports 'T', but its
	// transaction is gone with it: nothing can commit, nothing to report.
	if err != nil && tx.Conn() != nil && !tx.Conn().IsClosed() && tx.Conn().PgConn().TxStatus() == 'T' {
		o.observer.logRelease(ctx, k.scope, k.key, err)
		return errors.Join(cause, fmt.Errorf("idem: release claim, roll back: %w", err))
	}
	return cause
}

// retentionInterval is the retention as PostgreSQL's interval, rounded up
// to the microsecond as every duration idem sends is (see pgtime).
func (o *options) retentionInterval() pgtype.Interval {
	return pgtime.Interval(o.retention)
}
