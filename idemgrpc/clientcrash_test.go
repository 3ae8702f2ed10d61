package idemgrpc_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"github.com/pgidem/idem/internal/testdb"
)

// The crash test runs a flow in a crash child (testdb.CrashChild), which
// kills itself once the server answered its call and before the answer is
// recorded. The server is the parent's.
const clientCrashEnv = "IDEMGRPC_CLIENT_CRASH"

// clientCrashJob is what the child runs.
type clientCrashJob struct{ Addr, Flow, Tenant, Key string }

func init() {
	testdb.CrashChild(clientCrashEnv, func(ctx context.Context, pool *pgxpool.Pool, j clientCrashJob) error {
		conn, err := grpc.NewClient(j.Addr, append(stampingClient(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
		if err != nil {
			return err
		}
		_, err = crashPayFlow(j.Flow, conn, j.Tenant, testdb.KillSelf).Run(ctx, pool, j.Tenant, j.Key, nil, 2500)
		return err
	})
}

// stampingClient is the dial options of a client that sends a flow
// call's provider key.
func stampingClient() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithProviderKey())),
		grpc.WithStatsHandler(idemgrpc.SendTracker())}
}

// crashPayFlow is a flow of one call, Pay over conn, whose function never
// names the provider key; afterAnswer, when set, runs once the server
// answered.
func crashPayFlow(name string, conn *grpc.ClientConn, tenant string, afterAnswer func()) *idem.Flow[int64, int64] {
	return idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, amount int64) (int64, error) {
		return idem.Call(s, "pay", func(ctx context.Context, _ string) (int64, error) {
			res, err := testpb.NewPaymentsClient(conn).Pay(metadata.AppendToOutgoingContext(ctx, tenantMetadata, tenant),
				&testpb.PayRequest{AmountCents: amount})
			if err == nil && afterAnswer != nil {
				afterAnswer()
			}
			return res.GetId(), err
		})
	}, idem.WithLease(2*time.Second))
}

func TestClientSendsAFlowCallsProviderKeyAgainAfterACrash(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	attempts := &attemptKeys{}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	startServer(t, pool, idemgrpc.Config{Required: true}, k.server(), lis, attempts.intercept)
	name := "crash-" + tenant

	testdb.RunCrashChild(t, ctx, clientCrashEnv, pool.Config().ConnString(), clientCrashJob{Addr: lis.Addr().String(), Flow: name, Tenant: tenant, Key: "k"})
	if keys := attempts.seen(); len(keys) != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("before the retry the server got the keys %q, %d payments; want one call", keys, countPayments(t, pool, tenant))
	}

	// The retry waits for the dead executor's lease to run out, and calls
	// again: the server replays the answer it gave the child.
	conn := dial(t, lis.Addr().String(), stampingClient()...)
	res, err := crashPayFlow(name, conn, tenant, nil).Run(ctx, pool, tenant, "k", nil, 2500, idem.WithWait(time.Minute))
	if err != nil || res.Replayed {
		t.Fatalf("the retry: %+v, %v; want the flow completed now", res, err)
	}
	want := flowCall(t, ctx, pool, tenant, "k", "pay").ProviderKey
	if keys := attempts.seen(); len(keys) != 2 || keys[0] != want || keys[1] != want {
		t.Fatalf("the server got the keys %q; want the call's provider key %q from the child and from the retry", keys, want)
	}
	if runs := k.seen(); len(runs) != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("the handler ran with the keys %q, %d payments; want one run, replayed to the retry", runs, countPayments(t, pool, tenant))
	}
	if n := count(t, pool, `SELECT count(*) FROM payment WHERE key = $1 AND id = $2`, want, res.Value); n != 1 {
		t.Fatalf("the flow's answer %d is not the payment the child's call made", res.Value)
	}
}
