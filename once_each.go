package idem

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
)

// MaxBatch is the most ids [OnceEach] takes in one call. The batch is
// claimed in one statement whose ids travel as one parameter and wait
// under one budget; a larger batch is split by the caller, one OnceEach
// per part, in the same transaction or in one each.
const MaxBatch = 10_000

// ErrInvalidBatch is returned by [OnceEach] when its ids cannot be
// claimed: more than [MaxBatch] of them, or an id that breaks the rules for
// keys (the error then wraps [ErrInvalidKey] too, and says which id by its
// index). Nothing is sent to the database and fn is not run.
var ErrInvalidBatch = errors.New("idem: invalid batch")

// OnceEach is [Once] for a batch of messages applied in one transaction:
// it claims every id of scope in tx in one statement, then calls fn(ctx,
// tx, i) for each i whose ids[i] was not handled before, in order, and
// reports ran[i] true for those. A redelivered message, and an id repeated
// within ids after its first place, gets ran[i] == false and no call. A
// batch of messages costs one round trip for the claim, instead of one or
// two per message, and takes no lock-table entry per message (see
// [MaxKeyLocks]).
//
// The records are written when the batch is claimed, in tx, before fn
// runs, as Once's are when fn has run: they commit with fn's writes or not
// at all. When fn returns an error for ids[i], OnceEach removes the records
// of ids[i] and of every id whose fn has not run yet, and returns the error
// wrapped (errors.Is works), with ran saying which ran before it; roll tx
// back, and the broker redelivers the batch. After any other error nothing
// of the batch is recorded: roll tx back. A panic in fn removes those
// records too, and goes on.
//
// A message that another transaction holds (another consumer's open
// batch, or a message it claimed with Once) is waited for, under the wait
// budget ([WithWait], by default [DefaultWait]): when that transaction
// commits its record, the message counts as handled; when it rolls back,
// this batch claims it. The budget bounds each wait for one holder; a
// holder still open past it gives [ErrInProgress], and tx is aborted. The
// claim waits only on records: a Once elsewhere that holds one of the ids
// on its key lock (among its transaction's first [MaxKeyLocks] keys) has
// written no record yet, so the batch claims the id, and that Once, when it
// stores its own record, waits for this batch under its budget, and then
// fails ([ErrInProgress], or [ErrSerialization] once the batch committed),
// its function's writes rolled back with its transaction. Either way the
// message is applied once.
//
// Scope, retention and the observer work as for Once ([WithRetention],
// [WithObserver]); a record that expired counts as new. A live record of
// the scope written by [Do] with a fingerprint, under one of the ids, gives
// [ErrFingerprintMismatch], as it does for Once, before fn runs. At
// REPEATABLE READ or SERIALIZABLE, a record committed after tx's snapshot
// gives [ErrSerialization]: retry the whole transaction, as [WithTx] does.
// An empty batch sends nothing and returns an empty ran.
func OnceEach(ctx context.Context, tx pgx.Tx, scope string, ids []string, fn func(ctx context.Context, tx pgx.Tx, i int) error, opts ...Option) (ran []bool, err error) {
	o, err := newOptions(opts)
	ctx, obs := o.observer.observe(ctx, "idem.OnceEach")
	defer func() { obs.end(ctx, scope, "", err) }()
	if err != nil {
		return nil, err
	}
	keys, err := newBatch(scope, ids)
	if err != nil {
		return nil, err
	}
	ran = make([]bool, len(ids))
	if len(keys) == 0 {
		return ran, nil
	}
	fp := o.storedFingerprint(scope, []byte{})
	claimedKeys, err := claimBatch(ctx, tx, scope, keys, fp, &o)
	if claimedKeys != nil {
		obs.claimDone(outcomeReplayed)
		if len(claimedKeys) > 0 {
			obs.claimDone(outcomeClaimed)
		}
	}
	if err != nil {
		return nil, err
	}
	return ran, runBatch(ctx, tx, scope, ids, claimedKeys, ran, fn, &o)
}

// newBatch validates a batch before anything reaches the database, and
// returns its ids without repeats, sorted: two batches that share ids then
// wait for each other's records in one order, never in a cycle.
func newBatch(scope string, ids []string) ([]string, error) {
	if err := ident.Check(scope); err != nil {
		return nil, fmt.Errorf("%w: %s", ErrInvalidScope, err)
	}
	if len(ids) > MaxBatch {
		return nil, fmt.Errorf("%w: %d ids, more than %d (MaxBatch): split the batch", ErrInvalidBatch, len(ids), MaxBatch)
	}
	for i, id := range ids {
		if err := ident.Check(id); err != nil {
			return nil, fmt.Errorf("%w: id %d: %w: %s", ErrInvalidBatch, i, ErrInvalidKey, err)
		}
	}
	keys := slices.Clone(ids)
	slices.Sort(keys)
	return slices.Compact(keys), nil
}

