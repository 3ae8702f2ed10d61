package idemgrpc

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
)

// Reasons of the errors that [RunFlow] answers for a flow, beside
// [ReasonKeyInProgress], [ReasonKeyReused], [ReasonKeyInvalid],
// [ReasonDatabaseUnavailable] and [ReasonRequestFailed], which mean for a
// flow what they mean for any call.
const (
	// ReasonOperationIncomplete (UNAVAILABLE): the flow serving the call
	// did not complete: a call it makes to another system failed, or its
	// outcome is not known yet, or one of its local steps failed. Nothing
	// of the failure was kept. The error carries a google.rpc.RetryInfo,
	// and the trailer grpc-retry-pushback-ms: retrying with the same key,
	// after that delay, continues the operation where it stopped, without
	// repeating what it completed, and calls the other system again with
	// the same provider key.
	ReasonOperationIncomplete = "OPERATION_INCOMPLETE"

	// ReasonOperationStopped (FAILED_PRECONDITION): the operation with the
	// key was stopped, for a person to decide what became of it (a call it
	// had started could no longer be made again safely), or an operator
	// ended it ([idem.EndFlow]). It will not run again: do not retry; the
	// service's operators know of it.
	ReasonOperationStopped = "OPERATION_STOPPED"

	// ReasonInputNotStorable (INVALID_ARGUMENT): the flow's input, which
	// the handler built from the request, cannot be stored: it is larger
	// than the flow stores, or holds what PostgreSQL cannot (a NUL
	// character, a number out of range). The flow did not run and nothing
	// was recorded. The same request gets the same answer: do not retry
	// it; fix it.
	ReasonInputNotStorable = "INPUT_NOT_STORABLE"
)

// incompleteRetryDelay is the RetryInfo of an UNAVAILABLE
// OPERATION_INCOMPLETE: the least wait, not a promise, as idemhttp's
// Retry-After of one second.
const incompleteRetryDelay = time.Second

