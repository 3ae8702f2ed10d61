package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/otelrec"
)

// gzipped compresses the answer of next, as a compression middleware inside
// idemhttp would.
func gzipped(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &bufferedWriter{header: w.Header()}
		next.ServeHTTP(rec, r)
		var buf bytes.Buffer
		zw := gzip.NewWriter(&buf)
		_, _ = zw.Write(rec.body.Bytes())
		_ = zw.Close()
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Add("Vary", "Accept-Encoding")
		w.WriteHeader(cmpStatus(rec.status))
		_, _ = w.Write(buf.Bytes())
	})
}

func cmpStatus(status int) int {
	if status == 0 {
		return http.StatusOK
	}
	return status
}

// bufferedWriter collects what a handler writes, for gzipped.
type bufferedWriter struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (b *bufferedWriter) Header() http.Header { return b.header }
func (b *bufferedWriter) WriteHeader(status int) {
	if b.status == 0 {
		b.status = status
	}
}
func (b *bufferedWriter) Write(p []byte) (int, error) { return b.body.Write(p) }

// gunzip decodes a gzipped body, failing the test if it is not one.
func gunzip(t *testing.T, what string, body []byte) string {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("%s: body %q is not gzip: %v", what, body, err)
	}
	plain, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return string(plain)
}

func TestReplayKeepsTheFieldsThatReadTheBody(t *testing.T) {
	for name, replayHeaders := range map[string][]string{
		"default list": nil,
		"empty list":   {},
		// Content-Length listed: it must still be the length sent.
		"length listed": {"Content-Length", "Location"},
	} {
		t.Run(name, func(t *testing.T) {
			_, pool, tenant := setup(t)
			var calls atomic.Int64
			srv := serve(t, pool, idemhttp.Config{ReplayHeaders: replayHeaders}, gzipped(payHandler(&calls)))
			// Asking for gzip itself, the client does not decompress: the
			// test sees the bytes on the wire.
			send := func() response {
				req := newPost(t, srv, "/payments", tenant, "gz-1", `{"amount_cents":100}`)
				req.Header.Set("Accept-Encoding", "gzip")
				return do(t, srv.Client(), req)
			}
			first, replay := send(), send()
			if first.status != http.StatusCreated || first.replayed() || !replay.replayed() {
				t.Fatalf("first %d replayed=%v, second replayed=%v", first.status, first.replayed(), replay.replayed())
			}
			for _, r := range []struct {
				what string
				res  response
			}{{"first answer", first}, {"replay", replay}} {
				if got := r.res.header.Get("Content-Encoding"); got != "gzip" {
					t.Errorf("%s: Content-Encoding %q, want gzip", r.what, got)
				}
				if got := r.res.header.Get("Content-Type"); got != "application/json" {
					t.Errorf("%s: Content-Type %q, want application/json", r.what, got)
				}
				if got := r.res.header.Get("Content-Length"); got != strconv.Itoa(len(r.res.body)) {
					t.Errorf("%s: Content-Length %q for a body of %d bytes", r.what, got, len(r.res.body))
				}
				var p payment
				if err := json.Unmarshal([]byte(gunzip(t, r.what, r.res.body)), &p); err != nil || p.Status != "paid" {
					t.Errorf("%s: decoded body %+v, %v", r.what, p, err)
				}
			}
			sameAnswer(t, replay, first, "Content-Encoding", "Content-Type", "Content-Length")
			if calls.Load() != 1 {
				t.Fatalf("handler ran %d times, want 1", calls.Load())
			}
		})
	}
}

func TestContentLengthIsTheStoredBodys(t *testing.T) {
	_, pool, tenant := setup(t)
	srv := serve(t, pool, idemhttp.Config{ReplayHeaders: []string{"Content-Length"}},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// A stale length, shorter than the body written.
			w.Header().Set("Content-Length", "3")
			_, _ = io.WriteString(w, "nine byte")
		}))
	first := post(t, srv, "/x", tenant, "cl-1", `{}`)
	replay := post(t, srv, "/x", tenant, "cl-1", `{}`)
	for _, r := range []response{first, replay} {
		if string(r.body) != "nine byte" || r.header.Get("Content-Length") != "9" {
			t.Fatalf("got %q with Content-Length %q, want the 9 bytes stored", r.body, r.header.Get("Content-Length"))
		}
	}
	if !replay.replayed() {
		t.Fatal("second answer is not a replay")
	}
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

