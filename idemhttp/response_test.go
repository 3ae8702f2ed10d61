package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

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
