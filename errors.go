package idem

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem/internal/guard"
)

// ErrInvalidKey is returned when a key is empty, longer than 255 bytes, not
// valid UTF-8, or contains a NUL byte. Nothing is sent to the database.
var ErrInvalidKey = errors.New("idem: invalid key")

// ErrInvalidScope is returned when a scope is empty, longer than 255 bytes,
// not valid UTF-8, or contains a NUL byte. Nothing is sent to the database.
var ErrInvalidScope = errors.New("idem: invalid scope")

// ErrInvalidOption is returned when an option has a value that cannot work,
// such as a negative retention. Nothing is sent to the database.
var ErrInvalidOption = errors.New("idem: invalid option")

// ErrInvalidVersion is returned by [Advance] when a version is negative.
// Nothing is sent to the database.
var ErrInvalidVersion = errors.New("idem: invalid version")

// ErrFingerprintMismatch is returned when a key is reused, while its record
// is live, with a request whose fingerprint differs from the one that claimed
// it. The function is not run. It usually means a client bug: one key was
// given to two different operations.
var ErrFingerprintMismatch = errors.New("idem: key reused with a different request")

// ErrInProgress is returned when another transaction holds the key and did
// not finish within the wait budget (see [WithWait]), or when the calling
// transaction already holds the key itself. The function is not run.
//
// The caller's transaction is unusable after ErrInProgress, because the
// statement that waited failed inside it: roll it back. The client should
// retry later with the same key.
var ErrInProgress = guard.ErrInProgress

// ErrResponseTooLarge is returned when the function's value, encoded as JSON,
// exceeds the limit set with [WithMaxResponseSize]. Nothing is stored and the
// claim is released; the caller should roll back.
var ErrResponseTooLarge = errors.New("idem: response too large to store")

// ErrResponseNotStorable is returned when the function's value cannot be
// stored for replay: it cannot be encoded as JSON, or its encoding holds a
// NUL character (\u0000), which PostgreSQL's jsonb rejects. Nothing is stored
// and the claim is released; the caller should roll back.
var ErrResponseNotStorable = errors.New("idem: response cannot be stored")

// ErrSerialization is returned when PostgreSQL aborted the transaction to
// keep it serializable (SQLSTATE 40001) or to break a deadlock (40P01). Under
// REPEATABLE READ and SERIALIZABLE it is how a claim learns that the key was
// completed after the transaction's snapshot was taken. The whole transaction
// must be retried; [Run] and [WithTx] do so on their own.
var ErrSerialization = guard.ErrSerialization

// translate turns driver errors from the package's own statements into the
// package's sentinel errors (see [guard.Translate]).
func translate(op string, err error) error { return guard.Translate(op, err) }

// errClaimLost is what storing a response gives when the calling
// transaction's claim is gone: only fn itself can have removed it.
var errClaimLost = errors.New("idem: the claim was removed before its response was stored (did fn change the record?)")

// translateStore is translate for the statement that stores a response,
// whose division_by_zero means the claim was lost (see KeyStoreResponse).
func translateStore(op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "22012" {
		return fmt.Errorf("%s: %w", op, errClaimLost)
	}
	return translate(op, err)
}
