package idemgrpc_test

import (
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

func TestRetryGetsTheSameResponseAndMetadataMarkedReplayed(t *testing.T) {
	t.Run("after a transaction", func(t *testing.T) { testRetryGetsTheSameAnswer(t, idemgrpc.Config{}) })
	// The retry read before any transaction.
	t.Run("LookupFirst", func(t *testing.T) { testRetryGetsTheSameAnswer(t, idemgrpc.Config{LookupFirst: true}) })
}

func testRetryGetsTheSameAnswer(t *testing.T, cfg idemgrpc.Config) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, cfg, p.server())
	req := &testpb.PayRequest{AmountCents: 2500, Labels: map[string]string{"order": "o-1"}}

	first := pay(ctx, conn, tenant, "k1", req)
	if first.err != nil {
		t.Fatal(first.err)
	}
	if first.replayed() {
		t.Fatal("the first answer is marked replayed")
	}
	retry := pay(ctx, conn, tenant, "k1", req)
	if retry.err != nil {
		t.Fatal(retry.err)
	}
	if !proto.Equal(retry.res, first.res) {
		t.Fatalf("retry got %v, want the first response %v", retry.res, first.res)
	}
	if !retry.replayed() {
		t.Fatalf("retry's header %v lacks %s: true", retry.header, idemgrpc.ReplayedMetadata)
	}
	for _, md := range []struct {
		name        string
		first, then metadata.MD
		key         string
	}{{"header", first.header, retry.header, "x-payment-id"}, {"trailer", first.trailer, retry.trailer, "x-served"}} {
		if got, want := md.then.Get(md.key), md.first.Get(md.key); len(want) != 1 || !slices.Equal(got, want) {
			t.Fatalf("%s %s: retry got %q, the first answer %q", md.name, md.key, got, want)
		}
	}
	if runs, rows, records := p.runs.Load(), countPayments(t, pool, tenant), countRecords(t, pool, tenant); runs != 1 || rows != 1 || records != 1 {
		t.Fatalf("after a retry: %d runs, %d payments, %d records; want 1 of each", runs, rows, records)
	}
}

func TestHandlerGetsTheTransactionKeyAndScope(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{}, p.server())
	if a := pay(ctx, conn, tenant, "the-key", &testpb.PayRequest{AmountCents: 1}); a.err != nil {
		t.Fatal(a.err)
	}
	// The handler's insert used Tx, Key and Scope, and committed with the
	// key's record.
	if n := count(t, pool, `SELECT count(*) FROM payment p JOIN idempotency_key k USING (scope, key) WHERE p.scope = $1 AND p.key = 'the-key'`, tenant); n != 1 {
		t.Fatalf("%d payments recorded under the call's scope and key with their record, want 1", n)
	}
}

func TestKeyReusedWithAnotherRequestIsFailedPrecondition(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{}, p.server())
	if a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 100}); a.err != nil {
		t.Fatal(a.err)
	}
	a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 999})
	wantReason(t, a.err, codes.FailedPrecondition, idemgrpc.ReasonKeyReused)
	if p.runs.Load() != 1 {
		t.Fatalf("the handler ran %d times, want 1", p.runs.Load())
	}
	// Another tenant's key of the same name is another key.
	if a := pay(ctx, conn, tenant+"-other", "k", &testpb.PayRequest{AmountCents: 999}); a.err != nil || a.replayed() {
		t.Fatalf("the same key for another tenant: %v, replayed %t; want a first run", a.err, a.replayed())
	}
}

