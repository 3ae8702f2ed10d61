package interop_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// TestRetryStormThroughAConnectionCutter sends logical payments from
// several clients through a proxy that cuts the connection carrying every
// third answer after the server sent it; each client retries with
// go-grpc-middleware's retry interceptor, beneath idemgrpc's client
// interceptor. Every logical call must end with the answer of the one run
// that committed: effects == logical calls.
func TestRetryStormThroughAConnectionCutter(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	cut := newCutter(t, serveGRPC(t, pool, &p), 3)

	const clients, workers, perWorker = 4, 4, 25
	const logical = clients * workers * perWorker
	st := storm(t, ctx, cut, tenant, clients, workers, perWorker)

	effects := count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant)
	records := count(t, pool, `SELECT count(*) FROM idempotency_key WHERE scope = $1`, tenant)
	t.Logf("storm: %d logical calls, %d attempts sent, %d connections cut after the server answered (of %d answers), "+
		"%d handler runs, %d answers replayed, %d calls failed; %d effects, %d records",
		logical, st.sent, cut.cuts.Load(), cut.answers.Load(), p.runs.Load(), st.replayed, st.failed, effects, records)
	if effects != logical || records != logical || st.failed != 0 {
		t.Fatalf("%d effects and %d records for %d logical calls (%d failed)", effects, records, logical, st.failed)
	}
	if cut.cuts.Load() == 0 || st.replayed == 0 {
		t.Fatalf("%d cuts and %d replays: the storm did not storm", cut.cuts.Load(), st.replayed)
	}
	// Each answer is the one committed run's: its id is the payment row of
	// its amount.
	for n, res := range st.answers {
		var id int64
		if err := pool.QueryRow(ctx, `SELECT id FROM payment WHERE amount_cents = $1`, int64(n+1)).Scan(&id); err != nil || res.GetId() != id {
			t.Fatalf("logical call %d got payment %d, the committed row is %d (%v)", n, res.GetId(), id, err)
		}
	}
}

// stormed is what the logical calls of a storm got.
type stormed struct {
	answers          []*testpb.Payment // the nth logical call's; nil if it failed
	sent             int64             // attempts that went to the wire
	replayed, failed int64             // logical calls
}

// callAttempts is what each attempt of one logical call got, for the message
// of a call that fails; attemptsKey carries it in the call's context, which
// the retry interceptor passes to each attempt. A logical call's attempts
// are made one after another.
type callAttempts struct{ codes []string }

type attemptsKey struct{}

// storm sends clients*workers*perWorker logical payments as tenant, the
// nth of n+1 cents, from clients connections through cut, each shared by
// workers goroutines that make perWorker calls in turn. Each client
// retries with go-grpc-middleware's retry interceptor, beneath idemgrpc's
// client interceptor. A logical call that fails fails the test.
func storm(t *testing.T, ctx context.Context, cut *cutter, tenant string, clients, workers, perWorker int) stormed {
	t.Helper()
	var sent, replayed, failed atomic.Int64
	countAttempt := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		sent.Add(1)
		err := invoker(ctx, method, req, reply, cc, opts...)
		if a, ok := ctx.Value(attemptsKey{}).(*callAttempts); ok {
			a.codes = append(a.codes, status.Code(err).String())
		}
		return err
	}
	answers := make([]*testpb.Payment, clients*workers*perWorker)
	var wg sync.WaitGroup
	for c := range clients {
		// A client is patient: an attempt that finds the call in progress
		// (ABORTED) waits for another attempt still running on the
		// server, which on a loaded machine can take a while, so the
		// budget is 500 attempts, not a few; a call that is lost or stuck
		// fails the test anyway, having used them all.
		conn := dial(t, cut.addr(),
			grpc.WithChainUnaryInterceptor(idemgrpc.MustNewClientInterceptor(),
				retry.UnaryClientInterceptor(retry.WithMax(500), retry.WithCodes(codes.Unavailable, codes.Aborted),
					retry.WithBackoff(retry.BackoffLinear(5*time.Millisecond))),
				countAttempt),
			// Reconnect at once after a cut, and wait for the connection
			// rather than fail the attempt while it is down.
			grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{
				BaseDelay: 5 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 50 * time.Millisecond}}),
			grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
		client := testpb.NewPaymentsClient(conn)
		for w := range workers {
			wg.Go(func() {
				for i := range perWorker {
					n := (c*workers+w)*perWorker + i
					var header metadata.MD
					tried := &callAttempts{}
					callCtx := context.WithValue(metadata.AppendToOutgoingContext(ctx, tenantKey, tenant), attemptsKey{}, tried)
					res, err := client.Pay(callCtx, &testpb.PayRequest{AmountCents: int64(n + 1)}, grpc.Header(&header))
					if err != nil {
						failed.Add(1)
						t.Errorf("logical call %d: %v; its %d attempts got %v", n, err, len(tried.codes), tried.codes)
						continue
					}
					answers[n] = res
					if len(header.Get(idemgrpc.ReplayedMetadata)) == 1 {
						replayed.Add(1)
					}
				}
			})
		}
	}
	wg.Wait()
	return stormed{answers: answers, sent: sent.Load(), replayed: replayed.Load(), failed: failed.Load()}
}
