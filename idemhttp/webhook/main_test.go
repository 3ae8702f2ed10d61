package webhook_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/internal/otelrec"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/internal/testserver"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// fixture is a receiver behind a real HTTP server, with a Standard
// Webhooks scheme of a fresh secret, a scope of its own, and a handler
// that records each event as a payment row (key = the event id), counting
// its runs.
type fixture struct {
	t      *testing.T
	ctx    context.Context
	pool   *pgxpool.Pool
	scope  string
	secret string
	scheme *webhook.StandardWebhooks
	srv    *httptest.Server
	rec    *otelrec.Recorder
	runs   atomic.Int64
	// handle, when set, runs after the payment row is written.
	handle func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error
}

// newFixture starts a receiver configured by cfg, whose zero Scheme and
// Scope are the fixture's.
func newFixture(t *testing.T, cfg webhook.Config) *fixture {
	t.Helper()
	t.Parallel()
	f := &fixture{t: t, pool: env.Pool(t), scope: testdb.Name("webhook"), rec: otelrec.New()}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	f.ctx = ctx
	f.secret = "whsec_" + base64.StdEncoding.EncodeToString([]byte(testserver.RandomHex(16)))
	var err error
	if f.scheme, err = webhook.NewStandardWebhooks(f.secret); err != nil {
		t.Fatal(err)
	}
	if cfg.Scheme == nil {
		cfg.Scheme = f.scheme
	}
	if cfg.Scope == nil {
		cfg.Scope = func(*http.Request) (string, error) { return f.scope, nil }
	}
	if cfg.Observer == nil {
		if cfg.Observer, err = idem.NewObserver(idem.ObserverConfig{MeterProvider: f.rec, Logger: quiet}); err != nil {
			t.Fatal(err)
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	recv, err := webhook.NewReceiver(f.pool, f.apply, cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.srv = httptest.NewServer(recv)
	t.Cleanup(f.srv.Close)
	return f
}

var quiet = slog.New(slog.DiscardHandler)

// apply records the event as a payment of the body's amount.
func (f *fixture) apply(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
	f.runs.Add(1)
	var body struct {
		Amount int64 `json:"amount"`
	}
	_ = json.Unmarshal(ev.Body, &body)
	if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, ev.Scope, ev.ID, body.Amount); err != nil {
		return err
	}
	if f.handle != nil {
		return f.handle(ctx, tx, ev)
	}
	return nil
}

// response is an answer read whole.
type response struct {
	status int
	header http.Header
	body   []byte
}

// code is the problem's code, "" for an answer that is not a problem.
func (r response) code() string {
	var p struct{ Code string }
	_ = json.Unmarshal(r.body, &p)
	return p.Code
}

// post sends body with header to the receiver.
func (f *fixture) post(header http.Header, body []byte) response {
	f.t.Helper()
	req, err := http.NewRequestWithContext(f.ctx, http.MethodPost, f.srv.URL, bytes.NewReader(body))
	if err != nil {
		f.t.Fatal(err)
	}
	for name, values := range header {
		req.Header[name] = values
	}
	res, err := f.srv.Client().Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	defer res.Body.Close()
	got, err := io.ReadAll(res.Body)
	if err != nil {
		f.t.Fatal(err)
	}
	return response{status: res.StatusCode, header: res.Header, body: got}
}

// signed returns the headers of a delivery of body as the event id, signed
// now by the fixture's scheme.
func (f *fixture) signed(id string, body []byte) http.Header {
	f.t.Helper()
	h := http.Header{}
	if err := f.scheme.Sign(h, id, time.Now(), body); err != nil {
		f.t.Fatal(err)
	}
	return h
}

// deliver sends a delivery of body as the event id, signed now.
func (f *fixture) deliver(id string, body []byte) response {
	f.t.Helper()
	return f.post(f.signed(id, body), body)
}

// payments counts the payment rows of the fixture's scope, and of one
// event when id is given.
func (f *fixture) payments(id ...string) int {
	f.t.Helper()
	if len(id) == 0 {
		return testdb.CountPayments(f.t, f.pool, f.scope)
	}
	var n int
	if err := f.pool.QueryRow(f.ctx, `SELECT count(*) FROM payment WHERE scope = $1 AND key = $2`, f.scope, id[0]).Scan(&n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

// counts is what the receiver counted, by outcome[:reason].
func (f *fixture) counts() map[string]float64 { return f.rec.Count("idem.webhook.deliveries") }

func readAll(res *http.Response) string {
	b, _ := io.ReadAll(res.Body)
	return string(b)
}
