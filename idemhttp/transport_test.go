package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

// wire is the Base of the Transport under test: it sends each attempt over
// a connection pool of the test's own and records it.
type wire struct {
	base *http.Transport
	// onAnswer, when set, sees each answer before the Transport does.
	onAnswer func(*http.Response)

	mu       sync.Mutex
	attempts []sentAttempt
}

// sentAttempt is what the wire saw of one attempt.
type sentAttempt struct {
	keys            []string // the values of the key's field
	start, answered time.Time
	status          int // 0 for an error
}

func newWire(t *testing.T) *wire {
	w := &wire{base: &http.Transport{}}
	t.Cleanup(w.base.CloseIdleConnections)
	return w
}

func (w *wire) RoundTrip(r *http.Request) (*http.Response, error) {
	return w.roundTrip(r, idemhttp.DefaultHeader)
}

func (w *wire) roundTrip(r *http.Request, header string) (*http.Response, error) {
	a := sentAttempt{keys: r.Header.Values(header), start: time.Now()}
	resp, err := w.base.RoundTrip(r)
	a.answered = time.Now()
	if err == nil {
		a.status = resp.StatusCode
		if w.onAnswer != nil {
			w.onAnswer(resp)
		}
	}
	w.mu.Lock()
	w.attempts = append(w.attempts, a)
	w.mu.Unlock()
	return resp, err
}

func (w *wire) sent() []sentAttempt {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]sentAttempt(nil), w.attempts...)
}

// scripted is a handler behind the middleware whose run n (from 1) answers
// what answer says; it records each run's key and body.
type scripted struct {
	answer func(n int, w http.ResponseWriter, r *http.Request)

	mu     sync.Mutex
	keys   []string
	bodies []string
}

func (h *scripted) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	h.mu.Lock()
	h.keys = append(h.keys, idemhttp.Key(r.Context()))
	h.bodies = append(h.bodies, string(body))
	n := len(h.keys)
	h.mu.Unlock()
	h.answer(n, w, r)
}

func (h *scripted) runs() (keys, bodies []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.keys...), append([]string(nil), h.bodies...)
}

// failFirst answers 503 to the first failures runs, which the middleware
// rolls back, and then 201 with the run's number.
func failFirst(failures int) *scripted {
	return &scripted{answer: func(n int, w http.ResponseWriter, r *http.Request) {
		if n <= failures {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "run %d", n)
	}}
}

// transportClient returns a client whose Transport is tr over w.
func transportClient(tr *idemhttp.Transport, w http.RoundTripper) *http.Client {
	tr.Base = w
	return &http.Client{Transport: tr}
}

// roundTrip sends req through client and reads the answer whole, with what
// Attempts reports of it.
func roundTrip(t *testing.T, client *http.Client, req *http.Request) (res response, key string, attempts int) {
	t.Helper()
	// Never wait for ever, whatever goes wrong.
	ctx, cancel := context.WithTimeout(req.Context(), 2*time.Minute)
	defer cancel()
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	key, attempts = idemhttp.Attempts(resp)
	return response{status: resp.StatusCode, header: resp.Header, body: body}, key, attempts
}

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestTransportKeepsOneKeyAcrossRetries(t *testing.T) {
	_, pool, tenant := setup(t)
	h := failFirst(2)
	srv := serve(t, pool, idemhttp.Config{Required: true}, h)
	w := newWire(t)
	client := transportClient(&idemhttp.Transport{BaseDelay: -1}, w)

	req := newPost(t, srv, "/payments", tenant, noKey, `{"amount_cents": 100}`)
	res, key, attempts := roundTrip(t, client, req)
	if res.status != http.StatusCreated || string(res.body) != "run 3" || res.replayed() {
		t.Fatalf("got %d %q replayed=%v, want run 3's 201", res.status, res.body, res.replayed())
	}
	if !uuidV4.MatchString(key) || attempts != 3 {
		t.Fatalf("Attempts = %q, %d; want a random UUID and 3", key, attempts)
	}
	keys, _ := h.runs()
	for i, k := range keys {
		if k != key {
			t.Fatalf("run %d had key %q, want %q", i+1, k, key)
		}
	}
	sent := w.sent()
	if len(sent) != 3 || len(keys) != 3 {
		t.Fatalf("%d attempts sent, %d runs; want 3 of each", len(sent), len(keys))
	}
	for i, a := range sent {
		if len(a.keys) != 1 || a.keys[0] != `"`+key+`"` {
			t.Fatalf("attempt %d sent the key field %q, want the sf-string of %q", i+1, a.keys, key)
		}
	}
	if v := req.Header.Values(idemhttp.DefaultHeader); v != nil {
		t.Fatalf("the caller's request was modified: it has the key field %q", v)
	}

	// Another logical call, another key.
	res, other, _ := roundTrip(t, client, newPost(t, srv, "/payments", tenant, noKey, `{"amount_cents": 100}`))
	if res.status != http.StatusCreated || other == key || !uuidV4.MatchString(other) {
		t.Fatalf("second call: %d with key %q, want 201 with a key other than %q", res.status, other, key)
	}
}

