package interop_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"github.com/pgidem/idem/idemhttp"
)

// connectConfig is idemhttp's configuration for connect-go handlers, as
// docs/grpc.md gives it.
func connectConfig() idemhttp.Config {
	return idemhttp.Config{
		Scope: func(r *http.Request) (string, error) {
			if tenant := r.Header.Get(tenantKey); tenant != "" {
				return tenant, nil
			}
			return "", errors.New("no tenant")
		},
		Fingerprint: idemgrpc.ConnectFingerprint,
		Store: func(status int) bool {
			return idemhttp.StoreDefinite(status) && status != http.StatusUnauthorized && status != 499
		},
		ReplayHeaders: []string{"X-Payment-Id", "Trailer-X-Served"},
	}
}

// connectPayments is the Payments service of connect-go behind idemhttp:
// Pay records the payment on idemhttp's transaction and answers it with
// the header X-Payment-Id and the trailer X-Served; an amount over 10000
// is declined, recorded too, with FAILED_PRECONDITION and an ErrorInfo; an
// amount of 503 or 409 fails with UNAVAILABLE or ABORTED after its insert.
type connectPayments struct{ runs atomic.Int64 }

func (p *connectPayments) pay(ctx context.Context, req *connect.Request[testpb.PayRequest]) (*connect.Response[testpb.Payment], error) {
	p.runs.Add(1)
	res := &testpb.Payment{AmountCents: req.Msg.GetAmountCents(), Status: "paid", Labels: req.Msg.GetLabels()}
	err := idemhttp.Tx(ctx).QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
		idemhttp.Scope(ctx), idemhttp.Key(ctx), req.Msg.GetAmountCents()).Scan(&res.Id)
	switch amount := req.Msg.GetAmountCents(); {
	case err != nil:
		return nil, connect.NewError(connect.CodeInternal, err)
	case amount == 503:
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("try again"))
	case amount == 409:
		return nil, connect.NewError(connect.CodeAborted, errors.New("try again"))
	case amount > 10000:
		cerr := connect.NewError(connect.CodeFailedPrecondition, errors.New("card declined"))
		detail, _ := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example.com"})
		cerr.AddDetail(detail)
		return nil, cerr
	}
	out := connect.NewResponse(res)
	out.Header().Set("X-Payment-Id", strconv.FormatInt(res.GetId(), 10))
	out.Trailer().Set("X-Served", "yes")
	return out, nil
}

// serveConnect serves p with connect-go behind idemhttp for cfg, over
// HTTP/1.1 and unencrypted HTTP/2, until the test ends.
func serveConnect(t *testing.T, pool *pgxpool.Pool, cfg idemhttp.Config, p *connectPayments) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(testpb.PaymentsPay, connect.NewUnaryHandler(testpb.PaymentsPay, p.pay))
	srv := httptest.NewUnstartedServer(idemhttp.MustNew(pool, cfg)(mux))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// recorded is an HTTP answer as it came over the wire.
type recorded struct {
	status int
	header http.Header
	body   []byte
}

// recorder is an http.RoundTripper that keeps every answer's raw form.
type recorder struct {
	base http.RoundTripper
	mu   sync.Mutex
	all  []recorded
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	res, err := r.base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(res.Body)
	_ = res.Body.Close()
	if err != nil {
		return nil, err
	}
	res.Body = io.NopCloser(bytes.NewReader(body))
	r.mu.Lock()
	r.all = append(r.all, recorded{status: res.StatusCode, header: res.Header.Clone(), body: body})
	r.mu.Unlock()
	return res, nil
}

func (r *recorder) last() recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.all[len(r.all)-1]
}

// callConnect calls Pay with client as tenant with key.
func callConnect(ctx context.Context, client *connect.Client[testpb.PayRequest, testpb.Payment], tenant, key string, msg *testpb.PayRequest) (*connect.Response[testpb.Payment], error) {
	req := connect.NewRequest(msg)
	req.Header().Set(tenantKey, tenant)
	req.Header().Set(idemhttp.DefaultHeader, key)
	return client.CallUnary(ctx, req)
}

