package idemhttp_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

func TestStandardMux(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	mw := idemhttp.MustNew(pool, idemhttp.Config{Scope: tenantScope})
	pay := payHandler(&calls)

	mux := http.NewServeMux()
	// Per route: the mux has matched the route, so path values are set.
	mux.Handle("POST /accounts/{account}/payments", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Account", r.PathValue("account"))
		pay.ServeHTTP(w, r)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	first := post(t, srv, "/accounts/acct-9/payments", tenant, "k", `{"amount_cents":100}`)
	if first.status != http.StatusCreated || first.header.Get("X-Account") != "acct-9" {
		t.Fatalf("first: %d %s %v", first.status, first.body, first.header)
	}
	retry := post(t, srv, "/accounts/acct-9/payments", tenant, "k", `{"amount_cents":100}`)
	if !retry.replayed() {
		t.Fatalf("retry: %d %s, want a replay", retry.status, retry.body)
	}
	sameAnswer(t, retry, first, "Content-Type", "Location")

	// Around the whole mux: every route's covered methods are covered.
	outer := http.NewServeMux()
	outer.Handle("POST /payments", pay)
	outer.HandleFunc("GET /payments/{id}", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "tx is nil: %v", idemhttp.Tx(r.Context()) == nil)
	})
	srv2 := serve(t, pool, idemhttp.Config{}, outer)
	first = post(t, srv2, "/payments", tenant, "k2", `{"amount_cents":100}`)
	retry = post(t, srv2, "/payments", tenant, "k2", `{"amount_cents":100}`)
	if first.status != http.StatusCreated || !retry.replayed() {
		t.Fatalf("through the wrapped mux: first %d %s, retry replayed=%v", first.status, first.body, retry.replayed())
	}
	sameAnswer(t, retry, first, "Content-Type", "Location")
	if get := do(t, srv2.Client(), newGet(t, srv2, "/payments/1", tenant)); string(get.body) != "tx is nil: true" {
		t.Fatalf("GET through the wrapped mux: %d %q", get.status, get.body)
	}
	if calls.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2", calls.Load())
	}
}

func TestUncoveredMethodPassesThrough(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{Required: true}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		fmt.Fprintf(w, "run %d, tx is nil: %v", n, idemhttp.Tx(r.Context()) == nil)
	}))
	for _, method := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
		for range 2 {
			req := newGet(t, srv, "/payments/1", tenant)
			req.Method = method
			req.Header.Set(idemhttp.DefaultHeader, "k")
			res := do(t, srv.Client(), req)
			if res.status != http.StatusOK || res.replayed() || !strings.HasSuffix(string(res.body), "tx is nil: true") {
				t.Fatalf("%s: %d %q replayed=%v", method, res.status, res.body, res.replayed())
			}
		}
	}
	if calls.Load() != 6 || countRecords(t, pool, tenant) != 0 {
		t.Fatalf("handler ran %d times, want 6, and no key claimed", calls.Load())
	}
	if idemhttp.Tx(context.Background()) != nil {
		t.Fatal("Tx of a bare context is not nil")
	}
}

// Middleware given a connection that is in a caller's transaction used to
// run the handler in that transaction and commit it, keyed requests and
// unkeyed ones alike. It now answers 500 without running the handler, and
// leaves the transaction as it was.
func TestMiddlewareRefusesAConnectionInATransaction(t *testing.T) {
	ctx, pool, tenant := setup(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'caller', 1)`, tenant); err != nil {
		t.Fatal(err)
	}

	var calls atomic.Int64
	var logs bytes.Buffer
	srv := httptest.NewServer(idemhttp.MustNew(conn, idemhttp.Config{
		Scope:  tenantScope,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})(payHandler(&calls)))
	t.Cleanup(srv.Close)
	for _, key := range []string{`"k1"`, noKey} {
		res := post(t, srv, "/payments", tenant, key, `{"amount_cents": 100}`)
		wantProblem(t, res, http.StatusInternalServerError, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemRequestFailed)
	}
	if n := calls.Load(); n != 0 {
		t.Errorf("the handler ran %d times, want never", n)
	}
	if n := strings.Count(logs.String(), "connection is in a transaction"); n != 2 {
		t.Errorf("%d requests logged the refusal, want 2; logs:\n%s", n, logs.String())
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'T' {
		t.Fatalf("the caller's transaction has status %q, want T", status)
	}
	if n, r := countPayments(t, pool, tenant), countRecords(t, pool, tenant); n != 0 || r != 0 {
		t.Errorf("%d payments, %d records committed under the caller's open transaction; want none", n, r)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("the caller's commit: %v", err)
	}
	if n, r := countPayments(t, pool, tenant), countRecords(t, pool, tenant); n != 1 || r != 0 {
		t.Errorf("after the caller's commit: %d payments, %d records; want its own 1 and none", n, r)
	}
}

func TestTxKeyAndScopeReachTheHandler(t *testing.T) {
	_, pool, tenant := setup(t)
	srv := serve(t, pool, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		fmt.Fprintf(w, "tx=%v key=%q scope=%q", idemhttp.Tx(ctx) != nil, idemhttp.Key(ctx), idemhttp.Scope(ctx))
	}))
	get := newGet(t, srv, "/payments", tenant)
	get.Header.Set(idemhttp.DefaultHeader, "ignored")
	for name, c := range map[string]struct {
		req  *http.Request
		want string
	}{
		// The key unquoted, the scope as Config.Scope gave it.
		"keyed": {newPost(t, srv, "/payments", tenant, `"order \"1\""`, `{}`), fmt.Sprintf(`tx=true key="order \"1\"" scope=%q`, tenant)},
		// Config.Scope is not called without a key.
		"unkeyed":            {newPost(t, srv, "/payments", tenant, noKey, `{}`), `tx=true key="" scope=""`},
		"method not covered": {get, `tx=false key="" scope=""`},
	} {
		if res := do(t, srv.Client(), c.req); res.status != http.StatusOK || string(res.body) != c.want {
			t.Errorf("%s: got %d %s, want %s", name, res.status, res.body, c.want)
		}
	}
	if ctx := context.Background(); idemhttp.Key(ctx) != "" || idemhttp.Scope(ctx) != "" {
		t.Error("Key or Scope of a bare context is not empty")
	}
}
