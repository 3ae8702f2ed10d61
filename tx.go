package idem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/guard"
)

// TxBeginner begins transactions. *pgxpool.Pool, *pgxpool.Conn and
// *pgx.Conn satisfy it.
type TxBeginner interface {
	BeginTx(ctx context.Context, txOptions pgx.TxOptions) (pgx.Tx, error)
}

// MaxTxAttempts is how many times [Run] and [WithTx] run a transaction that
// PostgreSQL keeps aborting with a serialization failure or a deadlock before
// they give up and return [ErrSerialization].
const MaxTxAttempts = 10

// Backoff between attempts: full jitter over an exponentially growing cap.
const (
	retryBaseDelay = 2 * time.Millisecond
	retryMaxDelay  = 250 * time.Millisecond
)

// rollbackTimeout bounds a rollback that runs after the caller's context
// ended, so a dead connection cannot hang the caller forever.
const rollbackTimeout = 5 * time.Second

// WithTx runs fn in a transaction begun on db with txOptions and commits it
// when fn returns nil. When fn returns an error or panics, the transaction
// is rolled back, with a context that is not cancelled, so that a cancelled
// caller still releases its locks at once.
//
// When the transaction fails with a serialization failure (SQLSTATE 40001)
// or a deadlock (40P01), anywhere including at COMMIT, WithTx runs fn again
// in a new transaction, after a short jittered backoff, up to
// [MaxTxAttempts] times in all. fn must therefore do nothing that cannot be
// rolled back. A failed COMMIT is reported as an error.
func WithTx(ctx context.Context, db TxBeginner, txOptions pgx.TxOptions, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return retry(ctx, func() error {
		tx, err := db.BeginTx(ctx, txOptions)
		if err != nil {
			return translate("idem: begin", err)
		}
		committed := false
		defer func() {
			if !committed {
				rollback(ctx, tx)
			}
		}()
		if err := fn(ctx, tx); err != nil {
			return err
		}
		committed = true
		if err := tx.Commit(ctx); err != nil {
			return translate("idem: commit", err)
		}
		return nil
	})
}

// Run begins a transaction on db, runs [Do] in it with the same arguments,
// and commits: the usual way to make one write exactly-once when the caller
// has no transaction of its own. Like [WithTx], it retries the whole
// transaction on serialization failures and deadlocks, so that under
// SERIALIZABLE a duplicate that loses the race sees a replay, not an error.
// A replay rolls its transaction back: it wrote nothing.
//
// The transaction is READ COMMITTED unless [WithTxOptions] says otherwise.
// Given a *pgxpool.Pool, *pgxpool.Conn or *pgx.Conn, Run sends BEGIN in the
// same round trip as the claim, and the stored value in the same round trip
// as COMMIT: a first execution costs one round trip more than fn's own
// statements, and a replay two round trips in all.
func Run[T any](ctx context.Context, db TxBeginner, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), opts ...Option,
) (_ Result[T], err error) {
	o, err := newOptions(opts)
	ctx, obs := o.observer.observe(ctx, "idem.Run")
	defer func() { obs.end(ctx, scope, key, err) }()
	if err != nil {
		return Result[T]{}, err
	}
	if err := checkScopeAndKey(scope, key); err != nil {
		return Result[T]{}, err
	}
	var res Result[T]
	err = retry(ctx, func() error {
		var err error
		res, err = runOnce(ctx, db, scope, key, fp, fn, o, obs)
		return err
	})
	if err != nil {
		return Result[T]{}, err
	}
	return res, nil
}

func runOnce[T any](ctx context.Context, beginner TxBeginner, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), o *options, obs *observation,
) (Result[T], error) {
	conn, release, err := ownConn(ctx, beginner)
	if err != nil {
		return Result[T]{}, fmt.Errorf("idem: acquire connection: %w", err)
	}
	defer release()

	if conn != nil && o.lookupFirst {
		stored, found, err := lookup(ctx, dbsqlc.New(conn), scope, key, fp)
		if err != nil {
			return Result[T]{}, err
		}
		if found {
			obs.claimDone(OutcomeReplayed)
			return replayed[T](stored, scope, o)
		}
	}
	lazy := &lazyTx{conn: conn, txOptions: o.txOptions}
	if conn == nil {
		if lazy.tx, err = beginner.BeginTx(ctx, o.txOptions); err != nil {
			return Result[T]{}, translate("idem: begin", err)
		}
	}
	finished := false
	defer func() {
		if !finished && lazy.tx != nil {
			rollback(ctx, lazy.tx)
		}
	}()

	res, store, err := attempt(ctx, lazy, lazy.current, scope, key, fp, fn, o, obs)
	if err != nil {
		return Result[T]{}, err
	}
	if store == nil {
		return res, nil // a replay: the deferred rollback ends the transaction
	}
	finished = true
	// A CommitQuery of the caller's must run as given, outside the pipeline.
	pipelined := conn != nil && o.txOptions.CommitQuery == ""
	err = commitWith(ctx, lazy.tx, pipelined, store)
	// The transaction has ended, and with a pipelined COMMIT its connection
	// may already serve someone else: nothing may touch lazy.tx again.
	lazy.tx = nil
	if err != nil {
		return Result[T]{}, err
	}
	return res, nil
}

