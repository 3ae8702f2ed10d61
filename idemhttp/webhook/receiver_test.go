package webhook_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/testserver"
)

func wantCounts(t *testing.T, got map[string]float64, want map[string]float64) {
	t.Helper()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("idem.webhook.deliveries %s = %v, want %v (all: %v)", k, got[k], v, got)
		}
	}
	for k, v := range got {
		if _, ok := want[k]; !ok && v != 0 {
			t.Errorf("idem.webhook.deliveries %s = %v, want none (all: %v)", k, v, got)
		}
	}
}

func TestRedeliveryIsAcknowledgedWithoutRunningTheHandler(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	body := []byte(`{"type":"charge.refunded","amount":2500}`)
	first := f.deliver("msg_1", body)
	if first.status != http.StatusNoContent || first.header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("first delivery: %d %s %s", first.status, first.header, first.body)
	}
	// The sender did not hear the answer, and delivers again, signing anew;
	// then redelivers once more by hand.
	for range 2 {
		again := f.deliver("msg_1", body)
		if again.status != http.StatusNoContent || again.header.Get(idemhttp.ReplayedHeader) != "true" {
			t.Fatalf("redelivery: %d %s %s", again.status, again.header, again.body)
		}
	}
	if runs, rows := f.runs.Load(), f.payments("msg_1"); runs != 1 || rows != 1 {
		t.Errorf("handler ran %d times, %d payment rows; want 1 and 1", runs, rows)
	}
	wantCounts(t, f.counts(), map[string]float64{"applied": 1, "duplicate": 2})
}

// An empty body is an empty slice, not nil: stored as it is, it is an
// empty bytea, where nil would be NULL and fail a NOT NULL column, answered
// 500 and delivered again for ever.
func TestEmptyBodyIsAnEmptySliceNotNil(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	f.handle = func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		_, err := tx.Exec(ctx, `CREATE TEMP TABLE delivery (body bytea NOT NULL) ON COMMIT DROP;`)
		if err == nil {
			_, err = tx.Exec(ctx, `INSERT INTO delivery (body) VALUES ($1)`, ev.Body)
		}
		if ev.Body == nil {
			return errors.Join(errors.New("the event's body is nil"), err)
		}
		return err
	}
	if a := f.deliver("msg_empty", nil); a.status != http.StatusNoContent {
		t.Fatalf("an empty body: %d %s; want 204", a.status, a.body)
	}
	if runs, rows := f.runs.Load(), f.payments("msg_empty"); runs != 1 || rows != 1 {
		t.Errorf("handler ran %d times, %d payment rows; want 1 and 1", runs, rows)
	}
}

