package idemgrpc_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	channelzpb "google.golang.org/grpc/channelz/grpc_channelz_v1"
	channelz "google.golang.org/grpc/channelz/service"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/test/bufconn"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// countingDB counts the transactions begun on it.
type countingDB struct {
	idem.TxBeginner
	begun atomic.Int64
}

func (c *countingDB) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	c.begun.Add(1)
	return c.TxBeginner.BeginTx(ctx, opts)
}

// keysSent is a client interceptor, beneath idemgrpc's, that records the
// idempotency keys each call carries, by method.
type keysSent struct {
	mu   sync.Mutex
	keys map[string][]string
}

func (k *keysSent) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	md, _ := metadata.FromOutgoingContext(ctx)
	k.mu.Lock()
	k.keys[method] = append(k.keys[method], md.Get(idemgrpc.DefaultMetadata)...)
	k.mu.Unlock()
	return invoker(ctx, method, req, reply, cc, opts...)
}

// TestMethodsWithoutSideEffectsAreLeftAlone serves gRPC's own health,
// reflection and channelz services, and a method that declares
// NO_SIDE_EFFECTS, beside the interceptor in its documented setup (the
// scope from the caller's authentication, a key required or not): their
// calls, without a tenant or a key, work, begin no transaction and store
// nothing, and the client interceptor adds them no key; a call of Pay
// through the same client and server gets a key, a transaction and a
// record.
func TestMethodsWithoutSideEffectsAreLeftAlone(t *testing.T) {
	ctx, pool, _ := setup(t)
	for _, required := range []bool{true, false} {
		db := &countingDB{TxBeginner: pool}
		interceptor, err := idemgrpc.NewServerInterceptor(db, idemgrpc.Config{Scope: tenantScope, Required: required})
		if err != nil {
			t.Fatal(err)
		}
		s := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptor))
		var p payments
		var getSawTx, getSawKey atomic.Bool
		srv := p.server()
		srv.Get = func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
			getSawTx.Store(idemgrpc.Tx(ctx) != nil)
			getSawKey.Store(idemgrpc.Key(ctx) != "")
			return &testpb.Payment{Id: 7}, nil
		}
		srv.Register(s)
		healthpb.RegisterHealthServer(s, health.NewServer())
		reflection.Register(s) // v1 and v1alpha
		channelz.RegisterChannelzServiceToServer(s)
		lis := bufconn.Listen(1 << 20)
		go func() { _ = s.Serve(lis) }()
		t.Cleanup(s.Stop)

		sent := &keysSent{keys: map[string][]string{}}
		plain := dialBufconn(t, lis)
		keyed := dialBufconn(t, lis, grpc.WithChainUnaryInterceptor(idemgrpc.MustNewClientInterceptor(), sent.intercept))

		for name, conn := range map[string]*grpc.ClientConn{"without a client interceptor": plain, "through idemgrpc's client interceptor": keyed} {
			name = fmt.Sprintf("Required %t, %s", required, name)
			for range 5 {
				res, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
				if err != nil || res.GetStatus() != healthpb.HealthCheckResponse_SERVING {
					t.Fatalf("%s: Health/Check: %v, %v", name, res, err)
				}
			}
			if _, err := healthpb.NewHealthClient(conn).List(ctx, &healthpb.HealthListRequest{}); err != nil {
				t.Fatalf("%s: Health/List: %v", name, err)
			}
			if _, err := channelzpb.NewChannelzClient(conn).GetServers(ctx, &channelzpb.GetServersRequest{}); err != nil {
				t.Fatalf("%s: Channelz/GetServers: %v", name, err)
			}
			if res, err := testpb.NewPaymentsClient(conn).Get(ctx, &testpb.PayRequest{}); err != nil || res.GetId() != 7 {
				t.Fatalf("%s: Payments/Get, NO_SIDE_EFFECTS: %v, %v", name, res, err)
			}
			listServices(t, ctx, conn, name)
		}
		if n := db.begun.Load(); n != 0 {
			t.Errorf("Required %t: the calls without side effects began %d transactions, want 0", required, n)
		}
		if n := count(t, pool, `SELECT count(*) FROM idempotency_key`); n != 0 {
			t.Errorf("Required %t: the calls without side effects stored %d records, want 0", required, n)
		}
		if getSawTx.Load() || getSawKey.Load() {
			t.Errorf("Required %t: Payments/Get, NO_SIDE_EFFECTS, saw a transaction (%t) or a key (%t)", required, getSawTx.Load(), getSawKey.Load())
		}
		for method, keys := range sent.keys {
			if len(keys) != 0 {
				t.Errorf("Required %t: the client interceptor gave %s the keys %q", required, method, keys)
			}
		}

		// The same client and server still cover what has side effects.
		tenant := fmt.Sprintf("tenant-required-%t", required)
		if _, err := testpb.NewPaymentsClient(keyed).Pay(outgoing(ctx, tenant, noKey), &testpb.PayRequest{AmountCents: 100}); err != nil {
			t.Fatal(err)
		}
		if keys := sent.keys[testpb.PaymentsPay]; len(keys) != 1 || db.begun.Load() != 1 || countRecords(t, pool, tenant) != 1 {
			t.Fatalf("Required %t: Pay: keys %q, %d transactions, %d records; want 1 key, 1 transaction, 1 record",
				required, keys, db.begun.Load(), countRecords(t, pool, tenant))
		}
		if _, err := pool.Exec(ctx, `DELETE FROM idempotency_key`); err != nil {
			t.Fatal(err)
		}
	}
}

// listServices asks both versions of server reflection for the services,
// and fails the test unless they list Payments. The two versions' messages
// are the same on the wire, so v1's serve for v1alpha's, whose Go types
// are deprecated.
func listServices(t *testing.T, ctx context.Context, conn *grpc.ClientConn, name string) {
	t.Helper()
	for _, method := range []string{
		"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
		"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
	} {
		stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, method)
		if err != nil {
			t.Fatalf("%s: %s: %v", name, method, err)
		}
		if err := stream.SendMsg(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
			t.Fatalf("%s: %s: %v", name, method, err)
		}
		res := new(reflectionpb.ServerReflectionResponse)
		if err := stream.RecvMsg(res); err != nil || !listsPayments(res.GetListServicesResponse().GetService()) {
			t.Fatalf("%s: %s: %v, %v", name, method, res, err)
		}
		_ = stream.CloseSend()
	}
}

func listsPayments(services []*reflectionpb.ServiceResponse) bool {
	for _, s := range services {
		if s.GetName() == "idemgrpc.test.v1.Payments" {
			return true
		}
	}
	return false
}