func TestTransportKeepsTheCallersKey(t *testing.T) {
	_, pool, tenant := setup(t)

	t.Run("set by the caller", func(t *testing.T) {
		t.Parallel()
		h := failFirst(1)
		srv := serve(t, pool, idemhttp.Config{}, h)
		w := newWire(t)
		client := transportClient(&idemhttp.Transport{BaseDelay: -1}, w)
		key := testdb.Name("order")
		res, got, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, key, `{}`))
		if res.status != http.StatusCreated || got != key || attempts != 2 {
			t.Fatalf("got %d, Attempts = %q, %d; want 201, %q, 2", res.status, got, attempts, key)
		}
		for i, a := range w.sent() {
			if len(a.keys) != 1 || a.keys[0] != key {
				t.Fatalf("attempt %d sent %q, want the caller's %q as it was", i+1, a.keys, key)
			}
		}
		if keys, _ := h.runs(); len(keys) != 2 || keys[0] != key || keys[1] != key {
			t.Fatalf("the handler saw the keys %q, want %q twice", keys, key)
		}
	})

	t.Run("an entry without values", func(t *testing.T) {
		t.Parallel()
		// Such an entry makes net/http re-send a POST without sending a
		// key: the Transport gives the request one.
		h := failFirst(1)
		srv := serve(t, pool, idemhttp.Config{Required: true}, h)
		client := transportClient(&idemhttp.Transport{BaseDelay: -1}, newWire(t))
		req := newPost(t, srv, "/payments", tenant, noKey, `{}`)
		req.Header[idemhttp.DefaultHeader] = nil
		res, key, attempts := roundTrip(t, client, req)
		if res.status != http.StatusCreated || !uuidV4.MatchString(key) || attempts != 2 {
			t.Fatalf("got %d, Attempts = %q, %d; want 201 with a fresh key after 2 attempts", res.status, key, attempts)
		}
	})

	t.Run("another header field", func(t *testing.T) {
		t.Parallel()
		h := failFirst(1)
		srv := serve(t, pool, idemhttp.Config{Required: true, Header: "X-Request-Key"}, h)
		w := newWire(t)
		client := transportClient(&idemhttp.Transport{Header: "x-request-key", BaseDelay: -1},
			roundTripFunc(func(r *http.Request) (*http.Response, error) { return w.roundTrip(r, "X-Request-Key") }))
		res, key, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, noKey, `{}`))
		if res.status != http.StatusCreated || attempts != 2 {
			t.Fatalf("got %d %q after %d attempts, want 201 after 2", res.status, res.body, attempts)
		}
		if keys, _ := h.runs(); len(keys) != 2 || keys[0] != key || keys[1] != key {
			t.Fatalf("the handler saw the keys %q, want %q twice", keys, key)
		}
		for i, a := range w.sent() {
			if len(a.keys) != 1 || a.keys[0] != `"`+key+`"` {
				t.Fatalf("attempt %d sent X-Request-Key: %q, want the sf-string of %q", i+1, a.keys, key)
			}
		}
	})
}

