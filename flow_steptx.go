package idem

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
)

// A local step whose transaction stays open (see flow_pending.go) begins
// it with its function's first statement, in one round trip: the lock of
// the flow (BEGIN, then FlowLock; for a flow that no one has started,
// FlowStartLock, the run's look at the flow, see flow_look.go, and
// FlowStartFree, then BEGIN), then the statement. The lock fails when the flow is not the
// executor's, or not free to start, and the server runs nothing
// sent after it: a fenced executor's statement never runs, and the
// function gets ErrLeaseLost (or the run looks at the flow again, as a
// duplicate). The step's function may therefore start before the lock is
// taken, up to its first statement; it never runs a statement without it.
//
// The statement travels so when it has arguments (pgx runs a statement
// without arguments through the simple protocol, which may hold several),
// no options, and the connection has no tracer (which would not see it):
// see dbsqlc.SendFlatOpen for the rest. Otherwise, and for anything else
// the function does with the transaction, the BEGIN and the lock are sent
// first, alone, as they would be without this.

// stepTx is the pgx.Tx a local step's function gets when the step's
// transaction stays open: it begins the transaction with the function's
// first statement.
type stepTx struct {
	r    *flowRun
	ctx  context.Context // the step's, for what has no context of its own
	conn *pgx.Conn
	opts pgx.TxOptions
	// b is what begins the transaction, queued, until it is sent (nil
	// after); starts is set when it takes the flow's advisory lock
	// (FlowStartLock), which reads namespace.
	b         *pgx.Batch
	starts    bool
	namespace pgtype.UUID
	// late is set when b begins the transaction after the flow's
	// advisory lock (see newStepTx).
	late bool
	// tx is pgx's transaction, once the round trip that began it is over;
	// err is why it did not begin: the flow not held (ErrLeaseLost), taken
	// (errTaken), or the round trip's error.
	tx  pgx.Tx
	err error
	// open is the first statement's result while it is read.
	open *dbsqlc.Open
}

// newStepTx queues what begins a local step's transaction on conn, with
// opts: BEGIN, the idle timeout and the flow's lock. For a flow that no
// one has started, BEGIN goes after the flow's advisory lock, the run's
// look at the flow and the check that it is not there, where it can
// (beginsLate, dbsqlc.CanBeginLate): they run in the round trip's implicit
// transaction, which BEGIN then makes the step's (the advisory lock held
// until it ends), or which ends with the round trip when the lock or the
// check failed, so that a run that found its flow there leaves the
// connection idle, with no ROLLBACK to send: a replay stays one round
// trip. On a session whose transactions have another isolation level,
// that BEGIN fails, nothing of the round trip runs, and it is sent again
// with BEGIN first, as on that connection from then on. The lock of the
// flow's row (FlowLock) always comes after BEGIN: on Citus, a statement
// of an implicit transaction runs on its worker as a transaction of its
// own, whose row lock would end with it.
func (r *flowRun) newStepTx(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions) *stepTx {
	t := &stepTx{r: r, ctx: ctx, conn: conn, opts: opts, starts: r.start != nil}
	t.queue()
	return t
}

// queue queues what begins the transaction on a new batch, t.b.
func (t *stepTx) queue() {
	r := t.r
	t.b = r.stepBatch.newBatch()
	t.late = t.starts && beginsLate(t.opts) && dbsqlc.CanBeginLate(t.conn)
	if !t.late {
		queueBegin(t.b, t.conn, t.opts)
		r.queueIdleTimeout(t.b)
	}
	if p := r.start; p != nil {
		// The look and the check after the lock, with snapshots that see
		// a row its previous holder committed.
		dbsqlc.QueueFlowStartLock(t.b, p.LockID, &t.namespace)
		r.queueLook(t.b)
		dbsqlc.QueueFlowStartFree(t.b, dbsqlc.FlowStartFreeParams{Scope: p.Scope, Key: p.Key})
	} else {
		dbsqlc.QueueFlowLock(t.b, dbsqlc.FlowLockParams{Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch})
	}
	if t.late {
		t.b.Queue(beginSQL(t.opts))
		r.queueIdleTimeout(t.b)
	}
}

