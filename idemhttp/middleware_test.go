package idemhttp_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/idemhttp"
)

func TestReplayIsByteExact(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	// Bytes that no JSON or text round trip would keep: odd spacing, a
	// number spelled 1.0, a NUL, invalid UTF-8 and trailing blanks.
	body := []byte("{\"b\": 1,  \"a\":\t[1.0, 1e0]}\n\x00\xff\xfe trailing  ")
	srv := serve(t, pool, idemhttp.Config{
		// Credentials are listed on purpose: they must be dropped anyway.
		ReplayHeaders: []string{"Content-Type", "location", "X-Trace", "X-Late",
			"Set-Cookie", "Authorization", "WWW-Authenticate"},
	}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'exact', 1)`, tenant); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		h := w.Header()
		h.Set("Content-Type", "application/vnd.example+json; charset=utf-8")
		h.Set("Location", "/payments/7")
		h.Add("X-Trace", "a")
		h.Add("X-Trace", "b")
		h.Set("Set-Cookie", "session=secret-cookie")
		h.Set("Authorization", "Bearer secret-token")
		h.Set("WWW-Authenticate", `Basic realm="secret-realm"`)
		h.Set("X-Unlisted", "first answer only")
		w.WriteHeader(http.StatusAccepted)
		_, _ = w.Write(body[:5])
		_, _ = w.Write(body[5:])
		h.Set("X-Late", "after the status: not part of the answer")
	}))

	first := post(t, srv, "/payments", tenant, `"exact-1"`, `{}`)
	if first.status != http.StatusAccepted || !bytes.Equal(first.body, body) || first.replayed() {
		t.Fatalf("first answer %d %q replayed=%v", first.status, first.body, first.replayed())
	}
	if first.header.Get("Set-Cookie") == "" || first.header.Get("X-Unlisted") == "" || first.header.Get("X-Late") != "" {
		t.Fatalf("first answer headers %v: want every header set before the status, and only those", first.header)
	}

	replay := post(t, srv, "/payments", tenant, `"exact-1"`, `{}`)
	if !replay.replayed() {
		t.Fatalf("second answer is not marked replayed: %v", replay.header)
	}
	sameAnswer(t, replay, first, "Content-Type", "Location", "X-Trace", "Content-Length")
	for _, name := range []string{"Set-Cookie", "Authorization", "WWW-Authenticate", "X-Unlisted", "X-Late"} {
		if v := replay.header.Values(name); len(v) > 0 {
			t.Errorf("replay carries %s: %q", name, v)
		}
	}
	var stored string
	if err := pool.QueryRow(context.Background(),
		`SELECT response::text FROM idempotency_key WHERE scope = $1`, tenant).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(stored, "secret") {
		t.Errorf("a credential was stored: %s", stored)
	}
	if calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("handler ran %d times, %d payments; want 1 and 1", calls.Load(), countPayments(t, pool, tenant))
	}
}

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

func TestRedirectAndNoContentAreStored(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		switch r.URL.Path {
		case "/see-other":
			w.Header().Set("Location", "/payments/1")
			w.WriteHeader(http.StatusSeeOther)
		case "/no-content":
			w.WriteHeader(http.StatusNoContent)
		case "/silent":
			// Writes nothing at all: net/http would answer 200, empty.
		}
	}))
	for _, path := range []string{"/see-other", "/no-content", "/silent"} {
		first := post(t, srv, path, tenant, "k"+path, `{}`)
		retry := post(t, srv, path, tenant, "k"+path, `{}`)
		if first.replayed() || !retry.replayed() {
			t.Fatalf("%s: first replayed=%v, retry replayed=%v", path, first.replayed(), retry.replayed())
		}
		sameAnswer(t, retry, first, "Location", "Content-Length")
	}
	if calls.Load() != 3 {
		t.Fatalf("handler ran %d times, want 3", calls.Load())
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

func newGet(t *testing.T, srv *httptest.Server, path, tenant string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(tenantHeader, tenant)
	return req
}

// blockingHandler inserts a payment and reports its backend's pid on
// started, then answers only once release is closed. Its first run answers
// firstStatus; later runs answer 201.
type blockingHandler struct {
	tenant      string
	firstStatus int
	calls       atomic.Int64
	started     chan int32
	release     chan struct{}
	releaseOnce sync.Once
}

func newBlockingHandler(t *testing.T, tenant string, firstStatus int) *blockingHandler {
	h := &blockingHandler{tenant: tenant, firstStatus: firstStatus, started: make(chan int32, 10), release: make(chan struct{})}
	// Never leave a handler blocked: the server waits for it to close.
	t.Cleanup(h.unblock)
	return h
}

func (h *blockingHandler) unblock() { h.releaseOnce.Do(func() { close(h.release) }) }

// awaitStarted returns the pid that the handler reports once it has
// started on the request answered by first. It fails the test at once when
// that request is answered without the handler having started (the
// database cannot be reached, say), and after a minute when neither
// happens, rather than wait forever.
func (h *blockingHandler) awaitStarted(t *testing.T, first <-chan response) int32 {
	t.Helper()
	select {
	case pid := <-h.started:
		return pid
	case res := <-first:
		t.Fatalf("first request answered %d %s before its handler started", res.status, res.body)
	case <-time.After(time.Minute):
		t.Fatal("the first request's handler did not start within a minute")
	}
	return 0
}

func (h *blockingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	tx := idemhttp.Tx(r.Context())
	var pid int32
	err := tx.QueryRow(r.Context(), `SELECT pg_backend_pid()`).Scan(&pid)
	if err == nil {
		_, err = tx.Exec(r.Context(), `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 100)`, h.tenant)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	h.started <- pid
	<-h.release
	status := http.StatusCreated
	if n == 1 {
		status = h.firstStatus
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, "run %d answered %d", n, status)
}

// waitForBlocked returns once some session waits for a lock that the
// session pid holds: a duplicate request is waiting on the claim.
func waitForBlocked(ctx context.Context, t *testing.T, pool *pgxpool.Pool, pid int32) {
	t.Helper()
	for {
		var waiting bool
		err := pool.QueryRow(ctx,
			`SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid)))`, pid).Scan(&waiting)
		if err != nil {
			t.Fatalf("look for a waiting request: %v", err)
		}
		if waiting {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal("no duplicate request waited for the first")
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// sendAsync sends req on its own goroutine and delivers the answer.
func sendAsync(client *http.Client, req *http.Request) <-chan response {
	out := make(chan response, 1)
	go func() {
		res, err := fetch(client, req)
		if err != nil {
			res = response{status: -1, body: []byte(err.Error())}
		}
		out <- res
	}()
	return out
}

func TestConcurrentDuplicateWaitsAndReplays(t *testing.T) {
	ctx, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusCreated)
	srv := serve(t, pool, idemhttp.Config{Wait: time.Minute}, h)

	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	pid := h.awaitStarted(t, firstDone)
	secondDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	waitForBlocked(ctx, t, pool, pid)
	h.unblock()

	first, second := <-firstDone, <-secondDone
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d %s replayed=%v", first.status, first.body, first.replayed())
	}
	if !second.replayed() {
		t.Fatalf("second: %d %s, want a replay of the first", second.status, second.body)
	}
	sameAnswer(t, second, first)
	if h.calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("handler ran %d times, want 1", h.calls.Load())
	}
}

func TestConcurrentDuplicateRunsWhenFirstRollsBack(t *testing.T) {
	ctx, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusInternalServerError)
	srv := serve(t, pool, idemhttp.Config{Wait: time.Minute}, h)

	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	pid := h.awaitStarted(t, firstDone)
	secondDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	waitForBlocked(ctx, t, pool, pid)
	h.unblock()

	if first := <-firstDone; first.status != http.StatusInternalServerError {
		t.Fatalf("first: %d %s, want its own 500", first.status, first.body)
	}
	second := <-secondDone
	if second.status != http.StatusCreated || second.replayed() || string(second.body) != "run 2 answered 201" {
		t.Fatalf("second: %d %q replayed=%v, want its own run", second.status, second.body, second.replayed())
	}
	if countPayments(t, pool, tenant) != 1 {
		t.Fatalf("%d payments, want only the second run's", countPayments(t, pool, tenant))
	}
}

func TestConcurrentDuplicatePastWaitGets409(t *testing.T) {
	_, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusCreated)
	srv := serve(t, pool, idemhttp.Config{Wait: 50 * time.Millisecond}, h)

	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	h.awaitStarted(t, firstDone)
	// The first request holds the key until released, so this one's wait
	// runs out whatever the machine's speed.
	busy := post(t, srv, "/payments", tenant, "k", `{}`)
	busy.problem(t, http.StatusConflict)
	if busy.header.Get("Retry-After") != "1" {
		t.Fatalf("Retry-After %q, want 1", busy.header.Get("Retry-After"))
	}
	h.unblock()

	first := <-firstDone
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	later := post(t, srv, "/payments", tenant, "k", `{}`)
	if !later.replayed() {
		t.Fatalf("later retry: %d %s, want a replay", later.status, later.body)
	}
	sameAnswer(t, later, first)
	if h.calls.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", h.calls.Load())
	}
}

func TestRetryStorm(t *testing.T) {
	_, pool, tenant := setup(t)
	const clients = 100
	var calls atomic.Int64
	pay := payHandler(&calls)
	srv := serve(t, pool, idemhttp.Config{Wait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Hold the claim a while so that the storm piles up on it; the
		// assertions hold however the requests interleave.
		time.Sleep(100 * time.Millisecond)
		pay.ServeHTTP(w, r)
	}))
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	t.Cleanup(client.CloseIdleConnections)

	start := make(chan struct{})
	answers := make([]response, clients)
	errs := make([]error, clients)
	var wg sync.WaitGroup
	for i := range clients {
		req := newPost(t, srv, "/payments", tenant, `"storm-1"`, `{"amount_cents": 4200}`)
		wg.Go(func() {
			<-start
			answers[i], errs[i] = fetch(client, req)
		})
	}
	close(start)
	wg.Wait()

	firsts := 0
	for i, a := range answers {
		if errs[i] != nil {
			t.Fatalf("client %d: %v", i, errs[i])
		}
		if a.status != http.StatusCreated || !bytes.Equal(a.body, answers[0].body) {
			t.Fatalf("client %d got %d %q, client 0 got %d %q", i, a.status, a.body, answers[0].status, answers[0].body)
		}
		if !a.replayed() {
			firsts++
		}
	}
	if firsts != 1 || calls.Load() != 1 || countPayments(t, pool, tenant) != 1 || countRecords(t, pool, tenant) != 1 {
		t.Fatalf("%d first answers, %d runs, %d payments, %d records; want 1 of each",
			firsts, calls.Load(), countPayments(t, pool, tenant), countRecords(t, pool, tenant))
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

func TestStandardMux(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	mw := idemhttp.New(pool, idemhttp.Config{Scope: tenantScope})
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

func TestNewRejectsConfigThatCannotWork(t *testing.T) {
	t.Parallel()
	scope := func(*http.Request) (string, error) { return "s", nil }
	pool := &pgxpool.Pool{} // never used: New must fail first
	cases := map[string]struct {
		db   *pgxpool.Pool
		cfg  idemhttp.Config
		want string
	}{
		"nil scope":          {pool, idemhttp.Config{}, "Scope"},
		"nil database":       {nil, idemhttp.Config{Scope: scope}, "database"},
		"negative retention": {pool, idemhttp.Config{Scope: scope, Retention: -time.Second}, "Retention"},
		// idem.WithRetention wants at least a microsecond, the resolution
		// of PostgreSQL's timestamps; without the check in New, every keyed
		// request would answer 500.
		"sub-microsecond retention": {pool, idemhttp.Config{Scope: scope, Retention: 500 * time.Nanosecond}, "Retention"},
		"negative body":             {pool, idemhttp.Config{Scope: scope, MaxBodyBytes: -1}, "MaxBodyBytes"},
		"bad header name":           {pool, idemhttp.Config{Scope: scope, Header: "Idempotency Key"}, "Header"},
		"bad method":                {pool, idemhttp.Config{Scope: scope, Methods: []string{"POST "}}, "Methods"},
		// idem rejects a wait that lock_timeout cannot express; without the
		// check in New, every keyed request would answer 500.
		"wait too long":     {pool, idemhttp.Config{Scope: scope, Wait: math.MaxInt32*time.Millisecond + time.Millisecond}, "Wait"},
		"negative response": {pool, idemhttp.Config{Scope: scope, MaxResponseBytes: -1}, "MaxResponseBytes"},
		// The stored size, base64 and an allowance for headers, would wrap.
		"largest response":     {pool, idemhttp.Config{Scope: scope, MaxResponseBytes: math.MaxInt}, "MaxResponseBytes"},
		"top quarter response": {pool, idemhttp.Config{Scope: scope, MaxResponseBytes: math.MaxInt/4*3 + 1}, "MaxResponseBytes"},
		// Sealed, the stored form is base64 twice over: a limit that fits
		// without a codec wraps with one.
		"largest response sealed": {pool, idemhttp.Config{Scope: scope, MaxResponseBytes: math.MaxInt / 3 * 2, Codec: &xorCodec{}}, "MaxResponseBytes"},
		"relative problem type":   {pool, idemhttp.Config{Scope: scope, ProblemTypeBase: "/errors#"}, "ProblemTypeBase"},
	}
	for name, c := range cases {
		func() {
			defer func() {
				p := recover()
				if msg, _ := p.(string); !strings.Contains(msg, c.want) {
					t.Errorf("%s: New panicked with %v, want a message naming %s", name, p, c.want)
				}
			}()
			if c.db == nil {
				idemhttp.New(nil, c.cfg)
			} else {
				idemhttp.New(c.db, c.cfg)
			}
		}()
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
	post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`).problem(t, http.StatusInternalServerError)
	if calls.Load() != 0 || countRecords(t, pool, "") != 0 {
		t.Fatalf("an empty scope ran the handler %d times", calls.Load())
	}
}

