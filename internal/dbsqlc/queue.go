// This file is written by hand, not generated: it sends sqlc's queries in
// pipelined batches, so that a call's statements share round trips.

package dbsqlc

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
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
		return r.Scan(&row.Lock, &row.TxStart, &row.ReadCommitted, &row.ReadOnly, &row.Citus)
	})
}

// QueueKeyClaimWait queues KeyClaimWait on b; row is filled in when the
// batch's results are read.
func QueueKeyClaimWait(b *pgx.Batch, arg KeyClaimWaitParams, row *KeyClaimWaitRow) {
	b.Queue(keyClaimWait, arg.LockTimeout, arg.Scope, arg.Key, arg.Fingerprint, arg.Retention).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Claimed, &row.Restored)
	})
}

// QueueKeyClaimIfFull queues KeyClaimIfFull on b; row is filled in when
// the batch's results are read.
func QueueKeyClaimIfFull(b *pgx.Batch, arg KeyClaimIfFullParams, row *KeyClaimIfFullRow) {
	b.Queue(keyClaimIfFull, arg.LockTimeout, arg.FullSince, arg.Scope, arg.Key, arg.Fingerprint, arg.State, arg.Retention).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Attempted, &row.Claimed, &row.Restored)
	})
}

// QueueKeyGet queues KeyGet on b; row is filled in and found set when the
// batch's results are read. No record is not an error.
func QueueKeyGet(b *pgx.Batch, arg KeyGetParams, row *KeyGetRow, found *bool) {
	b.Queue(keyGet, arg.Scope, arg.Key).QueryRow(func(r pgx.Row) error {
		err := r.Scan(&row.Fingerprint, &row.State, &row.Response, &row.Expired, &row.StandbyWait)
		*found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		return err
	})
}

// captured is a DBTX that records the statement a generated method would
// run, instead of running it, so that the statement can be queued on a
// batch with its arguments in the order sqlc wrote them.
type captured struct {
	sql  string
	args []any
}

var errCaptured = errors.New("dbsqlc: statement captured for a batch, not run")

func (c *captured) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.sql, c.args = sql, args
	return pgconn.CommandTag{}, errCaptured
}

func (c *captured) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.sql, c.args = sql, args
	return nil, errCaptured
}

func (c *captured) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	c.sql, c.args = sql, args
	return errRow{errCaptured}
}

// queueCall queues on b the statement that call runs through its Queries.
func queueCall(b *pgx.Batch, call func(q *Queries)) *pgx.QueuedQuery {
	var c captured
	call(New(&c))
	return b.Queue(c.sql, c.args...)
}

// noRow turns pgx.ErrNoRows into found == false.
func noRow(err error, found *bool) error {
	*found = err == nil
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	return err
}

// QueueFlowStart queues FlowStart on b: row is filled in and started set
// when the batch's results are read. No row is not an error.
func QueueFlowStart(b *pgx.Batch, arg FlowStartParams, row *FlowStartRow, started *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowStart(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation), started)
	})
}

// QueueFlowStartHeld queues FlowStartHeld on b, as QueueFlowStart does.
func QueueFlowStartHeld(b *pgx.Batch, arg FlowStartHeldParams, row *FlowStartHeldRow, started *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowStartHeld(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.CreatedAt, &row.LeasedUntil), started)
	})
}

// QueueFlowStartLock queues FlowStartLock on b; namespace is filled in and
// locked set when the batch's results are read. No row is not an error.
func QueueFlowStartLock(b *pgx.Batch, arg FlowStartLockParams, namespace *pgtype.UUID, locked *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowStartLock(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(namespace), locked)
	})
}

// QueueFlowRestart queues FlowRestart on b, as QueueFlowStart does.
func QueueFlowRestart(b *pgx.Batch, arg FlowRestartParams, row *FlowRestartRow, restarted *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowRestart(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation), restarted)
	})
}

// QueueFlowTakeOver queues FlowTakeOver on b, as QueueFlowStart does.
func QueueFlowTakeOver(b *pgx.Batch, arg FlowTakeOverParams, row *FlowTakeOverRow, tookOver *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowTakeOver(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.Input), tookOver)
	})
}

// QueueFlowAdopt queues FlowAdopt on b, as QueueFlowStart does.
func QueueFlowAdopt(b *pgx.Batch, arg FlowAdoptParams, row *FlowAdoptRow, adopted *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowAdopt(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.Input), adopted)
	})
}

// QueueFlowGet queues FlowGet on b; row is filled in and found set when the
// batch's results are read. No flow is not an error.
func QueueFlowGet(b *pgx.Batch, arg FlowGetParams, row *FlowGetRow, found *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowGet(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.Name, &row.Fingerprint, &row.State, &row.Output, &row.LastError, &row.Leased, &row.Expired, &row.StandbyWait), found)
	})
}