// beginsLate reports whether a transaction begun with opts may begin
// after other statements: one of the session's isolation level (the
// default, read committed, where it is the session's).
func beginsLate(opts pgx.TxOptions) bool {
	return opts == pgx.TxOptions{} || opts == pgx.TxOptions{IsoLevel: pgx.ReadCommitted}
}

// judge turns the error of the statements that begin the transaction into
// why it did not begin, and notes what the lock read.
func (t *stepTx) judge(err error) error {
	if t.starts && t.r.unlooked {
		if err := t.r.looked(true, err); err != nil {
			return err
		}
	}
	switch {
	case errors.Is(err, dbsqlc.ErrNotHeld) && t.starts:
		t.r.taken = errTaken
		return errTaken
	case errors.Is(err, dbsqlc.ErrNotHeld):
		return t.r.lostError()
	case err != nil:
		return translate("begin, locking the flow", err)
	}
	if t.starts {
		t.r.keys = providerKeys{namespace: t.namespace}
	}
	return nil
}

// RoundTripOver notes that the round trip that began the transaction is
// over: pgx's transaction over it, closed if it is not open (made of an
// empty batch, which sends nothing, so under no context).
func (t *stepTx) RoundTripOver(error) {
	t.open = nil
	t.tx = txOver(context.Background(), t.conn, emptyBegin(t.opts))
}

// errStepConnBusy is what a statement gets while the rows of the step's
// first statement are still open, as pgx's "conn busy" on a transaction of
// its own.
var errStepConnBusy = errors.New("idem: conn busy: the rows of the step's first statement are still open")

// begin sends what begins the transaction, alone, if it is still to send,
// and returns pgx's transaction, or why the transaction did not begin, or
// errStepConnBusy while the first statement's rows are open.
func (t *stepTx) begin(ctx context.Context) (pgx.Tx, error) {
	if t.open != nil {
		return nil, errStepConnBusy
	}
	if t.b != nil {
		b := t.b
		t.b = nil
		tx, err := t.r.sendBegin(ctx, t.conn, b, t.opts)
		if t.late && dbsqlc.BeganTooLate(t.conn, err) {
			// Nothing ran: again, BEGIN first.
			t.queue()
			b = t.b
			t.b = nil
			tx, err = t.r.sendBegin(ctx, t.conn, b, t.opts)
		}
		t.tx = tx
		if t.tx == nil {
			t.RoundTripOver(err)
		}
		t.err = t.judge(err)
	}
	return t.tx, t.err
}

// sendWith sends what begins the transaction with the statement sql, args,
// in one round trip, and returns the statement's result to read, or ok
// false when nothing was sent and the statement is to be sent otherwise.
// t.err is set when the transaction did not begin (open is nil then).
func (t *stepTx) sendWith(ctx context.Context, sql string, args []any) (open *dbsqlc.Open, ok bool) {
	if t.b == nil || t.conn.Config().Tracer != nil {
		return nil, false
	}
	for _, arg := range args {
		switch arg.(type) {
		case pgx.QueryExecMode, pgx.QueryRewriter, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
			return nil, false
		}
	}
	b := t.b
	b.Queue(sql, args...)
	open, sent, err := dbsqlc.SendFlatOpen(ctx, t.conn, b, t)
	if sent && t.late && dbsqlc.BeganTooLate(t.conn, err) {
		// Nothing ran: again, BEGIN first.
		t.queue()
		t.tx = nil
		b = t.b
		b.Queue(sql, args...)
		open, sent, err = dbsqlc.SendFlatOpen(ctx, t.conn, b, t)
	}
	if !sent {
		b.QueuedQueries = b.QueuedQueries[:len(b.QueuedQueries)-1]
		return nil, false
	}
	t.b = nil
	if t.err = t.judge(err); t.err != nil {
		if t.tx == nil { // failed before the round trip (a prepare)
			t.RoundTripOver(err)
		}
		return nil, true
	}
	t.open = open
	return open, true
}

