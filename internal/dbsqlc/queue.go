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

// QueueTxCommit queues TxCommit on b, and returns it, to read its
// command tag.
func QueueTxCommit(b *pgx.Batch) *pgx.QueuedQuery { return b.Queue(txCommit) }

// QueueTxIdleTimeout queues TxIdleTimeout on b, with timeout; rw (nil
// for none) rewrites its SQL as it is sent.
func QueueTxIdleTimeout(b *pgx.Batch, rw pgx.QueryRewriter, timeout string) {
	b.Queue(txIdleTimeout, withRewriter(rw, timeout)...)
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

// The flows' statements read their results in a callback set as their
// QueuedQuery's Fn, which does what QueuedQuery's QueryRow, Query and Exec
// do, in one closure instead of two.
//
// The flows' statements are queued with their arguments as pointers into
// the parameters, arg, which are moved to the heap once: each argument
// passed by value, as sqlc's methods pass them, would be boxed in an
// interface of its own, an allocation each. The arguments are in the
// order of sqlc's method for the statement, which
// TestQueuedArgumentsMatchTheGeneratedMethods checks.

// withArgs is a statement's parameters, moved to the heap, with its
// arguments, pointers into them: one allocation for both.
type withArgs[P any] struct {
	arg  P
	args [12]any
}

// set returns args, kept in q.
func (q *withArgs[P]) set(args ...any) []any {
	return q.args[:copy(q.args[:], args)]
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
	q := &withArgs[FlowStartParams]{arg: arg}
	b.Queue(flowStart, q.set(&q.arg.Scope, &q.arg.Key, &q.arg.FlowName, &q.arg.Fingerprint, &q.arg.Input, &q.arg.Epoch, &q.arg.Lease, &q.arg.Step, &q.arg.Retention, &q.arg.LockID)...).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation), started)
	}
}

// QueueFlowStartHeld queues FlowStartHeld on b, as QueueFlowStart does.
func QueueFlowStartHeld(b *pgx.Batch, arg FlowStartHeldParams, row *FlowStartHeldRow, started *bool) {
	q := &withArgs[FlowStartHeldParams]{arg: arg}
	b.Queue(flowStartHeld, q.set(&q.arg.Scope, &q.arg.Key, &q.arg.FlowName, &q.arg.Fingerprint, &q.arg.Input, &q.arg.ProviderNamespace, &q.arg.Epoch, &q.arg.Lease, &q.arg.Step, &q.arg.Retention, &q.arg.Steps)...).Fn = func(br pgx.BatchResults) error {
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
func QueueFlowStartLock(b *pgx.Batch, rw pgx.QueryRewriter, lockID int64, namespace *pgtype.UUID) {
	b.Queue(flowStartLock, withRewriter(rw, lockID)...).Fn = func(br pgx.BatchResults) error {
		return notHeld(br.QueryRow().Scan(namespace))
	}
}

// QueueFlowStartFree queues FlowStartFree on b, whose batch's error is
// ErrNotHeld when the key has a flow. rw (nil for none) rewrites its SQL
// as it is sent.
func QueueFlowStartFree(b *pgx.Batch, rw pgx.QueryRewriter, arg FlowStartFreeParams) {
	b.Queue(flowStartFree, withRewriter(rw, arg.Scope, arg.Key)...).Fn = func(br pgx.BatchResults) error {
		_, err := br.Exec()
		return notHeld(err)
	}
}

// QueueFlowLock queues FlowLock on b, whose batch's error is ErrNotHeld
// when the executor no longer holds the flow.
func QueueFlowLock(b *pgx.Batch, arg FlowLockParams) {
	q := &withArgs[FlowLockParams]{arg: arg}
	b.Queue(flowLock, q.set(&q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...).Fn = func(br pgx.BatchResults) error {
		_, err := br.Exec()
		return notHeld(err)
	}
}

// QueueFlowRestart queues FlowRestart on b, as QueueFlowStart does.
func QueueFlowRestart(b *pgx.Batch, arg FlowRestartParams, row *FlowRestartRow, restarted *bool) {
	q := &withArgs[FlowRestartParams]{arg: arg}
	b.Queue(flowRestart, q.set(&q.arg.Scope, &q.arg.Key, &q.arg.FlowName, &q.arg.Fingerprint, &q.arg.Input, &q.arg.Epoch, &q.arg.Lease, &q.arg.Retention)...).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation), restarted)
	}
}

