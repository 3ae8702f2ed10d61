package outbox_test

import (
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/internal/testserver"
	"github.com/pgidem/idem/outbox"
)

// A signing seed and its public key, and a symmetric secret, fresh for
// each test.
func webhookSecrets(t *testing.T) (symmetric, seed, public string) {
	t.Helper()
	raw := []byte(testserver.RandomHex(16)) // 32 bytes, an ed25519 seed
	publicKey := ed25519.NewKeyFromSeed(raw).Public().(ed25519.PublicKey)
	return "whsec_" + base64.StdEncoding.EncodeToString([]byte(testserver.RandomHex(16))),
		"whsk_" + base64.StdEncoding.EncodeToString(raw),
		"whpk_" + base64.StdEncoding.EncodeToString(publicKey)
}

// captured is a delivery as the receiver got it.
type captured struct {
	header http.Header
	body   []byte
}

// capture answers every request with status, and keeps each.
func capture(t *testing.T, status int) (*httptest.Server, func() []captured) {
	t.Helper()
	var mu sync.Mutex
	var got []captured
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, captured{header: r.Header.Clone(), body: body})
		mu.Unlock()
		w.WriteHeader(status)
	}))
	t.Cleanup(srv.Close)
	return srv, func() []captured {
		mu.Lock()
		defer mu.Unlock()
		return append([]captured(nil), got...)
	}
}

// The relay delivers each message as a Standard Webhooks delivery, its id
// the message's idempotency key, signed with every secret: a receiver that
// holds only the symmetric secret, or only the public key, accepts it.
func TestWebhookHandlerDeliversSignedStandardWebhooks(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	start := time.Now().Truncate(time.Second) // signed times are in whole seconds
	symmetric, seed, public := webhookSecrets(t)
	srv, got := capture(t, http.StatusNoContent)
	handler, err := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: srv.URL + "/hooks?token=x", Secrets: []string{symmetric, seed}})
	if err != nil {
		t.Fatal(err)
	}
	es := entries(scope, dest, 3)
	enqueue(t, ctx, pool, es...)
	startRelay(t, ctx, pool, handler, outbox.Config{Destinations: []string{dest}})
	waitFor(t, "3 deliveries", func() bool { return len(got()) >= 3 })

	bySymmetric, _ := webhook.NewStandardWebhooks(symmetric)
	byPublic, _ := webhook.NewStandardWebhooks(public)
	keys := map[string]bool{}
	for _, e := range es {
		keys[outbox.IdempotencyKey(e.Scope, e.Key, e.Destination)] = true
	}
	for _, d := range got() {
		r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(string(d.body)))
		r.Header = d.header
		for _, scheme := range []*webhook.StandardWebhooks{bySymmetric, byPublic} {
			v, err := scheme.Verify(r, d.body)
			if err != nil {
				t.Fatalf("delivery %s: %v", d.header, err)
			}
			if !keys[v.ID] || v.SignedAt.Before(start) || v.SignedAt.After(time.Now()) {
				t.Errorf("delivery id %q at %s, want a message's idempotency key, signed during the test", v.ID, v.SignedAt)
			}
		}
		if sigs := strings.Fields(d.header.Get("Webhook-Signature")); len(sigs) != 2 || !strings.HasPrefix(sigs[0], "v1,") || !strings.HasPrefix(sigs[1], "v1a,") {
			t.Errorf("signatures %q, want a v1 and a v1a", sigs)
		}
		if d.header.Get("Content-Type") != "application/json" {
			t.Errorf("Content-Type %q", d.header.Get("Content-Type"))
		}
	}
}

