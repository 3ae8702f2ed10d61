package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

// cardProvider stands in for a payment provider that honours idempotency
// keys: it applies a charge once per key, and counts its calls. fail, when
// set, fails a call after applying it; hold, when set, runs before.
type cardProvider struct {
	charges    atomic.Int64
	calls      atomic.Int64
	applied    sync.Map // provider key → true
	fail, hold func(attempt int64) error
}

func (p *cardProvider) charge(key string) (string, error) {
	attempt := p.calls.Add(1)
	if p.hold != nil {
		if err := p.hold(attempt); err != nil {
			return "", err
		}
	}
	if _, seen := p.applied.LoadOrStore(key, true); !seen {
		p.charges.Add(1)
	}
	if p.fail != nil {
		if err := p.fail(attempt); err != nil {
			return "", err
		}
	}
	return "ch_" + key[:8], nil
}

// order is the flow endpoint's input and answer.
type order struct {
	AmountCents int64  `json:"amount_cents"`
	PaymentID   int64  `json:"payment_id,omitempty"`
	ChargeID    string `json:"charge_id,omitempty"`
}

// setupFlow starts a payments endpoint served by a flow: reserve the
// payment, charge the card at p, answer 201 with both.
func setupFlow(t *testing.T, cfg idemhttp.Config) (context.Context, *pgxpool.Pool, string, *cardProvider, *httptest.Server) {
	ctx, pool, tenant := setup(t)
	p := &cardProvider{}
	flow := idem.MustNewFlow(testdb.Name("pay"), func(ctx context.Context, s *idem.Steps, in order) (order, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.AmountCents).Scan(&id)
			return id, err
		})
		if err != nil {
			return order{}, err
		}
		charge, err := idem.Call(s, "charge", func(_ context.Context, key string) (string, error) { return p.charge(key) })
		if err != nil {
			return order{}, err
		}
		return order{AmountCents: in.AmountCents, PaymentID: id, ChargeID: charge}, nil
	})
	if cfg.Scope == nil {
		cfg.Scope = tenantScope
	}
	m, err := idemhttp.NewMiddleware(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := serveHandler(t, idemhttp.FlowHandler(m, flow,
		func(r *http.Request, body []byte) (order, error) {
			var in order
			if err := json.Unmarshal(body, &in); err != nil || in.AmountCents <= 0 {
				return order{}, errors.New("the body must be a JSON object with a positive amount_cents")
			}
			return in, nil
		},
		func(w http.ResponseWriter, r *http.Request, out order) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Location", "/payments/"+strconv.FormatInt(out.PaymentID, 10))
			w.WriteHeader(http.StatusCreated)
			_ = json.NewEncoder(w).Encode(out)
		}))
	return ctx, pool, tenant, p, srv
}

func TestFlowHandlerRunsOnceAndReplaysTheAnswer(t *testing.T) {
	_, pool, tenant, p, srv := setupFlow(t, idemhttp.Config{})
	first := post(t, srv, "/payments", tenant, "order-1", `{"amount_cents": 2500}`)
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	retry := post(t, srv, "/payments", tenant, "order-1", `{"amount_cents": 2500}`)
	sameAnswer(t, retry, first, "Content-Type", "Location")
	if !retry.replayed() {
		t.Fatal("the retry is not marked replayed")
	}
	if p.calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("%d calls, %d payments; want 1, 1", p.calls.Load(), countPayments(t, pool, tenant))
	}
	base := idemhttp.DefaultProblemTypeBase
	wantProblem(t, post(t, srv, "/payments", tenant, "order-1", `{"amount_cents": 9900}`), 422, base, idemhttp.ProblemKeyReused)
	wantProblem(t, post(t, srv, "/payments", tenant, noKey, `{"amount_cents": 2500}`), 400, base, idemhttp.ProblemKeyMissing)
	p400 := wantProblem(t, post(t, srv, "/payments", tenant, "order-2", `{"amount_cents": -1}`), 400, base, idemhttp.ProblemRequestInvalid)
	if p400["detail"] != "the body must be a JSON object with a positive amount_cents" {
		t.Fatalf("request-invalid's detail: %v", p400["detail"])
	}
	wantProblem(t, post(t, srv, "/payments", "", "order-3", `{"amount_cents": 2500}`), 400, base, idemhttp.ProblemScopeUnknown)
}