func TestLookupFirstReplaysAndRejectsMismatches(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{LookupFirst: true}, payHandler(&calls))

	first := post(t, srv, "/payments", tenant, "lf-1", `{"amount_cents": 700}`)
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	retry := post(t, srv, "/payments", tenant, "lf-1", `{"amount_cents": 700}`)
	if !retry.replayed() {
		t.Fatal("the retry was not a replay")
	}
	sameAnswer(t, retry, first, "Content-Type")
	if other := post(t, srv, "/payments", tenant, "lf-1", `{"amount_cents": 900}`); other.status != http.StatusUnprocessableEntity {
		t.Fatalf("another body with the same key: %d, want 422", other.status)
	}
	if calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("handler ran %d times, want 1", calls.Load())
	}
}

func TestLargestAcceptedConfigWorks(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	// The largest wait idem accepts, and a response limit far beyond any
	// real one: New must not reject them, nor idem refuse them per request.
	srv := serve(t, pool, idemhttp.Config{
		Wait:             math.MaxInt32 * time.Millisecond,
		MaxResponseBytes: math.MaxInt / 8,
	}, payHandler(&calls))
	first := post(t, srv, "/payments", tenant, "big-1", `{"amount_cents":100}`)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s, want 201", first.status, first.body)
	}
	retry := post(t, srv, "/payments", tenant, "big-1", `{"amount_cents":100}`)
	if !retry.replayed() {
		t.Fatalf("retry: %d %s, want a replay", retry.status, retry.body)
	}
	sameAnswer(t, retry, first, "Content-Type", "Location")
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