// TestTransportFindsTheCallersKeyWhateverTheCaseOfItsName sets the key
// in the header map directly, under names spelled in other cases, as
// http.Header allows: the Transport keeps the caller's key, sends it once
// under the canonical name, and refuses two different keys before
// anything is sent.
func TestTransportFindsTheCallersKeyWhateverTheCaseOfItsName(t *testing.T) {
	_, pool, tenant := setup(t)
	// spellings is a Base that records, for each attempt, every entry of
	// the key's field, under whatever spelling of its name.
	type spellings struct {
		mu       sync.Mutex
		attempts []http.Header
	}
	record := func(sp *spellings, base http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			fields := http.Header{}
			for name, values := range r.Header {
				if strings.EqualFold(name, idemhttp.DefaultHeader) {
					fields[name] = values
				}
			}
			sp.mu.Lock()
			sp.attempts = append(sp.attempts, fields)
			sp.mu.Unlock()
			return base.RoundTrip(r)
		})
	}

	for name, set := range map[string]func(http.Header, string){
		"in lower case": func(h http.Header, key string) { h["idempotency-key"] = []string{key} },
		"in upper case": func(h http.Header, key string) { h["IDEMPOTENCY-KEY"] = []string{key} },
		"twice, in two cases": func(h http.Header, key string) {
			h.Set(idemhttp.DefaultHeader, key)
			h["idempotency-key"] = []string{`"` + key + `"`}
		},
		"beside an empty entry": func(h http.Header, key string) { h[idemhttp.DefaultHeader] = nil; h["idempotency-key"] = []string{key} },
		"twice, in the one name": func(h http.Header, key string) {
			h.Add(idemhttp.DefaultHeader, key)
			h.Add(idemhttp.DefaultHeader, key)
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := failFirst(1)
			srv := serve(t, pool, idemhttp.Config{Required: true}, h)
			sp := &spellings{}
			client := transportClient(&idemhttp.Transport{BaseDelay: -1}, record(sp, newWire(t)))
			key := testdb.Name("order")
			req := newPost(t, srv, "/payments", tenant, noKey, `{}`)
			set(req.Header, key)
			before := req.Header.Clone()
			res, got, attempts := roundTrip(t, client, req)
			if res.status != http.StatusCreated || got != key || attempts != 2 {
				t.Fatalf("got %d %s, Attempts = %q, %d; want 201, %q, 2", res.status, res.body, got, attempts, key)
			}
			for i, fields := range sp.attempts {
				if len(fields) != 1 || len(fields[idemhttp.DefaultHeader]) != 1 {
					t.Fatalf("attempt %d sent the key's field as %q, want one value under %s", i+1, fields, idemhttp.DefaultHeader)
				}
			}
			if keys, _ := h.runs(); len(keys) != 2 || keys[0] != key || keys[1] != key {
				t.Fatalf("the handler saw the keys %q, want the caller's %q twice", keys, key)
			}
			if fmt.Sprint(req.Header) != fmt.Sprint(before) {
				t.Fatalf("the caller's header became %q, was %q", req.Header, before)
			}
		})
	}

	for name, set := range map[string]func(http.Header){
		"in two cases":    func(h http.Header) { h.Set(idemhttp.DefaultHeader, "a"); h["idempotency-key"] = []string{"b"} },
		"in the one name": func(h http.Header) { h.Add(idemhttp.DefaultHeader, "a"); h.Add(idemhttp.DefaultHeader, "b") },
		"quoted and bare": func(h http.Header) { h["idempotency-key"] = []string{`"a"`}; h["IDEMPOTENCY-KEY"] = []string{"b"} },
	} {
		t.Run("two different keys "+name, func(t *testing.T) {
			t.Parallel()
			sp := &spellings{}
			client := transportClient(&idemhttp.Transport{}, record(sp, newWire(t)))
			req, err := http.NewRequest(http.MethodPost, "http://127.0.0.1:1/payments", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			set(req.Header)
			_, err = client.Do(req)
			if !errors.Is(err, idem.ErrInvalidKey) || !strings.Contains(err.Error(), "two different keys") || len(sp.attempts) != 0 {
				t.Fatalf("got %v after %d attempts; want an error wrapping idem.ErrInvalidKey, before any attempt", err, len(sp.attempts))
			}
		})
	}
}

