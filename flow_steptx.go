package idem

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// A local step's function gets a stepTx, the step's transaction, which
// stops working once the function returns: every method then returns
// pgx.ErrTxClosed, so that a statement sent later (by a goroutine the
// step started, or on a Tx kept in a struct) runs nowhere, rather than on
// a connection that idem commits, or has given back to its pool.
//
// A step whose transaction is not open yet (every local step of a flow
// but its first, which runs in the claim's: see flow_claim.go) begins it
// with its function's first statement, in one round trip, through pgx's
// batch: BEGIN, the idle timeout and the lock of the flow's row
// (FlowLock; for a flow whose claim's transaction was lost, its advisory
// lock and the check that it has no row, FlowStartLock and FlowStartFree),
// then the statement. The lock fails when the flow is not the executor's,
// and the server runs nothing sent after it: a fenced executor's
// statement never runs, and the function gets ErrLeaseLost. The step's
// function is entered only once the run knows it holds the flow (its
// lease holds by its own clock, see Local), but may run up to its first
// statement before the server has checked it. The statement travels so
// when it has arguments (pgx runs a statement without arguments through
// the simple protocol, which may hold several) and no options of pgx's;
// otherwise, and for anything else the function does with the
// transaction, BEGIN and the lock are sent first, alone.

// stepTx is the pgx.Tx a local step's function gets.
type stepTx struct {
	r    *flowRun
	ctx  context.Context // the step's, for what has no context of its own
	conn *pgx.Conn
	// b is what begins the transaction, queued, until it is sent (nil
	// after, and for a transaction that was open already); starts is set
	// when it takes the flow's advisory lock (FlowStartLock), which reads
	// namespace.
	b         *pgx.Batch
	starts    bool
	namespace pgtype.UUID
	// tx is pgx's transaction, once it began; err is why it did not: the
	// flow not held (ErrLeaseLost), taken (errTaken), or the round trip's
	// error.
	tx  pgx.Tx
	err error
	// first is the round trip of the function's first statement while
	// its result is read.
	first pgx.BatchResults
	// closed is set when the function returns.
	closed atomic.Bool
}

// newStepTx returns the transaction of a local step that begins it on
// conn with opts, with the function's first statement: BEGIN, the idle
// timeout and the flow's lock queued. A flow not started yet (its claim's
// transaction lost to an earlier step that failed) takes its advisory
// lock instead, and checks that it has no row.
func (r *flowRun) newStepTx(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions) *stepTx {
	t := &stepTx{r: r, ctx: ctx, conn: conn, starts: r.start != nil, b: &pgx.Batch{}}
	t.b.BeginTx(opts)
	queueIdleTimeout(t.b, r.o, namedFor(r.db))
	if p := r.start; p != nil {
		dbbatch.QueueFlowStartLock(t.b, nil, dbsqlc.FlowStartLockParams{LockID: p.LockID, Scope: p.Scope, Key: p.Key}, &t.namespace)
		dbbatch.QueueFlowStartFree(t.b, nil, dbsqlc.FlowStartFreeParams{Scope: p.Scope, Key: p.Key})
	} else {
		dbbatch.QueueFlowLock(t.b, dbsqlc.FlowLockParams{Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch})
	}
	return t
}

// openStepTx returns the transaction of a local step that runs in tx,
// open already, on conn (nil for a TxBeginner that is no pgx connection):
// the claim's, which holds the flow's lock, when starts is set.
func (r *flowRun) openStepTx(ctx context.Context, conn *pgx.Conn, tx pgx.Tx, starts bool) *stepTx {
	return &stepTx{r: r, ctx: ctx, conn: conn, tx: tx, starts: starts}
}

// judge turns the error of the statements that begin the transaction into
// why it did not begin, and notes what the lock read.
func (t *stepTx) judge(err error) error {
	switch {
	case errors.Is(err, dbbatch.ErrNotHeld) && t.starts:
		t.r.mu.Lock()
		t.r.taken = errTaken
		t.r.mu.Unlock()
		return errTaken
	case errors.Is(err, dbbatch.ErrNotHeld):
		return t.r.lostError()
	case err != nil:
		return translate("begin, locking the flow", err)
	}
	if t.starts && t.b == nil && t.namespace.Valid {
		t.r.keys = providerKeys{namespace: t.namespace}
	}
	return nil
}

