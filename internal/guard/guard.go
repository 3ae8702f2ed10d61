// Package guard holds what idem and its subpackages share at their
// boundaries: the errors that driver errors become, and the rules for the
// identifiers they accept. The idem package re-exports the errors.
package guard

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// MaxIdentifierLength is the longest scope, key or name accepted, in bytes.
const MaxIdentifierLength = 255

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

// CheckIdentifier applies the rules for scopes, keys and names: 1 to
// MaxIdentifierLength bytes of valid UTF-8 without NUL. Out-of-bounds input
// is rejected, never truncated, because truncation turns distinct
// identifiers into one. The error says what is wrong, without the value.
func CheckIdentifier(s string) error {
	switch {
	case s == "":
		return errors.New("empty")
	case len(s) > MaxIdentifierLength:
		return fmt.Errorf("%d bytes, more than %d", len(s), MaxIdentifierLength)
	case !utf8.ValidString(s):
		return errors.New("not valid UTF-8")
	case strings.IndexByte(s, 0) >= 0:
		return errors.New("contains a NUL byte")
	}
	return nil
}

// LockTag fills the top 16 bits of every key's lock id, so that idem's
// advisory locks can be told from an application's in pg_locks, where the
// top half of a bigint lock id is classid: classid >> 16 is LockTag.
//
// idem's lock ids are thus the bigints 0x1de0000000000000 to
// 0x1de0ffffffffffff (2152720621883097088 to 2153002096859807743), which
// pg_locks shows as locktype advisory, objsubid 1, classid 501219328 to
// 501284863. Nothing else tells idem's locks from others: idem stats, idem
// inspect and idem_key_lock count every bigint advisory lock of this
// database in that range as idem's, an application's own included. An
// application that takes advisory locks by bigint id should keep its ids out
// of the range; ids spread over all bigints, as hashtextextended's are, land
// in it once in 65,536. Locks taken with two int keys (objsubid 2) are
// never counted.
const LockTag = 0x1de0

// LockID is the id of the transaction-scoped advisory lock that a call
// holds on (scope, key) from its claim until its transaction ends. pg_locks
// shows it as locktype advisory, objsubid 1, classid its top 32 bits and
// objid its bottom 32. Below LockTag, it is a 48-bit FNV-1a hash of scope
// and key: two keys with the same hash only wait for each other, and the
// primary key, not the lock, keeps their records apart. See LockTag for the
// range of ids this gives, and what else may hold one.
func LockID(scope, key string) int64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := range len(scope) {
		h = (h ^ uint64(scope[i])) * prime
	}
	h *= prime // a NUL byte between them: no identifier holds one
	for i := range len(key) {
		h = (h ^ uint64(key[i])) * prime
	}
	return LockTag<<48 | int64(h&(1<<48-1))
}
