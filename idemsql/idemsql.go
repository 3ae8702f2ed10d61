package idemsql

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Do is [idem.Do] in the caller's *sql.Tx: fn runs with tx, and its
// writes commit with the key's record or not at all. The semantics,
// options and errors are idem.Do's.
func Do[T any](ctx context.Context, tx *sql.Tx, scope, key string, fp []byte,
	fn func(ctx context.Context, tx *sql.Tx) (T, error), opts ...idem.Option,
) (idem.Result[T], error) {
	return idem.Do(ctx, wrap(tx), scope, key, fp, withSQLTx(fn), opts...)
}

// Run is [idem.Run] on a *sql.DB: it begins a transaction on db, runs
// [Do] in it and commits, retrying serialization failures and deadlocks.
// fn gets the *sql.Tx that idem's claim and record are in: the ORM's
// writes made on it (gorm.DB.Session with it as ConnPool, sqlx.Tx{Tx: tx},
// a sqlc Queries.WithTx) commit with the record or roll back with it. A
// write made on db itself, or on another transaction, is outside the
// operation and is not undone when fn fails. [idem.WithLookupFirst] is
// ignored (see the package documentation).
func Run[T any](ctx context.Context, db *sql.DB, scope, key string, fp []byte,
	fn func(ctx context.Context, tx *sql.Tx) (T, error), opts ...idem.Option,
) (idem.Result[T], error) {
	return idem.Run(ctx, Beginner(db), scope, key, fp, withSQLTx(fn), opts...)
}

// Once is [idem.Once] in the caller's *sql.Tx.
func Once(ctx context.Context, tx *sql.Tx, scope, id string, fn func(ctx context.Context, tx *sql.Tx) error, opts ...idem.Option) (bool, error) {
	return idem.Once(ctx, wrap(tx), scope, id, func(ctx context.Context, ptx pgx.Tx) error {
		return driverError(fn(ctx, sqlTxOf(ptx)))
	}, opts...)
}

// OnceEach is [idem.OnceEach] in the caller's *sql.Tx: a batch of
// messages claimed in one statement, fn called with tx for each id not
// handled before.
func OnceEach(ctx context.Context, tx *sql.Tx, scope string, ids []string, fn func(ctx context.Context, tx *sql.Tx, i int) error, opts ...idem.Option) ([]bool, error) {
	return idem.OnceEach(ctx, wrap(tx), scope, ids, func(ctx context.Context, ptx pgx.Tx, i int) error {
		return driverError(fn(ctx, sqlTxOf(ptx), i))
	}, opts...)
}

// Advance is [idem.Advance] in the caller's *sql.Tx.
func Advance(ctx context.Context, tx *sql.Tx, scope, entity string, version int64) (bool, error) {
	return idem.Advance(ctx, wrap(tx), scope, entity, version)
}

// WithTx is [idem.WithTx] on a *sql.DB: fn runs in a transaction begun
// with txOptions (see [Beginner] for those database/sql can express),
// retried on serialization failures and deadlocks, and committed when it
// returns nil.
func WithTx(ctx context.Context, db *sql.DB, txOptions pgx.TxOptions, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return idem.WithTx(ctx, Beginner(db), txOptions, func(ctx context.Context, ptx pgx.Tx) error {
		return driverError(fn(ctx, sqlTxOf(ptx)))
	})
}

// Local is [idem.Local] for a flow run on [Beginner]: the step's fn gets
// the step's *sql.Tx, whose writes commit with the step's result.
func Local[T any](s *idem.Steps, name string, fn func(ctx context.Context, tx *sql.Tx) (T, error)) (T, error) {
	return idem.Local(s, name, func(ctx context.Context, ptx pgx.Tx) (T, error) {
		tx, ok := Unwrap(ptx)
		if !ok {
			var zero T
			return zero, fmt.Errorf("idemsql: step %q: the flow runs on pgx: run it on idemsql.Beginner(db), or use idem.Local", name)
		}
		v, err := fn(ctx, tx)
		return v, driverError(err)
	})
}

// Unwrap returns the *sql.Tx under a pgx.Tx that idem handed to a function
// running on [Beginner]: the transaction idemhttp.Tx returns to a handler
// of middleware built on Beginner(db), for instance. ok is false for a
// transaction of pgx's own.
func Unwrap(tx pgx.Tx) (_ *sql.Tx, ok bool) {
	t, ok := tx.(*sqlTx)
	if !ok {
		return nil, false
	}
	return t.tx, true
}

// withSQLTx gives fn the *sql.Tx. Every function of the caller's passes
// its error through driverError, so that a server's error from the
// function's own statements (a serialization failure on lib/pq, whose
// *pq.Error is no *pgconn.PgError) is recognised as on pgx: Run and WithTx
// retry it.
func withSQLTx[T any](fn func(ctx context.Context, tx *sql.Tx) (T, error)) func(context.Context, pgx.Tx) (T, error) {
	return func(ctx context.Context, ptx pgx.Tx) (T, error) {
		v, err := fn(ctx, sqlTxOf(ptx))
		return v, driverError(err)
	}
}

// sqlTxOf is the *sql.Tx of a transaction this package made: idem hands
// a function the pgx.Tx it was given.
func sqlTxOf(tx pgx.Tx) *sql.Tx { return tx.(*sqlTx).tx }