// QueueFlowTakeOver queues FlowTakeOver on b, as QueueFlowStart does.
func QueueFlowTakeOver(b *pgx.Batch, arg FlowTakeOverParams, row *FlowTakeOverRow, tookOver *bool) {
	q := &withArgs[FlowTakeOverParams]{arg: arg}
	b.Queue(flowTakeOver, q.set(&q.arg.Epoch, &q.arg.Lease, &q.arg.Scope, &q.arg.Key, &q.arg.FlowName, &q.arg.Fingerprint)...).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.Input), tookOver)
	}
}

// QueueFlowAdopt queues FlowAdopt on b, as QueueFlowStart does.
func QueueFlowAdopt(b *pgx.Batch, arg FlowAdoptParams, row *FlowAdoptRow, adopted *bool) {
	queueCall(b, func(q *Queries) { _, _ = q.FlowAdopt(context.Background(), arg) }).QueryRow(func(r pgx.Row) error {
		return noRow(r.Scan(&row.ProviderNamespace, &row.Operation, &row.Input), adopted)
	})
}

// QueueFlowGet queues FlowGet on b; row is filled in and found set when the
// batch's results are read. No flow is not an error. rw (nil for none)
// rewrites its SQL as it is sent.
func QueueFlowGet(b *pgx.Batch, rw pgx.QueryRewriter, arg FlowGetParams, row *FlowGetRow, found *bool) {
	b.Queue(flowGet, withRewriter(rw, arg.Mark, arg.Scope, arg.Key)...).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.Name, &row.Fingerprint, &row.State, &row.Output, &row.LastError, &row.Leased, &row.Expired, &row.StandbyWait), found)
	}
}

