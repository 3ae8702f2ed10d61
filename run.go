package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// Run begins a transaction on db, runs [Do] in it with the same arguments,
// and commits: the usual way to make one write exactly-once when the caller
// has no transaction of its own. Like [WithTx], it retries the whole
// transaction on serialization failures and deadlocks, so that under
// SERIALIZABLE a duplicate that loses the race sees a replay, not an error.
// A replay commits its transaction, in which it wrote nothing, unless the
// server waits for a synchronous standby: then the replay answers once the
// standby has the record (docs/failover.md). A call whose context ends
// before its COMMIT returns gets the context's error, not the answer.
//
// The transaction is READ COMMITTED unless [WithTxOptions] says otherwise.
// Given a *pgxpool.Pool, *pgxpool.Conn or *pgx.Conn, Run sends BEGIN in the
// same round trip as the claim, and the record in the same round trip as
// COMMIT: a first execution costs as many round trips as fn's own
// statements in a transaction of their own, and a replay two. A
// [pgx.TxOptions] BeginQuery or CommitQuery is run as given, in a round
// trip of its own.
//
// db must not be in a transaction: a connection that is in one gives
// [ErrConnInTransaction].
func Run[T any](ctx context.Context, db TxBeginner, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), opts ...Option,
) (_ Result[T], err error) {
	o, err := newOptions(opts)
	ctx, obs := o.observer.observe(ctx, "idem.Run")
	defer func() { obs.end(ctx, scope, key, err) }()
	if err != nil {
		return Result[T]{}, err
	}
	k, err := newKeyRef(scope, key, fp)
	if err != nil {
		return Result[T]{}, err
	}
	k.fp = o.storedFingerprint(scope, k.fp)
	var res Result[T]
	err = retry(ctx, func() error {
		var err error
		res, err = runOnce(ctx, db, k, fn, &o, obs)
		return err
	})
	if err != nil {
		return Result[T]{}, err
	}
	return res, nil
}

// runOnce is one attempt of Run: lookup (WithLookupFirst), BEGIN and claim,
// fn, then the record and COMMIT.
func runOnce[T any](ctx context.Context, beginner TxBeginner, k keyRef,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), o *options, obs *observation,
) (Result[T], error) {
	conn, release, err := ownConn(ctx, beginner)
	if err != nil {
		return Result[T]{}, fmt.Errorf("idem: acquire connection: %w", err)
	}
	defer release()
	if err := dberr.CheckIdle(conn, "Run begins its own transaction: pass the pool, or call Do with the caller's transaction"); err != nil {
		return Result[T]{}, err
	}

	if conn != nil && o.lookupFirst {
		stored, found, err := lookup(ctx, dbsqlc.New(conn), k)
		if err != nil {
			return Result[T]{}, err
		}
		if found {
			obs.claimDone(outcomeReplayed)
			// The lookup's statement committed before it answered.
			if err := replayConfirmed(ctx); err != nil {
				return Result[T]{}, err
			}
			return replayed[T](stored, k.scope, o)
		}
	}

	// BEGIN travels with the claim, unless the caller's BeginQuery must run
	// as given: a batch sends each query as one statement, and a BeginQuery
	// may hold several.
	var begin *pgx.TxOptions
	var tx pgx.Tx
	switch {
	case conn != nil && o.txOptions.BeginQuery == "":
		begin = &o.txOptions
	case conn != nil:
		tx, err = conn.BeginTx(ctx, o.txOptions)
	default:
		tx, err = beginner.BeginTx(ctx, o.txOptions)
	}
	if err != nil {
		return Result[T]{}, translate("idem: begin", err)
	}
	c, tx, err := claim(ctx, tx, conn, begin, k, o)
	finished := false
	defer func() {
		if !finished && tx != nil {
			rollback(ctx, tx)
		}
	}()
	obs.claimDone(c.outcome)
	if err != nil {
		return Result[T]{}, err
	}
	if c.outcome == outcomeReplayed {
		if err := commitReplay(ctx, tx); err != nil {
			return Result[T]{}, err
		}
		finished = true
		return replayed[T](c.stored, k.scope, o)
	}

	res, s, err := execute(ctx, tx, k, c, closingFn(conn, fn), o)
	if err != nil {
		return Result[T]{}, err
	}
	finished = true
	// A CommitQuery of the caller's must run as given, outside the pipeline.
	if err := commitWith(ctx, tx, conn != nil && o.txOptions.CommitQuery == "", s); err != nil {
		return Result[T]{}, err
	}
	if err := commitConfirmed(ctx); err != nil {
		return Result[T]{}, err
	}
	return res, nil
}

