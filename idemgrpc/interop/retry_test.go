package interop_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// attempts is a client interceptor, chained last, that records the key of
// every attempt that goes to the wire.
type attempts struct {
	mu   sync.Mutex
	keys []string
}

func (a *attempts) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	md, _ := metadata.FromOutgoingContext(ctx)
	a.mu.Lock()
	a.keys = append(a.keys, strings.Join(md.Get(idemgrpc.DefaultMetadata), ","))
	a.mu.Unlock()
	return invoker(ctx, method, req, reply, cc, opts...)
}

func (a *attempts) seen() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.keys)
}

// retrying is go-grpc-middleware's retry interceptor as the docs advise
// it: UNAVAILABLE and ABORTED, with a short backoff.
func retrying() grpc.UnaryClientInterceptor {
	return retry.UnaryClientInterceptor(retry.WithMax(5), retry.WithCodes(codes.Unavailable, codes.Aborted),
		retry.WithBackoff(retry.BackoffLinear(10*time.Millisecond)))
}

func TestGoGRPCMiddlewareRetryKeepsOneKey(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	addr := serveGRPC(t, pool, &p, loseFirst(2))
	var a attempts
	conn := dial(t, addr, grpc.WithChainUnaryInterceptor(idemgrpc.MustNewClientInterceptor(), retrying(), a.intercept))
	var header metadata.MD
	res, err := testpb.NewPaymentsClient(conn).Pay(metadata.AppendToOutgoingContext(ctx, tenantKey, tenant),
		&testpb.PayRequest{AmountCents: 100}, grpc.Header(&header))
	if err != nil || len(header.Get(idemgrpc.ReplayedMetadata)) != 1 {
		t.Fatalf("a call whose first two answers were lost: %v, %v, header %v; want the stored answer replayed", res, err, header)
	}
	keys := a.seen()
	if len(keys) != 3 || keys[0] == "" || keys[1] != keys[0] || keys[2] != keys[0] {
		t.Fatalf("attempts sent with keys %q; want three with one key", keys)
	}
	if p.runs.Load() != 1 || count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant) != 1 {
		t.Fatalf("%d runs; want one, and one payment", p.runs.Load())
	}
}

func TestBeneathGoGRPCMiddlewareRetryFailsRatherThanRunTwice(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	addr := serveGRPC(t, pool, &p, loseFirst(1))
	// The wrong order: the retry interceptor first.
	conn := dial(t, addr, grpc.WithChainUnaryInterceptor(retrying(), idemgrpc.MustNewClientInterceptor()))
	_, err := testpb.NewPaymentsClient(conn).Pay(metadata.AppendToOutgoingContext(ctx, tenantKey, tenant), &testpb.PayRequest{AmountCents: 100})
	if st := status.Convert(err); st.Code() != codes.Internal || !strings.Contains(st.Message(), "chain idemgrpc.MustNewClientInterceptor() before the retry interceptor") {
		t.Fatalf("the retry beneath the wrong chain: %v; want INTERNAL that says how to chain", err)
	}
	if p.runs.Load() != 1 || count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant) != 1 {
		t.Fatalf("%d runs, want the first attempt's only", p.runs.Load())
	}
}