// roundTripFunc is a function as an http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestTransportLeavesSafeMethodsWithoutKey(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	srv := serveHandler(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprint(w, "balance: 100")
	}))
	w := newWire(t)
	client := transportClient(&idemhttp.Transport{BaseDelay: -1}, w)
	res, key, attempts := roundTrip(t, client, newGet(t, srv, "/balance", "shop"))
	if res.status != http.StatusOK || key != "" || attempts != 2 {
		t.Fatalf("got %d, Attempts = %q, %d; want 200 without a key after 2 attempts", res.status, key, attempts)
	}
	for i, a := range w.sent() {
		if a.keys != nil {
			t.Fatalf("attempt %d of a GET sent the key field %q", i+1, a.keys)
		}
	}
}

func TestTransportWaitsRetryAfterOfKeyInProgress(t *testing.T) {
	_, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusCreated)
	// No wait: a duplicate gets 409 key-in-progress, Retry-After: 1, at once.
	srv := serve(t, pool, idemhttp.Config{Wait: -1}, h)
	key := testdb.Name("k")

	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, key, `{}`))
	h.awaitStarted(t, firstDone)

	w := newWire(t)
	// The first request finishes once the Transport has got its 409: its
	// retry then replays the first answer.
	w.onAnswer = func(resp *http.Response) {
		if resp.StatusCode == http.StatusConflict {
			h.unblock()
		}
	}
	client := transportClient(&idemhttp.Transport{BaseDelay: time.Millisecond, MaxAttempts: -1}, w)
	res, _, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, key, `{}`))
	first := <-firstDone
	if !res.replayed() || attempts < 2 {
		t.Fatalf("got %d %q replayed=%v after %d attempts, want the first answer replayed", res.status, res.body, res.replayed(), attempts)
	}
	sameAnswer(t, res, first)
	sent := w.sent()
	for i, a := range sent[:len(sent)-1] {
		if a.status != http.StatusConflict {
			t.Fatalf("attempt %d got %d; only a 409 should have been retried", i+1, a.status)
		}
		// Retry-After is a lower bound on the wait, which a slow machine
		// only lengthens.
		if gap := sent[i+1].start.Sub(a.answered); gap < time.Second {
			t.Fatalf("attempt %d came %s after a 409 with Retry-After: 1", i+2, gap)
		}
	}
	if h.calls.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", h.calls.Load())
	}
}

func TestTransportReturns409WithRetryAfterOverMaxDelay(t *testing.T) {
	_, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusCreated)
	srv := serve(t, pool, idemhttp.Config{Wait: -1}, h)
	key := testdb.Name("k")
	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, key, `{}`))
	h.awaitStarted(t, firstDone)

	client := transportClient(&idemhttp.Transport{MaxDelay: 500 * time.Millisecond}, newWire(t))
	res, _, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, key, `{}`))
	wantProblem(t, res, http.StatusConflict, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemKeyInProgress)
	if attempts != 1 {
		t.Fatalf("%d attempts, want 1: Retry-After: 1 is over MaxDelay", attempts)
	}
	h.unblock()
	<-firstDone
}