// QueueFlowSteps queues FlowSteps on b; rows are appended to steps when the
// batch's results are read.
func QueueFlowSteps(b *pgx.Batch, arg FlowStepsParams, steps *[]FlowStepsRow) {
	q := &withArgs[FlowStepsParams]{arg: arg}
	b.Queue(flowSteps, q.set(&q.arg.Scope, &q.arg.Key)...).Fn = func(br pgx.BatchResults) error {
		// As QueuedQuery.Query reads its rows, in one closure instead of two.
		rows, _ := br.Query()
		defer rows.Close()
		for rows.Next() {
			var s FlowStepsRow
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
func QueueFlowLease(b *pgx.Batch, arg FlowLeaseParams, leased *bool) {
	q := &withArgs[FlowLeaseParams]{arg: arg}
	b.Queue(flowLease, q.set(&q.arg.Lease, &q.arg.Step, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...).Fn = func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		*leased = err == nil && tag.RowsAffected() == 1
		return err
	}
}

// QueueFlowLeaseSteps queues FlowLeaseSteps on b, as QueueFlowLease
// does.
func QueueFlowLeaseSteps(b *pgx.Batch, arg FlowLeaseStepsParams, leased *bool) {
	q := &withArgs[FlowLeaseStepsParams]{arg: arg}
	b.Queue(flowLeaseSteps, q.set(&q.arg.Lease, &q.arg.Step, &q.arg.Steps, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...).Fn = func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		*leased = err == nil && tag.RowsAffected() == 1
		return err
	}
}

// QueueFlowStepRecord queues FlowStepRecord on b.
func QueueFlowStepRecord(b *pgx.Batch, arg FlowStepRecordParams) {
	q := &withArgs[FlowStepRecordParams]{arg: arg}
	b.Queue(flowStepRecord, q.set(&q.arg.Scope, &q.arg.Key, &q.arg.Seq, &q.arg.Step, &q.arg.Result)...)
}

// QueueFlowCallIntent queues FlowCallIntent on b: row is filled in and
// leased set when the batch's results are read. No row is not an error.
func QueueFlowCallIntent(b *pgx.Batch, arg FlowCallIntentParams, row *FlowCallIntentRow, leased *bool) {
	q := &withArgs[FlowCallIntentParams]{arg: arg}
	b.Queue(flowCallIntent, q.set(&q.arg.Lease, &q.arg.Step, &q.arg.Steps, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch, &q.arg.Seq)...).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(&row.Rec, &row.CreatedAt, &row.LeasedUntil), leased)
	}
}

// QueueFlowComplete queues FlowComplete on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowComplete(b *pgx.Batch, arg FlowCompleteParams, n *int64) {
	q := &withArgs[FlowCompleteParams]{arg: arg}
	queueRows(b.Queue(flowComplete, q.set(&q.arg.Output, &q.arg.Steps, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...), n)
}

// QueueFlowRelease queues FlowRelease on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowRelease(b *pgx.Batch, arg FlowReleaseParams, n *int64) {
	q := &withArgs[FlowReleaseParams]{arg: arg}
	queueRows(b.Queue(flowRelease, q.set(&q.arg.LastError, &q.arg.Step, &q.arg.Steps, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...), n)
}

// QueueFlowStop queues FlowStop on b, setting n to the rows it
// affected when the batch's results are read.
func QueueFlowStop(b *pgx.Batch, arg FlowStopParams, n *int64) {
	q := &withArgs[FlowStopParams]{arg: arg}
	queueRows(b.Queue(flowStop, q.set(&q.arg.LastError, &q.arg.Step, &q.arg.Steps, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...), n)
}

// QueueFlowCompleteBare queues FlowCompleteBare on b, as
// QueueFlowComplete does.
func QueueFlowCompleteBare(b *pgx.Batch, arg FlowCompleteBareParams, n *int64) {
	q := &withArgs[FlowCompleteBareParams]{arg: arg}
	queueRows(b.Queue(flowCompleteBare, q.set(&q.arg.Output, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...), n)
}

// QueueFlowReleaseBare queues FlowReleaseBare on b, as QueueFlowRelease
// does.
func QueueFlowReleaseBare(b *pgx.Batch, arg FlowReleaseBareParams, n *int64) {
	q := &withArgs[FlowReleaseBareParams]{arg: arg}
	queueRows(b.Queue(flowReleaseBare, q.set(&q.arg.LastError, &q.arg.Step, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...), n)
}

// QueueFlowStopBare queues FlowStopBare on b, as QueueFlowStop does.
func QueueFlowStopBare(b *pgx.Batch, arg FlowStopBareParams, n *int64) {
	q := &withArgs[FlowStopBareParams]{arg: arg}
	queueRows(b.Queue(flowStopBare, q.set(&q.arg.LastError, &q.arg.Step, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...), n)
}

// QueueFlowLeaseUntil queues FlowLeaseUntil on b: until is filled in and
// leased set when the batch's results are read. No row is not an error.
func QueueFlowLeaseUntil(b *pgx.Batch, arg FlowLeaseUntilParams, until *pgtype.Timestamptz, leased *bool) {
	q := &withArgs[FlowLeaseUntilParams]{arg: arg}
	b.Queue(flowLeaseUntil, q.set(&q.arg.Lease, &q.arg.Step, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...).Fn = func(br pgx.BatchResults) error {
		r := br.QueryRow()
		return noRow(r.Scan(until), leased)
	}
}

// QueueFlowStepRows queues FlowStepRows on b; rows are appended to
// written when the batch's results are read.
func QueueFlowStepRows(b *pgx.Batch, arg FlowStepRowsParams, written *[]FlowStepRowsRow) {
	q := &withArgs[FlowStepRowsParams]{arg: arg}
	b.Queue(flowStepRows, q.set(&q.arg.Steps, &q.arg.Scope, &q.arg.Key, &q.arg.Epoch)...).Fn = scanStepRows(written)
}

// QueueFlowStepRowsUpdate queues FlowStepRowsUpdate on b, as
// QueueFlowStepRows does.
func QueueFlowStepRowsUpdate(b *pgx.Batch, arg FlowStepRowsUpdateParams, written *[]FlowStepRowsRow) {
	q := &withArgs[FlowStepRowsUpdateParams]{arg: arg}
	b.Queue(flowStepRowsUpdate, q.set(&q.arg.Scope, &q.arg.Key, &q.arg.Epoch, &q.arg.Steps)...).Fn = scanStepRows(written)
}

// scanStepRows appends FlowStepRows's rows, or FlowStepRowsUpdate's, to
// written.
func scanStepRows(written *[]FlowStepRowsRow) func(br pgx.BatchResults) error {
	return func(br pgx.BatchResults) error {
		rows, _ := br.Query()
		defer rows.Close()
		for rows.Next() {
			var w FlowStepRowsRow
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
