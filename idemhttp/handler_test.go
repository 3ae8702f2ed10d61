package idemhttp_test

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

func TestDeclinedCardStaysDeclined(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{}, payHandler(&calls))

	first := post(t, srv, "/payments", tenant, "decline-1", `{"amount_cents": 20000}`)
	if first.status != http.StatusPaymentRequired {
		t.Fatalf("status %d %s, want 402", first.status, first.body)
	}
	// The 4xx committed with the handler's write.
	if countPayments(t, pool, tenant) != 1 || countRecords(t, pool, tenant) != 1 {
		t.Fatal("a 4xx answer did not commit the handler's write and the record")
	}
	retry := post(t, srv, "/payments", tenant, "decline-1", `{"amount_cents": 20000}`)
	if !retry.replayed() {
		t.Fatal("the retry of a declined payment ran again")
	}
	sameAnswer(t, retry, first, "Content-Type", "Location")
	if calls.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", calls.Load())
	}
}

func TestServerErrorRollsBackAndRetryRunsAgain(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	var failing atomic.Bool
	failing.Store(true)
	srv := serve(t, pool, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 100)`, tenant); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if failing.Load() {
			w.Header().Set("X-Reason", "ledger unavailable")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, "try again later")
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "paid")
	}))

	failed := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`)
	if failed.status != http.StatusServiceUnavailable || string(failed.body) != "try again later" ||
		failed.header.Get("X-Reason") != "ledger unavailable" {
		t.Fatalf("got %d %q %v, want the handler's own 503", failed.status, failed.body, failed.header)
	}
	if countPayments(t, pool, tenant) != 0 || countRecords(t, pool, tenant) != 0 {
		t.Fatal("a 5xx answer left a payment or a record behind")
	}

	failing.Store(false)
	retry := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`)
	if retry.status != http.StatusCreated || retry.replayed() || calls.Load() != 2 {
		t.Fatalf("retry: %d replayed=%v after %d runs; want a fresh 201 from a second run", retry.status, retry.replayed(), calls.Load())
	}
	again := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`)
	if !again.replayed() || calls.Load() != 2 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("third request: replayed=%v, %d runs, %d payments", again.replayed(), calls.Load(), countPayments(t, pool, tenant))
	}
}

func TestPanicRollsBackAndRetryRunsAgain(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	var panicking atomic.Bool
	panicking.Store(true)
	var logs syncBuffer
	srv := serve(t, pool, idemhttp.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
				`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 100)`, tenant); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Set-Cookie", "half=written")
			_, _ = io.WriteString(w, "half a response")
			if panicking.Load() {
				panic("ledger exploded")
			}
		}))

	failed := post(t, srv, "/payments", tenant, "k", `{}`)
	failed.problem(t, http.StatusInternalServerError)
	if failed.header.Get("Set-Cookie") != "" || bytes.Contains(failed.body, []byte("half")) {
		t.Fatalf("the 500 carries what the handler wrote before it panicked: %v %q", failed.header, failed.body)
	}
	if countPayments(t, pool, tenant) != 0 || countRecords(t, pool, tenant) != 0 {
		t.Fatal("a panic left a payment or a record behind")
	}
	if !strings.Contains(logs.String(), "ledger exploded") {
		t.Fatalf("the panic was not logged; logs: %s", logs.String())
	}

	panicking.Store(false)
	retry := post(t, srv, "/payments", tenant, "k", `{}`)
	if retry.status != http.StatusOK || retry.replayed() || calls.Load() != 2 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("retry: %d replayed=%v, %d runs, %d payments; want a fresh 200 from a second run",
			retry.status, retry.replayed(), calls.Load(), countPayments(t, pool, tenant))
	}
}

