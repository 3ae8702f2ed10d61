package idem

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// fnTx is pgx's transaction as a function of the caller's gets it (Run's
// fn, a local step's nested transaction): it stops working once closed is
// set, when the function has returned, so that a statement sent later (by
// a goroutine the function started, or on a Tx kept in a struct) runs
// nowhere, rather than on a connection that idem has committed, or given
// back to its pool. Its methods then return pgx.ErrTxClosed. What the
// function does with Conn(), or with large objects it opened, idem cannot
// stop: they must not outlive it.
type fnTx struct {
	pgx.Tx
	closed *atomic.Bool
}

// closingFn returns fn, given on a connection of pgx's (conn), as it runs
// in a transaction that closes once it returns (fnTx); on any other
// TxBeginner (idemsql's, whose Unwrap needs its own transaction, which
// database/sql closes as it commits) fn as it is.
func closingFn[T any](conn *pgx.Conn, fn func(ctx context.Context, tx pgx.Tx) (T, error)) func(ctx context.Context, tx pgx.Tx) (T, error) {
	if conn == nil {
		return fn
	}
	return func(ctx context.Context, tx pgx.Tx) (T, error) {
		var closed atomic.Bool
		defer closed.Store(true)
		return fn(ctx, &fnTx{Tx: tx, closed: &closed})
	}
}

func (t *fnTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.closed.Load() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.Tx.Exec(ctx, sql, args...)
}

func (t *fnTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.closed.Load() {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return t.Tx.Query(ctx, sql, args...)
}

func (t *fnTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.closed.Load() {
		return errRows{pgx.ErrTxClosed}
	}
	return t.Tx.QueryRow(ctx, sql, args...)
}

func (t *fnTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed.Load() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.Tx.SendBatch(ctx, b)
}

func (t *fnTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if t.closed.Load() {
		return 0, pgx.ErrTxClosed
	}
	return t.Tx.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (t *fnTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return t.Tx.Prepare(ctx, name, sql)
}

func (t *fnTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	nested, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &fnTx{Tx: nested, closed: t.closed}, nil
}

func (t *fnTx) Commit(ctx context.Context) error {
	if t.closed.Load() {
		return pgx.ErrTxClosed
	}
	return t.Tx.Commit(ctx)
}

func (t *fnTx) Rollback(ctx context.Context) error {
	if t.closed.Load() {
		return pgx.ErrTxClosed
	}
	return t.Tx.Rollback(ctx)
}

func (t *fnTx) LargeObjects() pgx.LargeObjects {
	if t.closed.Load() {
		return closedTx.LargeObjects()
	}
	return t.Tx.LargeObjects()
}