// Each answer is read as the Standard Webhooks specification describes:
// 2xx delivered, 410 parked, every other answer retried (no sooner than
// Retry-After).
func TestWebhookHandlerReadsAnswersAsTheSpecificationSays(t *testing.T) {
	t.Parallel()
	symmetric, _, _ := webhookSecrets(t)
	status := atomic.Int64{}
	retryAfterValue := atomic.Value{}
	retryAfterValue.Store("")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if v := retryAfterValue.Load().(string); v != "" {
			w.Header().Set("Retry-After", v)
		}
		w.Header().Set("Location", "/elsewhere")
		w.WriteHeader(int(status.Load()))
		fmt.Fprint(w, "the receiver's words")
	}))
	defer srv.Close()
	handler, err := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: srv.URL, Secrets: []string{symmetric}})
	if err != nil {
		t.Fatal(err)
	}
	msg := outbox.Message{ID: 1, IdempotencyKey: "k", Payload: []byte(`{}`), Attempt: 1}
	// An HTTP-date is in whole seconds, and the wait it asks for is
	// measured when the answer arrives, however long after this.
	dated := time.Now()
	for _, c := range []struct {
		status     int
		retryAfter string
		delivered  bool
		park       bool
		after      time.Duration
	}{
		{status: 200, delivered: true},
		{status: 202, delivered: true},
		{status: 204, delivered: true},
		{status: 301},
		{status: 302},
		{status: 400},
		{status: 401},
		{status: 404},
		{status: 410, park: true},
		{status: 413},
		{status: 422},
		{status: 408},
		{status: 409},
		{status: 425},
		{status: 429, retryAfter: "120", after: 120 * time.Second},
		{status: 429},
		{status: 500},
		{status: 502},
		{status: 503, retryAfter: "7", after: 7 * time.Second},
		{status: 503, retryAfter: dated.Add(time.Hour).UTC().Format(http.TimeFormat), after: time.Hour},
		{status: 503, retryAfter: "0"},
		{status: 503, retryAfter: "soon"},
		{status: 504},
	} {
		status.Store(int64(c.status))
		retryAfterValue.Store(c.retryAfter)
		err := handler(context.Background(), msg)
		if c.delivered {
			if err != nil {
				t.Errorf("%d: %v, want delivered", c.status, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("%d: delivered, want a failure", c.status)
			continue
		}
		park, after := outbox.Classified(err)
		least := c.after
		if strings.HasSuffix(c.retryAfter, "GMT") {
			least = c.after - time.Since(dated) - time.Second
		}
		if park != c.park || after < least || after > c.after {
			t.Errorf("%d Retry-After %q: park %v, retry after %s; want park %v, retry after %s (%v)", c.status, c.retryAfter, park, after, c.park, c.after, err)
		}
		if !strings.Contains(err.Error(), fmt.Sprint(c.status)) || !strings.Contains(err.Error(), "the receiver's words") {
			t.Errorf("%d: error %q says neither the status nor the answer", c.status, err)
		}
	}
}

// Redirects are not followed: a 3xx is a failed attempt, and the place it
// points to gets nothing.
func TestWebhookHandlerFollowsNoRedirect(t *testing.T) {
	t.Parallel()
	symmetric, _, _ := webhookSecrets(t)
	elsewhere, got := capture(t, http.StatusOK)
	srv := httptest.NewServer(http.RedirectHandler(elsewhere.URL, http.StatusTemporaryRedirect))
	defer srv.Close()
	handler, _ := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: srv.URL, Secrets: []string{symmetric}, Client: &http.Client{}})
	if err := handler(context.Background(), outbox.Message{IdempotencyKey: "k"}); err == nil {
		t.Error("a redirect counted as delivered")
	}
	if n := len(got()); n != 0 {
		t.Errorf("the redirect was followed: %d requests", n)
	}
}

// An attempt is bounded by Timeout: a receiver that never answers fails
// the attempt, to be retried.
func TestWebhookHandlerAttemptIsBounded(t *testing.T) {
	t.Parallel()
	symmetric, _, _ := webhookSecrets(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	defer srv.Close()
	handler, _ := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: srv.URL, Secrets: []string{symmetric}, Timeout: 50 * time.Millisecond})
	err := handler(context.Background(), outbox.Message{IdempotencyKey: "k"})
	if park, _ := outbox.Classified(err); !errors.Is(err, context.DeadlineExceeded) || park {
		t.Errorf("a receiver that never answers: %v, want a deadline exceeded, retried", err)
	}
}

