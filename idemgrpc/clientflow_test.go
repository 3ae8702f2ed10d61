package idemgrpc_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// attemptKeys is a server interceptor, before idem's, that records the
// key of every attempt that reaches the server, and loses the answer of
// the first lose ones (committed, answered UNAVAILABLE).
type attemptKeys struct {
	lose int64

	mu   sync.Mutex
	keys []string
}

func (a *attemptKeys) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	a.mu.Lock()
	a.keys = append(a.keys, md.Get(idemgrpc.DefaultMetadata)...)
	n := int64(len(a.keys))
	a.mu.Unlock()
	resp, err := handler(ctx, req)
	if n <= a.lose {
		return nil, status.Error(codes.Unavailable, "the answer was lost")
	}
	return resp, err
}

func (a *attemptKeys) seen() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.keys...)
}

// payFlow is a flow of one call, Pay over conn, whose function never
// names the provider key; fields, when set, adds metadata to the call.
func payFlow(name string, conn *grpc.ClientConn, tenant string, fields func() []string, opts ...idem.CallOption) *idem.Flow[int64, int64] {
	return idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, amount int64) (int64, error) {
		return idem.Call(s, "pay", func(ctx context.Context, _ string) (int64, error) {
			ctx = metadata.AppendToOutgoingContext(ctx, tenantMetadata, tenant)
			if fields != nil {
				ctx = metadata.AppendToOutgoingContext(ctx, fields()...)
			}
			res, err := testpb.NewPaymentsClient(conn).Pay(ctx, &testpb.PayRequest{AmountCents: amount})
			return res.GetId(), err
		}, opts...)
	})
}

func TestClientSendsAFlowCallsProviderKeyOnEveryAttempt(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	attempts := &attemptKeys{lose: 1}
	conn := serveClient(t, pool, idemgrpc.Config{Required: true}, k.server(), attempts.intercept,
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithProviderKey())),
		grpc.WithStatsHandler(idemgrpc.SendTracker()))
	flow := payFlow("pay-"+tenant, conn, tenant, nil)

	// The first run's answer is lost after the provider committed: the
	// call is uncertain, and the next run makes it again.
	_, err := flow.Run(ctx, pool, tenant, "k", nil, 700)
	if status.Code(err) != codes.Unavailable || !errors.Is(err, idem.ErrFlowIncomplete) || errors.Is(err, idem.ErrNotSent) {
		t.Fatalf("the first run: %v; want the lost answer, uncertain, the flow incomplete", err)
	}
	res, err := flow.Run(ctx, pool, tenant, "k", nil, 700)
	if err != nil || res.Replayed {
		t.Fatalf("the second run: %+v, %v; want the flow completed now", res, err)
	}
	want := flowCall(t, ctx, pool, tenant, "k", "pay").ProviderKey
	if keys := attempts.seen(); len(keys) != 2 || keys[0] != want || keys[1] != want {
		t.Fatalf("the server got the keys %q; want the call's provider key %q on both attempts", keys, want)
	}
	if runs := k.seen(); len(runs) != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("the handler ran with the keys %q, %d payments; want one run: the second attempt replayed", runs, countPayments(t, pool, tenant))
	}
	if n := count(t, pool, `SELECT count(*) FROM payment WHERE key = $1 AND id = $2`, want, res.Value); n != 1 {
		t.Fatalf("the flow's answer %d is not the payment made under the provider key", res.Value)
	}
}

func TestClientRefusesAFlowCallThatCarriesAnotherKey(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	attempts := &attemptKeys{}
	conn := serveClient(t, pool, idemgrpc.Config{Required: true}, k.server(), attempts.intercept,
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithProviderKey())))
	// The first run sets a key of its own; the next one none, and gets the
	// call's.
	var run atomic.Int64
	flow := payFlow("other-"+tenant, conn, tenant, func() []string {
		if run.Add(1) == 1 {
			return []string{idemgrpc.DefaultMetadata, "a-key-of-its-own"}
		}
		return nil
	}, idem.AtMostOnce())
	_, err := flow.Run(ctx, pool, tenant, "k", nil, 1)
	for _, want := range []error{idemgrpc.ErrKeyConflict, idem.ErrInvalidKey, idem.ErrNotSent, idem.ErrFlowIncomplete} {
		if !errors.Is(err, want) {
			t.Fatalf("a call with another key: %v; want an error that wraps %v", err, want)
		}
	}
	if status.Code(err) != codes.InvalidArgument || len(attempts.seen()) != 0 {
		t.Fatalf("got %v, the server saw %q; want INVALID_ARGUMENT, nothing sent", err, attempts.seen())
	}
	// Refused before it was sent, the at-most-once call is made by the
	// next run, rather than stopped for a person.
	if step := flowCall(t, ctx, pool, tenant, "k", "pay"); step.State != "unsent" {
		t.Fatalf("the call's state is %q after it was refused; want unsent", step.State)
	}
	if _, err := flow.Run(ctx, pool, tenant, "k", nil, 1); err != nil {
		t.Fatal(err)
	}
	want := flowCall(t, ctx, pool, tenant, "k", "pay").ProviderKey
	if keys := attempts.seen(); len(keys) != 1 || keys[0] != want {
		t.Fatalf("the server got %q; want the call's provider key %q once", keys, want)
	}
}

