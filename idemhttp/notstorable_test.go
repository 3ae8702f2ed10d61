package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

// note is the input and the answer of the flow endpoint of these tests.
type note struct {
	Text string `json:"text"`
}

// TestFlowInputThatCannotBeStoredIs422AndNotRetried sends a flow endpoint,
// through the Transport, inputs that the flow can never store: a string
// with a NUL character, and an input over the flow's size limit. Each is
// the request's problem, answered 422 input-not-storable, which the
// Transport returns after one attempt; the flow does not run and nothing
// is recorded.
func TestFlowInputThatCannotBeStoredIs422AndNotRetried(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var runs atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("note"), func(ctx context.Context, s *idem.Steps, in note) (note, error) {
		runs.Add(1)
		return in, nil
	}, idem.WithMaxResponseSize(256))
	m, err := idemhttp.NewMiddleware(pool, idemhttp.Config{Scope: tenantScope})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveHandler(t, idemhttp.FlowHandler(m, flow,
		func(r *http.Request, body []byte) (note, error) {
			var in note
			return in, json.Unmarshal(body, &in)
		},
		func(w http.ResponseWriter, r *http.Request, out note) { _ = json.NewEncoder(w).Encode(out) }))
	client := transportClient(&idemhttp.Transport{BaseDelay: time.Millisecond}, newWire(t))

	for name, c := range map[string]struct{ body, detail string }{
		"a NUL character": {`{"text": "a\u0000b"}`, "NUL character"},
		"over the limit":  {`{"text": "` + strings.Repeat("n", 300) + `"}`, "larger than the server stores"},
	} {
		res, _, attempts := roundTrip(t, client, newPost(t, srv, "/notes", tenant, testdb.Name("k"), c.body))
		p := wantProblem(t, res, http.StatusUnprocessableEntity, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemInputNotStorable)
		if detail, _ := p["detail"].(string); !strings.Contains(detail, c.detail) {
			t.Errorf("%s: detail %q does not say %q", name, detail, c.detail)
		}
		if attempts != 1 {
			t.Errorf("%s: the Transport sent the request %d times, want once", name, attempts)
		}
	}
	var flows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow WHERE scope = $1`, tenant).Scan(&flows); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 0 || flows != 0 {
		t.Fatalf("the flow ran %d times, and recorded %d operations; want neither", runs.Load(), flows)
	}
	// The same endpoint takes an input it can store.
	if res := post(t, srv, "/notes", tenant, testdb.Name("k"), `{"text": "ab"}`); res.status != http.StatusOK || runs.Load() != 1 {
		t.Fatalf("a storable input: %d %s, %d runs", res.status, res.body, runs.Load())
	}
}

// TestAnswerThatCannotBeStoredIs500WithoutInvitingARetry makes the server
// produce answers it cannot store, its own bug: a handler's header larger
// than the stored answer may be (the body is bounded by MaxResponseBytes,
// the headers by an allowance of 1 MiB above it), and a flow's answer with
// a NUL character. Each is 500 request-failed, whose detail says the error
// is the server's and does not say that retrying is safe; nothing is kept.
func TestAnswerThatCannotBeStoredIs500WithoutInvitingARetry(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	srv := serve(t, pool, idemhttp.Config{MaxResponseBytes: 1, Logger: slog.New(slog.DiscardHandler)}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if _, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, idemhttp.Scope(r.Context()), idemhttp.Key(r.Context())); err != nil {
			t.Error(err)
		}
		w.Header().Set("Location", "/payments/"+strings.Repeat("1", 1<<20))
		w.WriteHeader(http.StatusCreated)
	}))
	flow := idem.MustNewFlow(testdb.Name("note"), func(ctx context.Context, s *idem.Steps, in note) (note, error) {
		return note{Text: in.Text + "\x00"}, nil
	})
	m, err := idemhttp.NewMiddleware(pool, idemhttp.Config{Scope: tenantScope, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	flowSrv := serveHandler(t, idemhttp.FlowHandler(m, flow,
		func(r *http.Request, body []byte) (note, error) { return note{Text: string(body)}, nil },
		func(w http.ResponseWriter, r *http.Request, out note) { _ = json.NewEncoder(w).Encode(out) }))

	for name, res := range map[string]response{
		"a handler's answer": post(t, srv, "/payments", tenant, testdb.Name("k"), `{}`),
		"a flow's answer":    post(t, flowSrv, "/notes", tenant, testdb.Name("k"), `ab`),
	} {
		p := wantProblem(t, res, http.StatusInternalServerError, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemRequestFailed)
		if detail, _ := p["detail"].(string); strings.Contains(detail, "is safe") || !strings.Contains(detail, "error of the server's") {
			t.Errorf("%s: the detail %q invites a retry, or does not say whose the error is", name, detail)
		}
	}
	if calls.Load() != 1 || countPayments(t, pool, tenant) != 0 || countRecords(t, pool, tenant) != 0 {
		t.Fatalf("%d runs, %d payments, %d records; want 1 run, rolled back", calls.Load(), countPayments(t, pool, tenant), countRecords(t, pool, tenant))
	}
}

// failingCodec seals nothing: a codec whose key service is down, say.
type failingCodec struct{}

func (failingCodec) Seal(string, []byte) ([]byte, error) {
	return nil, errors.New("key service unavailable")
}
func (failingCodec) Open(string, []byte) ([]byte, error) {
	return nil, errors.New("key service unavailable")
}

// TestFlowCodecThatCannotSealTheInputIsTheServersFailure gives a flow a
// codec that fails: the input is fine, so the answer is the server's 500,
// not the request's 422.
func TestFlowCodecThatCannotSealTheInputIsTheServersFailure(t *testing.T) {
	_, pool, tenant := setup(t)
	flow := idem.MustNewFlow(testdb.Name("note"), func(ctx context.Context, s *idem.Steps, in note) (note, error) { return in, nil },
		idem.WithCodec(failingCodec{}))
	m, err := idemhttp.NewMiddleware(pool, idemhttp.Config{Scope: tenantScope, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveHandler(t, idemhttp.FlowHandler(m, flow,
		func(r *http.Request, body []byte) (note, error) { return note{Text: string(body)}, nil },
		func(w http.ResponseWriter, r *http.Request, out note) { _ = json.NewEncoder(w).Encode(out) }))
	wantProblem(t, post(t, srv, "/notes", tenant, testdb.Name("k"), `ab`), http.StatusInternalServerError,
		idemhttp.DefaultProblemTypeBase, idemhttp.ProblemRequestFailed)
}
