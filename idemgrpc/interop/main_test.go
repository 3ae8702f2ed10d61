package interop_test

import (
	"context"
	"crypto/rand"
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"github.com/pgidem/idem/idemtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// tenantKey names the caller in the tests, in gRPC metadata and as an HTTP
// header: it stands in for authentication.
const tenantKey = "x-tenant"

func tenantScope(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if tenant := md.Get(tenantKey); len(tenant) == 1 && tenant[0] != "" {
		return tenant[0], nil
	}
	return "", errors.New("no tenant")
}

// setup marks the test parallel and returns a context, a pool on a
// database of the test's own with the payment table, and a tenant.
func setup(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	pool := idemtest.Pool(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE payment (
		id           bigserial PRIMARY KEY,
		scope        text   NOT NULL,
		key          text   NOT NULL,
		amount_cents bigint NOT NULL UNIQUE
	)`); err != nil {
		t.Fatal(err)
	}
	return ctx, pool, "tenant-" + rand.Text()[:8]
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

// dial returns a client connection to addr, closed when the test ends.
func dial(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// count returns the number that sql counts.
func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