// errStepConnBusy is what a statement gets while the rows of the step's
// first statement are still open, as pgx's "conn busy" on a transaction of
// its own.
var errStepConnBusy = errors.New("idem: conn busy: the rows of the step's first statement are still open")

// begin sends what begins the transaction, alone, if it is still to send,
// and returns pgx's transaction, or why the transaction did not begin, or
// errStepConnBusy while the first statement's rows are open.
func (t *stepTx) begin(ctx context.Context) (pgx.Tx, error) {
	if t.first != nil {
		return nil, errStepConnBusy
	}
	if b := t.b; b != nil {
		results := t.conn.SendBatch(ctx, b)
		t.tx = results.Tx()
		t.b = nil
		t.err = t.judge(results.Close())
	}
	return t.tx, t.err
}

// sendWith sends what begins the transaction with the statement sql,
// args, in one round trip, reads the results of what begins it, and
// reports whether it did: then the statement's result is to read from
// t.first, or, when the transaction did not begin, t.err says why. When
// it did not send (nothing to begin, options, no arguments, or arguments
// pgx could not encode), the statement is to be sent otherwise.
func (t *stepTx) sendWith(ctx context.Context, sql string, args []any) bool {
	if t.b == nil || len(args) == 0 || queryTracedOnly(t.conn) {
		return false
	}
	for _, arg := range args {
		switch arg.(type) {
		case pgx.QueryExecMode, pgx.QueryRewriter, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
			return false
		}
	}
	b := t.b
	n := len(b.QueuedQueries)
	b.Queue(sql, args...)
	results := t.conn.SendBatch(ctx, b)
	var err error
	for _, q := range b.QueuedQueries[:n] {
		if q.Fn != nil {
			err = q.Fn(results)
		} else {
			_, err = results.Exec()
		}
		if err != nil {
			break
		}
	}
	if err != nil {
		closeErr := results.Close()
		if errors.As(err, new(pgx.ErrPreprocessingBatch)) && t.conn.PgConn().TxStatus() == 'I' {
			// Nothing was sent: the statement could not be prepared or
			// its arguments encoded. What begins the transaction goes
			// alone, and the statement fails on its own.
			b.QueuedQueries = b.QueuedQueries[:n]
			return false
		}
		t.b = nil
		t.tx = results.Tx()
		if closeErr != nil && !errors.Is(err, dbbatch.ErrNotHeld) {
			err = closeErr
		}
		t.err = t.judge(err)
		return true
	}
	t.b = nil
	t.tx = results.Tx()
	t.err = t.judge(nil)
	t.first = results
	return true
}

// queryTracedOnly reports whether conn's tracer traces statements sent
// alone but not batches, which would not see the function's statement if
// it went with a batch.
func queryTracedOnly(conn *pgx.Conn) bool {
	tracer := conn.Config().Tracer
	_, batches := tracer.(pgx.BatchTracer)
	return tracer != nil && !batches
}

// over ends the first statement's round trip, once its result is read,
// and returns err, or the round trip's error.
func (t *stepTx) over(err error) error {
	if t.first == nil {
		return err
	}
	closeErr := t.first.Close()
	t.first = nil
	if err == nil {
		err = closeErr
	}
	return err
}

