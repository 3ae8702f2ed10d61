// Package dbbatch queues idem's sqlc statements on a pgx.Batch, each with
// the arguments sqlc's method passes and its result read by a callback,
// so that a call's statements share round trips through pgx.
package dbbatch

import (
	"context"
	"errors"

	"github.com/pgidem/idem/internal/dbsqlc"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// Queue returns Queries that queue their statements on b instead of
// running them. Only statements without results can be queued this way;
// those with a row have a Queue function of their own below.
func Queue(b *pgx.Batch) *dbsqlc.Queries { return dbsqlc.New(batchQueue{b}) }

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

// QueueTxCommit queues TxCommit on b, and returns it, to read its
// command tag.
func QueueTxCommit(b *pgx.Batch) *pgx.QueuedQuery {
	return queueCall(b, nil, func(q *dbsqlc.Queries) { _ = q.TxCommit(context.Background()) })
}

// QueueTxIdleTimeout queues TxIdleTimeout on b, with timeout; rw (nil
// for none) rewrites its SQL as it is sent.
func QueueTxIdleTimeout(b *pgx.Batch, rw pgx.QueryRewriter, timeout string) {
	queueCall(b, rw, func(q *dbsqlc.Queries) { _ = q.TxIdleTimeout(context.Background(), timeout) })
}

// withRewriter returns args, after rw, unless rw is nil: pgx takes a
// QueryRewriter as a queued statement's first argument.
func withRewriter(rw pgx.QueryRewriter, args ...any) []any {
	if rw == nil {
		return args
	}
	return append([]any{rw}, args...)
}

// QueueKeyLock queues KeyLock on b; row is filled in when the batch's
// results are read (BatchResults.Close).
func QueueKeyLock(b *pgx.Batch, arg dbsqlc.KeyLockParams, row *dbsqlc.KeyLockRow) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.KeyLock(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Lock, &row.TxStart, &row.ReadCommitted, &row.ReadOnly, &row.Citus)
	})
}

// QueueKeyLockCitus queues KeyLockCitus on b; row, KeyLock's, is filled
// in when the batch's results are read.
func QueueKeyLockCitus(b *pgx.Batch, arg dbsqlc.KeyLockCitusParams, row *dbsqlc.KeyLockRow) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.KeyLockCitus(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Lock, &row.TxStart, &row.ReadCommitted, &row.ReadOnly, &row.Citus)
	})
}

// QueueKeyClaimWait queues KeyClaimWait on b; row is filled in when the
// batch's results are read.
func QueueKeyClaimWait(b *pgx.Batch, arg dbsqlc.KeyClaimWaitParams, row *dbsqlc.KeyClaimWaitRow) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.KeyClaimWait(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Claimed, &row.Restored)
	})
}

// QueueKeyClaimIfFull queues KeyClaimIfFull on b; row is filled in when
// the batch's results are read.
func QueueKeyClaimIfFull(b *pgx.Batch, arg dbsqlc.KeyClaimIfFullParams, row *dbsqlc.KeyClaimIfFullRow) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.KeyClaimIfFull(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return r.Scan(&row.Attempted, &row.Claimed, &row.Restored)
	})
}

// QueueKeyGet queues KeyGet on b; row is filled in and found set when the
// batch's results are read. No record is not an error.
func QueueKeyGet(b *pgx.Batch, arg dbsqlc.KeyGetParams, row *dbsqlc.KeyGetRow, found *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.KeyGet(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		err := r.Scan(&row.Fingerprint, &row.State, &row.Response, &row.Expired, &row.StandbyWait)
		*found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		return err
	})
}

// captured is a dbsqlc.DBTX that records the statement a generated method would
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

// The flows' statements read their results in a callback set as their
// QueuedQuery's Fn, which does what QueuedQuery's QueryRow, Query and Exec
// do, in one closure instead of two.
//
// queueCall queues on b the statement that call runs through its
// dbsqlc.Queries, with the arguments sqlc's method passes, after rw, when not
// nil (see withRewriter).
func queueCall(b *pgx.Batch, rw pgx.QueryRewriter, call func(q *dbsqlc.Queries)) *pgx.QueuedQuery {
	var c captured
	call(dbsqlc.New(&c))
	return b.Queue(c.sql, withRewriter(rw, c.args...)...)
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
func QueueFlowStart(b *pgx.Batch, arg dbsqlc.FlowStartParams, row *dbsqlc.FlowStartRow, started *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowStart(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation), started)
	}
}

// QueueFlowStartHeld queues FlowStartHeld on b, as QueueFlowStart does.
func QueueFlowStartHeld(b *pgx.Batch, arg dbsqlc.FlowStartHeldParams, row *dbsqlc.FlowStartHeldRow, started *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowStartHeld(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.CreatedAt, &row.LeasedUntil), started)
	}
}

// ErrNotHeld is the error of FlowLock and FlowStartLock, read through
// their Queue functions, when the flow was not the executor's, or not free
// to start: the statements after them in the round trip did not run.
var ErrNotHeld = errors.New("dbsqlc: the flow is not held")

