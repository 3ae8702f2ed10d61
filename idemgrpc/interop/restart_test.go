package interop_test

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// documentedClient returns the dial options of the client setup that
// docs/grpc.md gives ("A client that survives a server restart"), with
// the per-attempt timeout given; waitForReady false leaves out its
// grpc.WaitForReady(true), as the setup before it did.
func documentedClient(perAttempt time.Duration, waitForReady bool) []grpc.DialOption {
	opts := []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(
			idemgrpc.MustNewClientInterceptor(idemgrpc.WithProviderKey()), // first: one key per logical call
			retry.UnaryClientInterceptor(
				retry.WithCodes(codes.Unavailable, codes.Aborted),
				retry.WithMax(10),
				retry.WithPerRetryTimeout(perAttempt),
				retry.WithBackoff(retry.BackoffExponentialWithJitterBounded(100*time.Millisecond, 0.2, 2*time.Second)),
			),
		),
		grpc.WithStatsHandler(idemgrpc.SendTracker()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
	}
	if waitForReady {
		opts = append(opts, grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	}
	return opts
}

// startGRPC serves p on lis, with the interceptor for pool, until stopped.
func startGRPC(t *testing.T, pool *pgxpool.Pool, p *payments, lis net.Listener) *grpc.Server {
	t.Helper()
	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{Scope: tenantScope, Required: true})
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptor))
	(&testpb.PaymentsServer{Pay: p.pay}).Register(s)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return s
}

// waitForState returns once conn is in state, or fails the test when ctx
// ends first.
func waitForState(t *testing.T, ctx context.Context, conn *grpc.ClientConn, state connectivity.State) {
	t.Helper()
	for s := conn.GetState(); s != state; s = conn.GetState() {
		if !conn.WaitForStateChange(ctx, s) {
			t.Fatalf("the connection stayed %s; want %s", s, state)
		}
	}
}

func TestDocumentedClientSetupSurvivesAServerRestart(t *testing.T) {
	ctx, pool, tenant := setup(t)
	ctx = metadata.AppendToOutgoingContext(ctx, tenantKey, tenant)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	var p payments
	first := startGRPC(t, pool, &p, lis)

	survives := testpb.NewPaymentsClient(dial(t, addr, documentedClient(2*time.Second, true)...))
	givesUpConn := dial(t, addr, documentedClient(2*time.Second, false)...)
	givesUp := testpb.NewPaymentsClient(givesUpConn)
	for i, client := range []testpb.PaymentsClient{survives, givesUp} {
		if _, err := client.Pay(ctx, &testpb.PayRequest{AmountCents: int64(i + 1)}); err != nil {
			t.Fatal(err)
		}
	}

	first.Stop() // the server goes down
	// Once the client has seen its connection go: a call sent on it
	// before then may have been written, and would stay uncertain.
	for s := givesUpConn.GetState(); s == connectivity.Ready; s = givesUpConn.GetState() {
		if !givesUpConn.WaitForStateChange(ctx, s) {
			t.Fatal("the client never saw the server go")
		}
	}
	// Without WaitForReady, each retry fails at once while the connection
	// is down, and the call gives up within its backoffs: as surely not
	// sent.
	_, err = givesUp.Pay(ctx, &testpb.PayRequest{AmountCents: 3})
	if status.Code(err) != codes.Unavailable || !errors.Is(err, idem.ErrNotSent) {
		t.Fatalf("without WaitForReady, while the server is down: %v; want UNAVAILABLE, not sent", err)
	}

	conn := dial(t, addr, documentedClient(2*time.Second, true)...)
	done := make(chan error, 1)
	go func() {
		_, err := testpb.NewPaymentsClient(conn).Pay(ctx, &testpb.PayRequest{AmountCents: 4})
		done <- err
	}()
	// The call waits; the restart comes once a reconnection has failed,
	// so that the call has waited through at least one.
	waitForState(t, ctx, conn, connectivity.TransientFailure)
	lis, err = net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	startGRPC(t, pool, &p, lis)
	if err := <-done; err != nil {
		t.Fatalf("the documented setup, across the restart: %v; want the call served", err)
	}
	if p.runs.Load() != 3 || count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant) != 3 {
		t.Fatalf("%d runs, %d payments; want 3 of each", p.runs.Load(), count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant))
	}
}