// An attempt's error, which the relay logs and stores as last_error,
// shows the URL without its userinfo or query, which may hold a token:
// also the errors of net/http, which name the URL they were given.
func TestWebhookHandlerErrorsShowNoCredentialOfTheURL(t *testing.T) {
	t.Parallel()
	symmetric, _, _ := webhookSecrets(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := ln.Addr().String()
	ln.Close()
	hangs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	defer hangs.Close()
	answers, _ := capture(t, http.StatusServiceUnavailable)
	for name, base := range map[string]string{
		"connection refused": "http://" + refused,
		"timed out":          hangs.URL,
		"answered 503":       answers.URL,
	} {
		u := strings.Replace(base, "//", "//hook-user:hunter2@", 1) + "/hooks/42?token=s3cret"
		for _, cfg := range []outbox.WebhookConfig{
			{URL: u, Secrets: []string{symmetric}, Timeout: 100 * time.Millisecond},
			{Endpoint: func(context.Context, outbox.Message) (outbox.WebhookEndpoint, error) {
				return outbox.WebhookEndpoint{URL: u, Secrets: []string{symmetric}}, nil
			}, Timeout: 100 * time.Millisecond},
		} {
			handler, err := outbox.NewWebhookHandler(cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = handler(context.Background(), outbox.Message{IdempotencyKey: "k"})
			if err == nil {
				t.Fatalf("%s: delivered", name)
			}
			if text := err.Error(); strings.Contains(text, "s3cret") || strings.Contains(text, "hunter2") || strings.Contains(text, "hook-user") ||
				!strings.Contains(text, "/hooks/42") {
				t.Errorf("%s: %q; want the URL's path, and neither its userinfo nor its query", name, text)
			}
			var urlErr *url.Error
			if name != "answered 503" && !errors.As(err, &urlErr) {
				t.Errorf("%s: %v; want net/http's *url.Error still in the chain", name, err)
			}
		}
	}
}

// idem's receiver refuses a delivery signed outside its tolerance, 400
// webhook-stale, as when its clock is minutes off: the sender retries it,
// as the specification retries every answer but 2xx and 410, rather than
// park it, and the message is delivered once the clock is right, without
// anyone calling Requeue.
func TestAReceiverWhoseClockIsOffGetsTheMessageOnceItIsRight(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	symmetric, _, _ := webhookSecrets(t)
	scheme, _ := webhook.NewStandardWebhooks(symmetric)
	var slow atomic.Int64 // how far behind the receiver's clock is
	slow.Store(int64(10 * time.Minute))
	var applied atomic.Int64
	recv, err := webhook.NewReceiver(pool, func(context.Context, pgx.Tx, webhook.Event) error {
		applied.Add(1)
		return nil
	}, webhook.Config{
		Scheme: scheme,
		Scope:  func(*http.Request) (string, error) { return "webhook:" + scope, nil },
		Now:    func() time.Time { return time.Now().Add(-time.Duration(slow.Load())) },
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	var answers sync.Map // status -> count
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := httptest.NewRecorder()
		recv.ServeHTTP(rec, r)
		n, _ := answers.LoadOrStore(rec.Code, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
	}))
	defer srv.Close()
	handler, err := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: srv.URL, Secrets: []string{symmetric}})
	if err != nil {
		t.Fatal(err)
	}
	ids := enqueue(t, ctx, pool, entries(scope, dest, 1)...)
	startRelay(t, ctx, pool, handler, outbox.Config{Destinations: []string{dest}, RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 50 * time.Millisecond})
	state := func() (string, int) {
		var state string
		var attempts int
		if err := pool.QueryRow(ctx, `SELECT state, attempts FROM outbox_message WHERE id = $1`, ids[0]).Scan(&state, &attempts); err != nil {
			t.Fatal(err)
		}
		return state, attempts
	}
	waitFor(t, "two refused attempts, or the message parked", func() bool {
		st, attempts := state()
		return st != "pending" || attempts >= 2
	})
	if st, attempts := state(); st != "pending" {
		t.Fatalf("the message is %s after %d attempts refused 400 webhook-stale; want it pending, to be retried", st, attempts)
	}
	slow.Store(0)
	waitFor(t, "the message delivered", func() bool { st, _ := state(); return st != "pending" })
	if st, attempts := state(); st != "delivered" || applied.Load() != 1 {
		t.Fatalf("the message is %s after %d attempts, applied %d times; want delivered, applied once", st, attempts, applied.Load())
	}
	if n, ok := answers.Load(http.StatusBadRequest); !ok || n.(*atomic.Int64).Load() < 2 {
		t.Fatal("the receiver did not refuse the first attempts 400")
	}
}