// failingBody is a request body whose read fails midway.
type failingBody struct{ read bool }

func (b *failingBody) Read(p []byte) (int, error) {
	if b.read {
		return 0, errors.New("connection reset")
	}
	b.read = true
	return copy(p, `{"amount`), nil
}

func TestProblemsHaveATypeACodeAndALink(t *testing.T) {
	for name, base := range map[string]string{
		"default base": "",
		"own base":     "https://api.example.com/docs/errors#",
	} {
		t.Run(name, func(t *testing.T) {
			_, pool, tenant := setup(t)
			want := base
			if want == "" {
				want = idemhttp.DefaultProblemTypeBase
			}
			var calls atomic.Int64
			cfg := idemhttp.Config{
				ProblemTypeBase: base,
				Required:        true,
				MaxBodyBytes:    64,
				Fingerprint: func(r *http.Request, body []byte) ([]byte, error) {
					if r.URL.Path == "/unfingerprintable" {
						return nil, errors.New("no")
					}
					return idemhttp.DefaultFingerprint(r, body), nil
				},
				Logger: slog.New(slog.DiscardHandler),
			}
			srv := serve(t, pool, cfg, payHandler(&calls))
			// The same middleware around a broken body and a broken scope.
			cfg.Scope = tenantScope
			mw := idemhttp.New(pool, cfg)
			breakBody := serveHandler(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				r.Body = io.NopCloser(&failingBody{})
				r.ContentLength = -1
				mw(payHandler(&calls)).ServeHTTP(w, r)
			}))
			cfg.Scope = func(*http.Request) (string, error) { return "", nil } // a bug: an empty scope
			badScope := serve(t, pool, cfg, payHandler(&calls))

			wantProblem(t, post(t, srv, "/payments", tenant, noKey, `{}`), http.StatusBadRequest, want, idemhttp.ProblemKeyMissing)
			wantProblem(t, post(t, srv, "/payments", tenant, `"open`, `{}`), http.StatusBadRequest, want, idemhttp.ProblemKeyInvalid)
			wantProblem(t, post(t, srv, "/payments", "", "k", `{}`), http.StatusBadRequest, want, idemhttp.ProblemScopeUnknown)
			wantProblem(t, post(t, srv, "/unfingerprintable", tenant, "k", `{}`), http.StatusBadRequest, want, idemhttp.ProblemFingerprintFailed)
			wantProblem(t, post(t, breakBody, "/payments", tenant, "k", `{}`), http.StatusBadRequest, want, idemhttp.ProblemBodyUnreadable)
			wantProblem(t, post(t, srv, "/payments", tenant, "k", strings.Repeat(" ", 65)), http.StatusRequestEntityTooLarge, want, idemhttp.ProblemBodyTooLarge)
			wantProblem(t, post(t, badScope, "/payments", tenant, "k", `{}`), http.StatusInternalServerError, want, idemhttp.ProblemRequestFailed)
			if res := post(t, srv, "/payments", tenant, "k", `{"amount_cents":100}`); res.status != http.StatusCreated {
				t.Fatalf("first: %d %s", res.status, res.body)
			}
			wantProblem(t, post(t, srv, "/payments", tenant, "k", `{"amount_cents":200}`), http.StatusUnprocessableEntity, want, idemhttp.ProblemKeyReused)
			if calls.Load() != 1 {
				t.Fatalf("handler ran %d times, want 1", calls.Load())
			}
		})
	}
}

// serveHandler starts a plain server around h.
func serveHandler(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func TestInProgressProblem(t *testing.T) {
	_, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusCreated)
	srv := serve(t, pool, idemhttp.Config{Wait: 50 * time.Millisecond}, h)
	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	h.awaitStarted(t, firstDone)
	wantProblem(t, post(t, srv, "/payments", tenant, "k", `{}`), http.StatusConflict, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemKeyInProgress)
	h.unblock()
	if first := <-firstDone; first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
}

// allCodes lists every problem code; PROBLEMS.md documents each.
var allCodes = []string{
	idemhttp.ProblemKeyMissing, idemhttp.ProblemKeyInvalid, idemhttp.ProblemScopeUnknown,
	idemhttp.ProblemFingerprintFailed, idemhttp.ProblemBodyUnreadable, idemhttp.ProblemBodyTooLarge,
	idemhttp.ProblemKeyReused, idemhttp.ProblemKeyInProgress, idemhttp.ProblemResponseNotStored,
	idemhttp.ProblemRequestFailed,
}

func TestEveryProblemCodeIsDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("PROBLEMS.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(idemhttp.DefaultProblemTypeBase, "/idemhttp/PROBLEMS.md#") {
		t.Fatalf("DefaultProblemTypeBase %q does not point at PROBLEMS.md", idemhttp.DefaultProblemTypeBase)
	}
	for _, code := range allCodes {
		// A heading "## code" gets the anchor #code.
		if !bytes.Contains(doc, []byte("\n## "+code+"\n")) {
			t.Errorf("PROBLEMS.md has no heading for %s", code)
		}
	}
}

func TestNewRejectsAProblemTypeBaseThatIsNotAnAbsoluteURI(t *testing.T) {
	t.Parallel()
	scope := func(*http.Request) (string, error) { return "s", nil }
	for _, base := range []string{"errors#", "/docs/errors#", "https://example.com/a b#", "https://example.com/<x>#", "::"} {
		func() {
			defer func() {
				if msg, _ := recover().(string); !strings.Contains(msg, "ProblemTypeBase") {
					t.Errorf("base %q: New panicked with %q, want a message naming ProblemTypeBase", base, msg)
				}
			}()
			idemhttp.New(&pgxpool.Pool{}, idemhttp.Config{Scope: scope, ProblemTypeBase: base})
		}()
	}
}

// statusHandler answers the status in the request's path, /status/429, after
// a write on the request's transaction.
func statusHandler(tenant string, calls *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		status, _ := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/status/"))
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, tenant, r.URL.Path); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, "run "+strconv.FormatInt(n, 10))
	})
}

func TestStorePolicy(t *testing.T) {
	t.Run("default stores every answer below 500", func(t *testing.T) {
		_, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{}, statusHandler(tenant, &calls))
		for i, status := range []int{200, 408, 409, 425, 429, 499} {
			path := "/status/" + strconv.Itoa(status)
			first := post(t, srv, path, tenant, path, `{}`)
			retry := post(t, srv, path, tenant, path, `{}`)
			if first.status != status || !retry.replayed() {
				t.Fatalf("%d: first %d, retry replayed=%v", status, first.status, retry.replayed())
			}
			sameAnswer(t, retry, first)
			if calls.Load() != int64(i+1) {
				t.Fatalf("%d: handler ran %d times, want %d", status, calls.Load(), i+1)
			}
		}
		if countPayments(t, pool, tenant) != 6 {
			t.Fatalf("%d payments, want 6", countPayments(t, pool, tenant))
		}
	})
	t.Run("StoreFinal leaves out the answers that ask for a retry", func(t *testing.T) {
		_, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{Store: idemhttp.StoreFinal}, statusHandler(tenant, &calls))
		for _, status := range []int{408, 409, 425, 429} {
			path := "/status/" + strconv.Itoa(status)
			before := calls.Load()
			first := post(t, srv, path, tenant, path, `{}`)
			retry := post(t, srv, path, tenant, path, `{}`)
			if first.status != status || retry.status != status || retry.replayed() || calls.Load() != before+2 {
				t.Fatalf("%d: first %d, retry %d replayed=%v, %d runs; want two runs of the handler",
					status, first.status, retry.status, retry.replayed(), calls.Load()-before)
			}
		}
		// Nothing of those answers was kept: neither the writes nor a record.
		if countPayments(t, pool, tenant) != 0 || countRecords(t, pool, tenant) != 0 {
			t.Fatalf("%d payments and %d records after unstored answers, want none",
				countPayments(t, pool, tenant), countRecords(t, pool, tenant))
		}
		// Other 4xx and 2xx are still stored.
		for _, status := range []int{201, 402} {
			path := "/status/" + strconv.Itoa(status)
			post(t, srv, path, tenant, path, `{}`)
			if retry := post(t, srv, path, tenant, path, `{}`); !retry.replayed() {
				t.Fatalf("%d was not stored", status)
			}
		}
	})
	t.Run("a policy may store a 5xx", func(t *testing.T) {
		_, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{Store: func(status int) bool { return status != 503 }}, statusHandler(tenant, &calls))
		first := post(t, srv, "/status/500", tenant, "k500", `{}`)
		retry := post(t, srv, "/status/500", tenant, "k500", `{}`)
		if first.status != 500 || !retry.replayed() || calls.Load() != 1 {
			t.Fatalf("first %d, retry replayed=%v after %d runs", first.status, retry.replayed(), calls.Load())
		}
		post(t, srv, "/status/503", tenant, "k503", `{}`)
		if retry := post(t, srv, "/status/503", tenant, "k503", `{}`); retry.replayed() || calls.Load() != 3 {
			t.Fatalf("503: retry replayed=%v after %d runs", retry.replayed(), calls.Load())
		}
	})
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

