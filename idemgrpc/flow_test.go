package idemgrpc_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// cardProvider stands in for a payment provider that honours idempotency
// keys: it applies a charge once per provider key, declines amounts over
// 10000, and counts its calls and the keys they carried. hold, when set,
// runs before a call is applied; fail, when set, after (the call was
// applied, but its caller does not learn it).
type cardProvider struct {
	calls, charges atomic.Int64
	mu             sync.Mutex
	keys           []string // the provider key of each call
	applied        map[string]bool
	hold, fail     func(attempt int64) error
}

func (p *cardProvider) charge(ctx context.Context, key string, amount int64) (string, error) {
	attempt := p.calls.Add(1)
	p.mu.Lock()
	p.keys = append(p.keys, key)
	p.mu.Unlock()
	if p.hold != nil {
		if err := p.hold(attempt); err != nil {
			return "", err
		}
	}
	if amount > 10000 {
		return "", nil // declined: a definite answer, applied as nothing
	}
	p.mu.Lock()
	if !p.applied[key] {
		p.applied[key] = true
		p.charges.Add(1)
	}
	p.mu.Unlock()
	if p.fail != nil {
		if err := p.fail(attempt); err != nil {
			return "", err
		}
	}
	return "ch_" + key[:8], nil
}

// providerKeys returns the provider keys of the calls made so far.
func (p *cardProvider) providerKeys() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.keys...)
}

// order is the flow's input and answer.
type order struct {
	AmountCents int64  `json:"amount_cents"`
	Note        string `json:"note,omitempty"`
	PaymentID   int64  `json:"payment_id,omitempty"`
	ChargeID    string `json:"charge_id,omitempty"`
	Declined    bool   `json:"declined,omitempty"`
}

// newPayFlow returns the flow that serves Pay: record the payment, charge
// the card at p; a decline is part of its answer.
func newPayFlow(p *cardProvider) *idem.Flow[order, order] {
	return idem.MustNewFlow("pay", func(ctx context.Context, s *idem.Steps, in order) (order, error) {
		id, err := idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.AmountCents).Scan(&id)
			return id, err
		})
		if err != nil {
			return order{}, err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			return p.charge(ctx, key, in.AmountCents)
		})
		if err != nil {
			return order{}, err
		}
		return order{AmountCents: in.AmountCents, PaymentID: id, ChargeID: charge, Declined: charge == ""}, nil
	})
}

// payByFlow is Pay's handler: it runs flow with the request's amount and
// its label note, and answers a decline FAILED_PRECONDITION.
func payByFlow(flow *idem.Flow[order, order]) func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
	return func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
		out, err := idemgrpc.RunFlow(ctx, flow, order{AmountCents: req.GetAmountCents(), Note: req.GetLabels()["note"]})
		if err != nil {
			return nil, err
		}
		if out.Declined {
			return nil, status.Error(codes.FailedPrecondition, "card declined")
		}
		return &testpb.Payment{Id: out.PaymentID, AmountCents: out.AmountCents, Status: "paid",
			Labels: map[string]string{"charge": out.ChargeID}}, nil
	}
}

// serveFlow serves Pay with the pay flow on pool, with cfg and Pay listed
// in its Flows, and returns a connection to it and the provider.
func serveFlow(t *testing.T, pool *pgxpool.Pool, cfg idemgrpc.Config, before ...grpc.UnaryServerInterceptor) (*grpc.ClientConn, *cardProvider) {
	t.Helper()
	p := &cardProvider{applied: map[string]bool{}}
	cfg.Flows = append(cfg.Flows, testpb.PaymentsPay)
	return serve(t, pool, cfg, &testpb.PaymentsServer{Pay: payByFlow(newPayFlow(p))}, before...), p
}

// retryInfo returns the delay of st's RetryInfo, 0 if it has none.
func retryInfo(st *status.Status) time.Duration {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.RetryInfo); ok {
			return info.GetRetryDelay().AsDuration()
		}
	}
	return 0
}