func TestAbortHandlerPanicCutsConnectionAndRollsBack(t *testing.T) {
	_, pool, tenant := setup(t)
	srv := serve(t, pool, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 100)`, tenant); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		panic(http.ErrAbortHandler)
	}))
	if res, err := fetch(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`)); err == nil {
		t.Fatalf("got an answer, %d %q; want the connection cut", res.status, res.body)
	}
	if countPayments(t, pool, tenant) != 0 || countRecords(t, pool, tenant) != 0 {
		t.Fatal("an aborted handler left a payment or a record behind")
	}
}

func TestMissingKey(t *testing.T) {
	t.Run("required", func(t *testing.T) {
		_, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{Required: true}, payHandler(&calls))
		post(t, srv, "/payments", tenant, noKey, `{"amount_cents":100}`).problem(t, http.StatusBadRequest)
		if calls.Load() != 0 || countPayments(t, pool, tenant) != 0 {
			t.Fatal("the handler ran without the required key")
		}
	})
	t.Run("optional runs in a transaction", func(t *testing.T) {
		_, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{}, payHandler(&calls))
		// payHandler writes on idemhttp.Tx, which would panic if nil.
		for range 2 {
			if res := post(t, srv, "/payments", tenant, noKey, `{"amount_cents":100}`); res.status != http.StatusCreated || res.replayed() {
				t.Fatalf("got %d %s replayed=%v, want a fresh 201", res.status, res.body, res.replayed())
			}
		}
		if calls.Load() != 2 || countPayments(t, pool, tenant) != 2 || countRecords(t, pool, tenant) != 0 {
			t.Fatalf("%d runs, %d payments, %d records; want 2, 2, 0",
				calls.Load(), countPayments(t, pool, tenant), countRecords(t, pool, tenant))
		}
	})
	t.Run("optional rolls back a 5xx", func(t *testing.T) {
		_, pool, tenant := setup(t)
		srv := serve(t, pool, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
				`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 100)`, tenant); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			http.Error(w, "ledger unavailable", http.StatusBadGateway)
		}))
		if res := post(t, srv, "/payments", tenant, noKey, `{}`); res.status != http.StatusBadGateway {
			t.Fatalf("got %d %s, want the handler's 502", res.status, res.body)
		}
		if countPayments(t, pool, tenant) != 0 {
			t.Fatal("a 5xx answer without a key committed its write")
		}
	})
}

func TestInvalidKeyIsRejected(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{}, payHandler(&calls))
	cases := map[string][]string{
		"empty":                       {""},
		"empty sf-string":             {`""`},
		"unterminated sf-string":      {`"abc`},
		"invalid escape":              {`"a\b"`},
		"text after the sf-string":    {`"abc"def`},
		"parameters":                  {`"abc";v=1`},
		"non-ASCII sf-string":         {"\"caf\xc3\xa9\""},
		"non-ASCII bare token":        {"caf\xc3\xa9"},
		"space in a bare token":       {"two words"},
		"tab in a bare token":         {"two\twords"},
		"sf-string over 255 bytes":    {`"` + strings.Repeat("a", 256) + `"`},
		"bare token over 255 bytes":   {strings.Repeat("a", 256)},
		"escapes over 255 unquoted":   {`"` + strings.Repeat(`\\`, 256) + `"`},
		"field sent twice":            {"k1", "k2"},
		"sf-string list of two items": {`"k1", "k2"`},
	}
	for name, values := range cases {
		req := newPost(t, srv, "/payments", tenant, noKey, `{"amount_cents":100}`)
		req.Header[idemhttp.DefaultHeader] = values
		p := do(t, srv.Client(), req).problem(t, http.StatusBadRequest)
		if !strings.Contains(p["detail"].(string), idemhttp.DefaultHeader) {
			t.Errorf("%s: detail %q does not name the header", name, p["detail"])
		}
	}
	if calls.Load() != 0 || countRecords(t, pool, tenant) != 0 {
		t.Fatalf("an invalid key ran the handler %d times", calls.Load())
	}

	// The bound is on the key after unquoting: 255 escaped backslashes are
	// 512 bytes on the wire and a valid key of 255 bytes.
	longest := `"` + strings.Repeat(`\\`, 255) + `"`
	for range 2 {
		if res := post(t, srv, "/payments", tenant, longest, `{"amount_cents":100}`); res.status != http.StatusCreated {
			t.Fatalf("longest key: %d %s", res.status, res.body)
		}
	}
	if calls.Load() != 1 {
		t.Fatalf("longest key ran the handler %d times, want 1", calls.Load())
	}
}