// lockWaiters counts the transactions waiting for the advisory lock of
// (scope, key), idem's key lock.
func lockWaiters(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) int {
	t.Helper()
	id := uint64(keylock.ID(scope, key))
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
		AND classid = $1 AND objid = $2 AND objsubid = 1`, int64(id>>32), int64(id&0xffffffff)).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A sender's twins, delivered while the first is being applied, wait for
// it and are acknowledged once it commits; the handler runs once.
func TestConcurrentTwinsAreAppliedOnce(t *testing.T) {
	f := newFixture(t, webhook.Config{Wait: time.Minute})
	const twins = 6
	release := make(chan struct{})
	f.handle = func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		<-release
		return nil
	}
	body := []byte(`{"amount":100}`)
	answers := make(chan response, twins)
	var wg sync.WaitGroup
	for range twins {
		wg.Go(func() { answers <- f.deliver("msg_twin", body) })
	}
	// Hold the first until every other twin waits for its key.
	for lockWaiters(t, f.ctx, f.pool, f.scope, "msg_twin") < twins-1 {
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	close(answers)
	replayed := 0
	for a := range answers {
		if a.status != http.StatusNoContent {
			t.Errorf("twin answered %d %s", a.status, a.body)
		}
		if a.header.Get(idemhttp.ReplayedHeader) == "true" {
			replayed++
		}
	}
	if runs, rows := f.runs.Load(), f.payments(); runs != 1 || rows != 1 || replayed != twins-1 {
		t.Errorf("handler ran %d times, %d rows, %d replayed; want 1, 1, %d", runs, rows, replayed, twins-1)
	}
	wantCounts(t, f.counts(), map[string]float64{"applied": 1, "duplicate": twins - 1})
}

// A twin that would wait longer than Config.Wait is told to come back
// later, with nothing written; delivered again, it is a duplicate.
func TestTwinPastTheWaitIs409WithRetryAfter(t *testing.T) {
	f := newFixture(t, webhook.Config{Wait: -1})
	entered, release := make(chan struct{}), make(chan struct{})
	f.handle = func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		close(entered)
		<-release
		return nil
	}
	body := []byte(`{"amount":100}`)
	first := make(chan response, 1)
	go func() { first <- f.deliver("msg_slow", body) }()
	<-entered
	twin := f.deliver("msg_slow", body)
	close(release)
	if twin.status != http.StatusConflict || twin.code() != idemhttp.ProblemKeyInProgress || twin.header.Get("Retry-After") != "1" {
		t.Errorf("twin: %d %s Retry-After %q", twin.status, twin.body, twin.header.Get("Retry-After"))
	}
	if a := <-first; a.status != http.StatusNoContent {
		t.Fatalf("first: %d %s", a.status, a.body)
	}
	f.handle = nil
	if again := f.deliver("msg_slow", body); again.status != http.StatusNoContent || again.header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Errorf("twin delivered again: %d %s", again.status, again.body)
	}
	if f.runs.Load() != 1 || f.payments() != 1 {
		t.Errorf("handler ran %d times, %d rows; want 1 and 1", f.runs.Load(), f.payments())
	}
	wantCounts(t, f.counts(), map[string]float64{"applied": 1, "duplicate": 1, "failed:in_progress": 1})
}

func TestSameIDWithAnotherPayloadIsRefusedAndCounted(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	if a := f.deliver("msg_x", []byte(`{"amount":100}`)); a.status != http.StatusNoContent {
		t.Fatalf("first: %d %s", a.status, a.body)
	}
	a := f.deliver("msg_x", []byte(`{"amount":999999}`))
	if a.status != http.StatusUnprocessableEntity || a.code() != webhook.ProblemIDReused {
		t.Errorf("same id, another payload: %d %s", a.status, a.body)
	}
	if got := a.header.Get("Content-Type"); got != "application/problem+json" {
		t.Errorf("Content-Type %q", got)
	}
	want := `<` + idemhttp.DefaultProblemTypeBase + webhook.ProblemIDReused + `>; rel="describedby"`
	if got := a.header.Get("Link"); got != want {
		t.Errorf("Link %q, want %q", got, want)
	}
	if f.runs.Load() != 1 || f.payments() != 1 {
		t.Errorf("handler ran %d times, %d rows; want 1 and 1", f.runs.Load(), f.payments())
	}
	wantCounts(t, f.counts(), map[string]float64{"applied": 1, "refused:id_reused": 1})
}

// Whatever fails verification is refused with its problem before
// anything is written: no record, no handler run.
func TestRefusedDeliveriesWriteNothing(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	f := newFixture(t, webhook.Config{Now: func() time.Time { return now }, MaxBodyBytes: 64})
	body := []byte(`{"amount":1}`)
	signedAt := func(at time.Time) http.Header {
		h := http.Header{}
		if err := f.scheme.Sign(h, "msg_r", at, body); err != nil {
			t.Fatal(err)
		}
		return h
	}
	other, _ := webhook.NewStandardWebhooks("whsec_" + strings.Repeat("A", 32))
	wrong := http.Header{}
	_ = other.Sign(wrong, "msg_r", now, body)
	noSig := signedAt(now)
	noSig.Del("Webhook-Signature")
	badTS := signedAt(now)
	badTS.Set("Webhook-Timestamp", "noon")
	for _, c := range []struct {
		name   string
		header http.Header
		body   []byte
		status int
		code   string
	}{
		{"unsigned", noSig, body, http.StatusBadRequest, webhook.ProblemUnsigned},
		{"malformed", badTS, body, http.StatusBadRequest, webhook.ProblemMalformed},
		{"another secret", wrong, body, http.StatusBadRequest, webhook.ProblemSignatureInvalid},
		{"body changed on the way", signedAt(now), []byte(`{"amount":2}`), http.StatusBadRequest, webhook.ProblemSignatureInvalid},
		{"signed 5m1s ago", signedAt(now.Add(-5*time.Minute - time.Second)), body, http.StatusBadRequest, webhook.ProblemStale},
		{"signed 5m1s ahead", signedAt(now.Add(5*time.Minute + time.Second)), body, http.StatusBadRequest, webhook.ProblemStale},
		{"body over the limit", signedAt(now), []byte(`{"amount":1,"pad":"` + strings.Repeat("x", 64) + `"}`), http.StatusRequestEntityTooLarge, idemhttp.ProblemBodyTooLarge},
	} {
		a := f.post(c.header, c.body)
		if a.status != c.status || a.code() != c.code {
			t.Errorf("%s: %d %s, want %d %s", c.name, a.status, a.body, c.status, c.code)
		}
	}
	var records int
	if err := f.pool.QueryRow(f.ctx, `SELECT count(*) FROM idempotency_key WHERE scope = $1`, f.scope).Scan(&records); err != nil {
		t.Fatal(err)
	}
	if f.runs.Load() != 0 || records != 0 || f.payments() != 0 {
		t.Errorf("handler ran %d times, %d records, %d rows; want none", f.runs.Load(), records, f.payments())
	}
	wantCounts(t, f.counts(), map[string]float64{
		"refused:unsigned": 1, "refused:malformed": 1, "refused:signature_invalid": 2,
		"refused:stale": 2, "refused:body_too_large": 1,
	})
	// Within the tolerance, on the injected clock, the same delivery is
	// applied.
	if a := f.post(signedAt(now.Add(-4*time.Minute)), body); a.status != http.StatusNoContent {
		t.Errorf("signed 4m ago: %d %s", a.status, a.body)
	}
}

// A body over the limit is refused without being read whole: one whose
// Content-Length announces more is refused before a byte is read, and one
// that streams more is read only to the limit's next byte.
func TestBodyOverTheLimitIsNotReadWhole(t *testing.T) {
	t.Parallel()
	scheme, _ := webhook.NewStandardWebhooks("whsec_" + strings.Repeat("D", 32))
	recv, err := webhook.NewReceiver(env.Pool(t), func(context.Context, pgx.Tx, webhook.Event) error { return nil },
		webhook.Config{Scheme: scheme, Scope: func(*http.Request) (string, error) { return "webhook:limit", nil }, MaxBodyBytes: 1024, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name          string
		contentLength int64
		maxRead       int64
	}{
		{"announced 1 TiB", 1 << 40, 0},
		{"streamed without end", -1, 1025},
	} {
		body := &endlessBody{}
		req := httptest.NewRequest(http.MethodPost, "/", body)
		req.ContentLength = c.contentLength
		w := httptest.NewRecorder()
		recv.ServeHTTP(w, req)
		if w.Code != http.StatusRequestEntityTooLarge || !strings.Contains(w.Body.String(), idemhttp.ProblemBodyTooLarge) {
			t.Errorf("%s: %d %s", c.name, w.Code, w.Body)
		}
		if body.n > c.maxRead {
			t.Errorf("%s: %d bytes read, want at most %d", c.name, body.n, c.maxRead)
		}
	}
}

// endlessBody is a body of 'x' without end, counting what is read of it.
type endlessBody struct{ n int64 }

func (r *endlessBody) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'x'
	}
	r.n += int64(len(p))
	return len(p), nil
}

// The 204 is sent only once the commit succeeded: a commit that fails (a
// deferred constraint) answers 500, and keeps nothing, so the sender's
// next delivery applies the event.
func TestACommitThatFailsIsNotAcknowledged(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	table := "webhook_deferred_" + testserver.RandomHex(6)
	if _, err := f.pool.Exec(f.ctx, `CREATE TABLE `+table+` (id int UNIQUE DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = f.pool.Exec(context.Background(), `DROP TABLE `+table) })
	f.handle = func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES (1), (1)`) // fails only at COMMIT
		return err
	}
	body := []byte(`{"amount":100}`)
	if a := f.deliver("msg_c", body); a.status != http.StatusInternalServerError || a.code() != idemhttp.ProblemRequestFailed {
		t.Fatalf("commit failed: %d %s", a.status, a.body)
	}
	if f.payments() != 0 {
		t.Fatalf("%d rows after a failed commit", f.payments())
	}
	f.handle = nil
	if a := f.deliver("msg_c", body); a.status != http.StatusNoContent || a.header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("delivered again: %d %s", a.status, a.body)
	}
	if f.runs.Load() != 2 || f.payments() != 1 {
		t.Errorf("handler ran %d times, %d rows; want 2 and 1", f.runs.Load(), f.payments())
	}
	wantCounts(t, f.counts(), map[string]float64{"failed:error": 1, "applied": 1})
}

// A handler's error or panic rolls its writes back and is never stored:
// the sender's next delivery runs the handler again.
func TestHandlerFailureIsRetriedNotStored(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	var fail sync.Mutex
	mode := "error"
	f.handle = func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		fail.Lock()
		defer fail.Unlock()
		switch mode {
		case "error":
			return errors.New("the ledger is closed")
		case "panic":
			panic("a bug")
		case "inner key reused":
			// The handler's own idem.Do found a key reused: its failure,
			// not the event's id reused.
			return fmt.Errorf("inner call: %w", idem.ErrFingerprintMismatch)
		}
		return nil
	}
	body := []byte(`{"amount":100}`)
	for _, m := range []string{"error", "panic", "inner key reused"} {
		fail.Lock()
		mode = m
		fail.Unlock()
		if a := f.deliver("msg_h", body); a.status != http.StatusInternalServerError || a.code() != idemhttp.ProblemRequestFailed {
			t.Errorf("handler %s: %d %s", m, a.status, a.body)
		}
		if f.payments() != 0 {
			t.Fatalf("handler %s: %d rows kept", m, f.payments())
		}
	}
	fail.Lock()
	mode = ""
	fail.Unlock()
	if a := f.deliver("msg_h", body); a.status != http.StatusNoContent {
		t.Fatalf("third delivery: %d %s", a.status, a.body)
	}
	if f.runs.Load() != 4 || f.payments() != 1 {
		t.Errorf("handler ran %d times, %d rows; want 4 and 1", f.runs.Load(), f.payments())
	}
	wantCounts(t, f.counts(), map[string]float64{"failed:handler": 3, "applied": 1})
}

// A database the receiver cannot reach gets the sender to deliver again
// later: 503 with Retry-After, never a 4xx that would make it stop.
func TestDatabaseOutageIs503WithRetryAfter(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=5")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scheme, _ := webhook.NewStandardWebhooks("whsec_" + strings.Repeat("B", 32))
	ran := false
	recv, err := webhook.NewReceiver(pool, func(context.Context, pgx.Tx, webhook.Event) error { ran = true; return nil },
		webhook.Config{Scheme: scheme, Scope: func(*http.Request) (string, error) { return "webhook:test", nil }, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	body := []byte(`{}`)
	req, _ := http.NewRequest(http.MethodPost, "/", strings.NewReader(string(body)))
	_ = scheme.Sign(req.Header, "msg_down", time.Now(), body)
	w := httptest.NewRecorder()
	recv.ServeHTTP(w, req)
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "1" || ran {
		t.Errorf("database down: %d Retry-After %q %s, handler ran %v", w.Code, w.Header().Get("Retry-After"), w.Body, ran)
	}
	if !strings.Contains(w.Body.String(), idemhttp.ProblemDatabaseUnavailable) {
		t.Errorf("problem %s", w.Body)
	}
}

// An event id that idem cannot take as a key is recorded under its
// SHA-256, and so is one that looks like such a key; each is still
// applied once.
func TestLongEventIDsAreRecordedUnderTheirHash(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	hashed := func(id string) string {
		sum := sha256.Sum256([]byte(id))
		return "sha256:" + hex.EncodeToString(sum[:])
	}
	long := "evt_" + strings.Repeat("x", 300)
	lookalike := hashed("something else")
	for _, id := range []string{long, lookalike, "evt_plain"} {
		for range 2 {
			if a := f.deliver(id, []byte(`{"amount":1}`)); a.status != http.StatusNoContent {
				t.Fatalf("%.20s…: %d %s", id, a.status, a.body)
			}
		}
	}
	rows, err := f.pool.Query(f.ctx, `SELECT key FROM idempotency_key WHERE scope = $1 ORDER BY key`, f.scope)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"evt_plain", hashed(long), hashed(lookalike)}
	if len(keys) != 3 || !contains(keys, want[0]) || !contains(keys, want[1]) || !contains(keys, want[2]) {
		t.Errorf("recorded keys %q, want %q", keys, want)
	}
	if f.runs.Load() != 3 {
		t.Errorf("handler ran %d times, want 3", f.runs.Load())
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// The handler gets the verified event, and a Stripe redelivery whose
// pending_webhooks changed is a duplicate, not a reused id.
func TestStripeDeliveries(t *testing.T) {
	stripe, _ := webhook.NewStripe(stripeSecret)
	f := newFixture(t, webhook.Config{Scheme: stripe})
	var got []webhook.Event
	var mu sync.Mutex
	f.handle = func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, ev)
		return nil
	}
	for _, pending := range []int{2, 1, 0} {
		body := []byte(fmt.Sprintf(`{"id":"evt_s1","type":"charge.refunded","pending_webhooks":%d,"amount":700}`, pending))
		h := http.Header{}
		stripe.Sign(h, time.Now(), body)
		if a := f.post(h, body); a.status != http.StatusNoContent {
			t.Fatalf("stripe, pending %d: %d %s", pending, a.status, a.body)
		}
	}
	if len(got) != 1 || got[0].ID != "evt_s1" || got[0].Type != "charge.refunded" || got[0].Scope != f.scope || got[0].SignedAt.IsZero() {
		t.Errorf("stripe events %+v", got)
	}
}

func TestGitHubDeliveries(t *testing.T) {
	github, _ := webhook.NewGitHub("gh-secret")
	g := newFixture(t, webhook.Config{Scheme: github})
	body := []byte(`{"action":"opened","amount":3}`)
	for range 2 {
		h := http.Header{"X-Github-Event": {"issues"}}
		github.Sign(h, "72d3162e-cc78-11e3-81ab-4c9367dc0958", body)
		if a := g.post(h, body); a.status != http.StatusNoContent {
			t.Fatalf("github: %d %s", a.status, a.body)
		}
	}
	if g.runs.Load() != 1 || g.payments("72d3162e-cc78-11e3-81ab-4c9367dc0958") != 1 {
		t.Errorf("github: handler ran %d times", g.runs.Load())
	}
}

// A scope that Config.Scope cannot give is 400, nothing written; one that
// idem refuses is the server's fault, 500.
func TestScopeErrors(t *testing.T) {
	f := newFixture(t, webhook.Config{Scope: func(r *http.Request) (string, error) {
		switch r.URL.Query().Get("tenant") {
		case "":
			return "", errors.New("no tenant")
		case "long":
			return strings.Repeat("s", 256), nil
		}
		return "webhook:" + r.URL.Query().Get("tenant"), nil
	}})
	body := []byte(`{}`)
	post := func(query string) response {
		req, _ := http.NewRequestWithContext(f.ctx, http.MethodPost, f.srv.URL+query, strings.NewReader(string(body)))
		_ = f.scheme.Sign(req.Header, "msg_s", time.Now(), body)
		res, err := f.srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		var b strings.Builder
		_, _ = fmt.Fprint(&b, readAll(res))
		return response{status: res.StatusCode, header: res.Header, body: []byte(b.String())}
	}
	if a := post(""); a.status != http.StatusBadRequest || a.code() != idemhttp.ProblemScopeUnknown {
		t.Errorf("no tenant: %d %s", a.status, a.body)
	}
	if a := post("?tenant=long"); a.status != http.StatusInternalServerError {
		t.Errorf("scope of 256 bytes: %d %s", a.status, a.body)
	}
	if f.runs.Load() != 0 {
		t.Errorf("handler ran %d times", f.runs.Load())
	}
}

// The Observer counts each delivery once, and passes the claim to idem's
// own counters.
func TestObserverCountsEachDeliveryOnce(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	body := []byte(`{}`)
	f.deliver("msg_o", body)
	f.deliver("msg_o", body)
	f.post(http.Header{}, body)
	wantCounts(t, f.counts(), map[string]float64{"applied": 1, "duplicate": 1, "refused:unsigned": 1})
	if calls := f.rec.Count("idem.calls"); calls["claimed"] != 1 || calls["replayed"] != 1 {
		t.Errorf("idem.calls %v", calls)
	}
}

func TestNewReceiverRefusesEveryInvalidField(t *testing.T) {
	t.Parallel()
	scheme, _ := webhook.NewStandardWebhooks("whsec_" + strings.Repeat("C", 32))
	scope := func(*http.Request) (string, error) { return "s", nil }
	valid := func() webhook.Config { return webhook.Config{Scheme: scheme, Scope: scope} }
	handle := func(context.Context, pgx.Tx, webhook.Event) error { return nil }
	pool := env.Pool(t)
	for _, c := range []struct {
		field string
		cfg   func(*webhook.Config)
	}{
		{"Config.Scheme", func(c *webhook.Config) { c.Scheme = nil }},
		{"Config.Scope", func(c *webhook.Config) { c.Scope = nil }},
		{"Config.Retention", func(c *webhook.Config) { c.Retention = -time.Hour }},
		{"Config.Retention", func(c *webhook.Config) { c.Retention = time.Minute }}, // under twice the tolerance
		{"Config.Retention", func(c *webhook.Config) { c.Retention, c.Tolerance = time.Hour, 2*time.Hour }},
		{"Config.Wait", func(c *webhook.Config) { c.Wait = 1000 * time.Hour }},
		{"Config.ProblemTypeBase", func(c *webhook.Config) { c.ProblemTypeBase = "problems#" }},
		{"Config.ProblemTypeBase", func(c *webhook.Config) { c.ProblemTypeBase = "https://example.com/a b#" }},
	} {
		cfg := valid()
		c.cfg(&cfg)
		_, err := webhook.NewReceiver(pool, handle, cfg)
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(fmt.Sprint(err), c.field) {
			t.Errorf("%s: %v, want an error naming it that wraps ErrInvalidOption", c.field, err)
		}
	}
	if _, err := webhook.NewReceiver(nil, handle, valid()); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("nil db: %v", err)
	}
	if _, err := webhook.NewReceiver(pool, nil, valid()); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("nil handler: %v", err)
	}
	// What may be negative: no tolerance (then any retention), no wait, no
	// limit.
	cfg := valid()
	cfg.Tolerance, cfg.Retention, cfg.Wait, cfg.MaxBodyBytes = -1, time.Second, -1, -1
	if _, err := webhook.NewReceiver(pool, handle, cfg); err != nil {
		t.Errorf("negative tolerance, wait and limit: %v", err)
	}
}

func TestEveryProblemCodeIsDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../PROBLEMS.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, code := range []string{webhook.ProblemUnsigned, webhook.ProblemMalformed, webhook.ProblemSignatureInvalid, webhook.ProblemStale, webhook.ProblemIDReused} {
		if !bytes.Contains(doc, []byte("\n## "+code+"\n")) {
			t.Errorf("PROBLEMS.md has no heading for %s", code)
		}
	}
}
