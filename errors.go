package idem

import (
	"errors"
	"fmt"

	"github.com/pgidem/idem/internal/dberr"
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

// FieldError is the one form in which idem and its subpackages refuse a
// value that cannot work: an option, a field of a configuration or an
// argument of a constructor. It names the value and says what is wrong,
// as "idemhttp: Config.Wait: must not exceed ...", and wraps
// [ErrInvalidOption], and Err when another error refused the value.
// Nothing is sent to the database.
type FieldError struct {
	// Package is the package that refused the value, such as "idemhttp".
	Package string
	// Field names the value as its caller wrote it, such as
	// "WithTxOptions.AccessMode" or "Config.Wait", or the function whose
	// argument it is, such as "StartRelay" (the problem then names the
	// argument).
	Field string
	// Problem says what is wrong with the value.
	Problem string
	// Err is the error that refused the value, if any.
	Err error
}

func (e *FieldError) Error() string { return e.Package + ": " + e.Field + ": " + e.Problem }

// Unwrap returns ErrInvalidOption, and Err when there is one.
func (e *FieldError) Unwrap() []error {
	if e.Err == nil {
		return []error{ErrInvalidOption}
	}
	return []error{ErrInvalidOption, e.Err}
}

// ErrInvalidVersion is returned by [Advance] when a version is negative.
// Nothing is sent to the database.
var ErrInvalidVersion = errors.New("idem: invalid version")

// ErrFingerprintMismatch is returned when a key is reused, while its record
// is live, with a request whose fingerprint differs from the one that
// recorded it. The function is not run, and the caller's transaction stays
// usable. It usually means a client bug: one key was given to two different
// operations.
var ErrFingerprintMismatch = errors.New("idem: key reused with a different request")

// ErrInProgress is returned when another transaction holds the key and did
// not finish within the wait budget (see [WithWait]). The function is not
// run, but in one case: a key that the other transaction holds by a record
// in progress (past its [MaxKeyLocks], or in an [OnceEach] batch), which
// the duplicate meets only when it stores its own record, after fn (see
// [Do]); fn's writes then roll back with the transaction.
//
// After a wait that ran out, the caller's transaction is aborted, because
// the statement that waited failed inside it: roll it back. The client
// should retry later with the same key.
var ErrInProgress = dberr.ErrInProgress

// ErrReadOnly is returned when the transaction is read-only, or the server
// a standby (a connection that reached a replica, as after a failover when
// the connection string does not ask for target_session_attrs=read-write):
// idem cannot record a key there. Nothing was written and no lock taken;
// the transaction stays usable. Run the call in a read-write transaction
// on the primary.
var ErrReadOnly = errors.New("idem: transaction is read-only")

// errReadOnly is ErrReadOnly as the claim reports it.
var errReadOnly = fmt.Errorf("%w (a read-only transaction, or a standby server): idem records keys only in a read-write transaction on the primary", ErrReadOnly)

// ErrResponseTooLarge is returned when the function's value, encoded as JSON,
// exceeds the limit set with [WithMaxResponseSize]. Nothing is stored (a
// claim written early, at REPEATABLE READ or SERIALIZABLE, is removed), and
// the caller's transaction stays usable; roll it back, since fn's writes
// have no record.
var ErrResponseTooLarge = errors.New("idem: response too large to store")

// ErrResponseNotStorable is returned when the function's value cannot be
// stored for replay: it cannot be encoded as JSON, or its encoding is
// something PostgreSQL's jsonb rejects (a NUL character, a lone UTF-16
// surrogate, invalid UTF-8, a number beyond numeric's range). The value is
// not sent (a claim written early, at REPEATABLE READ or SERIALIZABLE, is
// removed), and the caller's transaction stays usable; roll it back, since
// fn's writes have no record.
var ErrResponseNotStorable = errors.New("idem: response cannot be stored")

// ErrInputNotStorable is in the chain of the error [Flow.Run] returns when
// the flow's input cannot be stored, with [ErrResponseTooLarge] or
// [ErrResponseNotStorable], which says why. Nothing is sent to the
// database and the flow does not run. A [Codec] that fails to seal the
// input is the server's failure, not the input's: its error has
// ErrResponseNotStorable in its chain, but not this one. The input comes from the request, so
// the request cannot be served as it is, however often it is retried: at
// HTTP it is 422 input-not-storable.
var ErrInputNotStorable = errors.New("idem: flow's input cannot be stored")

// ErrSerialization is returned when PostgreSQL aborted the transaction to
// keep it serializable (SQLSTATE 40001) or to break a deadlock (40P01), or
// when the key was completed while the function ran by a writer that does
// not wait for the key's lock (an older idem, a hand-written statement).
// Under REPEATABLE READ and SERIALIZABLE it is how a claim learns that the
// key was completed after the transaction's snapshot was taken. The whole
// transaction must be retried; [Run] and [WithTx] do so on their own, and
// the retry replays the key's answer.
var ErrSerialization = dberr.ErrSerialization

// ErrConnInTransaction is returned by [Run], [WithTx], [Purge],
// [StartPurger] and the outbox's StartRelay when db is a *pgx.Conn or
// *pgxpool.Conn that is in a transaction, open or failed: they begin and
// end transactions of their own, and on such a connection BEGIN is only a
// warning, so their COMMIT or ROLLBACK would end the caller's transaction
// part-way. Nothing is sent: the caller's transaction is as it was, still
// the caller's to commit or roll back. Pass the pool or an idle
// connection, or, to make a write exactly-once in the caller's
// transaction, call [Do] with it.
var ErrConnInTransaction = dberr.ErrConnInTransaction

// translate turns driver errors from the package's own statements into the
// package's sentinel errors (see [dberr.Translate]).
func translate(op string, err error) error { return dberr.Translate(op, err) }

// ErrLeaseLost is returned by a step of a [Flow], and by [Flow.Run], when
// the executor no longer holds the flow: its lease ran out before it could
// renew it (the process stalled, the database was out of reach), and
// another executor may have taken the flow over, or an operator ended the
// flow ([EndFlow]). Nothing the step tried to commit was committed. Return
// it from the flow's function: the flow is the other executor's to finish,
// and a retry with the same key waits for it and replays its answer.
var ErrLeaseLost = errors.New("idem: flow's lease was lost")

// ErrFlowIncomplete is in the chain of the error [Flow.Run] and
// [Flow.Resume] return when the flow's function returned an error (a call
// that failed, or whose outcome is not known, wrapped by [Call]; a local
// step's error): nothing of the error was stored, the flow stays in
// progress with its lease given up, and the next run continues it from
// its first incomplete step. The function's own error is in the chain
// too. At HTTP it is 503 operation-incomplete: retrying with the same key
// continues the operation.
var ErrFlowIncomplete = errors.New("idem: flow did not complete")

// ErrFlowChanged is returned by a step of a [Flow] resumed with steps other
// than those its earlier runs recorded: a step of another name or kind at
// the place of a recorded one, as after a deployment that changed the
// flow's function while flows were in progress. The step does not run and
// nothing is called. The flow stays as it was, for a version of the
// function that takes the recorded steps to resume, or for an operator to
// end ([EndFlow]).
var ErrFlowChanged = errors.New("idem: flow's steps differ from those recorded")

// ErrFlowStopped is returned by [Flow.Run] for a flow that will not run
// again: one that needs a person's decision, because a call it had started
// could not be made again safely (see [WithProviderWindow]), or one that an
// operator ended ([EndFlow]). The error says which; [InspectFlow] shows the
// flow's steps and its last error. Retrying does not help: the client
// should be told that the operation needs attention.
var ErrFlowStopped = errors.New("idem: flow stopped")

// ErrNotSent is for a [Call]'s function to wrap in the error it returns
// when the attempt surely did not reach the other system: the connection
// was refused, the host's name did not resolve, the request was never
// written. The call is then not counted as one that may have been
// applied: when no earlier attempt may have been either, the next attempt
// calls as if it were the first, whatever [AtMostOnce] and
// [WithProviderWindow] say. idemhttp.Transport and idemgrpc's client
// interceptor wrap it in the errors they are sure of. Wrap it in nothing
// else: an attempt whose request may have left must stay uncertain.
var ErrNotSent = errors.New("idem: the call was not sent")

// ErrOutcomeUnknown is in the chain of the error [Call] returns for a
// [BestEffort] call whose attempt may have reached the other system: its
// outcome is recorded as unknown, the call is never made again, and every
// later run of the flow gets the same error from it. The flow is not
// stopped: its function decides what an unknown outcome means (for a
// notification, usually nothing), and goes on.
var ErrOutcomeUnknown = errors.New("idem: the call's outcome is unknown")

// ErrFlowNotStopped is returned by [ResolveFlow] and [Flow.Resolve] for a
// flow that is not stopped for a person's decision: running (resolved
// already, perhaps by someone else), done, ended, or none for the key.
// Nothing was written.
var ErrFlowNotStopped = errors.New("idem: flow is not stopped for attention")

// ErrStepMismatch is returned by [ResolveFlow] and [Flow.Resolve] for a
// resolution of a step other than the call the flow stopped at
// ([FlowInfo].Step). Nothing was written.
var ErrStepMismatch = errors.New("idem: the flow stopped at another step")

// ErrFlowSealed is returned by [ResolveFlow] for a resolution with a
// result of a flow whose records are sealed by a [Codec]: the result must
// be sealed too, by [Flow.Resolve]. Nothing was written.
var ErrFlowSealed = errors.New("idem: the flow's records are sealed by a codec")