// RunFlow runs flow for the call whose context is ctx, with input in, and
// returns its answer: the handler of a method that [Config.Flows] lists
// calls it, and builds its response from the answer. The flow runs under
// the call's scope, key and fingerprint, which the interceptor read as it
// does for every covered call ([Config.Scope], [Config.Metadata],
// [Config.KeyField], [Config.Fingerprint]: by default the full method name
// and the request), with [Config.Wait]; no transaction is open and no
// connection held while it runs, but in each of its local steps, briefly.
//
//	func (s *payments) Checkout(ctx context.Context, req *pb.CheckoutRequest) (*pb.Receipt, error) {
//		out, err := idemgrpc.RunFlow(ctx, s.checkout, order{AmountCents: req.GetAmountCents()})
//		if err != nil {
//			return nil, err // a status already
//		}
//		if out.Declined {
//			return nil, status.Error(codes.FailedPrecondition, "card declined")
//		}
//		return &pb.Receipt{ChargeId: out.ChargeID}, nil
//	}
//
// A retry of a completed flow gets its stored answer without running
// anything, and RunFlow sets the header metadata idempotent-replayed:
// true. What is stored is the flow's answer, as JSON, not the response
// message: the handler must build the same response, or the same error,
// from the same answer. A definite failure (a declined card) is part of
// the answer, so that every retry gets it again; [Config.Store] does not
// apply. How the flow stores its records is the flow's own affair, set by
// the options given to [idem.NewFlow], which its completer
// ([idem.Flow.Resume]) uses too: the fields of Config that concern stored
// answers (Retention, Codec, Observer, MaxResponseBytes, LookupFirst,
// TxOptions) do not apply to flows.
//
// When the flow gives no answer, RunFlow returns a status error, for the
// handler to return as it is (the table in docs/grpc.md lists them):
//
//   - the flow did not complete ([idem.ErrFlowIncomplete]: a call failed
//     or its outcome is unknown, whatever sentinel of idem's the
//     function's error wraps, as over idemhttp): UNAVAILABLE, reason
//     [ReasonOperationIncomplete], with a RetryInfo of one second and the
//     trailer grpc-retry-pushback-ms; the client's retry with the same key
//     continues the flow where it stopped. The flow's own error is logged,
//     not sent: it may hold what a provider said;
//   - another call with the key holds the flow past [Config.Wait]
//     ([idem.ErrInProgress], or [idem.ErrLeaseLost]: another executor took
//     it over): ABORTED, reason [ReasonKeyInProgress], with a RetryInfo,
//     as for any call;
//   - the key was used for another request, or by another flow
//     ([idem.ErrFingerprintMismatch]): FAILED_PRECONDITION, reason
//     [ReasonKeyReused];
//   - the flow was stopped for a person's decision, or ended by an
//     operator ([idem.ErrFlowStopped]): FAILED_PRECONDITION, reason
//     [ReasonOperationStopped], logged: do not retry;
//   - the input cannot be stored ([idem.ErrInputNotStorable]):
//     INVALID_ARGUMENT, reason [ReasonInputNotStorable], and the flow does
//     not run;
//   - the flow's steps differ from those its operation recorded
//     ([idem.ErrFlowChanged]), or its answer cannot be stored: INTERNAL,
//     reason [ReasonRequestFailed], logged, whose message does not invite
//     a retry: the same call would meet it again;
//   - the database cannot be reached: UNAVAILABLE, reason
//     [ReasonDatabaseUnavailable]; another failure of the database:
//     INTERNAL, reason [ReasonRequestFailed]; both logged, and safe to
//     retry with the same key;
//   - the client went away, or its deadline passed: CANCELLED or
//     DEADLINE_EXCEEDED; the flow gave its lease up and a retry continues
//     it.
//
// Called from a method that Config.Flows does not list, RunFlow runs
// nothing and returns INTERNAL (reason [ReasonRequestFailed]), logged to
// slog.Default(): under a covered method's transaction, a flow would hold
// it, and a pooled connection, across its calls to other systems, which
// exhausts the pool under load; outside the interceptor, it has no key. A
// panic of the flow's function gives the flow's lease up and goes on up
// the interceptor chain, as a handler's does.
func RunFlow[In, Out any](ctx context.Context, flow *idem.Flow[In, Out], in In) (Out, error) {
	var zero Out
	v, _ := ctx.Value(callKey{}).(callValues)
	if v.flows == nil {
		return zero, notAFlowMethod(ctx, v)
	}
	res, err := flow.Run(ctx, v.flows.db, v.scope, v.key, v.fp, in, v.flows.flowOptions...)
	if err != nil {
		return zero, v.flows.flowError(ctx, v, err)
	}
	if res.Replayed {
		setMetadata(v.stream, metadata.Pairs(ReplayedMetadata, "true"), nil)
	}
	return res.Value, nil
}

// serveFlow runs the handler of a method that Config.Flows lists, with no
// transaction, telling it the call's scope, key and fingerprint, which
// RunFlow reads.
func (i *interceptor) serveFlow(ctx context.Context, c call, v callValues, fp []byte) (any, error) {
	v.fp, v.flows, v.method, v.stream = fp, i, c.info.FullMethod, c.stream
	return c.handler(context.WithValue(ctx, callKey{}, v), c.req)
}

// checkFlows checks Config.Flows, and records its methods.
func (s *settings) checkFlows(flows []string) error {
	s.flows = make(map[string]bool, len(flows))
	for _, m := range flows {
		switch {
		case !isFullMethod(m):
			return invalidField("Config.Flows", "holds %q, which is not a full method name such as /payments.v1.Payments/Create", m)
		case hasNoSideEffects(m):
			return invalidField("Config.Flows", "holds %q, a method without side effects, which is never covered", m)
		case s.optional[m]:
			return invalidField("Config.Flows", "holds %q, which Config.Optional lists too: a flow is identified by its key, which its calls must carry", m)
		}
		s.flows[m] = true
	}
	return nil
}