func (t *stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if len(args) > 0 {
		if open, ok := t.sendWith(ctx, sql, args); ok {
			if open == nil {
				return pgconn.CommandTag{}, t.err
			}
			return open.Exec()
		}
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return tx.Exec(ctx, sql, args...)
}

func (t *stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if open, ok := t.sendWith(ctx, sql, args); ok {
		if open == nil {
			return errRows{t.err}, t.err
		}
		return open.Query()
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return errRows{err}, err
	}
	return tx.Query(ctx, sql, args...)
}

func (t *stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if open, ok := t.sendWith(ctx, sql, args); ok {
		if open == nil {
			return errRows{t.err}
		}
		return open.QueryRow()
	}
	tx, err := t.begin(ctx)
	if err != nil {
		return errRows{err}
	}
	return tx.QueryRow(ctx, sql, args...)
}

func (t *stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.begin(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Begin(ctx)
}

func (t *stepTx) Commit(ctx context.Context) error {
	tx, err := t.begin(ctx)
	if err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func (t *stepTx) Rollback(ctx context.Context) error {
	tx, err := t.begin(ctx)
	if tx == nil {
		return err
	}
	return tx.Rollback(ctx)
}

func (t *stepTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	tx, err := t.begin(ctx)
	if err != nil {
		return 0, err
	}
	return tx.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (t *stepTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	tx, err := t.begin(ctx)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return tx.SendBatch(ctx, b)
}

func (t *stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	tx, err := t.begin(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Prepare(ctx, name, sql)
}

// LargeObjects begins the transaction first, under the step's context: a
// transaction that did not begin is closed, and its large objects fail;
// while the first statement's rows are open, they are closed first.
func (t *stepTx) LargeObjects() pgx.LargeObjects {
	if t.open != nil {
		t.open.Close()
	}
	tx, _ := t.begin(t.ctx)
	return tx.LargeObjects()
}

// Conn begins the transaction first, under the step's context: what the
// function sends on the connection itself comes after. When it did not
// begin because the lock failed before BEGIN (newStepTx), the connection
// is left in a transaction that failed, as it would be with BEGIN first,
// so that what the function sends on it fails rather than commits on its
// own, and the step rolls it back.
func (t *stepTx) Conn() *pgx.Conn {
	if _, err := t.begin(t.ctx); err != nil && t.conn.PgConn().TxStatus() == 'I' {
		ctx, cancel := cleanupContext(t.ctx)
		defer cancel()
		_, _ = t.conn.PgConn().Exec(ctx, failedTxSQL).ReadAll()
		if t.conn.PgConn().TxStatus() == 'E' {
			t.tx = txOver(ctx, t.conn, emptyBegin(t.opts))
		}
	}
	return t.conn
}

// failedTxSQL leaves a connection in a transaction that failed.
const failedTxSQL = "BEGIN; SELECT 1 / 0"

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

// runLocalOpen is an attempt of a local step whose transaction stays open
// when its function returns (see runLocal), on conn, pooled's (nil for
// none), which it gives back unless the step is left open: the
// transaction begins with the function's first statement (stepTx), and
// is left open, its record unsent, for the flow's next statement to
// commit (flowRun.flush).
func runLocalOpen[T any](ctx context.Context, r *flowRun, seq int32, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error),
	conn *pgx.Conn, pooled *pgxpool.Conn, opts pgx.TxOptions) (T, error) {
	var zero T
	kept := false
	t := r.newStepTx(ctx, conn, opts)
	defer func() {
		if kept {
			return
		}
		if t.open != nil {
			t.open.Close()
		}
		if t.tx != nil && conn.PgConn().TxStatus() != 'I' {
			rollback(ctx, t.tx)
		}
		releaseConn(pooled)
	}()
	carries := r.result != nil
	value, err := fn(ctx, t)
	if err != nil && t.b != nil {
		return zero, err // nothing was sent
	}
	if t.open != nil {
		// Rows fn left open: the step fails, as its commit would on
		// pgx's transaction (the deferred cleanup closes them).
		return zero, errStepConnBusy
	}
	if _, beginErr := t.begin(ctx); beginErr != nil {
		return zero, beginErr
	}
	if err != nil {
		return zero, err
	}
	record, encoded, err := localRecord(r, seq, name, value)
	if err != nil {
		return zero, err
	}
	value, err = decodedResult[T](r, encoded)
	if err != nil {
		return zero, err
	}
	lease := dbsqlc.FlowLeaseStepsParams{Lease: pgtime.Interval(r.o.lease), Step: name, Scope: r.k.scope, Key: r.k.key, Epoch: r.epoch}
	r.keepOpen(&openStep{name: name, conn: conn, pooled: pooled, tx: t.tx, record: record, lease: lease, carries: carries, starts: t.starts})
	kept = true
	return value, nil
}
