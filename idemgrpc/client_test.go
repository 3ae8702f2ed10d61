package idemgrpc_test

import (
	"context"
	"errors"
	"regexp"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// keysSeen is a Payments server whose Pay records the key of each run,
// and a payment for it, and sets no metadata, so that gRPC may retry its
// calls (gRPC does not retry a call once it has received a header).
type keysSeen struct {
	mu   sync.Mutex
	keys []string
}

func (k *keysSeen) server() *testpb.PaymentsServer {
	return &testpb.PaymentsServer{Pay: func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
		k.mu.Lock()
		k.keys = append(k.keys, idemgrpc.Key(ctx))
		k.mu.Unlock()
		res := &testpb.Payment{AmountCents: req.GetAmountCents()}
		err := idemgrpc.Tx(ctx).QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			idemgrpc.Scope(ctx), idemgrpc.Key(ctx), req.GetAmountCents()).Scan(&res.Id)
		return res, err
	}}
}

func (k *keysSeen) seen() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.keys...)
}

// serveClient starts the server with the interceptor for cfg, its answers
// lost after commit by losing (outside idem's), and returns a connection
// with opts.
func serveClient(t *testing.T, pool *pgxpool.Pool, cfg idemgrpc.Config, srv *testpb.PaymentsServer, losing grpc.UnaryServerInterceptor, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	var before []grpc.UnaryServerInterceptor
	if losing != nil {
		before = append(before, losing)
	}
	startServer(t, pool, cfg, srv, lis, before...)
	return dialBufconn(t, lis, opts...)
}

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestClientInterceptorGivesEachCallAFreshKeyAndKeepsTheCallersOwn(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	conn := serveClient(t, pool, idemgrpc.Config{Required: true}, k.server(), nil,
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor()))
	for range 2 {
		if a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{}); a.err != nil {
			t.Fatal(a.err)
		}
	}
	if a := pay(ctx, conn, tenant, "the-callers-own", &testpb.PayRequest{}); a.err != nil {
		t.Fatal(a.err)
	}
	keys := k.seen()
	if len(keys) != 3 || !uuidV4.MatchString(keys[0]) || !uuidV4.MatchString(keys[1]) || keys[0] == keys[1] || keys[2] != "the-callers-own" {
		t.Fatalf("keys seen %q; want two fresh UUIDs, then the caller's own", keys)
	}
}

func TestClientKeyIsKeptAcrossGRPCRetryPolicy(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	const serviceConfig = `{"methodConfig": [{
		"name": [{"service": "idemgrpc.test.v1.Payments"}],
		"retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
			"backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`
	conn := serveClient(t, pool, idemgrpc.Config{Required: true}, k.server(), loseFirst(1),
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor()), grpc.WithDefaultServiceConfig(serviceConfig))
	a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{AmountCents: 9})
	if a.err != nil || !a.replayed() {
		t.Fatalf("a call whose first answer was lost: %v, replayed %t; want the stored answer", a.err, a.replayed())
	}
	// gRPC sent it twice, with one key: it ran once, and the second
	// attempt replayed it. (gRPC retries no further once an attempt has
	// received a header, as a replay's marks it.)
	keys := k.seen()
	if len(keys) != 1 || countPayments(t, pool, tenant) != 1 || countRecords(t, pool, tenant) != 1 {
		t.Fatalf("handler runs with keys %q, %d payments; want one run", keys, countPayments(t, pool, tenant))
	}
	if n := count(t, pool, `SELECT count(*) FROM payment WHERE key = $1`, keys[0]); n != 1 {
		t.Fatalf("%d payments under the retried call's key", n)
	}
}

func TestClientKeyFieldPutsTheKeyInTheRequest(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	conn := serveClient(t, pool, idemgrpc.Config{Required: true, KeyField: "request_id", Metadata: "x-unused"}, k.server(), nil,
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithKeyField("request_id"), idemgrpc.WithMetadata("x-unused"))))
	req := &testpb.PayRequest{AmountCents: 1}
	if a := pay(ctx, conn, tenant, noKey, req); a.err != nil {
		t.Fatal(a.err)
	}
	if req.GetRequestId() != "" {
		t.Fatalf("the caller's request was changed: request_id %q", req.GetRequestId())
	}
	if a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{RequestId: "set-by-caller"}); a.err != nil {
		t.Fatal(a.err)
	}
	if keys := k.seen(); len(keys) != 2 || !uuidV4.MatchString(keys[0]) || keys[1] != "set-by-caller" {
		t.Fatalf("keys seen %q; want a fresh UUID in request_id, then the caller's", keys)
	}
}

func TestClientOptionsChooseTheMetadataAndTheKeys(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	var n atomic.Int64
	keys := func() string { return "generated-" + string(rune('0'+n.Add(1))) }
	conn := serveClient(t, pool, idemgrpc.Config{Required: true, Metadata: "x-request-key"}, k.server(), nil,
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithMetadata("X-Request-Key"), idemgrpc.WithKeyGenerator(keys))))
	if a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{}); a.err != nil {
		t.Fatal(a.err)
	}
	if got := k.seen(); len(got) != 1 || got[0] != "generated-1" {
		t.Fatalf("keys seen %q, want generated-1", got)
	}
}

func TestClientInterceptorBeneathARetryInterceptorFails(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	// Retries as go-grpc-middleware's retry interceptor does, marking the
	// second attempt with x-retry-attempt; chained before the idem
	// interceptor, whose keys are then per attempt.
	retrying := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
			return err
		}
		md, _ := metadata.FromOutgoingContext(ctx)
		return invoker(metadata.NewOutgoingContext(ctx, metadata.Join(md, metadata.Pairs("x-retry-attempt", "1"))), method, req, reply, cc, opts...)
	}
	conn := serveClient(t, pool, idemgrpc.Config{Required: true}, k.server(), nil,
		grpc.WithChainUnaryInterceptor(retrying, idemgrpc.MustNewClientInterceptor()))
	a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{})
	if status.Code(a.err) != codes.Internal || len(k.seen()) != 1 {
		t.Fatalf("the second attempt: %v, %d runs; want INTERNAL and only the first attempt's run", a.err, len(k.seen()))
	}
}

func TestClientOptionsThatCannotWorkAreRefused(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		opt   idemgrpc.ClientOption
		field string
	}{
		"WithKeyGenerator(nil)":   {idemgrpc.WithKeyGenerator(nil), "WithKeyGenerator"},
		"WithMetadata(a space)":   {idemgrpc.WithMetadata("idempotency key"), "WithMetadata"},
		"WithMetadata(binary)":    {idemgrpc.WithMetadata("key-bin"), "WithMetadata"},
		"WithMetadata(empty)":     {idemgrpc.WithMetadata(""), "WithMetadata"},
		"WithKeyField(not proto)": {idemgrpc.WithKeyField("request-id"), "WithKeyField"},
	} {
		i, err := idemgrpc.NewClientInterceptor(c.opt)
		fe, ok := errors.AsType[*idem.FieldError](err)
		if i != nil || !ok || fe.Package != "idemgrpc" || fe.Field != c.field || !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("NewClientInterceptor(%s): %v; want no interceptor and a FieldError naming idemgrpc's %s that wraps idem.ErrInvalidOption", name, err, c.field)
		}
		func() {
			defer func() {
				if p, _ := recover().(error); p == nil || p.Error() != err.Error() {
					t.Errorf("MustNewClientInterceptor(%s) panicked with %v; want NewClientInterceptor's error %v", name, p, err)
				}
			}()
			idemgrpc.MustNewClientInterceptor(c.opt)
		}()
	}
}
