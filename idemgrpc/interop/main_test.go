package interop_test

import (
	"context"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/grpctest"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"github.com/pgidem/idem/internal/testdb"
)

// env is the test binary's server, on which grpctest.Setup makes each
// test's database.
var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// Shared helpers, under the names this package's tests use. tenantKey
// names the caller in gRPC metadata and as an HTTP header.
const tenantKey = grpctest.TenantMetadata

var (
	tenantScope = grpctest.TenantScope
	dial        = grpctest.Dial
	loseFirst   = grpctest.LoseFirst
	count       = testdb.Count
)

// setup marks the test parallel and returns a context, a pool on a
// database of the test's own with the payment table, and a tenant.
func setup(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	return grpctest.Setup(t, env, 3*time.Minute, `CREATE TABLE payment (
		id           bigserial PRIMARY KEY,
		scope        text   NOT NULL,
		key          text   NOT NULL,
		amount_cents bigint NOT NULL UNIQUE
	)`)
}

// payments records a payment on the call's transaction, under its key, and
// answers it; runs counts its runs, keys the keys they had.
type payments struct {
	runs atomic.Int64
	mu   sync.Mutex
	keys []string
}

func (p *payments) pay(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
	p.runs.Add(1)
	p.mu.Lock()
	p.keys = append(p.keys, idemgrpc.Key(ctx))
	p.mu.Unlock()
	res := &testpb.Payment{AmountCents: req.GetAmountCents(), Status: "paid"}
	err := idemgrpc.Tx(ctx).QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
		idemgrpc.Scope(ctx), idemgrpc.Key(ctx), req.GetAmountCents()).Scan(&res.Id)
	return res, err
}

// serveGRPC serves payments on a TCP listener on 127.0.0.1, with the
// interceptor for pool chained after before, until the test ends, and
// returns its address.
func serveGRPC(t *testing.T, pool *pgxpool.Pool, p *payments, before ...grpc.UnaryServerInterceptor) string {
	t.Helper()
	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{Scope: tenantScope, Required: true})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(grpc.ChainUnaryInterceptor(append(before, interceptor)...))
	(&testpb.PaymentsServer{Pay: p.pay}).Register(s)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}