// claimBatch claims keys (sorted, no repeats) in tx and returns those that
// are this batch's to run (KeyClaimBatch). When some were skipped, it reads
// their records (KeyGetBatch): a live completed record with the batch's
// fingerprint is a message handled before, one with another fingerprint a
// mismatch; an expired record, one committed in progress, or one removed
// since, is taken over (KeyReclaimBatch). On a mismatch, the records this
// batch wrote are removed before the error is returned.
//
// On Citus the claims wait on the node of the scope's shard, under a
// budget set there (queueWaiting). Whether the database has Citus is what
// the connection's last claim read; before one did, the batch asks
// (CitusInstalled) in the same round trip, and sets the budget both ways,
// which on PostgreSQL sets the same lock_timeout twice (over database/sql,
// which has no pipeline, it asks first).
func claimBatch(ctx context.Context, tx pgx.Tx, scope string, keys []string, fp []byte, o *options) (map[string]bool, error) {
	q := dbsqlc.New(tx)
	started := time.Now()
	budget := func() string { return millis(max(o.wait-time.Since(started), 0)) }
	data := stateOf(tx, tx.Conn())
	citus, known := citusOf(data)
	if !known && tx.Conn() == nil {
		// No pipeline (idemsql's database/sql): each statement is a round
		// trip, and asking first costs one where setting the budget both
		// ways would cost three.
		installed, err := q.CitusInstalled(ctx)
		if err != nil {
			return nil, translate("idem: claim batch", err)
		}
		citus, known = installed, true
		setCitus(data, citus)
	}
	var got []string
	b := &pgx.Batch{}
	if !known {
		dbbatch.QueueCitusInstalled(b, &citus)
	}
	queueWaiting(ctx, b, citus || !known, scope, budget(), func() {
		dbbatch.QueueKeyClaimBatch(b, dbsqlc.KeyClaimBatchParams{
			LockTimeout: budget(), Scope: scope, Fingerprint: fp, Retention: o.retentionInterval(), Keys: keys,
		}, &got)
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, translate("idem: claim batch", err)
	}
	if !known {
		setCitus(data, citus)
	}
	claimed := make(map[string]bool, len(got))
	for _, k := range got {
		claimed[k] = true
	}
	if len(claimed) == len(keys) {
		return claimed, nil
	}
	skipped := make([]string, 0, len(keys)-len(claimed))
	for _, k := range keys {
		if !claimed[k] {
			skipped = append(skipped, k)
		}
	}
	recs, err := q.KeyGetBatch(ctx, dbsqlc.KeyGetBatchParams{Scope: scope, Keys: skipped})
	if err != nil {
		return nil, translate("idem: read batch", err)
	}
	live := make(map[string]bool, len(recs))
	for _, r := range recs {
		if r.Expired || r.State != stateDone {
			continue
		}
		if !slices.Equal(r.Fingerprint, fp) {
			return nil, releaseBatch(ctx, tx, scope, got, o, fmt.Errorf("%w (OnceEach: an id of the batch is a key that Do recorded with a fingerprint)", ErrFingerprintMismatch))
		}
		live[r.Key] = true
	}
	var stale []string
	for _, k := range skipped {
		if !live[k] {
			stale = append(stale, k)
		}
	}
	if len(stale) == 0 {
		return claimed, nil
	}
	var again []string
	b = &pgx.Batch{}
	queueWaiting(ctx, b, citus, scope, budget(), func() {
		dbbatch.QueueKeyReclaimBatch(b, dbsqlc.KeyReclaimBatchParams{
			LockTimeout: budget(), Scope: scope, Fingerprint: fp, Retention: o.retentionInterval(), Keys: stale,
		}, &again)
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, translate("idem: reclaim batch", err)
	}
	for _, k := range again {
		claimed[k] = true
	}
	return claimed, nil
}

// runBatch calls fn for each id of ids that the batch claimed, at its first
// place, and marks it in ran. When fn fails or panics, the records of the
// ids whose fn did not complete are removed.
func runBatch(ctx context.Context, tx pgx.Tx, scope string, ids []string, claimed map[string]bool,
	ran []bool, fn func(ctx context.Context, tx pgx.Tx, i int) error, o *options,
) (err error) {
	done := make(map[string]bool, len(claimed))
	finished := false
	defer func() {
		if finished {
			return
		}
		p := recover()
		pending := make([]string, 0, len(claimed)-len(done))
		for k := range claimed {
			if !done[k] {
				pending = append(pending, k)
			}
		}
		err = releaseBatch(ctx, tx, scope, pending, o, err)
		if p != nil {
			panic(p)
		}
	}()
	seen := make(map[string]bool, len(claimed))
	for i, id := range ids {
		if !claimed[id] || seen[id] {
			// Handled before, or a repeat of an id earlier in the batch.
			continue
		}
		seen[id] = true
		k := keyRef{scope: scope, key: id}
		r := enter(tx, k)
		err := func() error {
			defer r.leave(k)
			return fn(ctx, tx, i)
		}()
		if err != nil {
			return fmt.Errorf("idem: OnceEach, id %d: %w", i, err)
		}
		ran[i] = true
		done[id] = true
	}
	finished = true
	return nil
}

// releaseBatch removes the records this batch wrote for keys, then
// returns cause, joined with the removal's error if it failed: the
// transaction can then commit nothing. The removal is bounded as
// releaseOnFailure's is.
func releaseBatch(ctx context.Context, tx pgx.Tx, scope string, keys []string, o *options, cause error) error {
	if len(keys) == 0 {
		return cause
	}
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	err := dbsqlc.New(tx).KeyReleaseBatch(ctx, dbsqlc.KeyReleaseBatchParams{Scope: scope, Keys: keys})
	if err != nil && tx.Conn() != nil && !tx.Conn().IsClosed() && tx.Conn().PgConn().TxStatus() == 'T' {
		o.observer.logRelease(ctx, scope, "", err)
		return errors.Join(cause, fmt.Errorf("idem: release the batch's claims, roll back: %w", err))
	}
	return cause
}
