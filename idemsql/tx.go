package idemsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"weak"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// ErrUnsupported is returned by the methods of the pgx.Tx that idem's
// calls get (see [Unwrap]) that database/sql cannot carry: CopyFrom,
// Prepare, Begin (savepoints) and large objects. errors.Is also matches
// it with errors.ErrUnsupported.
var ErrUnsupported = fmt.Errorf("idemsql: %w over database/sql", errors.ErrUnsupported)

// querier is what *sql.Tx and *sql.DB share: a statement runs on the
// transaction, or on the pool as a transaction of its own.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// exec runs idem's sqlc statements, written for pgx, through database/sql:
// the same SQL and arguments, each statement a round trip of its own.
type exec struct{ q querier }

func (e exec) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	res, err := bounded(ctx, func() (sql.Result, error) { return e.q.ExecContext(ctx, query, args...) }, nil)
	if err != nil {
		return pgconn.CommandTag{}, driverError(err)
	}
	n, _ := res.RowsAffected()
	return pgconn.NewCommandTag(fmt.Sprintf("%s %d", verb(query), n)), nil
}

func (e exec) Query(ctx context.Context, query string, args ...any) (pgx.Rows, error) {
	rows, err := bounded(ctx, func() (*sql.Rows, error) { return e.q.QueryContext(ctx, query, args...) },
		func(rows *sql.Rows) { _ = rows.Close() })
	if err != nil {
		return nil, driverError(err)
	}
	return &sqlRows{rows: rows}, nil
}

// bounded runs f, a driver's call, and returns when it does or when ctx
// ends, whichever comes first, so that a driver that does not give up
// when its context ends (lib/pq, on a server that stopped answering,
// waits as long as the connection lasts) cannot keep idem's call past it.
// The driver's call goes on in the background; what it returns after
// that is given to abandon, if not nil, to release.
func bounded[T any](ctx context.Context, f func() (T, error), abandon func(T)) (T, error) {
	if ctx.Done() == nil {
		return f()
	}
	type result struct {
		v   T
		err error
	}
	var mu sync.Mutex
	abandoned := false
	done := make(chan result, 1)
	go func() {
		v, err := f()
		mu.Lock()
		defer mu.Unlock()
		if abandoned {
			if err == nil && abandon != nil {
				abandon(v)
			}
			return
		}
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case r := <-done:
		return r.v, r.err
	default:
	}
	abandoned = true
	var zero T
	return zero, fmt.Errorf("idemsql: the driver did not return before the context ended: %w", context.Cause(ctx))
}

func (e exec) QueryRow(ctx context.Context, query string, args ...any) pgx.Row {
	rows, err := e.Query(ctx, query, args...)
	return sqlRow{rows: rows, err: err}
}

// verb is the first word of a statement after sqlc's leading comment, for
// a command tag that reads as PostgreSQL's would: only its count matters.
func verb(query string) string {
	for line := range strings.Lines(query) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "--") {
			continue
		}
		w, _, _ := strings.Cut(line, " ")
		return strings.ToUpper(w)
	}
	return "EXEC"
}

// sqlTx is the pgx.Tx over a *sql.Tx that idem's calls take. It has no
// *pgx.Conn (Conn returns nil), which makes idem send its statements one
// by one through it, as database/sql allows, instead of beneath pgx; it
// keeps idem's state for the transaction (IdemData) in its place.
type sqlTx struct {
	exec
	tx *sql.Tx
}

var _ pgx.Tx = (*sqlTx)(nil)

func wrap(tx *sql.Tx) *sqlTx { return &sqlTx{exec: exec{q: tx}, tx: tx} }

// states keeps each *sql.Tx's state for idem, found again by the *sql.Tx,
// so that a Do on a key inside that key's own function, in the same
// *sql.Tx, joins it, and the count of key locks spans the transaction. An
// entry goes when its *sql.Tx is collected: the map holds it weakly.
var states sync.Map // weak.Pointer[sql.Tx] -> map[string]any

// IdemData returns idem's state for the transaction (see idem's conn.go).
func (t *sqlTx) IdemData() map[string]any {
	key := weak.Make(t.tx)
	if v, ok := states.Load(key); ok {
		return v.(map[string]any)
	}
	v, loaded := states.LoadOrStore(key, map[string]any{})
	if !loaded {
		runtime.AddCleanup(t.tx, func(key weak.Pointer[sql.Tx]) { states.Delete(key) }, key)
	}
	return v.(map[string]any)
}

func (t *sqlTx) Begin(context.Context) (pgx.Tx, error) {
	return nil, fmt.Errorf("savepoints: %w", ErrUnsupported)
}

func (t *sqlTx) Commit(ctx context.Context) error { return t.end(ctx, "commit", t.tx.Commit) }

func (t *sqlTx) Rollback(ctx context.Context) error { return t.end(ctx, "rollback", t.tx.Rollback) }

// end commits or rolls back, returning when ctx ends if the driver has
// not returned by then: *sql.Tx's Commit and Rollback take no context,
// and a driver that sets no deadline of its own (lib/pq) would wait for a
// server that stopped answering as long as the connection lasts. The
// driver's call goes on in the background, and its connection stays with
// it; idem's calls bound their rollbacks (idem.WithTx), so that they
// return within that bound whatever the driver does.
func (t *sqlTx) end(ctx context.Context, op string, f func() error) error {
	_, err := bounded(ctx, func() (struct{}, error) { return struct{}{}, f() }, nil)
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Cause(ctx)) {
		return fmt.Errorf("%s: %w", op, err)
	}
	if errors.Is(err, sql.ErrTxDone) {
		return errors.Join(pgx.ErrTxClosed, err)
	}
	return driverError(err)
}