// commitWith stores the response and commits. On a connection Run drives
// itself both go in one round trip; the pgx.Tx is then left unclosed, which
// is harmless: the server's transaction ended with the batch, and the
// connection goes back to its pool idle.
func commitWith(ctx context.Context, tx pgx.Tx, pipelined bool, store *dbsqlc.KeyStoreResponseParams) error {
	if !pipelined {
		if err := dbsqlc.New(tx).KeyStoreResponse(ctx, *store); err != nil {
			rollback(ctx, tx)
			return translateStore("idem: store response", err)
		}
		if err := tx.Commit(ctx); err != nil {
			return translate("idem: commit", err)
		}
		return nil
	}

	batch := &pgx.Batch{}
	q := dbsqlc.New(batchQueue{batch})
	_ = q.KeyStoreResponse(ctx, *store) // queuing cannot fail
	_ = q.TxCommit(ctx)
	results := tx.SendBatch(ctx, batch)
	var tag pgconn.CommandTag
	var err error
	for range batch.Len() {
		if tag, err = results.Exec(); err != nil {
			break
		}
	}
	if closeErr := results.Close(); err == nil {
		err = closeErr
	}
	if err == nil && tag.String() == "ROLLBACK" {
		err = pgx.ErrTxCommitRollback
	}
	if err != nil {
		if tx.Conn().PgConn().TxStatus() != 'I' {
			rollback(ctx, tx)
		}
		return translateStore("idem: store response and commit", err)
	}
	return nil
}

// retry runs attempt until it succeeds, fails for good, or has failed with
// a serialization failure or deadlock MaxTxAttempts times.
func retry(ctx context.Context, attempt func() error) error {
	for n := 1; ; n++ {
		err := attempt()
		if err == nil || !guard.IsRetryable(err) {
			return err
		}
		if n == MaxTxAttempts {
			return fmt.Errorf("idem: gave up after %d attempts: %w", n, err)
		}
		if err := sleep(ctx, retryDelay(n)); err != nil {
			return err
		}
	}
}

func retryDelay(attempt int) time.Duration {
	ceiling := min(retryBaseDelay<<(attempt-1), retryMaxDelay)
	return ceiling/2 + rand.N(ceiling/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// ownConn returns the connection under beginner when it is one Run may
// drive directly, with the function that gives it back. For any other
// TxBeginner it returns a nil connection.
func ownConn(ctx context.Context, beginner TxBeginner) (*pgx.Conn, func(), error) {
	switch b := beginner.(type) {
	case *pgxpool.Pool:
		pc, err := b.Acquire(ctx)
		if err != nil {
			return nil, func() {}, err
		}
		return pc.Conn(), pc.Release, nil
	case *pgxpool.Conn:
		return b.Conn(), func() {}, nil
	case *pgx.Conn:
		return b, func() {}, nil
	}
	return nil, func() {}, nil
}

func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// lazyTx is a dbsqlc.DBTX whose transaction begins with the first statement
// sent through it, in the same round trip (pgx's Batch.BeginTx). Later
// statements run in that transaction. When tx is set from the start, it
// simply runs statements in tx.
type lazyTx struct {
	conn      *pgx.Conn
	txOptions pgx.TxOptions
	tx        pgx.Tx
}

func (l *lazyTx) current() pgx.Tx { return l.tx }

// begin sends BEGIN and sql in one batch and returns the results positioned
// at sql's.
func (l *lazyTx) begin(ctx context.Context, sql string, args []any) (pgx.BatchResults, error) {
	batch := &pgx.Batch{}
	batch.BeginTx(l.txOptions)
	batch.Queue(sql, args...)
	results := l.conn.SendBatch(ctx, batch)
	l.tx = results.Tx()
	if _, err := results.Exec(); err != nil {
		_ = results.Close()
		return nil, err
	}
	return results, nil
}

func (l *lazyTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if l.tx != nil {
		return l.tx.Exec(ctx, sql, args...)
	}
	results, err := l.begin(ctx, sql, args)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := results.Exec()
	if closeErr := results.Close(); err == nil {
		err = closeErr
	}
	return tag, err
}

func (l *lazyTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if l.tx != nil {
		return l.tx.Query(ctx, sql, args...)
	}
	return nil, errors.New("idem: a transaction cannot begin with a query returning many rows")
}

func (l *lazyTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if l.tx != nil {
		return l.tx.QueryRow(ctx, sql, args...)
	}
	results, err := l.begin(ctx, sql, args)
	if err != nil {
		return errRow{err}
	}
	return batchRow{row: results.QueryRow(), results: results}
}

// batchRow is a row from a batch; scanning it closes the batch, after which
// the transaction the batch began may be used.
type batchRow struct {
	row     pgx.Row
	results pgx.BatchResults
}

func (r batchRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if closeErr := r.results.Close(); err == nil {
		err = closeErr
	}
	return err
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// batchQueue is a dbsqlc.DBTX that queues statements on a batch instead of
// running them. Only statements without results can be queued.
type batchQueue struct{ batch *pgx.Batch }

func (q batchQueue) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.batch.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (q batchQueue) Query(context.Context, string, ...any) (pgx.Rows, error) {
	return nil, errQueuedResult
}

func (q batchQueue) QueryRow(context.Context, string, ...any) pgx.Row {
	return errRow{errQueuedResult}
}

var errQueuedResult = errors.New("idem: a queued statement cannot return rows")