// xorCodec is a Codec that flips every byte, enough to show that what is
// stored is what the codec sealed.
type xorCodec struct{ seals, opens atomic.Int64 }

func (c *xorCodec) Seal(scope string, plaintext []byte) ([]byte, error) {
	c.seals.Add(1)
	return xor(plaintext), nil
}

func (c *xorCodec) Open(scope string, sealed []byte) ([]byte, error) {
	c.opens.Add(1)
	return xor(sealed), nil
}

func xor(b []byte) []byte {
	out := make([]byte, len(b))
	for i, c := range b {
		out[i] = c ^ 0xa5
	}
	return out
}

func TestCodecSealsStoredAnswers(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	codec := &xorCodec{}
	srv := serve(t, pool, idemhttp.Config{Codec: codec}, payHandler(&calls))
	first := post(t, srv, "/payments", tenant, "sealed-1", `{"amount_cents":100}`)
	replay := post(t, srv, "/payments", tenant, "sealed-1", `{"amount_cents":100}`)
	if !replay.replayed() {
		t.Fatalf("second answer is not a replay: %d %s", replay.status, replay.body)
	}
	sameAnswer(t, replay, first, "Content-Type", "Location")
	if codec.seals.Load() != 1 || codec.opens.Load() != 1 {
		t.Fatalf("codec sealed %d and opened %d times, want 1 and 1", codec.seals.Load(), codec.opens.Load())
	}
	var stored string
	if err := pool.QueryRow(context.Background(),
		`SELECT response::text FROM idempotency_key WHERE scope = $1`, tenant).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	// Unsealed, the stored form names its fields and the Location.
	for _, plain := range []string{"status", "header", "Location", "/payments/"} {
		if strings.Contains(stored, plain) {
			t.Fatalf("stored answer %s holds %q in the clear", stored, plain)
		}
	}
}

func TestCodecFitsTheLargestAnswer(t *testing.T) {
	_, pool, tenant := setup(t)
	// Sealed, the stored form is the body in base64 twice over: beyond
	// about 2 MiB that no longer fits the allowance made for headers.
	const limit = 3 << 20
	body := bytes.Repeat([]byte{0xff}, limit)
	srv := serve(t, pool, idemhttp.Config{Codec: &xorCodec{}, MaxResponseBytes: limit},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(body) }))
	first := post(t, srv, "/x", tenant, "big", `{}`)
	replay := post(t, srv, "/x", tenant, "big", `{}`)
	if first.status != http.StatusOK || !replay.replayed() || !bytes.Equal(replay.body, body) {
		t.Fatalf("first %d, replay %d replayed=%v: want the %d bytes back", first.status, replay.status, replay.replayed(), limit)
	}
}

func TestObserverSeesKeyedRequests(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	rec := otelrec.New()
	observer, err := idem.NewObserver(idem.ObserverConfig{MeterProvider: rec, TracerProvider: rec})
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, pool, idemhttp.Config{Observer: observer}, payHandler(&calls))
	post(t, srv, "/payments", tenant, "obs-1", `{"amount_cents":100}`)
	post(t, srv, "/payments", tenant, "obs-1", `{"amount_cents":100}`)
	post(t, srv, "/payments", tenant, "obs-1", `{"amount_cents":200}`).problem(t, http.StatusUnprocessableEntity)
	post(t, srv, "/payments", tenant, noKey, `{"amount_cents":100}`) // not observed: no key

	got := rec.Count("idem.calls")
	want := map[string]float64{"claimed": 1, "replayed": 1, "mismatch": 1}
	if len(got) != len(want) {
		t.Fatalf("outcomes %v, want %v", got, want)
	}
	for outcome, n := range want {
		if got[outcome] != n {
			t.Fatalf("outcomes %v, want %v", got, want)
		}
	}
	if n := len(rec.Ended()); n != 3 {
		t.Fatalf("%d spans, want one per keyed request, 3", n)
	}
}