func TestTransportDoesNotRetry4xx(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	pay := payHandler(&calls)
	conflict := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/conflict" {
			calls.Add(1)
			http.Error(w, "that order exists", http.StatusConflict) // no Retry-After
			return
		}
		pay.ServeHTTP(w, r)
	})
	srv := serve(t, pool, idemhttp.Config{MaxBodyBytes: 100}, conflict)
	reused := testdb.Name("k")
	if res := post(t, srv, "/payments", tenant, reused, `{"amount_cents": 100}`); res.status != http.StatusCreated {
		t.Fatalf("first payment: %d %s", res.status, res.body)
	}

	for _, c := range []struct {
		name, path, key, body string
		status                int
		code                  string
	}{
		{"400 key-invalid", "/payments", `"unterminated`, `{"amount_cents": 100}`, http.StatusBadRequest, idemhttp.ProblemKeyInvalid},
		{"422 key-reused", "/payments", reused, `{"amount_cents": 200}`, http.StatusUnprocessableEntity, idemhttp.ProblemKeyReused},
		{"413 body-too-large", "/payments", noKey, `{"amount_cents": 100, "note": "` + strings.Repeat("x", 100) + `"}`, http.StatusRequestEntityTooLarge, idemhttp.ProblemBodyTooLarge},
		{"402 of the handler", "/payments", noKey, `{"amount_cents": 20000}`, http.StatusPaymentRequired, ""},
		{"409 of the handler, without Retry-After", "/conflict", noKey, `{}`, http.StatusConflict, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			w := newWire(t)
			client := transportClient(&idemhttp.Transport{BaseDelay: -1}, w)
			res, _, attempts := roundTrip(t, client, newPost(t, srv, c.path, tenant, c.key, c.body))
			if c.code != "" {
				wantProblem(t, res, c.status, idemhttp.DefaultProblemTypeBase, c.code)
			} else if res.status != c.status {
				t.Fatalf("got %d %s, want %d", res.status, res.body, c.status)
			}
			if attempts != 1 || len(w.sent()) != 1 {
				t.Fatalf("Attempts %d, %d sent; want 1 of each", attempts, len(w.sent()))
			}
		})
	}
}

func TestTransportRetries5xxUpToMaxAttempts(t *testing.T) {
	_, pool, tenant := setup(t)

	for _, c := range []struct {
		status, attempts int
	}{
		{http.StatusInternalServerError, 3},
		{http.StatusBadGateway, 3},
		{http.StatusServiceUnavailable, 3},
		{http.StatusNotImplemented, 1}, // no retry changes it
	} {
		t.Run(http.StatusText(c.status), func(t *testing.T) {
			t.Parallel()
			h := &scripted{answer: func(_ int, w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "failed", c.status)
			}}
			srv := serve(t, pool, idemhttp.Config{}, h)
			client := transportClient(&idemhttp.Transport{MaxAttempts: 3, BaseDelay: time.Millisecond}, newWire(t))
			res, key, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, noKey, `{}`))
			keys, _ := h.runs()
			if res.status != c.status || attempts != c.attempts || len(keys) != c.attempts {
				t.Fatalf("got %d after %d attempts and %d runs, want %d after %d", res.status, attempts, len(keys), c.status, c.attempts)
			}
			for _, k := range keys {
				if k != key {
					t.Fatalf("the handler saw the keys %q, want %q every time", keys, key)
				}
			}
		})
	}
}