func TestClientPutsTheProviderKeyInTheKeyField(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var k keysSeen
	conn := serveClient(t, pool, idemgrpc.Config{Required: true, KeyField: "request_id"}, k.server(), nil,
		grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithProviderKey(), idemgrpc.WithKeyField("request_id"))))
	var sent *testpb.PayRequest
	flow := idem.MustNewFlow("field-"+tenant, func(ctx context.Context, s *idem.Steps, amount int64) (int64, error) {
		return idem.Call(s, "pay", func(ctx context.Context, _ string) (int64, error) {
			sent = &testpb.PayRequest{AmountCents: amount}
			res, err := testpb.NewPaymentsClient(conn).Pay(metadata.AppendToOutgoingContext(ctx, tenantMetadata, tenant), sent)
			return res.GetId(), err
		})
	})
	if _, err := flow.Run(ctx, pool, tenant, "k", nil, 5); err != nil {
		t.Fatal(err)
	}
	want := flowCall(t, ctx, pool, tenant, "k", "pay").ProviderKey
	if keys := k.seen(); len(keys) != 1 || keys[0] != want || sent.GetRequestId() != "" {
		t.Fatalf("the handler saw the keys %q, the caller's message holds %q; want the provider key %q in a copy",
			keys, sent.GetRequestId(), want)
	}
}

// cuttable is a listener on 127.0.0.1 that can cut every connection it
// accepted and stop accepting, as a server that dies does.
type cuttable struct {
	net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func listenCuttable(t *testing.T) *cuttable {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return &cuttable{Listener: ln}
}

func (c *cuttable) Accept() (net.Conn, error) {
	conn, err := c.Listener.Accept()
	if err == nil {
		c.mu.Lock()
		c.conns = append(c.conns, conn)
		c.mu.Unlock()
	}
	return conn, err
}

// cut closes the listener, then every connection.
func (c *cuttable) cut() {
	c.Listener.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.conns {
		conn.Close()
	}
}

// serveProvider serves srv, a provider without idem, on lis until the test
// ends.
func serveProvider(t *testing.T, lis net.Listener, srv *testpb.PaymentsServer) {
	s := grpc.NewServer()
	srv.Register(s)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
}

// refusedTarget returns a target on which nothing listens.
func refusedTarget(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestClientCallThatNeverLeftWrapsErrNotSent(t *testing.T) {
	t.Parallel()
	keyed := grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor())
	tracked := grpc.WithStatsHandler(idemgrpc.SendTracker())
	call := func(t *testing.T, target string, timeout time.Duration, opts []grpc.DialOption, callOpts ...grpc.CallOption) error {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		_, err := testpb.NewPaymentsClient(dial(t, target, opts...)).Pay(ctx, &testpb.PayRequest{}, callOpts...)
		if err == nil {
			t.Fatal("the call succeeded")
		}
		return err
	}

	t.Run("connection refused", func(t *testing.T) {
		t.Parallel()
		err := call(t, refusedTarget(t), time.Minute, []grpc.DialOption{keyed, tracked})
		if status.Code(err) != codes.Unavailable || !errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; want UNAVAILABLE wrapping idem.ErrNotSent", err)
		}
	})

	t.Run("name not resolved", func(t *testing.T) {
		t.Parallel()
		// The passthrough resolver hands the name to the dialer, which
		// fails to resolve it, as a name server that knows no such host.
		noDNS := grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return nil, &net.DNSError{Err: "no such host", Name: addr, IsNotFound: true}
		})
		err := call(t, "passthrough:///provider.invalid:443", time.Minute, []grpc.DialOption{keyed, tracked, noDNS})
		if status.Code(err) != codes.Unavailable || !errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; want UNAVAILABLE wrapping idem.ErrNotSent", err)
		}
	})

	t.Run("waiting for ready past the deadline", func(t *testing.T) {
		t.Parallel()
		err := call(t, refusedTarget(t), 300*time.Millisecond, []grpc.DialOption{keyed, tracked}, grpc.WaitForReady(true))
		if status.Code(err) != codes.DeadlineExceeded || !errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; want DEADLINE_EXCEEDED wrapping idem.ErrNotSent", err)
		}
	})

	t.Run("without SendTracker", func(t *testing.T) {
		t.Parallel()
		err := call(t, refusedTarget(t), time.Minute, []grpc.DialOption{keyed})
		if status.Code(err) != codes.Unavailable || errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; want UNAVAILABLE, uncertain: the interceptor alone cannot see gRPC's attempts", err)
		}
	})
}