func TestReplayKeepsHeaderBytesAndNilFields(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	// A body that net/http would sniff as HTML, were Content-Type absent.
	const body = "<html><body>caf\xe9</body></html>"
	srv := serve(t, pool, idemhttp.Config{
		ReplayHeaders: []string{"Content-Type", "Location", "X-Empty", "X-Many"},
	}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		h := w.Header()
		// Not UTF-8: a JSON string would turn \xe9 into U+FFFD.
		h.Set("Location", "/files/caf\xe9")
		// nil is net/http's way to send no Content-Type and sniff none.
		h["Content-Type"] = nil
		h.Set("X-Empty", "")
		h["X-Many"] = []string{"a", "", "\xff\xfe"}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, body)
	}))

	first := post(t, srv, "/files", tenant, "bytes-1", `{}`)
	if first.status != http.StatusCreated || string(first.body) != body {
		t.Fatalf("first: %d %q", first.status, first.body)
	}
	if got := first.header.Get("Location"); got != "/files/caf\xe9" {
		t.Fatalf("first Location %q, want the handler's bytes", got)
	}
	if ct, ok := first.header["Content-Type"]; ok {
		t.Fatalf("first answer carries Content-Type %q, which the handler suppressed", ct)
	}

	replay := post(t, srv, "/files", tenant, "bytes-1", `{}`)
	if !replay.replayed() {
		t.Fatalf("second answer is not a replay: %d %v", replay.status, replay.header)
	}
	sameAnswer(t, replay, first, "Location", "X-Empty", "X-Many", "Content-Length")
	if ct, ok := replay.header["Content-Type"]; ok {
		t.Fatalf("replay carries Content-Type %q, which the first answer did not", ct)
	}
	if calls.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", calls.Load())
	}
}
