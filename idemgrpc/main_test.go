package idemgrpc_test

import (
	"context"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/grpctest"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"github.com/pgidem/idem/internal/testdb"
)

// env is the test binary's server, on which grpctest.Setup makes each
// test's database; ExampleRunFlow finds a database of its own in
// DATABASE_URL, as an application would.
var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// Shared helpers, under the names this package's tests use.
const tenantMetadata = grpctest.TenantMetadata

var (
	tenantScope    = grpctest.TenantScope
	dial           = grpctest.Dial
	loseFirst      = grpctest.LoseFirst
	count          = testdb.Count
	waitForBlocked = testdb.WaitForBlocked
	flowCall       = testdb.FlowStep
	countPayments  = testdb.CountPayments
	countRecords   = testdb.CountRecords
)

// paymentTable is the table the tests' handlers write to.
const paymentTable = `CREATE TABLE payment (
	id           bigserial PRIMARY KEY,
	scope        text   NOT NULL,
	key          text   NOT NULL,
	amount_cents bigint NOT NULL
)`

// setup marks the test parallel and returns a context, a pool on a
// database of the test's own with the payment table, and a tenant.
func setup(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	return grpctest.Setup(t, env, 2*time.Minute, paymentTable)
}

// payments is the Payments service of the tests. Pay records a payment on
// the call's transaction and answers it, with the header metadata
// x-payment-id and the trailer x-served; an amount over 10000 is declined
// (recorded too) with FAILED_PRECONDITION and an ErrorInfo of its own; a
// set fail answers that error instead, after the insert. runs counts Pay's
// runs.
type payments struct {
	runs atomic.Int64
	fail atomic.Pointer[error]
}

func (p *payments) server() *testpb.PaymentsServer {
	return &testpb.PaymentsServer{Pay: p.pay}
}

func (p *payments) pay(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
	p.runs.Add(1)
	tx := idemgrpc.Tx(ctx)
	if tx == nil {
		return nil, status.Error(codes.FailedPrecondition, "no transaction")
	}
	res := &testpb.Payment{AmountCents: req.GetAmountCents(), Status: "paid", Labels: req.GetLabels()}
	err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
		idemgrpc.Scope(ctx), idemgrpc.Key(ctx), req.GetAmountCents()).Scan(&res.Id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := p.fail.Load(); err != nil {
		return nil, *err
	}
	if req.GetAmountCents() > 10000 {
		st, _ := status.New(codes.FailedPrecondition, "card declined").WithDetails(
			&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example.com"})
		return nil, st.Err()
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs("x-payment-id", strconv.FormatInt(res.Id, 10)))
	_ = grpc.SetTrailer(ctx, metadata.Pairs("x-served", "yes"))
	return res, nil
}

// failWith makes Pay answer err after its insert.
func (p *payments) failWith(err error) { p.fail.Store(&err) }

// serve starts a real gRPC server on an in-memory listener, with the
// interceptor for pool and cfg (scoped by tenantScope unless cfg says
// otherwise) chained after opts' interceptors, and returns a connection
// to it.
func serve(t *testing.T, pool *pgxpool.Pool, cfg idemgrpc.Config, srv *testpb.PaymentsServer, before ...grpc.UnaryServerInterceptor) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	startServer(t, pool, cfg, srv, lis, before...)
	return dialBufconn(t, lis)
}

// dialBufconn returns a client connection to lis.
func dialBufconn(t *testing.T, lis *bufconn.Listener, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	return dial(t, "passthrough:///bufnet", append(opts, grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
		return lis.DialContext(ctx)
	}))...)
}

// discard is a logger for tests whose failures are expected.
var discard = slog.New(slog.DiscardHandler)

// startServer serves srv on lis until the test ends.
func startServer(t *testing.T, pool *pgxpool.Pool, cfg idemgrpc.Config, srv *testpb.PaymentsServer, lis net.Listener, before ...grpc.UnaryServerInterceptor) {
	t.Helper()
	if cfg.Scope == nil {
		cfg.Scope = tenantScope
	}
	interceptor, err := idemgrpc.NewServerInterceptor(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(grpc.ChainUnaryInterceptor(append(before, interceptor)...))
	srv.Register(s)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
}

// outgoing returns ctx with the tenant's metadata and, unless key is
// noKey, the idempotency key.
func outgoing(ctx context.Context, tenant, key string) context.Context {
	ctx = metadata.AppendToOutgoingContext(ctx, tenantMetadata, tenant)
	if key != noKey {
		ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.DefaultMetadata, key)
	}
	return ctx
}

// noKey asks outgoing for a call without a key.
const noKey = "\x00none"

// answer is a call's outcome, with the metadata it came with.
type answer struct {
	res     *testpb.Payment
	err     error
	header  metadata.MD
	trailer metadata.MD
}

func (a answer) replayed() bool {
	return len(a.header.Get(idemgrpc.ReplayedMetadata)) == 1 && a.header.Get(idemgrpc.ReplayedMetadata)[0] == "true"
}

// pay calls Pay as tenant with key.
func pay(ctx context.Context, conn *grpc.ClientConn, tenant, key string, req *testpb.PayRequest, opts ...grpc.CallOption) answer {
	var a answer
	opts = append(opts, grpc.Header(&a.header), grpc.Trailer(&a.trailer))
	a.res, a.err = testpb.NewPaymentsClient(conn).Pay(outgoing(ctx, tenant, key), req, opts...)
	return a
}

// wantReason fails the test unless err is a status with code whose
// ErrorInfo has idem's domain and reason. It returns the status.
func wantReason(t *testing.T, err error, code codes.Code, reason string) *status.Status {
	t.Helper()
	st := status.Convert(err)
	if st.Code() != code {
		t.Fatalf("got %v, want code %s", err, code)
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			if info.GetDomain() != idemgrpc.ErrorDomain || info.GetReason() != reason {
				t.Fatalf("ErrorInfo %v, want domain %q and reason %q", info, idemgrpc.ErrorDomain, reason)
			}
			return st
		}
	}
	t.Fatalf("%v carries no ErrorInfo", err)
	return nil
}