func TestClientCallCutAfterItWasSentStaysUncertain(t *testing.T) {
	t.Parallel()
	// The server gets the call and dies: its connection is cut, and it
	// accepts no other. gRPC's retry policy tries again, and each retry
	// fails for want of a connection: the last attempt's error is one of
	// a call that never left, but the first reached the server.
	const serviceConfig = `{"methodConfig": [{"name": [{"service": "idemgrpc.test.v1.Payments"}],
		"retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
			"backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`
	for name, retry := range map[string]bool{"cut": false, "cut, then retried and refused": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			lis := listenCuttable(t)
			var runs atomic.Int64
			serveProvider(t, lis, &testpb.PaymentsServer{Pay: func(ctx context.Context, _ *testpb.PayRequest) (*testpb.Payment, error) {
				runs.Add(1)
				lis.cut()
				<-ctx.Done()
				return nil, ctx.Err()
			}})
			opts := []grpc.DialOption{grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor()), grpc.WithStatsHandler(idemgrpc.SendTracker())}
			if retry {
				opts = append(opts, grpc.WithDefaultServiceConfig(serviceConfig))
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_, err := testpb.NewPaymentsClient(dial(t, lis.Addr().String(), opts...)).Pay(ctx, &testpb.PayRequest{})
			if status.Code(err) != codes.Unavailable || runs.Load() != 1 {
				t.Fatalf("got %v after %d runs; want UNAVAILABLE after the server got the call", err, runs.Load())
			}
			if errors.Is(err, idem.ErrNotSent) {
				t.Fatalf("got %v; the server got the call: it must stay uncertain", err)
			}
		})
	}
}

func TestClientAtMostOnceCallNeverSentIsMadeByTheNextRun(t *testing.T) {
	ctx, pool, tenant := setup(t)
	lis := listenCuttable(t)
	addr := lis.Addr().String()
	lis.Close() // the provider is down
	conn := dial(t, addr, grpc.WithUnaryInterceptor(idemgrpc.MustNewClientInterceptor(idemgrpc.WithProviderKey())),
		grpc.WithStatsHandler(idemgrpc.SendTracker()))
	var runs atomic.Int64
	flow := payFlow("sms-"+tenant, conn, tenant, nil, idem.AtMostOnce())
	_, err := flow.Run(ctx, pool, tenant, "k", nil, 1)
	if !errors.Is(err, idem.ErrNotSent) || !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("with the provider down: %v; want not sent, the flow incomplete", err)
	}
	// The provider comes back on its address.
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	serveProvider(t, ln, &testpb.PaymentsServer{Pay: func(context.Context, *testpb.PayRequest) (*testpb.Payment, error) {
		return &testpb.Payment{Id: runs.Add(1)}, nil
	}})
	// Until gRPC's reconnection backoff has passed, runs fail without
	// sending, as freely as the first: none counts as an attempt that may
	// have been applied.
	var res idem.Result[int64]
	for {
		res, err = flow.Run(ctx, pool, tenant, "k", nil, 1, idem.WithWait(time.Minute))
		if !errors.Is(err, idem.ErrNotSent) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil || res.Value != 1 || runs.Load() != 1 {
		t.Fatalf("the next run: %+v, %v, %d sends; want the call made once, not the flow stopped", res, err, runs.Load())
	}
}