func TestFlowMethodRunsOnceAndReplaysItsAnswer(t *testing.T) {
	ctx, pool, tenant := setup(t)
	conn, p := serveFlow(t, pool, idemgrpc.Config{})

	first := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 2500})
	if first.err != nil || first.replayed() || first.res.GetLabels()["charge"] == "" {
		t.Fatalf("first: %v %v, replayed %t", first.res, first.err, first.replayed())
	}
	retry := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 2500})
	if retry.err != nil || !retry.replayed() || !proto.Equal(retry.res, first.res) {
		t.Fatalf("retry: %v %v, replayed %t; want %v replayed", retry.res, retry.err, retry.replayed(), first.res)
	}
	if p.calls.Load() != 1 || p.charges.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("%d calls, %d charges, %d payments; want 1, 1, 1", p.calls.Load(), p.charges.Load(), countPayments(t, pool, tenant))
	}

	// A decline is part of the flow's answer: its retry is declined again,
	// marked replayed, without calling the provider.
	for i := range 2 {
		declined := pay(ctx, conn, tenant, "declined", &testpb.PayRequest{AmountCents: 20000})
		if status.Code(declined.err) != codes.FailedPrecondition || declined.replayed() != (i == 1) {
			t.Fatalf("declined, attempt %d: %v, replayed %t", i+1, declined.err, declined.replayed())
		}
	}
	if p.calls.Load() != 2 {
		t.Fatalf("%d provider calls after the declined one's retry, want 2", p.calls.Load())
	}

	// The interceptor's own answers, as for any covered call; a flow
	// method needs a key although Config.Required is false.
	wantReason(t, pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 9900}).err, codes.FailedPrecondition, idemgrpc.ReasonKeyReused)
	wantReason(t, pay(ctx, conn, tenant, noKey, &testpb.PayRequest{AmountCents: 2500}).err, codes.InvalidArgument, idemgrpc.ReasonKeyMissing)
	wantReason(t, pay(ctx, conn, "", "k2", &testpb.PayRequest{AmountCents: 2500}).err, codes.Unauthenticated, idemgrpc.ReasonScopeUnknown)
	if p.calls.Load() != 2 || countPayments(t, pool, tenant) != 2 {
		t.Fatalf("%d provider calls and %d payments after the refused calls, want 2 and 2", p.calls.Load(), countPayments(t, pool, tenant))
	}
}

func TestFlowMethodIncompleteIsUnavailableAndItsRetryCallsWithTheSameProviderKey(t *testing.T) {
	ctx, pool, tenant := setup(t)
	conn, p := serveFlow(t, pool, idemgrpc.Config{})
	// The provider applies the first call, and its answer is lost.
	p.fail = func(attempt int64) error {
		if attempt == 1 {
			return errors.New("read tcp: i/o timeout, after the provider charged")
		}
		return nil
	}
	req := &testpb.PayRequest{AmountCents: 2500}
	failed := pay(ctx, conn, tenant, "k", req)
	st := wantReason(t, failed.err, codes.Unavailable, idemgrpc.ReasonOperationIncomplete)
	if retryInfo(st) != time.Second {
		t.Fatalf("RetryInfo delay %s, want 1s", retryInfo(st))
	}
	if got := failed.trailer.Get("grpc-retry-pushback-ms"); len(got) != 1 || got[0] != "1000" {
		t.Fatalf("trailer grpc-retry-pushback-ms %q, want 1000", got)
	}
	if strings.Contains(st.Message(), "provider charged") {
		t.Fatalf("the flow's own error reached the client: %q", st.Message())
	}

	retry := pay(ctx, conn, tenant, "k", req)
	if retry.err != nil || retry.replayed() {
		t.Fatalf("the retry: %v, replayed %t; want the flow's first answer", retry.err, retry.replayed())
	}
	keys := p.providerKeys()
	if len(keys) != 2 || keys[0] != keys[1] || p.charges.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("provider keys %q, %d charges, %d payments; want 2 calls with one key, 1 charge, 1 payment",
			keys, p.charges.Load(), countPayments(t, pool, tenant))
	}
	if retry.res.GetLabels()["charge"] != "ch_"+keys[0][:8] {
		t.Fatalf("the answer's charge %q is not the provider's", retry.res.GetLabels()["charge"])
	}
}

// holdFirstCall makes p's first call wait until the returned release is
// called (at the latest when the test ends), after closing calling.
func holdFirstCall(t *testing.T, p *cardProvider) (calling <-chan struct{}, release func()) {
	entered, released := make(chan struct{}), make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(released) }) }
	t.Cleanup(release)
	p.hold = func(attempt int64) error {
		if attempt == 1 {
			close(entered)
			<-released
		}
		return nil
	}
	return entered, release
}