func TestCallWithoutKey(t *testing.T) {
	t.Run("required", func(t *testing.T) {
		ctx, pool, tenant := setup(t)
		var p payments
		conn := serve(t, pool, idemgrpc.Config{Required: true}, p.server())
		a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{AmountCents: 1})
		wantReason(t, a.err, codes.InvalidArgument, idemgrpc.ReasonKeyMissing)
		if p.runs.Load() != 0 {
			t.Fatal("the handler ran without the required key")
		}
	})
	t.Run("optional", func(t *testing.T) {
		ctx, pool, tenant := setup(t)
		var p payments
		conn := serve(t, pool, idemgrpc.Config{}, p.server())
		for range 2 {
			if a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{AmountCents: 1}); a.err != nil || a.replayed() {
				t.Fatalf("a call without a key: %v, replayed %t", a.err, a.replayed())
			}
		}
		// Each ran in a transaction of its own, which committed, with
		// nothing recorded.
		if rows, records := count(t, pool, `SELECT count(*) FROM payment WHERE key = ''`), count(t, pool, `SELECT count(*) FROM idempotency_key`); rows != 2 || records != 0 {
			t.Fatalf("%d payments and %d records after two calls without a key, want 2 and 0", rows, records)
		}
	})
	t.Run("optional per method", func(t *testing.T) {
		ctx, pool, tenant := setup(t)
		var p payments
		conn := serve(t, pool, idemgrpc.Config{Required: true, Optional: []string{testpb.PaymentsPay}}, p.server())
		if a := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{AmountCents: 1}); a.err != nil {
			t.Fatalf("a call without a key of a method Config.Optional lists: %v", a.err)
		}
	})
}

func TestMethodsNotCoveredPassStraightThrough(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var sawTx, sawKey bool
	srv := &testpb.PaymentsServer{Pay: func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
		sawTx, sawKey = idemgrpc.Tx(ctx) != nil, idemgrpc.Key(ctx) != ""
		return &testpb.Payment{}, nil
	}}
	conn := serve(t, pool, idemgrpc.Config{Required: true, Methods: []string{"/other.v1.Service/Method"}}, srv)
	for range 2 {
		if a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{}); a.err != nil || a.replayed() {
			t.Fatalf("a method not covered: %v, replayed %t", a.err, a.replayed())
		}
	}
	if sawTx || sawKey || countRecords(t, pool, tenant) != 0 {
		t.Fatalf("a method not covered saw a transaction (%t) or a key (%t), or recorded one", sawTx, sawKey)
	}
}

func TestKeyInvalid(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{}, p.server())
	for name, md := range map[string]metadata.MD{
		"empty":      metadata.Pairs(idemgrpc.DefaultMetadata, ""),
		"too long":   metadata.Pairs(idemgrpc.DefaultMetadata, strings.Repeat("k", 256)),
		"sent twice": metadata.Pairs(idemgrpc.DefaultMetadata, "a", idemgrpc.DefaultMetadata, "b"),
	} {
		ctx := metadata.NewOutgoingContext(ctx, metadata.Join(md, metadata.Pairs(tenantMetadata, tenant)))
		_, err := testpb.NewPaymentsClient(conn).Pay(ctx, &testpb.PayRequest{})
		t.Logf("%s: %v", name, err)
		wantReason(t, err, codes.InvalidArgument, idemgrpc.ReasonKeyInvalid)
	}
	if p.runs.Load() != 0 {
		t.Fatalf("the handler ran %d times with an invalid key", p.runs.Load())
	}
}

func TestScopeUnknownIsUnauthenticated(t *testing.T) {
	ctx, pool, _ := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{}, p.server())
	a := pay(ctx, conn, "", "k", &testpb.PayRequest{})
	st := wantReason(t, a.err, codes.Unauthenticated, idemgrpc.ReasonScopeUnknown)
	if strings.Contains(st.Message(), "no tenant") {
		t.Fatalf("the message %q shows Config.Scope's error", st.Message())
	}
	if p.runs.Load() != 0 {
		t.Fatal("the handler ran without a scope")
	}
}

