package idem

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// runTx is the transaction that Run begins itself, in the claim's round
// trip, when it sends its statements beneath pgx (dbsqlc.Wire): pgx has no
// way to wrap a transaction it did not begin, so fn gets this one, which
// sends everything through the connection, as pgx's own does.
type runTx struct {
	conn   *pgx.Conn
	closed bool
	// savepoints counts the pseudo nested transactions begun on it.
	savepoints int64
	// lo is a pgx transaction over the same server transaction, made only
	// for LargeObjects, which pgx lets no other type build.
	lo pgx.Tx
}

var _ pgx.Tx = (*runTx)(nil)

func (tx *runTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	tx.savepoints++
	sp := &savepointTx{parent: tx, n: tx.savepoints}
	if _, err := tx.conn.Exec(ctx, "savepoint "+sp.name()); err != nil {
		return nil, err
	}
	return sp, nil
}

func (tx *runTx) Commit(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	tag, err := tx.conn.Exec(ctx, "commit")
	tx.closed = true
	if err != nil {
		if tx.conn.PgConn().TxStatus() != 'I' {
			_ = tx.conn.Close(ctx) // the server's transaction state is unknown
		}
		return err
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

func (tx *runTx) Rollback(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	_, err := tx.conn.Exec(ctx, "rollback")
	tx.closed = true
	if err != nil {
		// A rollback that did not arrive leaves a transaction open on a
		// connection that would go back to its pool: close it.
		_ = tx.conn.Close(ctx)
	}
	return err
}

func (tx *runTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if tx.closed {
		return 0, pgx.ErrTxClosed
	}
	return tx.conn.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (tx *runTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if tx.closed {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return tx.conn.SendBatch(ctx, b)
}

// LargeObjects returns pgx's large objects over this transaction. pgx
// builds them only on a transaction of its own: the first call begins
// one on the connection, which, inside this transaction, the server
// answers with a warning and nothing else; it is never committed itself.
func (tx *runTx) LargeObjects() pgx.LargeObjects {
	if tx.lo == nil {
		lo, err := tx.conn.Begin(context.Background())
		if err != nil {
			panic(fmt.Sprintf("idem: large objects in Run's transaction: %v", err))
		}
		tx.lo = lo
	}
	return tx.lo.LargeObjects()
}

func (tx *runTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	return tx.conn.Prepare(ctx, name, sql)
}

func (tx *runTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if tx.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return tx.conn.Exec(ctx, sql, arguments...)
}

func (tx *runTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	return tx.conn.Query(ctx, sql, args...)
}

func (tx *runTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if tx.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return tx.conn.QueryRow(ctx, sql, args...)
}

func (tx *runTx) Conn() *pgx.Conn { return tx.conn }

// savepointTx is a transaction nested in a runTx, as a savepoint.
type savepointTx struct {
	parent *runTx
	n      int64
	closed bool
}

var _ pgx.Tx = (*savepointTx)(nil)

func (sp *savepointTx) name() string { return fmt.Sprintf("sp_%d", sp.n) }

func (sp *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.parent.Begin(ctx)
}

func (sp *savepointTx) Commit(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.parent.Exec(ctx, "release savepoint "+sp.name())
	sp.closed = true
	return err
}

func (sp *savepointTx) Rollback(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.parent.Exec(ctx, "rollback to savepoint "+sp.name())
	sp.closed = true
	return err
}

func (sp *savepointTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if sp.closed {
		return 0, pgx.ErrTxClosed
	}
	return sp.parent.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (sp *savepointTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if sp.closed {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return sp.parent.SendBatch(ctx, b)
}

func (sp *savepointTx) LargeObjects() pgx.LargeObjects { return sp.parent.LargeObjects() }

func (sp *savepointTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.parent.Prepare(ctx, name, sql)
}

func (sp *savepointTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if sp.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return sp.parent.Exec(ctx, sql, arguments...)
}

func (sp *savepointTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.parent.Query(ctx, sql, args...)
}

func (sp *savepointTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if sp.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return sp.parent.QueryRow(ctx, sql, args...)
}

func (sp *savepointTx) Conn() *pgx.Conn { return sp.parent.conn }

// errRow is a row that reports err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
