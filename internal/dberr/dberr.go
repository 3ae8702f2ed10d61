// Package dberr holds the errors that idem and its subpackages share at
// the driver's boundary: the sentinels that driver errors become, their
// translation, which of them a retry can cure, and the check that refuses a
// connection already in a transaction. The idem package re-exports the
// sentinels.
package dberr

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Errors that driver errors are translated into; see idem's documentation
// of ErrInProgress and ErrSerialization.
var (
	ErrInProgress    = errors.New("idem: key is in use")
	ErrSerialization = errors.New("idem: transaction must be retried")
)

// ErrConnInTransaction refuses a connection that is in a transaction where
// the module would begin one of its own; see idem's documentation of it.
var ErrConnInTransaction = errors.New("idem: connection is in a transaction")

// CheckIdle returns an error wrapping ErrConnInTransaction when db is a
// connection (a *pgx.Conn or a *pgxpool.Conn) in a transaction, open or
// failed, and nil otherwise. Call it before sending anything on db: on such
// a connection BEGIN is only a warning, and the COMMIT or ROLLBACK that
// follows would end the transaction in progress. advice says what to do
// instead. Other TxBeginners cannot be checked, and a closed connection
// passes: its own error says more.
func CheckIdle(db any, advice string) error {
	var conn *pgx.Conn
	switch db := db.(type) {
	case *pgx.Conn:
		conn = db
	case *pgxpool.Conn:
		conn = db.Conn()
	}
	if conn == nil || conn.IsClosed() {
		return nil
	}
	switch conn.PgConn().TxStatus() {
	case 'I':
		return nil
	case 'E':
		return fmt.Errorf("%w (a failed one, waiting for its ROLLBACK): %s", ErrConnInTransaction, advice)
	}
	return fmt.Errorf("%w: %s", ErrConnInTransaction, advice)
}

// SQLSTATE codes that are translated.
const (
	sqlstateSerializationFailure = "40001"
	sqlstateDeadlockDetected     = "40P01"
	sqlstateLockNotAvailable     = "55P03"
)

// Translate turns a driver error from one of the module's own statements
// into ErrInProgress or ErrSerialization where it means one of them, so
// that callers never inspect SQLSTATE codes. op says what was being done.
// A translated error reads as its sentinel and op, once, without the
// driver's wording ("idem: key is in use (wait for key: the wait budget ran
// out, SQLSTATE 55P03)"); the driver's error stays in the chain
// for errors.As.
func Translate(op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case sqlstateLockNotAvailable:
			return &translated{sentinel: ErrInProgress, op: op, why: "the wait budget ran out", err: err}
		case sqlstateSerializationFailure:
			return &translated{sentinel: ErrSerialization, op: op, why: "serialization failure", err: err}
		case sqlstateDeadlockDetected:
			return &translated{sentinel: ErrSerialization, op: op, why: "deadlock", err: err}
		}
	}
	return fmt.Errorf("%s: %w", op, err)
}

// translated is a driver error that means one of the sentinels.
type translated struct {
	sentinel error
	op, why  string
	err      error
}

func (t *translated) Error() string {
	var pgErr *pgconn.PgError
	code := ""
	if errors.As(t.err, &pgErr) {
		code = ", SQLSTATE " + pgErr.Code
	}
	op := strings.TrimPrefix(strings.TrimPrefix(t.op, "idem: "), "outbox: ")
	return fmt.Sprintf("%s (%s: %s%s)", t.sentinel, op, t.why, code)
}

func (t *translated) Unwrap() []error { return []error{t.sentinel, t.err} }

// IsRetryable reports whether err means the whole transaction may succeed
// if run again from the start.
func IsRetryable(err error) bool {
	if errors.Is(err, ErrSerialization) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == sqlstateSerializationFailure || pgErr.Code == sqlstateDeadlockDetected
	}
	return false
}
