package adapter

import (
	"errors"

	"github.com/pgidem/idem"
)

// FlowFailure is why a flow's run gave its caller no answer, as an adapter
// tells its client: idemhttp answers each with a problem, idemgrpc with a
// status, and both classify the run's error here, so that a flow gets the
// same answer over either.
type FlowFailure int

const (
	// FlowFailed is any other failure: the database's (see
	// [DatabaseUnavailable]), or the server's own, such as an answer that
	// cannot be stored. The adapter answers it as any request that failed.
	FlowFailed FlowFailure = iota

	// FlowIncomplete is the flow's function's own error
	// ([idem.ErrFlowIncomplete]): a call failed, or its outcome is
	// unknown, whatever the error says. An error of the function's that
	// wraps one of idem's sentinels (a nested Run's ErrFingerprintMismatch,
	// an idemhttp.Transport's ErrInvalidKey) is still one: the client's key
	// and request are not at fault, and its retry continues the flow.
	FlowIncomplete

	// FlowChanged: the flow's steps differ from those its operation
	// recorded ([idem.ErrFlowChanged]); the same request meets it again.
	FlowChanged

	// FlowStopped: the operation was stopped for a person's decision, or
	// ended by an operator ([idem.ErrFlowStopped]).
	FlowStopped

	// FlowInProgress: another executor holds the flow past the wait
	// ([idem.ErrInProgress]), or took it over ([idem.ErrLeaseLost]).
	FlowInProgress

	// FlowKeyReused: the key's operation was recorded with another
	// fingerprint, or by another flow ([idem.ErrFingerprintMismatch]).
	FlowKeyReused

	// FlowKeyInvalid: the key breaks idem's rules ([idem.ErrInvalidKey]).
	FlowKeyInvalid

	// FlowInputNotStorable: the input read from the request cannot be
	// stored ([idem.ErrInputNotStorable]); the flow did not run.
	FlowInputNotStorable
)

// ClassifyFlowError tells why the run of a flow that returned err gave no
// answer.
func ClassifyFlowError(err error) FlowFailure {
	switch {
	// First: the function's error may wrap anything, and is the flow's
	// own whatever it wraps.
	case errors.Is(err, idem.ErrFlowIncomplete):
		return FlowIncomplete
	case errors.Is(err, idem.ErrFlowChanged):
		return FlowChanged
	case errors.Is(err, idem.ErrFlowStopped):
		return FlowStopped
	case errors.Is(err, idem.ErrInProgress), errors.Is(err, idem.ErrLeaseLost):
		return FlowInProgress
	case errors.Is(err, idem.ErrFingerprintMismatch):
		return FlowKeyReused
	case errors.Is(err, idem.ErrInvalidKey):
		return FlowKeyInvalid
	case errors.Is(err, idem.ErrInputNotStorable):
		return FlowInputNotStorable
	}
	return FlowFailed
}