// notHeld turns the division by zero that FlowLock, FlowStartLock and
// FlowStartFree fail with into ErrNotHeld.
func notHeld(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "22012" {
		return ErrNotHeld
	}
	return err
}

// QueueFlowStartLock queues FlowStartLock on b; namespace is filled in
// when the batch's results are read, whose error is ErrNotHeld when it did
// not get the lock. rw (nil for none) rewrites its SQL as it is sent.
func QueueFlowStartLock(b *pgx.Batch, rw pgx.QueryRewriter, arg dbsqlc.FlowStartLockParams, namespace *pgtype.UUID) {
	queueCall(b, rw, func(q *dbsqlc.Queries) { _, _ = q.FlowStartLock(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		return notHeld(br.QueryRow().Scan(namespace))
	}
}

// QueueFlowStartFree queues FlowStartFree on b, whose batch's error is
// ErrNotHeld when the key has a flow. rw (nil for none) rewrites its SQL
// as it is sent.
func QueueFlowStartFree(b *pgx.Batch, rw pgx.QueryRewriter, arg dbsqlc.FlowStartFreeParams) {
	queueCall(b, rw, func(q *dbsqlc.Queries) { _ = q.FlowStartFree(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		_, err := br.Exec()
		return notHeld(err)
	}
}

// QueueFlowLock queues FlowLock on b, whose batch's error is ErrNotHeld
// when the executor no longer holds the flow.
func QueueFlowLock(b *pgx.Batch, arg dbsqlc.FlowLockParams) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _ = q.FlowLock(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		_, err := br.Exec()
		return notHeld(err)
	}
}

// QueueFlowRestart queues FlowRestart on b, as QueueFlowStart does.
func QueueFlowRestart(b *pgx.Batch, arg dbsqlc.FlowRestartParams, row *dbsqlc.FlowRestartRow, restarted *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowRestart(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation), restarted)
	}
}

// QueueFlowTakeOver queues FlowTakeOver on b, as QueueFlowStart does.
func QueueFlowTakeOver(b *pgx.Batch, arg dbsqlc.FlowTakeOverParams, row *dbsqlc.FlowTakeOverRow, tookOver *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowTakeOver(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.Input), tookOver)
	}
}

// QueueFlowAdopt queues FlowAdopt on b, as QueueFlowStart does.
func QueueFlowAdopt(b *pgx.Batch, arg dbsqlc.FlowAdoptParams, row *dbsqlc.FlowAdoptRow, adopted *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowAdopt(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.Input), adopted)
	})
}

// QueueFlowGet queues FlowGet on b; row is filled in and found set when the
// batch's results are read. No flow is not an error. rw (nil for none)
// rewrites its SQL as it is sent.
func QueueFlowGet(b *pgx.Batch, rw pgx.QueryRewriter, arg dbsqlc.FlowGetParams, row *dbsqlc.FlowGetRow, found *bool) {
	queueCall(b, rw, func(q *dbsqlc.Queries) { _, _ = q.FlowGet(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.Name, &row.Fingerprint, &row.State, &row.Output, &row.LastError, &row.Leased, &row.Expired, &row.StandbyWait), found)
	}
}

// QueueFlowSteps queues FlowSteps on b; rows are appended to steps when the
// batch's results are read.
func QueueFlowSteps(b *pgx.Batch, arg dbsqlc.FlowStepsParams, steps *[]dbsqlc.FlowStepsRow) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowSteps(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		// As QueuedQuery.Query reads its rows, in one closure instead of two.
		rows, _ := br.Query()
		defer rows.Close()
		for rows.Next() {
			var s dbsqlc.FlowStepsRow
			if err := rows.Scan(&s.Seq, &s.Rec, &s.InRow, &s.Base); err != nil {
				return err
			}
			*steps = append(*steps, s)
		}
		rows.Close()
		return rows.Err()
	}
}

// QueueFlowLease queues FlowLease on b; leased is set when the batch's
// results are read.
func QueueFlowLease(b *pgx.Batch, arg dbsqlc.FlowLeaseParams, leased *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowLease(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		*leased = err == nil && tag.RowsAffected() == 1
		return err
	}
}

// QueueFlowLeaseSteps queues FlowLeaseSteps on b, as QueueFlowLease
// does.
func QueueFlowLeaseSteps(b *pgx.Batch, arg dbsqlc.FlowLeaseStepsParams, leased *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowLeaseSteps(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		*leased = err == nil && tag.RowsAffected() == 1
		return err
	}
}

// QueueFlowStepRecord queues FlowStepRecord on b.
func QueueFlowStepRecord(b *pgx.Batch, arg dbsqlc.FlowStepRecordParams) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _ = q.FlowStepRecord(context.Background(), arg) })
}

// QueueFlowCallIntent queues FlowCallIntent on b: row is filled in and
// leased set when the batch's results are read. No row is not an error.
func QueueFlowCallIntent(b *pgx.Batch, arg dbsqlc.FlowCallIntentParams, row *dbsqlc.FlowCallIntentRow, leased *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowCallIntent(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.Rec, &row.CreatedAt, &row.LeasedUntil), leased)
	}
}

