// Package grpctest is what idemgrpc's tests and its interop tests share:
// a database with the tests' payment table, the tenant that stands in for
// authentication, a client connection that ends with the test, and a
// server interceptor that loses answers.
package grpctest

import (
	"context"
	"crypto/rand"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TenantMetadata stands in for authentication in the tests: it names the
// caller, and TenantScope turns it into the scope.
const TenantMetadata = "x-tenant"

// TenantScope is the tests' Config.Scope: the caller that TenantMetadata
// names.
func TenantScope(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if tenant := md.Get(TenantMetadata); len(tenant) == 1 && tenant[0] != "" {
		return tenant[0], nil
	}
	return "", errors.New("no tenant")
}

// Dial returns a client connection to target, closed when the test ends.
func Dial(t testing.TB, target string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(target, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// LoseFirst returns a server interceptor that lets the first n calls
// complete, committed, and then answers them UNAVAILABLE, as if the answer
// was lost on its way.
func LoseFirst(n int64) grpc.UnaryServerInterceptor {
	var calls atomic.Int64
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if calls.Add(1) <= n {
			return nil, status.Error(codes.Unavailable, "the answer was lost")
		}
		return resp, err
	}
}

// Setup marks the test parallel and returns a context that ends with it
// (within timeout), a pool on a database of the test's own on env's
// server, with idem's migrations and paymentTable, the CREATE TABLE of the
// tests' payment table, and a tenant no other test uses. The pool is
// closed and the database dropped when the test ends.
func Setup(t *testing.T, env *testdb.Env, timeout time.Duration, paymentTable string) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	pool, err := pgxpool.New(ctx, env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close) // before EmptyDatabase's cleanup drops the database
	db := stdlib.OpenDBFromPool(pool)
	err = idem.Migrate(ctx, db)
	_ = db.Close()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, paymentTable); err != nil {
		t.Fatal(err)
	}
	return ctx, pool, "tenant-" + rand.Text()[:8]
}