// TestScopeThatIsNotAScopeIsInternalAndDoesNotInviteARetry gives the
// interceptor a scope function that breaks its contract, answering "" (or
// more than 255 bytes) where it should return an error: the server's bug,
// which every retry would meet again, so the call gets INTERNAL, whose
// message does not say that retrying is safe, and nothing runs.
func TestScopeThatIsNotAScopeIsInternalAndDoesNotInviteARetry(t *testing.T) {
	ctx, pool, tenant := setup(t)
	for name, scope := range map[string]string{"empty": "", "too long": strings.Repeat("s", 256)} {
		var p payments
		conn := serve(t, pool, idemgrpc.Config{
			Scope:  func(context.Context) (string, error) { return scope, nil },
			Logger: discard,
		}, p.server())
		a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 100})
		st := wantReason(t, a.err, codes.Internal, idemgrpc.ReasonRequestFailed)
		if strings.Contains(st.Message(), "retrying it with the same idempotency key is safe") || !strings.Contains(st.Message(), "error of the server's") {
			t.Errorf("%s scope: the message %q invites a retry, or does not say whose the error is", name, st.Message())
		}
		if p.runs.Load() != 0 || count(t, pool, `SELECT count(*) FROM idempotency_key`) != 0 {
			t.Fatalf("%s scope: the handler ran %d times", name, p.runs.Load())
		}
	}
}

func TestDatabaseUnavailableIsUnavailable(t *testing.T) {
	ctx, pool, tenant := setup(t)
	// A pool on a port where nothing listens, on this machine.
	cfg := pool.Config().Copy()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = "127.0.0.1", 1, nil
	down, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(down.Close)
	var p payments
	conn := serve(t, down, idemgrpc.Config{}, p.server())
	a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{})
	st := wantReason(t, a.err, codes.Unavailable, idemgrpc.ReasonDatabaseUnavailable)
	if !strings.Contains(st.Message(), "retrying it with the same idempotency key is safe") {
		t.Fatalf("message %q does not say that a retry is safe", st.Message())
	}
	b := pay(ctx, conn, tenant, noKey, &testpb.PayRequest{})
	wantReason(t, b.err, codes.Unavailable, idemgrpc.ReasonDatabaseUnavailable)
}

// TestAStandbyIsUnavailable serves calls on a pool whose sessions are
// read-only, as a standby's are (idem refuses both with ErrReadOnly, from
// transaction_read_only): UNAVAILABLE, which clients retry, as for a
// database that cannot be reached, not INTERNAL.
func TestAStandbyIsUnavailable(t *testing.T) {
	ctx, pool, tenant := setup(t)
	cfg := pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	readOnly, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(readOnly.Close)
	var p payments
	conn := serve(t, readOnly, idemgrpc.Config{Logger: discard}, p.server())
	wantReason(t, pay(ctx, conn, tenant, "k", &testpb.PayRequest{}).err, codes.Unavailable, idemgrpc.ReasonDatabaseUnavailable)
	if p.runs.Load() != 0 {
		t.Fatal("the handler ran on a read-only server")
	}
}

func TestResponseTooLargeCommitsAndItsRetryIsAlreadyExists(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{MaxResponseBytes: 16, Logger: discard}, p.server())
	req := &testpb.PayRequest{AmountCents: 1, Labels: map[string]string{"big": strings.Repeat("x", 64)}}
	first := pay(ctx, conn, tenant, "k", req)
	if first.err != nil || len(first.res.GetLabels()["big"]) != 64 {
		t.Fatalf("first call: %v, %v; want the whole response", first.res, first.err)
	}
	retry := pay(ctx, conn, tenant, "k", req)
	st := wantReason(t, retry.err, codes.AlreadyExists, idemgrpc.ReasonResponseNotStored)
	if !retry.replayed() || !strings.Contains(st.Message(), "completed with code OK") {
		t.Fatalf("retry: %v, replayed %t; want the code it completed with, marked replayed", st.Message(), retry.replayed())
	}
	if runs, rows := p.runs.Load(), countPayments(t, pool, tenant); runs != 1 || rows != 1 {
		t.Fatalf("%d runs and %d payments, want the first call's only", runs, rows)
	}

	// Negative: no limit.
	conn = serve(t, pool, idemgrpc.Config{MaxResponseBytes: -1}, p.server())
	if a, b := pay(ctx, conn, tenant, "k2", req), pay(ctx, conn, tenant, "k2", req); b.err != nil || !proto.Equal(a.res, b.res) {
		t.Fatalf("with no limit the retry got %v, %v", b.res, b.err)
	}
}