// QueueFlowComplete queues FlowComplete on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowComplete(b *pgx.Batch, arg dbsqlc.FlowCompleteParams, n *int64) {
	queueRows(queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowComplete(context.Background(), arg) }), n)
}

// QueueFlowRelease queues FlowRelease on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowRelease(b *pgx.Batch, arg dbsqlc.FlowReleaseParams, n *int64) {
	queueRows(queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowRelease(context.Background(), arg) }), n)
}

// QueueFlowRecordSteps queues FlowRecordSteps on b, setting n to the rows
// it affected when the batch's results are read.
func QueueFlowRecordSteps(b *pgx.Batch, arg dbsqlc.FlowRecordStepsParams, n *int64) {
	queueRows(queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowRecordSteps(context.Background(), arg) }), n)
}

// QueueFlowStop queues FlowStop on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowStop(b *pgx.Batch, arg dbsqlc.FlowStopParams, n *int64) {
	queueRows(queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowStop(context.Background(), arg) }), n)
}

// QueueFlowCompleteBare queues FlowCompleteBare on b, as
// QueueFlowComplete does.
func QueueFlowCompleteBare(b *pgx.Batch, arg dbsqlc.FlowCompleteBareParams, n *int64) {
	queueRows(queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowCompleteBare(context.Background(), arg) }), n)
}

// QueueFlowReleaseBare queues FlowReleaseBare on b, as QueueFlowRelease
// does.
func QueueFlowReleaseBare(b *pgx.Batch, arg dbsqlc.FlowReleaseBareParams, n *int64) {
	queueRows(queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowReleaseBare(context.Background(), arg) }), n)
}

// QueueFlowStopBare queues FlowStopBare on b, as QueueFlowStop does.
func QueueFlowStopBare(b *pgx.Batch, arg dbsqlc.FlowStopBareParams, n *int64) {
	queueRows(queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowStopBare(context.Background(), arg) }), n)
}

// QueueFlowLeaseUntil queues FlowLeaseUntil on b: until is filled in and
// leased set when the batch's results are read. No row is not an error.
func QueueFlowLeaseUntil(b *pgx.Batch, arg dbsqlc.FlowLeaseUntilParams, until *pgtype.Timestamptz, leased *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowLeaseUntil(context.Background(), arg) }).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(until), leased)
	}
}

// QueueFlowStepRows queues FlowStepRows on b; rows are appended to
// written when the batch's results are read.
func QueueFlowStepRows(b *pgx.Batch, arg dbsqlc.FlowStepRowsParams, written *[]dbsqlc.FlowStepRowsRow) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowStepRows(context.Background(), arg) }).Fn = scanStepRows(written)
}

// QueueFlowStepRowsUpdate queues FlowStepRowsUpdate on b, as
// QueueFlowStepRows does.
func QueueFlowStepRowsUpdate(b *pgx.Batch, arg dbsqlc.FlowStepRowsUpdateParams, written *[]dbsqlc.FlowStepRowsRow) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.FlowStepRowsUpdate(context.Background(), arg) }).Fn = scanStepRows(written)
}

// scanStepRows appends FlowStepRows's rows, or FlowStepRowsUpdate's, to
// written.
func scanStepRows(written *[]dbsqlc.FlowStepRowsRow) func(br pgx.BatchResults) error {
	return func(br pgx.BatchResults) error {
		rows, _ := br.Query()
		defer rows.Close()
		for rows.Next() {
			var w dbsqlc.FlowStepRowsRow
			if err := rows.Scan(&w.Seq, &w.FirstCalledAt); err != nil {
				return err
			}
			*written = append(*written, w)
		}
		rows.Close()
		return rows.Err()
	}
}

// queueRows sets n to the rows qq affected when the batch's results are
// read.
func queueRows(qq *pgx.QueuedQuery, n *int64) {
	qq.Fn = func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		if err != nil {
			return err
		}
		*n = tag.RowsAffected()
		return nil
	}
}

// QueueCitusInstalled queues CitusInstalled on b; installed is set when
// the batch's results are read.
func QueueCitusInstalled(b *pgx.Batch, installed *bool) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.CitusInstalled(context.Background()) }).QueryRow(func(r pgx.Row) error {
		return r.Scan(installed)
	})
}

// QueueKeyClaimBatch queues KeyClaimBatch on b; the keys it wrote are
// appended to keys when the batch's results are read.
func QueueKeyClaimBatch(b *pgx.Batch, arg dbsqlc.KeyClaimBatchParams, keys *[]string) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.KeyClaimBatch(context.Background(), arg) }).Query(scanKeys(keys))
}

// QueueKeyReclaimBatch queues KeyReclaimBatch on b, as QueueKeyClaimBatch
// does.
func QueueKeyReclaimBatch(b *pgx.Batch, arg dbsqlc.KeyReclaimBatchParams, keys *[]string) {
	queueCall(b, nil, func(q *dbsqlc.Queries) { _, _ = q.KeyReclaimBatch(context.Background(), arg) }).Query(scanKeys(keys))
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