func TestConnectThroughIdemhttpReplaysByteForByte(t *testing.T) {
	for name, opts := range map[string][]connect.ClientOption{
		"binary": nil,
		"JSON":   {connect.WithProtoJSON()},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, pool, tenant := setup(t)
			var p connectPayments
			srv := serveConnect(t, pool, connectConfig(), &p)
			rec := &recorder{base: srv.Client().Transport}
			client := connect.NewClient[testpb.PayRequest, testpb.Payment](&http.Client{Transport: rec}, srv.URL+testpb.PaymentsPay, opts...)
			// A map of many entries, which the binary codec writes in
			// another order each time.
			msg := &testpb.PayRequest{AmountCents: 2500, Labels: map[string]string{}}
			for _, k := range strings.Split("a b c d e f g h i j k l", " ") {
				msg.Labels[k] = strings.ToUpper(k)
			}

			first, err := callConnect(ctx, client, tenant, "k", msg)
			if err != nil {
				t.Fatal(err)
			}
			firstRaw := rec.last()
			retry, err := callConnect(ctx, client, tenant, "k", msg)
			if err != nil {
				t.Fatal(err)
			}
			retryRaw := rec.last()
			if !proto.Equal(first.Msg, retry.Msg) || retry.Header().Get(idemhttp.ReplayedHeader) != "true" {
				t.Fatalf("retry %v, header %v; want %v replayed", retry.Msg, retry.Header(), first.Msg)
			}
			if !bytes.Equal(firstRaw.body, retryRaw.body) || firstRaw.status != retryRaw.status {
				t.Fatalf("the replay's body is not the first's byte for byte:\n%q\n%q", firstRaw.body, retryRaw.body)
			}
			for _, name := range []string{"Content-Type", "X-Payment-Id", "Trailer-X-Served"} {
				if got, want := retryRaw.header.Get(name), firstRaw.header.Get(name); got == "" || got != want {
					t.Fatalf("header %s: replay %q, first %q", name, got, want)
				}
			}
			if retry.Trailer().Get("X-Served") != "yes" {
				t.Fatalf("the replay's trailer %v lacks X-Served", retry.Trailer())
			}
			if p.runs.Load() != 1 || count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant) != 1 {
				t.Fatalf("%d runs, want 1", p.runs.Load())
			}
		})
	}
}

func TestConnectErrorsThroughIdemhttp(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p connectPayments
	srv := serveConnect(t, pool, connectConfig(), &p)
	rec := &recorder{base: srv.Client().Transport}
	client := connect.NewClient[testpb.PayRequest, testpb.Payment](&http.Client{Transport: rec}, srv.URL+testpb.PaymentsPay)

	// A definite error is stored and replayed, byte for byte, with its
	// details.
	declined := &testpb.PayRequest{AmountCents: 20000}
	_, err := callConnect(ctx, client, tenant, "declined", declined)
	firstRaw := rec.last()
	_, retryErr := callConnect(ctx, client, tenant, "declined", declined)
	var cerr *connect.Error
	if !errors.As(retryErr, &cerr) || cerr.Code() != connect.CodeFailedPrecondition || cerr.Meta().Get(idemhttp.ReplayedHeader) != "true" ||
		!bytes.Equal(rec.last().body, firstRaw.body) || connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("retry of a declined payment: %v; want the first error (%v) replayed byte for byte", retryErr, err)
	}
	if detail, err := cerr.Details()[0].Value(); err != nil || detail.(*errdetails.ErrorInfo).GetReason() != "CARD_DECLINED" {
		t.Fatalf("replayed details: %v, %v", detail, err)
	}

	// UNAVAILABLE (503) and ABORTED (409) roll back, and the retry runs.
	for _, amount := range []int64{503, 409} {
		key := "retryable-" + strconv.FormatInt(amount, 10)
		for range 2 {
			_, err := callConnect(ctx, client, tenant, key, &testpb.PayRequest{AmountCents: amount})
			if c := connect.CodeOf(err); c != connect.CodeUnavailable && c != connect.CodeAborted {
				t.Fatalf("amount %d: %v", amount, err)
			}
		}
	}
	if runs, rows := p.runs.Load(), count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant); runs != 5 || rows != 1 {
		t.Fatalf("%d runs and %d payments; want 5 runs (1 declined, 2 and 2 retryable) and the declined payment only", runs, rows)
	}
}

