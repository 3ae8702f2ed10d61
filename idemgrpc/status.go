package idemgrpc

import (
	"context"
	"errors"
	"log/slog"
	"strconv"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo that every error
// of the interceptor's own carries, with one of the reasons below.
const ErrorDomain = "github.com/pgidem/idem"

// Reasons of the errors the interceptor answers itself, in the
// google.rpc.ErrorInfo of each (domain [ErrorDomain]), so that a client
// can tell one from another without reading the message. The reasons are
// stable: a reason is never given another meaning. The table of
// https://github.com/pgidem/idem/blob/main/docs/grpc.md lists them with
// their codes and what a client should do.
const (
	// ReasonKeyMissing (INVALID_ARGUMENT): Config.Required is set and the
	// call has no key. The handler did not run. Send a key.
	ReasonKeyMissing = "KEY_MISSING"

	// ReasonKeyInvalid (INVALID_ARGUMENT): the key is empty, longer than
	// 255 bytes, sent twice, or differs between the metadata and the
	// request's key field. The handler did not run.
	ReasonKeyInvalid = "KEY_INVALID"

	// ReasonScopeUnknown (UNAUTHENTICATED): Config.Scope could not tell who
	// is calling, so the key cannot be scoped. The handler did not run.
	ReasonScopeUnknown = "SCOPE_UNKNOWN"

	// ReasonFingerprintFailed (INVALID_ARGUMENT): Config.Fingerprint could
	// not fingerprint the request. The handler did not run.
	ReasonFingerprintFailed = "FINGERPRINT_FAILED"

	// ReasonKeyReused (FAILED_PRECONDITION): the key was used before for a
	// different request (another fingerprint). The handler did not run.
	// Use a new key for a new request.
	ReasonKeyReused = "KEY_REUSED"

	// ReasonKeyInProgress (ABORTED): a call with the key is still running,
	// and did not finish within Config.Wait. The error carries a
	// google.rpc.RetryInfo, and the trailer grpc-retry-pushback-ms that
	// gRPC's own retry policy reads: retry after that delay, with the same
	// key.
	ReasonKeyInProgress = "KEY_IN_PROGRESS"

	// ReasonResponseNotStored (ALREADY_EXISTS): the call with the key
	// completed, but its answer was larger than Config.MaxResponseBytes, so
	// only its code (the ErrorInfo's metadata "code") and its metadata were
	// kept. The call will not run again: do not retry it.
	ReasonResponseNotStored = "RESPONSE_NOT_STORED"

	// ReasonRequestFailed (INTERNAL): the call did not complete, because of
	// a database error, or an error of the server's: Config.Scope gave no
	// valid scope ("" or over 255 bytes), the answer could not be stored,
	// Config.KeyField names no string field. Nothing it did was kept:
	// retrying it with the same key is safe, but the message says so only
	// when a retry can help, not for an error of the server's that the same
	// call would meet again.
	ReasonRequestFailed = "REQUEST_FAILED"

	// ReasonDatabaseUnavailable (UNAVAILABLE): the database could not be
	// reached, the connection to it broke, or the connection reached a
	// standby (a read-only server, as during a failover), so the call did
	// not complete, or completed without its answer reaching the client.
	// Retrying it later with the same key is safe: it runs again or
	// replays.
	ReasonDatabaseUnavailable = "DATABASE_UNAVAILABLE"
)

// newStatus is the error of the interceptor's own with code, reason and
// message, with its ErrorInfo and any further details.
func newStatus(code codes.Code, reason, msg string, metadata map[string]string, details ...protoadapt.MessageV1) error {
	info := &errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: metadata}
	st, err := status.New(code, msg).WithDetails(append([]protoadapt.MessageV1{info}, details...)...)
	if err != nil {
		// Only a detail that cannot be marshaled gets here, and these all
		// can.
		return status.Error(code, msg)
	}
	return st.Err()
}

// inProgress answers a call whose key another call holds past the wait:
// ABORTED with a RetryInfo, and the same delay in the trailer that gRPC's
// own retry policy reads.
func (i *interceptor) inProgress(stream grpc.ServerTransportStream) error {
	ms := strconv.FormatInt(i.retryDelay.Milliseconds(), 10)
	setMetadata(stream, nil, metadata.Pairs("grpc-retry-pushback-ms", ms))
	return newStatus(codes.Aborted, ReasonKeyInProgress,
		"idemgrpc: a call with this idempotency key is still running; retry it later with the same key", nil,
		&errdetails.RetryInfo{RetryDelay: durationpb.New(i.retryDelay)})
}

// failed answers a call whose transaction did not commit, or may not have,
// for a reason other than the handler's answer: UNAVAILABLE when the
// database is unavailable, INTERNAL otherwise, and logs err. keyed says
// whether the call has a key, with which a retry is safe.
func (i *interceptor) failed(ctx context.Context, method string, err error, keyed bool) error {
	if ctx.Err() != nil {
		// The client went away, or its deadline passed: it ended its own
		// call, and nobody is left to read the answer.
		return status.FromContextError(ctx.Err()).Err()
	}
	code, reason, msg := codes.Internal, ReasonRequestFailed, "idemgrpc: the call could not be completed"
	switch {
	case adapter.DatabaseUnavailable(err):
		code, reason, msg = codes.Unavailable, ReasonDatabaseUnavailable, "idemgrpc: the call could not be completed: the database is unavailable"
	case errors.Is(err, idem.ErrInvalidScope), errors.Is(err, idem.ErrResponseTooLarge), errors.Is(err, idem.ErrResponseNotStorable):
		// The server's own misconfiguration or bug, which the same call
		// meets again: safe to retry, since nothing was kept, but no use.
		msg += " because of an error of the server's, which retrying would meet again until the service is fixed"
		keyed = false
	}
	i.logger.LogAttrs(ctx, slog.LevelError, "idemgrpc: call failed; its transaction did not commit",
		slog.String("method", method), slog.String("code", code.String()), slog.Any("error", err))
	if keyed {
		msg += "; retrying it with the same idempotency key is safe"
	}
	return newStatus(code, reason, msg, nil)
}