// duplicateKey marks the context of the calls that carry the metadata
// x-duplicate, down to their queries.
type duplicateKey struct{}

// duplicateTracer reports on looked each query or batch that a call
// marked by duplicateKey sends.
type duplicateTracer struct{ looked chan struct{} }

func (d duplicateTracer) seen(ctx context.Context) context.Context {
	if ctx.Value(duplicateKey{}) != nil {
		select {
		case d.looked <- struct{}{}:
		default:
		}
	}
	return ctx
}

func (d duplicateTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return d.seen(ctx)
}

func (d duplicateTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return d.seen(ctx)
}

func (duplicateTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData)     {}
func (duplicateTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (duplicateTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

func TestFlowMethodDuplicateDuringASlowCallWaitsAndReplays(t *testing.T) {
	ctx, shared, tenant := setup(t)
	// A pool of the test's own, whose tracer sees the duplicate's queries:
	// once it has looked at the flow, held by the first call, it waits.
	tracer := duplicateTracer{looked: make(chan struct{}, 1)}
	cfg, err := pgxpool.ParseConfig(shared.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	conn, p := serveFlow(t, pool, idemgrpc.Config{Wait: time.Minute},
		func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("x-duplicate")) > 0 {
				ctx = context.WithValue(ctx, duplicateKey{}, true)
			}
			return handler(ctx, req)
		})
	calling, release := holdFirstCall(t, p)
	req := &testpb.PayRequest{AmountCents: 2500}

	firstDone := payAsync(ctx, conn, tenant, "k", req)
	<-calling
	dupDone := payAsync(metadata.AppendToOutgoingContext(ctx, "x-duplicate", "1"), conn, tenant, "k", req)
	select {
	case <-tracer.looked: // the duplicate looked at the flow while the first call is in the provider
	case dup := <-dupDone:
		t.Fatalf("the duplicate was answered (%v, %v) while the first call was still in the provider", dup.res, dup.err)
	}
	select {
	case dup := <-dupDone:
		t.Fatalf("the duplicate was answered (%v, %v) while the first call was still in the provider", dup.res, dup.err)
	default:
	}
	release()
	first, dup := <-firstDone, <-dupDone
	if first.err != nil || dup.err != nil || !dup.replayed() || !proto.Equal(first.res, dup.res) {
		t.Fatalf("first %v %v, duplicate %v %v replayed %t; want the first answer replayed", first.res, first.err, dup.res, dup.err, dup.replayed())
	}
	if p.calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("%d provider calls, %d payments; want 1, 1", p.calls.Load(), countPayments(t, pool, tenant))
	}
}

func TestFlowMethodDuplicatePastTheWaitIsAbortedWithRetryInfo(t *testing.T) {
	ctx, pool, tenant := setup(t)
	conn, p := serveFlow(t, pool, idemgrpc.Config{Wait: -1})
	calling, release := holdFirstCall(t, p)
	req := &testpb.PayRequest{AmountCents: 2500}

	firstDone := payAsync(ctx, conn, tenant, "k", req)
	<-calling
	dup := pay(ctx, conn, tenant, "k", req)
	st := wantReason(t, dup.err, codes.Aborted, idemgrpc.ReasonKeyInProgress)
	if retryInfo(st) != time.Second {
		t.Fatalf("RetryInfo delay %s, want 1s", retryInfo(st))
	}
	release()
	if first := <-firstDone; first.err != nil {
		t.Fatal(first.err)
	}
	if retry := pay(ctx, conn, tenant, "k", req); retry.err != nil || !retry.replayed() || p.calls.Load() != 1 {
		t.Fatalf("the retry after the first completed: %v, replayed %t, %d provider calls", retry.err, retry.replayed(), p.calls.Load())
	}
}