func (t *sqlTx) CopyFrom(context.Context, pgx.Identifier, []string, pgx.CopyFromSource) (int64, error) {
	return 0, fmt.Errorf("CopyFrom: %w", ErrUnsupported)
}

// LargeObjects is not supported: the value returned fails every call.
func (t *sqlTx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }

func (t *sqlTx) Prepare(context.Context, string, string) (*pgconn.StatementDescription, error) {
	return nil, fmt.Errorf("Prepare: %w", ErrUnsupported)
}

func (t *sqlTx) Conn() *pgx.Conn { return nil }

// SendBatch runs b's statements one after the other, each in a round trip
// of its own: database/sql has no pipeline. Like pgx, it stops at the
// first error, which Close returns.
func (t *sqlTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return &batchResults{ctx: ctx, tx: t, queued: b.QueuedQueries}
}

type batchResults struct {
	ctx    context.Context
	tx     *sqlTx
	queued []*pgx.QueuedQuery
	next   int
	err    error
	closed bool
}

func (br *batchResults) take() (*pgx.QueuedQuery, error) {
	if br.err != nil {
		return nil, br.err
	}
	if br.closed || br.next == len(br.queued) {
		return nil, errors.New("idemsql: no more results in the batch")
	}
	qq := br.queued[br.next]
	br.next++
	return qq, nil
}

func (br *batchResults) Exec() (pgconn.CommandTag, error) {
	qq, err := br.take()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.tx.Exec(br.ctx, qq.SQL, qq.Arguments...)
	br.err = err
	return tag, err
}

func (br *batchResults) Query() (pgx.Rows, error) {
	qq, err := br.take()
	if err != nil {
		return &sqlRows{err: err}, err
	}
	rows, err := br.tx.Query(br.ctx, qq.SQL, qq.Arguments...)
	if err != nil {
		br.err = err
		return &sqlRows{err: err}, err
	}
	return &failOnErr{sqlRows: rows.(*sqlRows), br: br}, nil
}

func (br *batchResults) QueryRow() pgx.Row {
	rows, err := br.Query()
	if err != nil {
		return sqlRow{err: err}
	}
	return sqlRow{rows: rows}
}

// Close runs the statements not read yet, calling their callbacks, and
// returns the first error: a callback's own, when it returns one, as pgx
// does (it may make a statement's error its caller's).
func (br *batchResults) Close() error {
	for !br.closed && br.err == nil && br.next < len(br.queued) {
		qq := br.queued[br.next]
		if qq.Fn != nil {
			if err := qq.Fn(br); err != nil {
				br.err = err
			}
		} else {
			_, _ = br.Exec()
		}
	}
	br.closed = true
	return br.err
}

func (br *batchResults) Tx() pgx.Tx { return br.tx }

// failOnErr records the error of a batch's statement that surfaces only
// while its rows are read, so that the batch stops there.
type failOnErr struct {
	*sqlRows
	br *batchResults
}

func (f *failOnErr) Close() {
	f.sqlRows.Close()
	if err := f.sqlRows.Err(); err != nil && f.br.err == nil {
		f.br.err = err
	}
}

// sqlRows is pgx.Rows over *sql.Rows.
type sqlRows struct {
	rows *sql.Rows
	err  error
}

func (r *sqlRows) Close() {
	if r.rows != nil {
		if err := r.rows.Close(); err != nil && r.err == nil {
			r.err = driverError(err)
		}
	}
}

func (r *sqlRows) Err() error {
	if r.err != nil {
		return r.err
	}
	if r.rows != nil {
		return driverError(r.rows.Err())
	}
	return nil
}

func (r *sqlRows) CommandTag() pgconn.CommandTag { return pgconn.CommandTag{} }

func (r *sqlRows) FieldDescriptions() []pgconn.FieldDescription { return nil }

func (r *sqlRows) Next() bool {
	if r.rows == nil || r.err != nil {
		return false
	}
	if r.rows.Next() {
		return true
	}
	r.Close()
	return false
}

// Scan scans the current row into dest: every destination idem's sqlc
// code uses is a Go type database/sql fills or a pgtype that is an
// sql.Scanner. Drivers hand text they do not decode as []byte (lib/pq:
// interval, uuid), which pgtype's Scan methods take as a string.
func (r *sqlRows) Scan(dest ...any) error {
	if r.rows == nil {
		return r.Err()
	}
	shimmed := make([]any, len(dest))
	for i, d := range dest {
		shimmed[i] = d
		if s, ok := d.(sql.Scanner); ok {
			shimmed[i] = textScanner{s}
		}
	}
	if err := r.rows.Scan(shimmed...); err != nil {
		return fmt.Errorf("idemsql: scan: %w", err)
	}
	return nil
}

func (r *sqlRows) Values() ([]any, error) {
	cols, err := r.rows.Columns()
	if err != nil {
		return nil, err
	}
	vals := make([]any, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	return vals, r.rows.Scan(ptrs...)
}

func (r *sqlRows) RawValues() [][]byte { return nil }

func (r *sqlRows) Conn() *pgx.Conn { return nil }

func (r *sqlRows) TypeMap() *pgtype.Map { return nil }

// textScanner passes a []byte to a pgtype Scanner as the string it takes.
type textScanner struct{ s sql.Scanner }

func (t textScanner) Scan(src any) error {
	if b, ok := src.([]byte); ok {
		src = string(b)
	}
	return t.s.Scan(src)
}

// sqlRow is pgx.Row over the first row of a query: no row is
// pgx.ErrNoRows, as sqlc's pgx code expects.
type sqlRow struct {
	rows pgx.Rows
	err  error
}

func (r sqlRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}