// With Endpoint, each message goes to its own receiver with its own
// secrets; an endpoint that cannot work parks the message, a lookup that
// fails is retried.
func TestWebhookHandlerEndpointPerMessage(t *testing.T) {
	t.Parallel()
	symmetric, _, _ := webhookSecrets(t)
	a, gotA := capture(t, http.StatusOK)
	b, gotB := capture(t, http.StatusOK)
	handler, err := outbox.NewWebhookHandler(outbox.WebhookConfig{
		Endpoint: func(ctx context.Context, msg outbox.Message) (outbox.WebhookEndpoint, error) {
			switch msg.Destination {
			case "a":
				return outbox.WebhookEndpoint{URL: a.URL, Secrets: []string{symmetric}}, nil
			case "b":
				return outbox.WebhookEndpoint{URL: b.URL, Secrets: []string{symmetric}}, nil
			case "no-secret":
				return outbox.WebhookEndpoint{URL: a.URL}, nil
			case "no-url":
				return outbox.WebhookEndpoint{URL: "/relative", Secrets: []string{symmetric}}, nil
			}
			return outbox.WebhookEndpoint{}, errors.New("customer directory unavailable")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	for dest, want := range map[string]string{"a": "delivered", "b": "delivered", "no-secret": "parked", "no-url": "parked", "other": "retried"} {
		err := handler(context.Background(), outbox.Message{Destination: dest, IdempotencyKey: "k-" + dest})
		park, _ := outbox.Classified(err)
		got := map[bool]string{true: "parked", false: "retried"}[park]
		if err == nil {
			got = "delivered"
		}
		if got != want {
			t.Errorf("%s: %s (%v), want %s", dest, got, err, want)
		}
	}
	if len(gotA()) != 1 || len(gotB()) != 1 || gotA()[0].header.Get("Webhook-Id") != "k-a" || gotB()[0].header.Get("Webhook-Id") != "k-b" {
		t.Errorf("receiver a got %d, b %d", len(gotA()), len(gotB()))
	}
}

func TestNewWebhookHandlerRefusesEveryInvalidField(t *testing.T) {
	t.Parallel()
	symmetric, _, public := webhookSecrets(t)
	endpoint := func(context.Context, outbox.Message) (outbox.WebhookEndpoint, error) {
		return outbox.WebhookEndpoint{}, nil
	}
	for _, c := range []struct {
		field string
		cfg   outbox.WebhookConfig
	}{
		{"WebhookConfig.URL", outbox.WebhookConfig{Secrets: []string{symmetric}}},
		{"WebhookConfig.URL", outbox.WebhookConfig{URL: "example.com/hooks", Secrets: []string{symmetric}}},
		{"WebhookConfig.URL", outbox.WebhookConfig{URL: "ftp://example.com/hooks", Secrets: []string{symmetric}}},
		{"WebhookConfig.Secrets", outbox.WebhookConfig{URL: "https://example.com/hooks"}},
		{"WebhookConfig.Secrets", outbox.WebhookConfig{URL: "https://example.com/hooks", Secrets: []string{"whsec_!!"}}},
		{"WebhookConfig.Secrets", outbox.WebhookConfig{URL: "https://example.com/hooks", Secrets: []string{public}}},
		{"WebhookConfig.Endpoint", outbox.WebhookConfig{URL: "https://example.com/hooks", Secrets: []string{symmetric}, Endpoint: endpoint}},
		{"WebhookConfig.ContentType", outbox.WebhookConfig{URL: "https://example.com/hooks", Secrets: []string{symmetric}, ContentType: "json; ="}},
	} {
		_, err := outbox.NewWebhookHandler(c.cfg)
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(fmt.Sprint(err), c.field) {
			t.Errorf("%s: %v, want an error naming it that wraps ErrInvalidOption", c.field, err)
		}
		if err != nil && strings.Contains(err.Error(), strings.TrimPrefix(symmetric, "whsec_")) {
			t.Errorf("%s: the error shows a secret: %v", c.field, err)
		}
	}
	if _, err := outbox.NewWebhookHandler(outbox.WebhookConfig{Endpoint: endpoint, Timeout: -1}); err != nil {
		t.Errorf("Endpoint alone, no timeout: %v", err)
	}
}

// The relay waits at least as long as a handler's RetryAfter asks, capped
// at MaxRetryDelay, before the next attempt.
func TestRelayHonoursRetryAfter(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	es := entries(scope, dest, 2)
	ids := enqueue(t, ctx, pool, es...)
	var attempts atomic.Int64
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		attempts.Add(1)
		if msg.Key == es[0].Key {
			return outbox.RetryAfter(errors.New("busy"), time.Hour)
		}
		return outbox.RetryAfter(errors.New("busy for days"), 30*24*time.Hour)
	}, outbox.Config{Destinations: []string{dest}, MaxRetryDelay: 2 * time.Hour})
	waitFor(t, "both attempts", func() bool { return attempts.Load() >= 2 })
	for i, want := range []time.Duration{time.Hour, 2 * time.Hour} {
		var wait time.Duration
		waitFor(t, "the outcome", func() bool {
			var attempts int
			err := pool.QueryRow(ctx, `SELECT attempts, extract(epoch FROM next_attempt_at - now())::float8 * 1e9 FROM outbox_message WHERE id = $1 AND leased_until IS NULL`, ids[i]).Scan(&attempts, &wait)
			return err == nil
		})
		if wait < want-time.Minute || wait > want {
			t.Errorf("message %d is due in %s, want %s", i, wait, want)
		}
	}
}