// commitWith records the operation and commits. On a connection Run drives
// itself both go in one round trip; pgx's Tx is then left unclosed, which
// is harmless: the server's transaction ended with the batch, the
// connection goes back to its pool idle, and fn's Tx (fnTx) refuses what
// comes after. Nothing may touch tx afterwards: the connection may
// already serve someone else.
func commitWith(ctx context.Context, tx pgx.Tx, pipelined bool, s store) error {
	if !pipelined {
		if err := s.run(ctx, tx); err != nil {
			rollback(ctx, tx)
			return translateStore(s.c, err)
		}
		if err := tx.Commit(ctx); err != nil {
			return translate("idem: commit", err)
		}
		return nil
	}
	if tx.Conn().PgConn().TxStatus() == 'I' {
		// fn ended the transaction: what it wrote is gone or committed
		// without its record, and nothing may be recorded now.
		return fmt.Errorf("idem: store response: %w (fn ended Run's transaction)", pgx.ErrTxClosed)
	}
	batch := &pgx.Batch{}
	q := dbbatch.Queue(batch)
	_ = s.queue(ctx, q, true) // queuing cannot fail
	stored := batch.Len()
	_ = q.TxCommit(ctx)
	results := tx.SendBatch(ctx, batch)
	// Each statement's error is its own: the record's (the first of its
	// statements' on Citus) goes to translateStore, COMMIT's (a deferred
	// constraint, a serialization failure) to translate, as a COMMIT
	// outside the pipeline would.
	var storeErr error
	for range stored {
		if _, err := results.Exec(); storeErr == nil {
			storeErr = err
		}
	}
	tag, commitErr := results.Exec()
	closeErr := results.Close()
	var err error
	switch {
	case storeErr != nil:
		err = translateStore(s.c, storeErr)
	case commitErr != nil:
		err = translate("idem: commit", commitErr)
	case closeErr != nil:
		err = translate("idem: commit", closeErr)
	case tag.String() == "ROLLBACK":
		err = translate("idem: commit", pgx.ErrTxCommitRollback)
	}
	if err != nil && tx.Conn().PgConn().TxStatus() != 'I' {
		rollback(ctx, tx)
	}
	return err
}

// lookup reads the key's live record outside any transaction, and reports
// found when it holds a completed operation to replay.
func lookup(ctx context.Context, q *dbsqlc.Queries, k keyRef) (stored []byte, found bool, err error) {
	rec, err := q.KeyGet(ctx, dbsqlc.KeyGetParams{Scope: k.scope, Key: k.key})
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && (rec.Expired || rec.State != stateDone)) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, translate("idem: look up key", err)
	}
	c, err := replayOrMismatch(rec.Fingerprint, rec.Response, k.fp)
	return c.stored, err == nil, err
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

// beginSQL is the statement that begins a transaction with opts, as pgx
// spells it.
func beginSQL(opts pgx.TxOptions) string {
	if opts == (pgx.TxOptions{IsoLevel: pgx.ReadCommitted}) {
		return "begin isolation level read committed"
	}
	var b strings.Builder
	b.WriteString("begin")
	if opts.IsoLevel != "" {
		b.WriteString(" isolation level ")
		b.WriteString(string(opts.IsoLevel))
	}
	if opts.AccessMode != "" {
		b.WriteString(" ")
		b.WriteString(string(opts.AccessMode))
	}
	if opts.DeferrableMode != "" {
		b.WriteString(" ")
		b.WriteString(string(opts.DeferrableMode))
	}
	return b.String()
}