// QueueFlowSteps queues FlowSteps on b; rows are appended to steps when the
// batch's results are read.
func QueueFlowSteps(b *pgx.Batch, arg FlowStepsParams, steps *[]FlowStepsRow) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowSteps(context.Background(), arg) }).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var s FlowStepsRow
			if err := rows.Scan(&s.Seq, &s.Rec); err != nil {
				return err
			}
			*steps = append(*steps, s)
		}
		return rows.Err()
	})
}

// QueueFlowLease queues FlowLease on b; leased is set when the batch's
// results are read.
func QueueFlowLease(b *pgx.Batch, arg FlowLeaseParams, leased *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowLease(context.Background(), arg) }).Exec(func(tag pgconn.CommandTag) error {
		*leased = tag.RowsAffected() == 1
		return nil
	})
}

// QueueFlowLeaseSteps queues FlowLeaseSteps on b, as QueueFlowLease
// does.
func QueueFlowLeaseSteps(b *pgx.Batch, arg FlowLeaseStepsParams, leased *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowLeaseSteps(context.Background(), arg) }).Exec(func(tag pgconn.CommandTag) error {
		*leased = tag.RowsAffected() == 1
		return nil
	})
}

// QueueFlowStepRecord queues FlowStepRecord on b.
func QueueFlowStepRecord(b *pgx.Batch, arg FlowStepRecordParams) {
	queueCall(b, func(q *Queries) { _ = q.FlowStepRecord(context.Background(), arg) })
}

// QueueFlowLock queues FlowLock on b; held is set when the batch's
// results are read.
func QueueFlowLock(b *pgx.Batch, arg FlowLockParams, held *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowLock(context.Background(), arg) }).Exec(func(tag pgconn.CommandTag) error {
		*held = tag.RowsAffected() == 1
		return nil
	})
}

// QueueFlowCallIntent queues FlowCallIntent on b: row is filled in and
// leased set when the batch's results are read. No row is not an error.
func QueueFlowCallIntent(b *pgx.Batch, arg FlowCallIntentParams, row *FlowCallIntentRow, leased *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowCallIntent(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.FirstCalledAt, &row.LeasedUntil), leased)
	})
}

// QueueFlowComplete queues FlowComplete on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowComplete(b *pgx.Batch, arg FlowCompleteParams, n *int64) {
	queueRows(b, func(q *Queries) { _, _ = q.FlowComplete(context.Background(), arg) }, n)
}

// QueueFlowRelease queues FlowRelease on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowRelease(b *pgx.Batch, arg FlowReleaseParams, n *int64) {
	queueRows(b, func(q *Queries) { _, _ = q.FlowRelease(context.Background(), arg) }, n)
}

// QueueFlowStop queues FlowStop on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowStop(b *pgx.Batch, arg FlowStopParams, n *int64) {
	queueRows(b, func(q *Queries) { _, _ = q.FlowStop(context.Background(), arg) }, n)
}

// queueRows queues the statement call runs, setting n to the rows it
// affected when the batch's results are read.
func queueRows(b *pgx.Batch, call func(q *Queries), n *int64) {
	queueCall(b, call).Exec(func(tag pgconn.CommandTag) error {
		*n = tag.RowsAffected()
		return nil
	})
}

// QueueCitusInstalled queues CitusInstalled on b; installed is set when
// the batch's results are read.
func QueueCitusInstalled(b *pgx.Batch, installed *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.CitusInstalled(context.Background()) }).QueryRow(func(r pgx.Row) error {
		return r.Scan(installed)
	})
}

// QueueKeyClaimBatch queues KeyClaimBatch on b; the keys it wrote are
// appended to keys when the batch's results are read.
func QueueKeyClaimBatch(b *pgx.Batch, arg KeyClaimBatchParams, keys *[]string) {
	queueCall(b, func(q *Queries) { _, _ = q.KeyClaimBatch(context.Background(), arg) }).Query(scanKeys(keys))
}

// QueueKeyReclaimBatch queues KeyReclaimBatch on b, as QueueKeyClaimBatch
// does.
func QueueKeyReclaimBatch(b *pgx.Batch, arg KeyReclaimBatchParams, keys *[]string) {
	queueCall(b, func(q *Queries) { _, _ = q.KeyReclaimBatch(context.Background(), arg) }).Query(scanKeys(keys))
}

func scanKeys(keys *[]string) func(pgx.Rows) error {
	return func(rows pgx.Rows) error {
		for rows.Next() {
			var k string
			if err := rows.Scan(&k); err != nil {
				return err
			}
			*keys = append(*keys, k)
		}
		return rows.Err()
	}
}