func TestQuotedAndBareKeysAreOneKey(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{}, payHandler(&calls))
	first := post(t, srv, "/payments", tenant, `"8e03978e-40d5"`, `{"amount_cents":100}`)
	bare := post(t, srv, "/payments", tenant, `8e03978e-40d5`, `{"amount_cents":100}`)
	if first.status != http.StatusCreated || !bare.replayed() {
		t.Fatalf("first %d, bare replayed=%v", first.status, bare.replayed())
	}
	sameAnswer(t, bare, first, "Content-Type", "Location")
}

func TestSameKeyDifferentRequest(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{}, payHandler(&calls))
	first := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}

	post(t, srv, "/payments", tenant, "k", `{"amount_cents":200}`).problem(t, http.StatusUnprocessableEntity)
	post(t, srv, "/payments?currency=eur", tenant, "k", `{"amount_cents":100}`).problem(t, http.StatusUnprocessableEntity)
	patch := newPost(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`)
	patch.Method = http.MethodPatch
	do(t, srv.Client(), patch).problem(t, http.StatusUnprocessableEntity)

	// The same JSON document spelled differently is the same request.
	same := post(t, srv, "/payments", tenant, "k", "{ \"amount_cents\" :\n 100.0 }")
	if !same.replayed() {
		t.Fatalf("re-encoded body: %d %s, want a replay", same.status, same.body)
	}
	sameAnswer(t, same, first)
	if calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("handler ran %d times, want 1", calls.Load())
	}
}

func TestFingerprintHookChoosesTheFields(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{
		// Only the path counts: a retry that re-renders its body differently
		// is still the same request.
		Fingerprint: func(r *http.Request, body []byte) ([]byte, error) {
			if r.URL.Path == "/unfingerprintable" {
				return nil, fmt.Errorf("no fingerprint for %s", r.URL.Path)
			}
			return []byte(r.URL.Path), nil
		},
	}, payHandler(&calls))
	first := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`)
	other := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100, "note":"rendered again"}`)
	if !other.replayed() {
		t.Fatalf("got %d %s, want a replay", other.status, other.body)
	}
	sameAnswer(t, other, first)
	post(t, srv, "/unfingerprintable", tenant, "k2", `{}`).problem(t, http.StatusBadRequest)
	if calls.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", calls.Load())
	}
}

func TestTenantsAreIsolated(t *testing.T) {
	_, pool, tenant := setup(t)
	tenantA, tenantB := tenant+"-a", tenant+"-b"
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{}, payHandler(&calls))

	// One key, two tenants, two requests: neither a 422 nor a replay of
	// the other tenant's answer, but two runs.
	a := post(t, srv, "/payments", tenantA, "shared", `{"amount_cents":100}`)
	b := post(t, srv, "/payments", tenantB, "shared", `{"amount_cents":200}`)
	if a.status != http.StatusCreated || b.status != http.StatusCreated || b.replayed() || bytes.Equal(a.body, b.body) {
		t.Fatalf("tenant A got %d %s, tenant B got %d %s replayed=%v", a.status, a.body, b.status, b.body, b.replayed())
	}
	// Each tenant's retry replays its own answer.
	sameAnswer(t, post(t, srv, "/payments", tenantA, "shared", `{"amount_cents":100}`), a)
	sameAnswer(t, post(t, srv, "/payments", tenantB, "shared", `{"amount_cents":200}`), b)

	// A caller the scope function cannot place gets 400, not some shared
	// scope's answers, and not the scope function's own error text.
	anon := post(t, srv, "/payments", "", "shared", `{"amount_cents":100}`)
	p := anon.problem(t, http.StatusBadRequest)
	if anon.replayed() || strings.Contains(p["detail"].(string), "no tenant") {
		t.Fatalf("unscoped request got %s", anon.body)
	}
	if calls.Load() != 2 || countPayments(t, pool, tenantA) != 1 || countPayments(t, pool, tenantB) != 1 {
		t.Fatalf("handler ran %d times, want 2", calls.Load())
	}
}

func TestInvalidScopeIsServerError(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{
		// A bug in the scope function: it answers an empty scope instead
		// of an error, which must not become a scope shared by everyone.
		Scope:  func(*http.Request) (string, error) { return "", nil },
		Logger: slog.New(slog.DiscardHandler),
	}, payHandler(&calls))
	p := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`).problem(t, http.StatusInternalServerError)
	if calls.Load() != 0 || countRecords(t, pool, "") != 0 {
		t.Fatalf("an empty scope ran the handler %d times", calls.Load())
	}
	// Every retry would meet the same bug: the answer must not invite one.
	if detail, _ := p["detail"].(string); strings.Contains(detail, "is safe") || !strings.Contains(detail, "error of the server's") {
		t.Fatalf("the detail %q invites a retry, or does not say whose the error is", detail)
	}
}

