package idemgrpc

import (
	"context"
	"sync/atomic"

	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem"
)

// SendTracker returns a [stats.Handler] that lets the client interceptor
// ([MustNewClientInterceptor]) tell a call that surely never left the client.
// Give it to the connection with the interceptor:
//
//	conn, err := grpc.NewClient(target,
//		grpc.WithChainUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithProviderKey())),
//		grpc.WithStatsHandler(idemgrpc.SendTracker()),
//		// ...
//	)
//
// With it, the error of a call of which no attempt opened a stream wraps
// [idem.ErrNotSent], keeping its status: a call that failed before gRPC
// had a connection to send it on (the connection was never established or
// was refused, the name did not resolve, a call without WaitForReady met
// a channel in TRANSIENT_FAILURE, one with WaitForReady reached its
// deadline waiting for one), so that a flow's [idem.AtMostOnce] call, or
// one past its provider window, is made again rather than stopped for a
// person. It counts the attempts beneath the interceptor, gRPC's own
// retries (a retryPolicy, transparent retries) and those of a retry
// interceptor chained after it: a call one of whose attempts opened a
// stream stays uncertain, whatever its last attempt's error, since the
// server may have received that attempt. The handler reads what gRPC
// reports of each attempt: stats.Begin as it starts, before it picks a
// connection, and stats.OutHeader once its stream holds the call's
// headers, queued to be written; an attempt that began and opened no
// stream wrote no byte of the call.
//
// Without the handler, no error wraps ErrNotSent: the interceptor cannot
// see gRPC's attempts, and an UNAVAILABLE may come from a server that got
// the call. It costs each call an allocation, and adds nothing to calls
// the interceptor does not see.
func SendTracker() stats.Handler { return sendTracker{} }

type sendTracker struct{}

func (sendTracker) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

func (sendTracker) HandleRPC(ctx context.Context, s stats.RPCStats) {
	t, _ := ctx.Value(sendsKey{}).(*sends)
	if t == nil || !s.IsClient() {
		return
	}
	switch s.(type) {
	case *stats.Begin:
		t.begun.Store(true)
	case *stats.OutHeader:
		t.opened.Store(true)
	}
}

func (sendTracker) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (sendTracker) HandleConn(context.Context, stats.ConnStats) {}

// sends is what a [SendTracker] saw of the attempts of one call.
type sends struct {
	begun  atomic.Bool // an attempt began
	opened atomic.Bool // an attempt opened a stream
}

// sendsKey is the context key of a call's sends.
type sendsKey struct{}

// trackSends returns ctx with the sends of the call it is given to.
func trackSends(ctx context.Context) (context.Context, *sends) {
	t := &sends{}
	return context.WithValue(ctx, sendsKey{}, t), t
}

// noneSent reports whether the call surely never left: a SendTracker saw
// an attempt begin, and none open a stream.
func (t *sends) noneSent() bool { return t.begun.Load() && !t.opened.Load() }

// notSentError is the error of a call that surely never left: its text and
// status are the call's error's, and its chain has [idem.ErrNotSent] too.
type notSentError struct{ err error }

func (e *notSentError) Error() string { return e.err.Error() }

func (e *notSentError) Unwrap() []error { return []error{e.err, idem.ErrNotSent} }

func (e *notSentError) GRPCStatus() *status.Status { return status.Convert(e.err) }