func (t *stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.closed.Load() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	if t.sendWith(ctx, sql, args) {
		if t.first == nil {
			return pgconn.CommandTag{}, t.err
		}
		tag, err := t.first.Exec()
		return tag, t.over(err)
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return tx.Exec(ctx, sql, args...)
}

func (t *stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.closed.Load() {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	if t.sendWith(ctx, sql, args) {
		if t.first == nil {
			return errRows{t.err}, t.err
		}
		rows, err := t.first.Query()
		if err != nil {
			rows.Close()
			err = t.over(err)
			return errRows{err}, err
		}
		return &firstRows{Rows: rows, t: t}, nil
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return errRows{err}, err
	}
	return tx.Query(ctx, sql, args...)
}

func (t *stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.closed.Load() {
		return errRows{pgx.ErrTxClosed}
	}
	if t.sendWith(ctx, sql, args) {
		if t.first == nil {
			return errRows{t.err}
		}
		return firstRow{row: t.first.QueryRow(), t: t}
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return errRows{err}
	}
	return tx.QueryRow(ctx, sql, args...)
}

// firstRows are the rows of the step's first statement: closing them, or
// reading past the last, ends its round trip.
type firstRows struct {
	pgx.Rows
	t    *stepTx
	done bool
}

func (r *firstRows) end() {
	if !r.done {
		r.done = true
		r.Rows.Close()
		_ = r.t.over(nil)
	}
}

func (r *firstRows) Next() bool {
	if r.done {
		return false
	}
	if !r.Rows.Next() {
		r.end()
		return false
	}
	return true
}

func (r *firstRows) Close() { r.end() }

// firstRow is the row of the step's first statement: scanning it ends its
// round trip.
type firstRow struct {
	row pgx.Row
	t   *stepTx
}

func (r firstRow) Scan(dest ...any) error { return r.t.over(r.row.Scan(dest...)) }

func (t *stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return nil, err
	}
	nested, err := tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &fnTx{Tx: nested, closed: &t.closed}, nil
}

// Commit and Rollback refuse: the step's transaction commits with the
// step's record, or not at all, which returning an error from the
// function asks for.
func (t *stepTx) Commit(context.Context) error {
	if t.closed.Load() {
		return pgx.ErrTxClosed
	}
	return errStepTxEnd
}

func (t *stepTx) Rollback(context.Context) error {
	if t.closed.Load() {
		return pgx.ErrTxClosed
	}
	return errStepTxEnd
}

// errStepTxEnd is what Commit and Rollback return on a step's transaction.
var errStepTxEnd = errors.New("idem: a local step's transaction commits with the step, when its function returns nil: return an error to roll it back")

func (t *stepTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if t.closed.Load() {
		return 0, pgx.ErrTxClosed
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return 0, err
	}
	return tx.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (t *stepTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed.Load() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return tx.SendBatch(ctx, b)
}

func (t *stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Prepare(ctx, name, sql)
}

// LargeObjects begins the transaction first, under the step's context: a
// transaction that did not begin is closed, and its large objects fail;
// while the first statement's rows are open, they are closed first. The
// large objects, pgx's, do not know when the function returns: they must
// not outlive it.
func (t *stepTx) LargeObjects() pgx.LargeObjects {
	if t.first != nil {
		_ = t.over(nil)
	}
	if t.closed.Load() {
		return closedTx.LargeObjects()
	}
	tx, _ := t.begin(t.ctx)
	if tx == nil {
		return closedTx.LargeObjects()
	}
	return tx.LargeObjects()
}

// closedTx is a pgx.Tx that is closed: its methods return pgx.ErrTxClosed.
var closedTx = func() pgx.Tx {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	return pgx.FailedBatchResults(b, pgx.ErrTxClosed).Tx()
}()

// Conn begins the transaction first, under the step's context: what the
// function sends on the connection itself comes after. The connection is
// the transaction's only while the function runs: what is sent on it
// after, idem cannot stop.
func (t *stepTx) Conn() *pgx.Conn {
	_, _ = t.begin(t.ctx)
	return t.conn
}

// errRows are the rows, or the row, of a statement that was not run.
type errRows struct{ err error }

func (r errRows) Close()                                       {}
func (r errRows) Err() error                                   { return r.err }
func (r errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                            { return r.err }
func (r errRows) Values() ([]any, error)                       { return nil, r.err }
func (r errRows) RawValues() [][]byte                          { return nil }
func (r errRows) Conn() *pgx.Conn                              { return nil }
func (r errRows) TypeMap() *pgtype.Map                         { return nil }