func TestFlowMethodStoppedIsFailedPreconditionAndNotRetried(t *testing.T) {
	ctx, pool, tenant := setup(t)
	conn, p := serveFlow(t, pool, idemgrpc.Config{Logger: discard})
	p.fail = func(int64) error { return errors.New("timeout") }
	req := &testpb.PayRequest{AmountCents: 2500}
	wantReason(t, pay(ctx, conn, tenant, "k", req).err, codes.Unavailable, idemgrpc.ReasonOperationIncomplete)
	if ended, err := idem.EndFlow(ctx, pool, tenant, "k", "refunded by hand"); err != nil || !ended {
		t.Fatalf("EndFlow = %t, %v", ended, err)
	}
	stopped := pay(ctx, conn, tenant, "k", req)
	st := wantReason(t, stopped.err, codes.FailedPrecondition, idemgrpc.ReasonOperationStopped)
	if retryInfo(st) != 0 || len(stopped.trailer.Get("grpc-retry-pushback-ms")) != 0 {
		t.Fatal("operation stopped invites a retry")
	}
	if p.calls.Load() != 1 {
		t.Fatalf("%d provider calls, want 1: a stopped flow does not call", p.calls.Load())
	}
}

func TestFlowMethodInputNotStorableIsInvalidArgument(t *testing.T) {
	ctx, pool, tenant := setup(t)
	conn, p := serveFlow(t, pool, idemgrpc.Config{})
	nul := &testpb.PayRequest{AmountCents: 2500, Labels: map[string]string{"note": "a\x00b"}}
	wantReason(t, pay(ctx, conn, tenant, "k", nul).err, codes.InvalidArgument, idemgrpc.ReasonInputNotStorable)
	if p.calls.Load() != 0 || countPayments(t, pool, tenant) != 0 || count(t, pool, `SELECT count(*) FROM idem_flow`) != 0 {
		t.Fatal("an input that cannot be stored ran, or left a record")
	}
}

// TestFlowMethodsHoldNoConnectionAcrossTheirCalls serves six calls at once
// on a pool of two connections, and holds each in the provider until all
// six are there. A flow run under a covered method's transaction holds a
// connection across its call: two calls would get in, and the others
// would wait for a connection for ever.
func TestFlowMethodsHoldNoConnectionAcrossTheirCalls(t *testing.T) {
	ctx, shared, tenant := setup(t)
	cfg, err := pgxpool.ParseConfig(shared.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	conn, p := serveFlow(t, pool, idemgrpc.Config{})

	const calls = 6
	var inCall sync.WaitGroup
	inCall.Add(calls)
	all := make(chan struct{})
	go func() { inCall.Wait(); close(all) }()
	p.hold = func(int64) error {
		inCall.Done()
		select {
		case <-all:
			return nil
		case <-ctx.Done():
			return errors.New("not every call reached the provider")
		}
	}
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() {
			if a := pay(ctx, conn, tenant, "k"+strconv.Itoa(i), &testpb.PayRequest{AmountCents: int64(100 + i)}); a.err != nil {
				t.Errorf("call %d: %v", i, a.err)
			}
		})
	}
	wg.Wait()
	if p.charges.Load() != calls {
		t.Fatalf("%d charges for %d calls", p.charges.Load(), calls)
	}
}

func TestRunFlowOutsideAFlowMethodIsInternalAndRunsNothing(t *testing.T) {
	ctx, pool, tenant := setup(t)
	p := &cardProvider{applied: map[string]bool{}}
	// Pay is covered, in a transaction, but not listed in Config.Flows.
	conn := serve(t, pool, idemgrpc.Config{}, &testpb.PaymentsServer{Pay: payByFlow(newPayFlow(p))})
	for _, key := range []string{"k", noKey} {
		a := pay(ctx, conn, tenant, key, &testpb.PayRequest{AmountCents: 2500})
		st := wantReason(t, a.err, codes.Internal, idemgrpc.ReasonRequestFailed)
		if strings.Contains(st.Message(), "retrying it with the same") {
			t.Fatalf("a server's bug invites a retry: %q", st.Message())
		}
	}
	if p.calls.Load() != 0 || count(t, pool, `SELECT count(*) FROM idem_flow`) != 0 {
		t.Fatal("RunFlow ran the flow outside a flow method")
	}
}

func TestConfigFlowsRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	scope := func(context.Context) (string, error) { return "t", nil }
	for _, cfg := range []idemgrpc.Config{
		{Scope: scope, Flows: []string{"p.S/M"}},
		{Scope: scope, Flows: []string{testpb.PaymentsGet}},
		{Scope: scope, Flows: []string{"/grpc.health.v1.Health/Check"}},
		{Scope: scope, Required: true, Optional: []string{"/p.S/M"}, Flows: []string{"/p.S/M"}},
	} {
		interceptor, err := idemgrpc.NewServerInterceptor(&pgxpool.Pool{}, cfg)
		if interceptor != nil || !errors.Is(err, idem.ErrInvalidOption) || !strings.HasPrefix(fmtVal(err), "idemgrpc: Config.Flows: ") {
			t.Errorf("%+v: got %v; want an error that names Config.Flows and wraps idem.ErrInvalidOption", cfg, err)
		}
	}
	// A flow method need not be in Methods, and may be.
	for _, cfg := range []idemgrpc.Config{
		{Scope: scope, Methods: []string{"/p.S/A"}, Flows: []string{"/p.S/M"}},
		{Scope: scope, Methods: []string{"/p.S/M"}, Flows: []string{"/p.S/M"}},
		{Scope: scope, Required: true, Optional: []string{"/p.S/A"}, Flows: []string{"/p.S/M"}},
	} {
		if _, err := idemgrpc.NewServerInterceptor(&pgxpool.Pool{}, cfg); err != nil {
			t.Errorf("%+v: %v", cfg, err)
		}
	}
}

func TestFlowMethodPanicGivesTheLeaseUpAndReachesTheRecoveryInterceptor(t *testing.T) {
	ctx, pool, tenant := setup(t)
	recovery := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (_ any, err error) {
		defer func() {
			if r := recover(); r != nil {
				err = status.Errorf(codes.Internal, "recovered: %v", r)
			}
		}()
		return handler(ctx, req)
	}
	// No wait: a retry that found the flow still held would get ABORTED.
	conn, p := serveFlow(t, pool, idemgrpc.Config{Wait: -1}, recovery)
	p.hold = func(attempt int64) error {
		if attempt == 1 {
			panic("boom, in the provider's client")
		}
		return nil
	}
	req := &testpb.PayRequest{AmountCents: 2500}
	if a := pay(ctx, conn, tenant, "k", req); status.Code(a.err) != codes.Internal || !strings.Contains(status.Convert(a.err).Message(), "recovered: boom") {
		t.Fatalf("a panicking flow: %v, want the recovery interceptor's INTERNAL", a.err)
	}
	if b := pay(ctx, conn, tenant, "k", req); b.err != nil || b.replayed() {
		t.Fatalf("the retry after a panic: %v, replayed %t; want the flow continued at once", b.err, b.replayed())
	}
	if keys := p.providerKeys(); len(keys) != 2 || keys[0] != keys[1] || p.charges.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("provider keys %q, %d charges, %d payments; want one key twice, 1, 1", keys, p.charges.Load(), countPayments(t, pool, tenant))
	}
}

func TestFlowMethodWhoseStepsChangedIsInternalAndDoesNotInviteARetry(t *testing.T) {
	ctx, pool, tenant := setup(t)
	before, p := serveFlow(t, pool, idemgrpc.Config{Logger: discard})
	p.fail = func(int64) error { return errors.New("timeout") }
	req := &testpb.PayRequest{AmountCents: 2500}
	wantReason(t, pay(ctx, before, tenant, "k", req).err, codes.Unavailable, idemgrpc.ReasonOperationIncomplete)

	// A deployment renames the flow's first step while the flow is in
	// progress.
	var ran atomic.Bool
	changed := idem.MustNewFlow("pay", func(ctx context.Context, s *idem.Steps, in order) (order, error) {
		return idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (order, error) {
			// The step ran if its statement did: a run's first step may
			// start, up to it, before the run knows the flow is there.
			if _, err := tx.Exec(ctx, `SELECT $1::int`, 1); err != nil {
				return order{}, err
			}
			ran.Store(true)
			return in, nil
		})
	})
	after := serve(t, pool, idemgrpc.Config{Flows: []string{testpb.PaymentsPay}, Logger: discard},
		&testpb.PaymentsServer{Pay: payByFlow(changed)})
	st := wantReason(t, pay(ctx, after, tenant, "k", req).err, codes.Internal, idemgrpc.ReasonRequestFailed)
	if strings.Contains(st.Message(), "retrying it with the same") || ran.Load() {
		t.Fatalf("changed steps: %q, step ran %t; want no retry invited and nothing run", st.Message(), ran.Load())
	}
}