func TestStreamingCallsPassThroughUntouched(t *testing.T) {
	ctx, pool, tenant := setup(t)
	srv := &testpb.PaymentsServer{
		Watch: func(req *testpb.PayRequest, stream grpc.ServerStreamingServer[testpb.Payment]) error {
			if idemgrpc.Tx(stream.Context()) != nil {
				return status.Error(codes.Internal, "a stream got a transaction")
			}
			for i := range 3 {
				if err := stream.Send(&testpb.Payment{Id: int64(i)}); err != nil {
					return err
				}
			}
			return nil
		},
	}
	conn := serve(t, pool, idemgrpc.Config{Required: true}, srv)
	// No key although Required: streams are never covered.
	stream, err := testpb.NewPaymentsClient(conn).Watch(outgoing(ctx, tenant, noKey), &testpb.PayRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for {
		p, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, p.GetId())
	}
	if !slices.Equal(got, []int64{0, 1, 2}) {
		t.Fatalf("stream gave %v, want 0 1 2", got)
	}
}

func TestChainsWithOtherInterceptors(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	var order []string
	outer := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		order = append(order, "outer")
		return handler(ctx, req)
	}
	lis := bufconn.Listen(1 << 20)
	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{Scope: tenantScope})
	if err != nil {
		t.Fatal(err)
	}
	inner := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		order = append(order, "inner")
		if idemgrpc.Tx(ctx) == nil {
			return nil, status.Error(codes.Internal, "an interceptor after idem's sees no transaction")
		}
		return handler(ctx, req)
	}
	s := grpc.NewServer(grpc.ChainUnaryInterceptor(outer, interceptor, inner))
	p.server().Register(s)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	conn := dialBufconn(t, lis)
	for range 2 {
		if a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{}); a.err != nil {
			t.Fatal(a.err)
		}
	}
	// The replay does not reach the interceptors after idem's.
	if want := []string{"outer", "inner", "outer"}; !slices.Equal(order, want) {
		t.Fatalf("interceptors ran %v, want %v", order, want)
	}
}

func TestOverTCP(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	startServer(t, pool, idemgrpc.Config{}, p.server(), lis)
	conn := dial(t, lis.Addr().String())
	first, retry := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 7}), pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 7})
	if first.err != nil || retry.err != nil || !proto.Equal(first.res, retry.res) || !retry.replayed() {
		t.Fatalf("over TCP: first %v %v, retry %v %v replayed %t", first.res, first.err, retry.res, retry.err, retry.replayed())
	}
	if rows := countPayments(t, pool, tenant); rows != 1 {
		t.Fatalf("%d payments, want 1", rows)
	}
}

func TestPanicRollsBackAndReachesTheRecoveryInterceptor(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	var panicked atomic.Bool
	srv := &testpb.PaymentsServer{Pay: func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
		res, err := p.pay(ctx, req)
		if panicked.CompareAndSwap(false, true) {
			panic("boom, after the insert")
		}
		return res, err
	}}
	recovery := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (_ any, err error) {
		defer func() {
			if r := recover(); r != nil {
				err = status.Errorf(codes.Internal, "recovered: %v", r)
			}
		}()
		return handler(ctx, req)
	}
	conn := serve(t, pool, idemgrpc.Config{}, srv, recovery)
	a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1})
	if st := status.Convert(a.err); st.Code() != codes.Internal || !strings.Contains(st.Message(), "recovered: boom") {
		t.Fatalf("a panicking handler: %v, want the recovery interceptor's INTERNAL", a.err)
	}
	if rows, records := countPayments(t, pool, tenant), countRecords(t, pool, tenant); rows != 0 || records != 0 {
		t.Fatalf("after a panic: %d payments and %d records, want nothing kept", rows, records)
	}
	if b := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1}); b.err != nil || b.replayed() {
		t.Fatalf("the retry after a panic: %v, replayed %t; want a run of its own", b.err, b.replayed())
	}
}
