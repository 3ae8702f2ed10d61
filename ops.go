package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/migration"
)

// What operators' tools need, such as the idem command's stats, inspect and
// migrate: they use this package's API only, so that a tool built against
// one version of idem works with the tables of the next.

// MigrationLockID is the id of the session-level advisory lock that
// [Migrate] holds while it applies migrations, so that replicas starting
// at once apply each migration once. A program that runs goose over
// [Migrations] itself, with [MigrationTable], gives goose this lock, so
// that its runs and Migrate's wait for one another rather than apply the
// same migration twice:
//
//	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(idem.MigrationLockID))
//	...
//	provider, err := goose.NewProvider(goose.DialectPostgres, db, idem.Migrations(),
//		goose.WithTableName(idem.MigrationTable), goose.WithSessionLocker(locker))
//
// It is not goose's default lock id, so idem's migrations never wait for an
// application's own goose run. The value spells "idem" in ASCII.
const MigrationLockID int64 = migration.LockID

// Stats summarizes idem's tables and the operations running now, for
// operators: see [ReadStats]. Times are zero when there is nothing to
// date.
type Stats struct {
	// Running counts the operations running now: the advisory locks with
	// idem's tag held in this database, which at READ COMMITTED are all
	// there is to see of an operation until it commits. It is an estimate:
	// an application's own advisory lock with an id in idem's range counts
	// too (see the package documentation, Operations), and the keys a
	// transaction claims past [MaxKeyLocks], which take no lock, do not.
	Running int64
	// OldestRunning is when the transaction of the oldest of them began.
	OldestRunning time.Time
	// Waiting counts the duplicates waiting for those locks.
	Waiting int64

	// Done counts the live records of completed operations.
	Done int64
	// InProgress counts the live records committed in progress, which
	// idem itself never commits (a hand-written statement, an older
	// version wrote them): the next call on such a key takes it over. A
	// record written in progress by a transaction still open is not
	// visible to other sessions, and not counted.
	InProgress int64
	// Expired counts the records past their retention: they count as
	// absent already, and wait for [Purge].
	Expired int64
	// Scopes counts the scopes that hold records.
	Scopes int64
	// OldestLive is when the oldest live record was created.
	OldestLive time.Time
	// TableBytes and IndexBytes are the size on disk of the records'
	// table and of its indexes.
	TableBytes, IndexBytes int64

	// OutboxPending counts the outbox's messages not yet delivered, and
	// OldestPending is when the oldest of them was enqueued.
	OutboxPending int64
	OldestPending time.Time
	// OutboxParked counts the messages a relay gave up on, which wait for
	// a decision (see the outbox package's Requeue).
	OutboxParked int64
	// OutboxDelivered counts the delivered messages not purged yet.
	OutboxDelivered int64

	// FlowsRunning counts the flows that an executor holds now (see
	// [Flow]), and OldestFlowRunning is when the oldest flow in progress
	// started.
	FlowsRunning      int64
	OldestFlowRunning time.Time
	// FlowsAbandoned counts the flows in progress that no executor holds:
	// their last run failed or its executor vanished. A retry, or
	// [Flow.Resume], continues them.
	FlowsAbandoned int64
	// FlowsAttention counts the flows stopped for a person's decision
	// (see [ErrFlowStopped]); [InspectFlow] shows why, [EndFlow] ends one.
	FlowsAttention int64
	// FlowsFinished counts the finished flows (done, or ended) whose
	// retention has not passed, and FlowsExpired those waiting for [Purge].
	FlowsFinished, FlowsExpired int64
}

// ReadStats reads [Stats] in a read-only transaction on db, a pool or an
// idle connection (a connection in a transaction gives
// [ErrConnInTransaction]). It reads every record, every outbox message and
// every flow: run it from a console or a periodic job, not from a request's
// path.
func ReadStats(ctx context.Context, db TxBeginner) (Stats, error) {
	var s Stats
	err := WithTx(ctx, db, readOnly, func(ctx context.Context, tx pgx.Tx) error {
		q := dbsqlc.New(tx)
		citus, err := q.CitusInstalled(ctx)
		if err != nil {
			return fmt.Errorf("idem: stats: %w", err)
		}
		f, err := keyInFlight(ctx, tx, 0, citus)
		if err != nil {
			return fmt.Errorf("idem: stats: operations running: %w", err)
		}
		k, err := q.KeyStats(ctx)
		if err != nil {
			return fmt.Errorf("idem: stats: records: %w", err)
		}
		if citus {
			if k.TableBytes, k.IndexBytes, err = citusSizes(ctx, tx, k.TableBytes, k.IndexBytes); err != nil {
				return fmt.Errorf("idem: stats: records' size: %w", err)
			}
		}
		o, err := q.OutboxStats(ctx)
		if err != nil {
			return fmt.Errorf("idem: stats: outbox: %w", err)
		}
		fl, err := q.FlowStats(ctx)
		if err != nil {
			return fmt.Errorf("idem: stats: flows: %w", err)
		}
		s = Stats{
			Running: f.Running, OldestRunning: timeOf(f.OldestStart), Waiting: f.Waiting,
			Done: k.Done, InProgress: k.InProgress, Expired: k.Expired, Scopes: k.Scopes,
			OldestLive: timeOf(k.OldestLive), TableBytes: k.TableBytes, IndexBytes: k.IndexBytes,
			OutboxPending: o.Pending, OldestPending: timeOf(o.OldestPending),
			OutboxParked: o.Parked, OutboxDelivered: o.Delivered,
			FlowsRunning: fl.Running, OldestFlowRunning: timeOf(fl.OldestRunning), FlowsAbandoned: fl.Abandoned,
			FlowsAttention: fl.Attention, FlowsFinished: fl.Finished, FlowsExpired: fl.Expired,
		}
		return nil
	})
	return s, err
}

