// This file is written by hand, not generated: it sends sqlc's queries in
// pipelined batches, so that a call's statements share round trips.

package dbsqlc

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Queue returns Queries that queue their statements on b instead of
// running them. Only statements without results can be queued this way;
// those with a row have a Queue function of their own below.
func Queue(b *pgx.Batch) *Queries { return New(batchQueue{b}) }

type batchQueue struct{ batch *pgx.Batch }

func (q batchQueue) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.batch.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (q batchQueue) Query(context.Context, string, ...any) (pgx.Rows, error) {
	return nil, errQueuedResult
}

func (q batchQueue) QueryRow(context.Context, string, ...any) pgx.Row { return errRow{errQueuedResult} }

var errQueuedResult = errors.New("dbsqlc: a queued statement cannot return rows; use its Queue function")

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// QueueKeyLock queues KeyLock on b; row is filled in when the batch's
// results are read (BatchResults.Close).
func QueueKeyLock(b *pgx.Batch, arg KeyLockParams, row *KeyLockRow) {
	b.Queue(keyLock, arg.FullSince, arg.Scope, arg.Key, arg.LockID).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Lock, &row.TxStart, &row.ReadCommitted, &row.ReadOnly)
	})
}

// QueueKeyClaimWait queues KeyClaimWait on b; row is filled in when the
// batch's results are read.
func QueueKeyClaimWait(b *pgx.Batch, arg KeyClaimWaitParams, row *KeyClaimWaitRow) {
	b.Queue(keyClaimWait, arg.LockTimeout, arg.Scope, arg.Key, arg.Fingerprint, arg.Retention).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Claimed, &row.Restored)
	})
}

// QueueKeyGet queues KeyGet on b; row is filled in and found set when the
// batch's results are read. No record is not an error.
func QueueKeyGet(b *pgx.Batch, arg KeyGetParams, row *KeyGetRow, found *bool) {
	b.Queue(keyGet, arg.Scope, arg.Key).QueryRow(func(r pgx.Row) error {
		err := r.Scan(&row.Fingerprint, &row.State, &row.Response, &row.Expired)
		*found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		return err
	})
}
