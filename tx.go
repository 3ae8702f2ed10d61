package idem

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// TxBeginner begins transactions. *pgxpool.Pool, *pgxpool.Conn and
// *pgx.Conn satisfy it.
type TxBeginner interface {
	BeginTx(ctx context.Context, txOptions pgx.TxOptions) (pgx.Tx, error)
}

// WithTx runs fn in a transaction begun on db with txOptions and commits it
// when fn returns nil. When fn returns an error or panics, the transaction
// is rolled back.
//
// When the transaction fails with a serialization failure (SQLSTATE 40001)
// or a deadlock (40P01), anywhere including at COMMIT, WithTx runs fn again
// in a new transaction, after a short jittered backoff, up to 10 times in
// all, then returns the last error, which wraps [ErrSerialization]. fn must
// therefore do nothing that cannot be rolled back. A failed COMMIT is
// reported as an error.
//
// The rollback after a failure runs even when ctx has ended, so that the
// transaction's locks are released at once, but for at most one second:
// WithTx, [Run] and [Do] return at most about a second after ctx ends, even
// on a connection that no longer answers.
//
// db must not be in a transaction: a connection that is in one gives
// [ErrConnInTransaction], and fn is not run.
func WithTx(ctx context.Context, db TxBeginner, txOptions pgx.TxOptions, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return retry(ctx, func() error {
		if err := dberr.CheckIdle(db, "WithTx begins its own transaction: pass the pool, or run fn in the caller's transaction"); err != nil {
			return err
		}
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

// maxTxAttempts is how many times Run and WithTx run a transaction that
// PostgreSQL keeps aborting with a serialization failure or a deadlock.
const maxTxAttempts = 10

// Backoff between attempts: full jitter over an exponentially growing cap.
const (
	retryBaseDelay = 2 * time.Millisecond
	retryMaxDelay  = 250 * time.Millisecond
)

// retry runs attempt until it succeeds, fails for good, or has failed with
// a serialization failure or deadlock maxTxAttempts times.
func retry(ctx context.Context, attempt func() error) error {
	for n := 1; ; n++ {
		err := attempt()
		if err == nil || !dberr.IsRetryable(err) {
			return err
		}
		if n == maxTxAttempts {
			return fmt.Errorf("idem: gave up after %d attempts: %w", n, err)
		}
		if err := backoff.Sleep(ctx, backoff.Jitter(n, retryBaseDelay, retryMaxDelay)); err != nil {
			return err
		}
	}
}

// cleanupTimeout bounds each statement that cleans up after a failure (a
// rollback, the release of a claim written early). It runs on a context
// that is not cancelled with the caller's, so that a cancelled caller still
// releases its locks at once, and it ends after cleanupTimeout, so that a
// dead connection cannot keep the caller waiting: pgx then closes the
// connection, and the server ends the transaction with it.
const cleanupTimeout = time.Second

func cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
}

func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// batchSender sends batches: a pool or a connection.
type batchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// sendBatch sends b on db, in one implicit transaction of its own: on a
// pool or connection directly, in one round trip; on any other TxBeginner
// in a transaction begun for it.
func sendBatch(ctx context.Context, db TxBeginner, b *pgx.Batch) error {
	if s, ok := db.(batchSender); ok {
		return s.SendBatch(ctx, b).Close()
	}
	return WithTx(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
		return tx.SendBatch(ctx, b).Close()
	})
}

// onDB runs fn's statement on db, in a transaction of its own: on a pool or
// connection directly, as one statement, which PostgreSQL runs as a
// transaction of its own, in one round trip instead of three (BEGIN, the
// statement, COMMIT); on any other TxBeginner in a transaction begun for
// it.
func onDB(ctx context.Context, db TxBeginner, fn func(q *dbsqlc.Queries) error) error {
	if d, ok := db.(dbsqlc.DBTX); ok {
		return fn(dbsqlc.New(d))
	}
	return WithTx(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
		return fn(dbsqlc.New(tx))
	})
}