// citusSizes returns, on a Citus coordinator, the size of the records'
// shards when idempotency_key is distributed (see docs/citus.sql), where
// the table's own size is that of an empty shell; otherwise table and
// index, as they are.
func citusSizes(ctx context.Context, tx pgx.Tx, table, index int64) (int64, int64, error) {
	// Citus refuses the size of a table it does not distribute: the
	// savepoint keeps the transaction usable then.
	sp, err := tx.Begin(ctx)
	if err != nil {
		return table, index, err
	}
	s, err := dbsqlc.New(sp).KeySizesCitus(ctx)
	if err != nil {
		return table, index, sp.Rollback(ctx)
	}
	return s.TableBytes, s.IndexBytes, sp.Commit(ctx)
}

// keyInFlight counts the key locks held and waited for (KeyInFlight), for
// every key, or with lockID not zero, for that key's. On a Citus
// coordinator (citus) it adds the workers' (KeyInFlightCitus): there a
// call takes its key's lock on the node of its scope's shard, never on the
// coordinator, whose own count is then zero.
func keyInFlight(ctx context.Context, tx pgx.Tx, lockID int64, citus bool) (dbsqlc.KeyInFlightRow, error) {
	q := dbsqlc.New(tx)
	f, err := q.KeyInFlight(ctx, dbsqlc.KeyInFlightParams{LockTag: keylock.Tag, LockID: lockID})
	if err != nil || !citus {
		return f, err
	}
	w, err := q.KeyInFlightCitus(ctx, dbsqlc.KeyInFlightCitusParams{LockTag: keylock.Tag, LockID: lockID})
	switch {
	case err != nil:
		return f, fmt.Errorf("the workers' locks: %w", err)
	case w.Unanswered > 0:
		return f, fmt.Errorf("the workers' locks: %d of the Citus workers did not answer", w.Unanswered)
	}
	f.Running += w.Running
	f.Waiting += w.Waiting
	if w.OldestStart.Valid && (!f.OldestStart.Valid || w.OldestStart.Time.Before(f.OldestStart.Time)) {
		f.OldestStart = w.OldestStart
	}
	return f, nil
}

// KeyInfo is what idem holds for one key: its record, and whether an
// operation holds its lock now. See [Inspect].
type KeyInfo struct {
	// Found reports whether the key has a record, live or expired. When it
	// has none, the record's fields below are zero.
	Found bool
	// State is the record's state: "done", or "in_progress" (see
	// [Stats.InProgress]).
	State string
	// Expired reports whether the record is past its retention: the key
	// counts as absent, and its next call runs the function again.
	Expired bool
	// Fingerprint is the fingerprint of the request that recorded the key.
	Fingerprint []byte
	// Response is the stored value as stored: the JSON encoding of the
	// function's value, sealed when the call had a [Codec]. Nil when
	// nothing is stored ([Once]). It may hold personal data.
	Response []byte
	// CreatedAt and ExpiresAt are when the record was written and when
	// its retention ends.
	CreatedAt, ExpiresAt time.Time

	// Running reports whether an operation holds the key's lock now: at
	// READ COMMITTED, a running operation has no record until it commits.
	// It is an estimate: another key whose 48-bit lock hash is the same
	// shares the lock, and so would an application's own advisory lock
	// with that id.
	Running bool
	// RunningSince is when the transaction holding the lock began.
	RunningSince time.Time
	// Waiting counts the duplicates waiting for the lock.
	Waiting int64
}

// Inspect reads what idem holds for (scope, key), whatever the record's
// state or expiry, in a read-only transaction on db, a pool or an idle
// connection. A key without a record is not an error: KeyInfo.Found is
// false. Scopes and keys are checked as [Do] checks them
// ([ErrInvalidScope], [ErrInvalidKey]) before anything is sent.
func Inspect(ctx context.Context, db TxBeginner, scope, key string) (KeyInfo, error) {
	k, err := newKeyRef(scope, key, nil)
	if err != nil {
		return KeyInfo{}, err
	}
	var info KeyInfo
	err = WithTx(ctx, db, readOnly, func(ctx context.Context, tx pgx.Tx) error {
		q := dbsqlc.New(tx)
		citus, err := q.CitusInstalled(ctx)
		if err != nil {
			return fmt.Errorf("idem: inspect: %w", err)
		}
		f, err := keyInFlight(ctx, tx, k.lockID, citus)
		if err != nil {
			return fmt.Errorf("idem: inspect: lock: %w", err)
		}
		info = KeyInfo{Running: f.Running > 0, RunningSince: timeOf(f.OldestStart), Waiting: f.Waiting}
		r, err := q.KeyInspect(ctx, dbsqlc.KeyInspectParams{Scope: k.scope, Key: k.key})
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("idem: inspect: record: %w", err)
		}
		info.Found, info.State, info.Expired = true, r.State, r.Expired
		info.Fingerprint, info.Response = r.Fingerprint, r.Response
		info.CreatedAt, info.ExpiresAt = timeOf(r.CreatedAt), timeOf(r.ExpiresAt)
		return nil
	})
	return info, err
}

// readOnly is the transaction ReadStats and Inspect read in: one snapshot
// for all their statements, and no write.
var readOnly = pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}

// timeOf is t's time, or the zero time when t is NULL.
func timeOf(t pgtype.Timestamptz) time.Time {
	if !t.Valid {
		return time.Time{}
	}
	return t.Time
}
