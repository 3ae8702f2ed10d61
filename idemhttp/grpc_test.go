package idemhttp_test

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

func TestGRPCAndGRPCWebCallsAreRefusedInTheirOwnProtocol(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{}, payHandler(&calls))
	for _, contentType := range []string{
		"application/grpc", "application/grpc+proto", "application/grpc+json",
		"application/grpc-web", "application/grpc-web+proto", "application/grpc-web-text", "application/grpc-web-text+proto",
	} {
		for _, key := range []string{"k-" + contentType, noKey} {
			req := newPost(t, srv, "/pkg.Payments/Pay", tenant, key, "\x00\x00\x00\x00\x00")
			req.Header.Set("Content-Type", contentType)
			res := do(t, srv.Client(), req)
			if res.status != http.StatusOK || res.header.Get("Grpc-Status") != "12" ||
				!strings.Contains(res.header.Get("Grpc-Message"), "idemgrpc") || res.header.Get("Content-Type") != contentType || len(res.body) != 0 {
				t.Fatalf("%s, key %q: %d %v %q; want a trailers-only UNIMPLEMENTED that points to idemgrpc", contentType, key, res.status, res.header, res.body)
			}
		}
	}
	if calls.Load() != 0 || countPayments(t, pool, tenant) != 0 || countRecords(t, pool, tenant) != 0 {
		t.Fatalf("gRPC calls ran the handler %d times, or left something stored", calls.Load())
	}

	// Not gRPC: the usual answers.
	req := newPost(t, srv, "/payments", tenant, "k", `{"amount_cents": 1}`)
	req.Header.Set("Content-Type", "application/grpcish")
	if res := do(t, srv.Client(), req); res.status != http.StatusCreated || res.header.Get("Grpc-Status") != "" {
		t.Fatalf("a media type that is not gRPC's: %d %v", res.status, res.header)
	}
}