func TestConnectBinaryRetryNeedsConnectFingerprint(t *testing.T) {
	ctx, pool, tenant := setup(t)
	part := func(m *testpb.PayRequest) []byte {
		b, _ := proto.Marshal(m)
		return b
	}
	// The same message, its map's entries in two orders, as connect-go's
	// binary codec may write it on two attempts.
	bodies := func(amountCents int64) [][]byte {
		amount, a, b := part(&testpb.PayRequest{AmountCents: amountCents}), part(&testpb.PayRequest{Labels: map[string]string{"a": "1"}}),
			part(&testpb.PayRequest{Labels: map[string]string{"b": "2"}})
		return [][]byte{bytes.Join([][]byte{amount, a, b}, nil), bytes.Join([][]byte{amount, b, a}, nil)}
	}
	post := func(srv *httptest.Server, key string, body []byte) recorded {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+testpb.PaymentsPay, bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/proto")
		req.Header.Set("Connect-Protocol-Version", "1")
		req.Header.Set(tenantKey, tenant)
		req.Header.Set(idemhttp.DefaultHeader, key)
		rec := &recorder{base: srv.Client().Transport}
		res, err := rec.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = res.Body.Close()
		return rec.last()
	}

	withDefault := connectConfig()
	withDefault.Fingerprint = nil
	srv := serveConnect(t, pool, withDefault, &connectPayments{})
	body := bodies(7)
	if first, retry := post(srv, "default", body[0]), post(srv, "default", body[1]); first.status != http.StatusOK || retry.status != http.StatusUnprocessableEntity {
		t.Fatalf("under DefaultFingerprint: %d, then %d; want 200, then 422 key-reused (the raw bytes differ)", first.status, retry.status)
	}
	srv = serveConnect(t, pool, connectConfig(), &connectPayments{})
	body = bodies(8)
	first, retry := post(srv, "connect", body[0]), post(srv, "connect", body[1])
	if first.status != http.StatusOK || retry.status != http.StatusOK || !bytes.Equal(first.body, retry.body) || retry.header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("under ConnectFingerprint: %d %q, then %d %q; want the first answer replayed", first.status, first.body, retry.status, retry.body)
	}
}

func TestGRPCAndGRPCWebThroughIdemhttpAreRefused(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p connectPayments
	srv := serveConnect(t, pool, connectConfig(), &p)
	h2c := new(http.Protocols)
	h2c.SetUnencryptedHTTP2(true)
	msg := &testpb.PayRequest{AmountCents: 1}
	for name, client := range map[string]*connect.Client[testpb.PayRequest, testpb.Payment]{
		"gRPC":     connect.NewClient[testpb.PayRequest, testpb.Payment](&http.Client{Transport: &http.Transport{Protocols: h2c}}, srv.URL+testpb.PaymentsPay, connect.WithGRPC()),
		"gRPC-Web": connect.NewClient[testpb.PayRequest, testpb.Payment](srv.Client(), srv.URL+testpb.PaymentsPay, connect.WithGRPCWeb()),
	} {
		_, err := callConnect(ctx, client, tenant, "k-"+name, msg)
		var cerr *connect.Error
		if !errors.As(err, &cerr) || cerr.Code() != connect.CodeUnimplemented || !strings.Contains(cerr.Message(), "idemgrpc") {
			t.Fatalf("%s through idemhttp: %v; want UNIMPLEMENTED pointing to idemgrpc", name, err)
		}
	}
	// grpc-go's own client.
	conn := dial(t, strings.TrimPrefix(srv.URL, "http://"))
	_, err := testpb.NewPaymentsClient(conn).Pay(metadata.AppendToOutgoingContext(ctx, tenantKey, tenant, idemgrpc.DefaultMetadata, "k-grpc-go"), msg)
	if st := status.Convert(err); st.Code() != codes.Unimplemented || !strings.Contains(st.Message(), "idemgrpc") {
		t.Fatalf("grpc-go through idemhttp: %v; want UNIMPLEMENTED pointing to idemgrpc", err)
	}
	if p.runs.Load() != 0 || count(t, pool, `SELECT count(*) FROM idempotency_key`) != 0 {
		t.Fatalf("the handler ran %d times, or something was stored", p.runs.Load())
	}
}