func TestBodyOverLimit(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	const limit = 32
	srv := serve(t, pool, idemhttp.Config{MaxBodyBytes: limit}, payHandler(&calls))
	fits := `{"amount_cents":1}` + strings.Repeat(" ", limit-len(`{"amount_cents":1}`))

	post(t, srv, "/payments", tenant, "k1", fits+" ").problem(t, http.StatusRequestEntityTooLarge)
	post(t, srv, "/payments", tenant, noKey, fits+" ").problem(t, http.StatusRequestEntityTooLarge)
	// Without a Content-Length, the middleware finds out by reading.
	chunked := newPost(t, srv, "/payments", tenant, "k2", "")
	chunked.Body = io.NopCloser(io.MultiReader(strings.NewReader(fits), strings.NewReader(" ")))
	chunked.ContentLength = -1
	do(t, srv.Client(), chunked).problem(t, http.StatusRequestEntityTooLarge)
	if calls.Load() != 0 || countRecords(t, pool, tenant) != 0 {
		t.Fatalf("a body over the limit ran the handler %d times", calls.Load())
	}

	if res := post(t, srv, "/payments", tenant, "k3", fits); res.status != http.StatusCreated {
		t.Fatalf("a body at the limit: %d %s", res.status, res.body)
	}
}

func TestUnlimitedBodyIsRead(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	// MaxBodyBytes at its largest value once overflowed the read limit, so
	// that every body read as empty and every body had one fingerprint.
	srv := serve(t, pool, idemhttp.Config{MaxBodyBytes: math.MaxInt64}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, _ = io.Copy(w, r.Body)
	}))
	const body = `{"amount_cents":100}`
	first := post(t, srv, "/payments", tenant, "unlimited-1", body)
	if first.status != http.StatusOK || string(first.body) != body {
		t.Fatalf("first: %d %q, want 200 echoing %q", first.status, first.body, body)
	}
	// Without a Content-Length the body is read to its end all the same.
	chunked := newPost(t, srv, "/payments", tenant, "unlimited-2", "")
	chunked.Body = io.NopCloser(strings.NewReader(body))
	chunked.ContentLength = -1
	if res := do(t, srv.Client(), chunked); res.status != http.StatusOK || string(res.body) != body {
		t.Fatalf("chunked: %d %q, want 200 echoing %q", res.status, res.body, body)
	}
	other := post(t, srv, "/payments", tenant, "unlimited-1", `{"amount_cents":900}`)
	other.problem(t, http.StatusUnprocessableEntity)
	if calls.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2", calls.Load())
	}
}

