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
	return runTx(ctx, db, txOptions, func(ctx context.Context, tx pgx.Tx, _ *statementQueue) error {
		return fn(ctx, tx)
	})
}

// Run begins a transaction on db, runs [Do] in it with the same arguments,
// and commits: the usual way to make one write exactly-once when the caller
// has no transaction of its own. Like [WithTx], it retries the whole
// transaction on serialization failures and deadlocks, so that under
// SERIALIZABLE a duplicate that loses the race sees a replay, not an error.
//
// The transaction is READ COMMITTED unless [WithTxOptions] says otherwise.
// Given a *pgxpool.Pool, *pgxpool.Conn or *pgx.Conn, Run stores the value in
// the same round trip as COMMIT.
func Run[T any](ctx context.Context, db TxBeginner, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), opts ...Option,
) (Result[T], error) {
	o, err := newOptions(opts)
	if err != nil {
		return Result[T]{}, err
	}
	if err := checkScopeAndKey(scope, key); err != nil {
		return Result[T]{}, err
	}
	var res Result[T]
	err = runTx(ctx, db, o.txOptions, func(ctx context.Context, tx pgx.Tx, beforeCommit *statementQueue) error {
		var store *dbsqlc.KeyStoreResponseParams
		var err error
		res, store, err = attempt(ctx, tx, scope, key, fp, fn, o)
		if err != nil || store == nil {
			return err
		}
		return beforeCommit.queries().KeyStoreResponse(ctx, *store)
	})
	if err != nil {
		return Result[T]{}, err
	}
	return res, nil
}

// txWork is one attempt's work in a transaction. Statements it puts on
// beforeCommit run after it returns, ahead of COMMIT, in the same round trip
// where the connection allows it.
type txWork func(ctx context.Context, tx pgx.Tx, beforeCommit *statementQueue) error

func runTx(ctx context.Context, beginner TxBeginner, txOptions pgx.TxOptions, work txWork) error {
	for attempt := 1; ; attempt++ {
		err := runTxOnce(ctx, beginner, txOptions, work)
		if err == nil || !isRetryable(err) {
			return err
		}
		if attempt == MaxTxAttempts {
			return fmt.Errorf("idem: gave up after %d attempts: %w", attempt, err)
		}
		if err := sleep(ctx, retryDelay(attempt)); err != nil {
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

func runTxOnce(ctx context.Context, beginner TxBeginner, txOptions pgx.TxOptions, work txWork) (err error) {
	conn, release, err := ownConn(ctx, beginner)
	if err != nil {
		return fmt.Errorf("idem: acquire connection: %w", err)
	}
	defer release()

	var tx pgx.Tx
	if conn != nil {
		tx, err = conn.BeginTx(ctx, txOptions)
	} else {
		tx, err = beginner.BeginTx(ctx, txOptions)
	}
	if err != nil {
		return translate("idem: begin", err)
	}
	finished := false
	defer func() {
		if !finished {
			rollback(ctx, tx)
		}
	}()

	var beforeCommit statementQueue
	if err := work(ctx, tx, &beforeCommit); err != nil {
		return err
	}
	finished = true
	if conn != nil && beforeCommit.len() > 0 {
		return commitPipelined(ctx, tx, &beforeCommit)
	}
	if beforeCommit.len() > 0 {
		if err := beforeCommit.send(ctx, tx); err != nil {
			rollback(ctx, tx)
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return translate("idem: commit", err)
	}
	return nil
}

// ownConn returns the connection under beginner when it is one Run may
// drive directly (to commit in a pipeline), with the function that gives it
// back. For any other TxBeginner it returns a nil connection.
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

// commitPipelined sends the queued statements and COMMIT in one round trip.
// The pgx.Tx is left behind unclosed: the server's transaction ended with
// the batch, and the connection is ours, so nothing else will use it.
func commitPipelined(ctx context.Context, tx pgx.Tx, q *statementQueue) error {
	if err := q.queries().TxCommit(ctx); err != nil {
		return err
	}
	err := q.send(ctx, tx)
	if err != nil {
		if tx.Conn().PgConn().TxStatus() != 'I' {
			rollback(ctx, tx)
		}
		return err
	}
	if q.lastTag.String() == "ROLLBACK" {
		return translate("idem: commit", pgx.ErrTxCommitRollback)
	}
	return nil
}

func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// statementQueue collects statements from the generated queries instead of
// running them, so that they can be sent together in one pipeline.
type statementQueue struct {
	batch   pgx.Batch
	lastTag pgconn.CommandTag
}

func (q *statementQueue) queries() *dbsqlc.Queries { return dbsqlc.New(q) }

func (q *statementQueue) len() int { return q.batch.Len() }

// Exec queues sql; its result is read by send.
func (q *statementQueue) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.batch.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

// Query is not supported: only statements without results can be queued.
func (q *statementQueue) Query(context.Context, string, ...any) (pgx.Rows, error) {
	return nil, errQueuedResult
}

// QueryRow is not supported: only statements without results can be queued.
func (q *statementQueue) QueryRow(context.Context, string, ...any) pgx.Row {
	return errRow{}
}

var errQueuedResult = errors.New("idem: a queued statement cannot return rows")

type errRow struct{}

func (errRow) Scan(...any) error { return errQueuedResult }

// send runs the queued statements in one round trip and reports the first
// failure.
func (q *statementQueue) send(ctx context.Context, tx pgx.Tx) error {
	results := tx.SendBatch(ctx, &q.batch)
	for range q.batch.Len() {
		tag, err := results.Exec()
		if err != nil {
			_ = results.Close()
			return translate("idem: finish transaction", err)
		}
		q.lastTag = tag
	}
	if err := results.Close(); err != nil {
		return translate("idem: finish transaction", err)
	}
	return nil
}