// notAFlowMethod answers RunFlow called outside a method that Config.Flows
// lists: a bug of the server's.
func notAFlowMethod(ctx context.Context, v callValues) error {
	why := "outside a method that an idemgrpc interceptor serves: the flow has no key"
	if v.tx != nil {
		why = "in a method that the interceptor serves in a transaction, which the flow would hold across its calls: list the method in Config.Flows"
	}
	method, _ := grpc.Method(ctx)
	slog.Default().LogAttrs(ctx, slog.LevelError, "idemgrpc: RunFlow called "+why, slog.String("method", method))
	return newStatus(codes.Internal, ReasonRequestFailed,
		"idemgrpc: the call could not be completed because of an error of the server's, which retrying would meet again until the service is fixed", nil)
}

// flowError answers a call whose flow gave no answer, and logs what the
// client cannot be told. The failure is classified as idemhttp classifies
// it (adapter.ClassifyFlowError): a flow gets the same answer over both.
func (i *interceptor) flowError(ctx context.Context, v callValues, err error) error {
	switch failure := adapter.ClassifyFlowError(err); {
	case failure == adapter.FlowKeyReused:
		return newStatus(codes.FailedPrecondition, ReasonKeyReused,
			"idemgrpc: this idempotency key was already used for a different request; use a new key for a new request", nil)
	case failure == adapter.FlowInProgress:
		return i.inProgress(v.stream)
	case failure == adapter.FlowKeyInvalid:
		return newStatus(codes.InvalidArgument, ReasonKeyInvalid, "idemgrpc: the idempotency key is not valid", nil)
	case failure == adapter.FlowInputNotStorable:
		// Before ErrResponseTooLarge, which failed would take for the
		// server's: the input comes from the request.
		why := "it holds what the database cannot store (a NUL character, a lone UTF-16 surrogate or a number out of range)"
		if errors.Is(err, idem.ErrResponseTooLarge) {
			why = "it is larger than the server stores"
		}
		return newStatus(codes.InvalidArgument, ReasonInputNotStorable,
			"idemgrpc: the operation's input, read from this request, cannot be stored: "+why+
				"; nothing ran and nothing was recorded, and the same request would get this answer again", nil)
	case failure == adapter.FlowStopped:
		i.logger.LogAttrs(ctx, slog.LevelWarn, "idemgrpc: operation stopped; it needs a person's decision",
			slog.String("method", v.method), slog.Any("error", err))
		return newStatus(codes.FailedPrecondition, ReasonOperationStopped,
			"idemgrpc: the operation with this idempotency key was stopped and will not run again: "+
				"the service's operators are to decide what became of it; do not retry it", nil)
	case ctx.Err() != nil:
		return status.FromContextError(ctx.Err()).Err()
	case failure == adapter.FlowChanged:
		// A deployment changed the flow's steps under operations in
		// progress: no retry gets further until the code or an operator
		// does something.
		i.logger.LogAttrs(ctx, slog.LevelError, "idemgrpc: flow's steps differ from those its operation recorded",
			slog.String("method", v.method), slog.Any("error", err))
		return newStatus(codes.Internal, ReasonRequestFailed,
			"idemgrpc: the call could not be completed because of an error of the server's, which retrying would meet again until the service is fixed", nil)
	case failure == adapter.FlowIncomplete:
		// The flow's own error: a call failed, or its outcome is unknown,
		// whatever the error it returned says (a provider's connection
		// refused is no database outage). It stays resumable, and nothing
		// of the error is kept or sent. An outcome the client's retry
		// mends, not a failure for a person: INFO.
		i.logger.LogAttrs(ctx, slog.LevelInfo, "idemgrpc: flow did not complete; a retry continues it",
			slog.String("method", v.method), slog.Any("error", err))
		setMetadata(v.stream, nil, metadata.Pairs("grpc-retry-pushback-ms", strconv.FormatInt(incompleteRetryDelay.Milliseconds(), 10)))
		return newStatus(codes.Unavailable, ReasonOperationIncomplete,
			"idemgrpc: the operation did not complete: a call it makes failed, or its outcome is not known yet; "+
				"retrying with the same idempotency key continues it", nil,
			&errdetails.RetryInfo{RetryDelay: durationpb.New(incompleteRetryDelay)})
	}
	return i.failed(ctx, v.method, err, true)
}