func TestTransportContextDeadlineBoundsRetries(t *testing.T) {
	_, pool, tenant := setup(t)
	unavailable := func(retryAfter string) *scripted {
		return &scripted{answer: func(_ int, w http.ResponseWriter, _ *http.Request) {
			if retryAfter != "" {
				w.Header().Set("Retry-After", retryAfter)
			}
			http.Error(w, "down", http.StatusServiceUnavailable)
		}}
	}

	t.Run("unlimited attempts end at the deadline", func(t *testing.T) {
		t.Parallel()
		// Not behind the middleware: the deadline alone is under test, and
		// an endpoint without a database answers the soonest.
		srv := serveHandler(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "down", http.StatusServiceUnavailable)
		}))
		w := newWire(t)
		client := transportClient(&idemhttp.Transport{MaxAttempts: -1, BaseDelay: 10 * time.Millisecond, MaxDelay: 50 * time.Millisecond}, w)
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		// Only the deadline can end this call: it returns the last 503
		// when the next wait would end past it, or the deadline's error
		// when it came during an attempt.
		resp, err := client.Do(newPost(t, srv, "/payments", tenant, noKey, `{}`).WithContext(ctx))
		switch {
		case err == nil:
			resp.Body.Close()
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("got %d, want the last 503", resp.StatusCode)
			}
		case !errors.Is(err, context.DeadlineExceeded):
			t.Fatalf("got %v, want the last 503 or the deadline", err)
		}
		t.Logf("%d attempts within the deadline", len(w.sent()))
	})

	t.Run("a wait past the deadline is not begun", func(t *testing.T) {
		t.Parallel()
		srv := serve(t, pool, idemhttp.Config{}, unavailable("3600"))
		client := transportClient(&idemhttp.Transport{MaxAttempts: -1, MaxDelay: -1}, newWire(t))
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		res, _, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, noKey, `{}`).WithContext(ctx))
		if res.status != http.StatusServiceUnavailable || attempts != 1 || ctx.Err() != nil {
			t.Fatalf("got %d after %d attempts, context %v; want the 503 at once", res.status, attempts, ctx.Err())
		}
	})

	t.Run("cancelling ends the wait", func(t *testing.T) {
		t.Parallel()
		srv := serve(t, pool, idemhttp.Config{}, unavailable("3600"))
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		w := newWire(t)
		w.onAnswer = func(*http.Response) { cancel() }
		client := transportClient(&idemhttp.Transport{MaxAttempts: -1, MaxDelay: -1}, w)
		key := testdb.Name("k")
		_, err := client.Do(newPost(t, srv, "/payments", tenant, key, `{}`).WithContext(ctx))
		if !errors.Is(err, context.Canceled) || len(w.sent()) != 1 {
			t.Fatalf("got %v after %d attempts, want context.Canceled after 1", err, len(w.sent()))
		}
		if want := fmt.Sprintf("attempt 1 with key %q", key); !strings.Contains(err.Error(), want) {
			t.Fatalf("error %q does not say %q", err, want)
		}
	})
}

func TestTransportReportsKeyAndAttemptsInItsError(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens: every attempt is refused
	w := newWire(t)
	client := transportClient(&idemhttp.Transport{MaxAttempts: 3, BaseDelay: time.Millisecond}, w)
	req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/payments", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(idemhttp.DefaultHeader, "order-1")
	_, err = client.Do(req)
	var opErr *net.OpError
	if !errors.As(err, &opErr) || !strings.Contains(err.Error(), `idemhttp: attempt 3 with key "order-1": `) || len(w.sent()) != 3 {
		t.Fatalf("got %v after %d attempts; want the refused connection of attempt 3, with its key", err, len(w.sent()))
	}
	if !errors.Is(err, idem.ErrNotSent) || !strings.HasSuffix(err.Error(), "(no attempt was sent)") {
		t.Fatalf("got %v; want it to wrap idem.ErrNotSent and say so: no attempt was ever connected", err)
	}
}