func TestResponseTooLargeToStoreCommitsAndRetriesGet410(t *testing.T) {
	for name, lookupFirst := range map[string]bool{"claim": false, "lookup first": true} {
		t.Run(name, func(t *testing.T) {
			_, pool, tenant := setup(t)
			var calls atomic.Int64
			var logs syncBuffer
			srv := serve(t, pool, idemhttp.Config{
				MaxResponseBytes: 8,
				LookupFirst:      lookupFirst,
				ReplayHeaders:    []string{"Location", "ETag", "X-Request"},
				Logger:           slog.New(slog.NewTextHandler(&logs, nil)),
			}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
					`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 100)`, tenant); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.Header().Set("Content-Type", "text/plain")
				w.Header().Set("Location", "/payments/1")
				w.Header().Set("ETag", `"v1"`)
				w.Header().Set("X-Request", "r-1")
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "nine byte")
			}))
			first := post(t, srv, "/payments", tenant, "k", `{}`)
			if first.status != http.StatusCreated || string(first.body) != "nine byte" || first.replayed() {
				t.Fatalf("first: %d %q, want the handler's whole answer", first.status, first.body)
			}
			if countPayments(t, pool, tenant) != 1 || countRecords(t, pool, tenant) != 1 {
				t.Fatal("the answer too large to store did not commit")
			}
			if !strings.Contains(logs.String(), idemhttp.ProblemResponseNotStored) {
				t.Errorf("nothing logged of the answer not stored; logs: %s", logs.String())
			}
			for range 2 {
				retry := post(t, srv, "/payments", tenant, "k", `{}`)
				p := wantProblem(t, retry, http.StatusGone, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemResponseNotStored)
				if p["original_status"] != float64(http.StatusCreated) || !retry.replayed() {
					t.Fatalf("retry %s replayed=%v, want original_status 201, replayed", retry.body, retry.replayed())
				}
				if retry.header.Get("Location") != "/payments/1" || retry.header.Get("X-Request") != "r-1" || retry.header.Get("ETag") != "" {
					t.Fatalf("retry headers %v: want Location and X-Request, and no ETag of the missing body", retry.header)
				}
			}
			if calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
				t.Fatalf("handler ran %d times, %d payments; want 1 and 1", calls.Load(), countPayments(t, pool, tenant))
			}
		})
	}
}

func TestBrokenDatabaseConnectionIs503AndRetryRunsAgain(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	var logs syncBuffer
	srv := serve(t, pool, idemhttp.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				// The server ends the session under the handler, as a
				// restart or a failover would, after the handler's work
				// and before the middleware's commit.
				_, _ = idemhttp.Tx(r.Context()).Exec(r.Context(), `SELECT pg_terminate_backend(pg_backend_pid())`)
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "paid")
		}))

	failed := post(t, srv, "/payments", tenant, "k", `{}`)
	p := wantProblem(t, failed, http.StatusServiceUnavailable, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemDatabaseUnavailable)
	if !strings.Contains(p["detail"].(string), "Retrying it with the same "+idemhttp.DefaultHeader+" is safe") {
		t.Errorf("detail %q does not say that retrying is safe", p["detail"])
	}
	if got := failed.header.Get("Retry-After"); got != "1" {
		t.Errorf("Retry-After %q, want 1", got)
	}
	if !strings.Contains(logs.String(), "status=503") {
		t.Errorf("the failure was not logged; logs: %s", logs.String())
	}
	if countRecords(t, pool, tenant) != 0 {
		t.Fatal("the broken request left a record behind")
	}
	retry := post(t, srv, "/payments", tenant, "k", `{}`)
	if retry.status != http.StatusCreated || retry.replayed() || calls.Load() != 2 {
		t.Fatalf("retry: %d %s replayed=%v after %d runs; want a fresh 201 from a second run",
			retry.status, retry.body, retry.replayed(), calls.Load())
	}
}
