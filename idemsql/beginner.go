package idemsql

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Beginner returns db as an [idem.TxBeginner], for the calls of idem and
// its packages that begin transactions of their own: [idem.Flow]'s Run
// and Resume, idemhttp.NewMiddleware, [idem.Inspect], [idem.Purge]. The
// transactions it begins are database/sql's; a function that idem runs in
// one gets it as a pgx.Tx, and [Unwrap] returns its *sql.Tx.
//
// database/sql expresses a pgx.TxOptions' IsoLevel and AccessMode; a
// DeferrableMode, BeginQuery or CommitQuery cannot be carried, and
// BeginTx refuses them with an error wrapping [idem.ErrInvalidOption]
// before anything is sent. A statement idem runs outside any transaction
// (a lease's renewal, a purge's batch) goes to db as a statement of its
// own.
func Beginner(db *sql.DB) idem.TxBeginner { return &beginner{exec: exec{q: db}, db: db} }

type beginner struct {
	exec
	db *sql.DB
}

func (b *beginner) BeginTx(ctx context.Context, o pgx.TxOptions) (pgx.Tx, error) {
	opts, err := sqlTxOptions(o)
	if err != nil {
		return nil, err
	}
	tx, err := b.db.BeginTx(ctx, opts)
	if err != nil {
		return nil, driverError(err)
	}
	return wrap(tx), nil
}

// sqlTxOptions is o as database/sql spells it, or an error for what it
// cannot spell.
func sqlTxOptions(o pgx.TxOptions) (*sql.TxOptions, error) {
	switch {
	case o.DeferrableMode == pgx.Deferrable:
		return nil, fmt.Errorf("%w: idemsql: database/sql cannot begin a DEFERRABLE transaction", idem.ErrInvalidOption)
	case o.BeginQuery != "" || o.CommitQuery != "":
		return nil, fmt.Errorf("%w: idemsql: database/sql begins and commits its transactions itself: no BeginQuery or CommitQuery", idem.ErrInvalidOption)
	}
	opts := &sql.TxOptions{ReadOnly: o.AccessMode == pgx.ReadOnly}
	switch o.IsoLevel {
	case "":
	case pgx.ReadCommitted:
		opts.Isolation = sql.LevelReadCommitted
	case pgx.RepeatableRead:
		opts.Isolation = sql.LevelRepeatableRead
	case pgx.Serializable:
		opts.Isolation = sql.LevelSerializable
	case pgx.ReadUncommitted:
		opts.Isolation = sql.LevelReadUncommitted
	default:
		return nil, fmt.Errorf("%w: idemsql: isolation level %q", idem.ErrInvalidOption, o.IsoLevel)
	}
	return opts, nil
}
