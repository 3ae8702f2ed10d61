package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// tenantHeader stands in for authentication in the tests: it names the
// caller, and tenantScope turns it into the scope.
const tenantHeader = "X-Tenant"

func tenantScope(r *http.Request) (string, error) {
	tenant := r.Header.Get(tenantHeader)
	if tenant == "" {
		return "", errors.New("no tenant")
	}
	return tenant, nil
}

// setup marks the test parallel and returns a context, the pool of the
// throwaway database, and a tenant no other test uses.
func setup(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	return env.Setup(t, "tenant")
}

// serve starts a real HTTP server with the middleware around next, scoped by
// tenantScope unless cfg says otherwise.
func serve(t *testing.T, pool *pgxpool.Pool, cfg idemhttp.Config, next http.Handler) *httptest.Server {
	t.Helper()
	if cfg.Scope == nil {
		cfg.Scope = tenantScope
	}
	srv := httptest.NewServer(idemhttp.MustNew(pool, cfg)(next))
	t.Cleanup(srv.Close)
	// A redirect is an answer to compare, not to follow.
	srv.Client().CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return srv
}

// payment is what payHandler answers.
type payment struct {
	ID          int64  `json:"id"`
	AmountCents int64  `json:"amount_cents"`
	Status      string `json:"status"`
}

// payHandler records a payment on the request's transaction and answers
// 201, or 402 for an amount over 10000 (a declined card, recorded too).
// calls counts its runs.
func payHandler(calls *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		var req struct {
			AmountCents int64 `json:"amount_cents"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		p := payment{AmountCents: req.AmountCents, Status: "paid"}
		status := http.StatusCreated
		if req.AmountCents > 10000 {
			p.Status, status = "declined", http.StatusPaymentRequired
		}
		err := idemhttp.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			r.Header.Get(tenantHeader), idemhttp.Key(r.Context()), req.AmountCents).Scan(&p.ID)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/payments/"+strconv.FormatInt(p.ID, 10))
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(p)
	})
}

// noKey asks send for a request without the key's header.
const noKey = "\x00none"

// response is an answer read whole.
type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) replayed() bool { return r.header.Get(idemhttp.ReplayedHeader) == "true" }

// problem decodes an RFC 9457 body, failing the test unless the answer is
// one with the given status.
func (r response) problem(t *testing.T, status int) map[string]any {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d; body %s", r.status, status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type %q, want application/problem+json", ct)
	}
	var p map[string]any
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body %q: %v", r.body, err)
	}
	for _, field := range []string{"type", "title", "detail"} {
		if s, _ := p[field].(string); s == "" {
			t.Fatalf("problem %s lacks %q", r.body, field)
		}
	}
	if p["status"] != float64(status) {
		t.Fatalf("problem %s: status field is not %d", r.body, status)
	}
	return p
}

// newPost returns a JSON POST to srv's path as tenant, with key as the raw
// value of the key's header (or none, for noKey).
func newPost(t *testing.T, srv *httptest.Server, path, tenant, key, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if tenant != "" {
		req.Header.Set(tenantHeader, tenant)
	}
	if key != noKey {
		req.Header.Set(idemhttp.DefaultHeader, key)
	}
	return req
}

// post sends newPost's request and reads the answer.
func post(t *testing.T, srv *httptest.Server, path, tenant, key, body string) response {
	t.Helper()
	return do(t, srv.Client(), newPost(t, srv, path, tenant, key, body))
}

func do(t *testing.T, client *http.Client, req *http.Request) response {
	t.Helper()
	res, err := fetch(client, req)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// fetch sends req and reads the answer whole; unlike do it may run on any
// goroutine.
func fetch(client *http.Client, req *http.Request) (response, error) {
	res, err := client.Do(req)
	if err != nil {
		return response{}, err
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: res.StatusCode, header: res.Header, body: body}, nil
}

// sameAnswer fails the test unless got is want again, byte for byte, in
// its status, its body and the listed headers.
func sameAnswer(t *testing.T, got, want response, headers ...string) {
	t.Helper()
	if got.status != want.status || !bytes.Equal(got.body, want.body) {
		t.Fatalf("got %d %q, want %d %q", got.status, got.body, want.status, want.body)
	}
	for _, name := range headers {
		if g, w := got.header.Values(name), want.header.Values(name); !slices.Equal(g, w) {
			t.Fatalf("header %s: got %q, want %q", name, g, w)
		}
	}
}

var countPayments = testdb.CountPayments
var countRecords = testdb.CountRecords

func newGet(t *testing.T, srv *httptest.Server, path, tenant string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(tenantHeader, tenant)
	return req
}

// serveHandler starts a plain server around h.
func serveHandler(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// wantProblem fails the test unless res is the problem code with status,
// its type under base, its code member and its describedby link. It returns
// the decoded problem.
func wantProblem(t *testing.T, res response, status int, base, code string) map[string]any {
	t.Helper()
	p := res.problem(t, status)
	if p["type"] != base+code || p["code"] != code {
		t.Fatalf("problem %s: want type %q and code %q", res.body, base+code, code)
	}
	if link, want := res.header.Get("Link"), "<"+base+code+`>; rel="describedby"`; link != want {
		t.Fatalf("Link %q, want %q", link, want)
	}
	return p
}

// syncBuffer is a log sink that the server's goroutines and the test may
// share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