func TestFlowHandlerAnswers503WhenACallFailsAndTheRetryContinues(t *testing.T) {
	_, pool, tenant, p, srv := setupFlow(t, idemhttp.Config{})
	p.fail = func(attempt int64) error {
		switch attempt {
		case 1:
			return errors.New("provider timeout, after it charged")
		case 2: // the provider's connection: no database outage
			return &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}
		}
		return nil
	}
	for range 2 {
		failed := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`)
		wantProblem(t, failed, 503, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemOperationIncomplete)
		if failed.header.Get("Retry-After") == "" {
			t.Fatal("503 operation-incomplete without Retry-After")
		}
	}
	retry := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`)
	if retry.status != http.StatusCreated || retry.replayed() {
		t.Fatalf("the third attempt: %d %s", retry.status, retry.body)
	}
	if p.charges.Load() != 1 || p.calls.Load() != 3 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("%d charges, %d calls, %d payments; want 1, 3, 1", p.charges.Load(), p.calls.Load(), countPayments(t, pool, tenant))
	}
}

// A flow that did not complete is an outcome its client's retry mends,
// not a failure for a person: it is logged at INFO, not WARN, and so are
// none of the answers a client causes (a key reused, a replay).
func TestFlowHandlerLogsAnIncompleteFlowAtInfo(t *testing.T) {
	var logs syncBuffer
	_, _, tenant, p, srv := setupFlow(t, idemhttp.Config{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	p.fail = func(attempt int64) error {
		if attempt == 1 {
			return errors.New("provider timeout")
		}
		return nil
	}
	wantProblem(t, post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`), 503, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemOperationIncomplete)
	if got := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`); got.status != http.StatusCreated {
		t.Fatalf("the retry: %d %s", got.status, got.body)
	}
	post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`)
	wantProblem(t, post(t, srv, "/payments", tenant, "k", `{"amount_cents": 9900}`), 422, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemKeyReused)
	text := logs.String()
	if !strings.Contains(text, `level=INFO msg="idemhttp: flow did not complete; a retry continues it"`) || !strings.Contains(text, "provider timeout") {
		t.Errorf("logs %q; want the incomplete flow at INFO, with its error", text)
	}
	if strings.Contains(text, "level=WARN") || strings.Contains(text, "level=ERROR") {
		t.Errorf("logs %q; want nothing at WARN or above", text)
	}
}

// TestFlowHandlerAnswersAFunctionsErrorThatWrapsASentinel503 fails the
// call with errors that wrap idem's sentinels, as a provider's client may
// (idemhttp.Transport's ErrInvalidKey for a request with another key): the
// error is the flow's own, incomplete, whatever it wraps, and the client
// is told to retry, not that its key is invalid, reused or in progress.
// idemgrpc answers the same (TestFlowMethodAnswersEachWayAFlowFailsAsIdemhttpDoes).
func TestFlowHandlerAnswersAFunctionsErrorThatWrapsASentinel503(t *testing.T) {
	_, _, tenant, p, srv := setupFlow(t, idemhttp.Config{Logger: slog.New(slog.DiscardHandler)})
	sentinels := []error{idem.ErrInvalidKey, idem.ErrFingerprintMismatch, idem.ErrInProgress, idem.ErrInputNotStorable}
	p.fail = func(attempt int64) error {
		if int(attempt) <= len(sentinels) {
			return fmt.Errorf("the provider's client: %w", sentinels[attempt-1])
		}
		return nil
	}
	for _, sentinel := range sentinels {
		failed := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`)
		if failed.status != http.StatusServiceUnavailable {
			t.Fatalf("a call whose error wraps %v: %d %s", sentinel, failed.status, failed.body)
		}
		wantProblem(t, failed, 503, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemOperationIncomplete)
	}
	if retry := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`); retry.status != http.StatusCreated {
		t.Fatalf("the retry after them: %d %s", retry.status, retry.body)
	}
}

func TestFlowHandlerHoldsNoTransactionDuringTheCall(t *testing.T) {
	ctx, _, tenant := setup(t)
	pool, err := pgxpool.New(ctx, env.URL(t)) // a pool of the test's own, to count its connections
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	m, err := idemhttp.NewMiddleware(pool, idemhttp.Config{Scope: tenantScope})
	if err != nil {
		t.Fatal(err)
	}
	var acquired atomic.Int32
	acquired.Store(-1)
	flow := idem.MustNewFlow(testdb.Name("held"), func(ctx context.Context, s *idem.Steps, _ struct{}) (int, error) {
		return idem.Call(s, "call", func(context.Context, string) (int, error) {
			acquired.Store(pool.Stat().AcquiredConns())
			return 1, nil
		})
	})
	srv := serveHandler(t, idemhttp.FlowHandler(m, flow,
		func(*http.Request, []byte) (struct{}, error) { return struct{}{}, nil },
		func(w http.ResponseWriter, _ *http.Request, n int) { w.WriteHeader(http.StatusOK) }))
	if res := post(t, srv, "/", tenant, "k", `{}`); res.status != http.StatusOK {
		t.Fatalf("%d %s", res.status, res.body)
	}
	if acquired.Load() != 0 {
		t.Fatalf("%d connections acquired during the call, want 0", acquired.Load())
	}
}

func TestFlowHandlerDuplicatesWaitOrGet409(t *testing.T) {
	ctx, _, tenant, p, srv := setupFlow(t, idemhttp.Config{Wait: -1})
	calling, release := make(chan struct{}), make(chan struct{})
	p.hold = func(attempt int64) error {
		if attempt == 1 {
			close(calling)
			<-release
		}
		return nil
	}
	first := make(chan response, 1)
	go func() {
		res, err := fetch(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`))
		if err != nil {
			t.Error(err)
		}
		first <- res
	}()
	<-calling
	dup := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`)
	wantProblem(t, dup, 409, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemKeyInProgress)
	close(release)
	if res := <-first; res.status != http.StatusCreated {
		t.Fatalf("the first request: %d %s", res.status, res.body)
	}
	// A completed flow cannot be ended, and replays.
	if ended, err := idem.EndFlow(ctx, env.Pool(t), tenant, "k", "test"); err != nil || ended {
		t.Fatalf("EndFlow of a completed flow = %t, %v; want false", ended, err)
	}
	if res := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`); !res.replayed() {
		t.Fatalf("the completed flow's retry: %d %s", res.status, res.body)
	}
}

func TestFlowHandlerStoppedOperationIs409(t *testing.T) {
	ctx, pool, tenant, p, srv := setupFlow(t, idemhttp.Config{})
	p.fail = func(int64) error { return errors.New("timeout") }
	wantProblem(t, post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`), 503,
		idemhttp.DefaultProblemTypeBase, idemhttp.ProblemOperationIncomplete)
	if ended, err := idem.EndFlow(ctx, pool, tenant, "k", "refunded by hand"); err != nil || !ended {
		t.Fatalf("EndFlow = %t, %v", ended, err)
	}
	stopped := post(t, srv, "/payments", tenant, "k", `{"amount_cents": 2500}`)
	wantProblem(t, stopped, 409, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemOperationStopped)
	if stopped.header.Get("Retry-After") != "" {
		t.Fatal("operation-stopped invites a retry")
	}
}