func TestTransportReplaysTheBody(t *testing.T) {
	_, pool, tenant := setup(t)
	const body = `{"amount_cents": 100}`

	for _, c := range []struct {
		name    string
		getBody bool
	}{{"with GetBody", true}, {"without GetBody, read whole", false}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			h := failFirst(2)
			srv := serve(t, pool, idemhttp.Config{}, h)
			client := transportClient(&idemhttp.Transport{BaseDelay: -1}, newWire(t))
			req := newPost(t, srv, "/payments", tenant, noKey, body)
			if !c.getBody {
				req.Body, req.GetBody = io.NopCloser(strings.NewReader(body)), nil
			}
			res, _, attempts := roundTrip(t, client, req)
			_, bodies := h.runs()
			if res.status != http.StatusCreated || attempts != 3 {
				t.Fatalf("got %d after %d attempts, want 201 after 3", res.status, attempts)
			}
			for i, b := range bodies {
				if b != body {
					t.Fatalf("run %d got the body %q, want %q", i+1, b, body)
				}
			}
		})
	}

	t.Run("over MaxBodyBytes without GetBody", func(t *testing.T) {
		t.Parallel()
		w := newWire(t)
		client := transportClient(&idemhttp.Transport{MaxBodyBytes: 10}, w)
		b := &closeCounter{Reader: strings.NewReader(body)}
		req, err := http.NewRequest(http.MethodPost, "http://127.0.0.1:1/payments", b)
		if err != nil {
			t.Fatal(err)
		}
		_, err = client.Do(req)
		var tooLarge *http.MaxBytesError
		if !errors.As(err, &tooLarge) || tooLarge.Limit != 10 || len(w.sent()) != 0 || b.closed.Load() == 0 {
			t.Fatalf("got %v, %d sent, body closed %d times; want an *http.MaxBytesError, nothing sent, the body closed",
				err, len(w.sent()), b.closed.Load())
		}
	})

	t.Run("over MaxBodyBytes with GetBody", func(t *testing.T) {
		t.Parallel()
		h := failFirst(1)
		srv := serve(t, pool, idemhttp.Config{}, h)
		client := transportClient(&idemhttp.Transport{MaxBodyBytes: 10, BaseDelay: -1}, newWire(t))
		res, _, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, noKey, body))
		if _, bodies := h.runs(); res.status != http.StatusCreated || attempts != 2 || bodies[1] != body {
			t.Fatalf("got %d after %d attempts, bodies %q; want 201 after 2, and the body again", res.status, attempts, bodies)
		}
	})
}

// closeCounter is a request body that counts its Close calls.
type closeCounter struct {
	io.Reader
	closed atomic.Int64
}

func (c *closeCounter) Close() error {
	c.closed.Add(1)
	return nil
}

func TestTransportRefusesInvalidFields(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		tr    idemhttp.Transport
		field string
		also  error
	}{
		{idemhttp.Transport{Header: "Idempotency Key"}, "Transport.Header", nil},
		{idemhttp.Transport{BaseDelay: time.Second, MaxDelay: time.Millisecond}, "Transport.MaxDelay", nil},
		{idemhttp.Transport{BaseDelay: time.Minute}, "Transport.BaseDelay", nil},
		{idemhttp.Transport{NewKey: func() string { return "" }}, "Transport.NewKey", idem.ErrInvalidKey},
		{idemhttp.Transport{NewKey: func() string { return strings.Repeat("k", 256) }}, "Transport.NewKey", idem.ErrInvalidKey},
		{idemhttp.Transport{NewKey: func() string { return "caf\xc3\xa9" }}, "Transport.NewKey", idem.ErrInvalidKey},
	} {
		var sent atomic.Int64
		tr := c.tr
		client := transportClient(&tr, roundTripFunc(func(*http.Request) (*http.Response, error) {
			sent.Add(1)
			return nil, errors.New("sent")
		}))
		b := &closeCounter{Reader: strings.NewReader(`{}`)}
		req, err := http.NewRequest(http.MethodPost, "http://127.0.0.1:1/payments", b)
		if err != nil {
			t.Fatal(err)
		}
		_, err = client.Do(req)
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), "idemhttp: "+c.field+": ") ||
			(c.also != nil && !errors.Is(err, c.also)) {
			t.Errorf("%s: got %v, want an error naming it that wraps idem.ErrInvalidOption", c.field, err)
		}
		if sent.Load() != 0 || b.closed.Load() == 0 {
			t.Errorf("%s: %d attempts sent, body closed %d times; want nothing sent, the body closed", c.field, sent.Load(), b.closed.Load())
		}
	}
}

func TestTransportZeroValueSendsOverDefaultTransport(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{Required: true}, payHandler(&calls))
	client := &http.Client{Transport: &idemhttp.Transport{}}
	res, key, attempts := roundTrip(t, client, newPost(t, srv, "/payments", tenant, noKey, `{"amount_cents": 100}`))
	if res.status != http.StatusCreated || !uuidV4.MatchString(key) || attempts != 1 {
		t.Fatalf("got %d %s, Attempts = %q, %d; want 201 with a fresh key, after 1 attempt", res.status, res.body, key, attempts)
	}
}
