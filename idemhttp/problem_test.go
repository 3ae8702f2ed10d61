package idemhttp_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

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
			mw := idemhttp.MustNew(pool, cfg)
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

// allCodes lists every problem code; PROBLEMS.md documents each.
var allCodes = []string{
	idemhttp.ProblemKeyMissing, idemhttp.ProblemKeyInvalid, idemhttp.ProblemScopeUnknown,
	idemhttp.ProblemFingerprintFailed, idemhttp.ProblemBodyUnreadable, idemhttp.ProblemBodyTooLarge,
	idemhttp.ProblemKeyReused, idemhttp.ProblemKeyInProgress, idemhttp.ProblemResponseNotStored,
	idemhttp.ProblemRequestFailed, idemhttp.ProblemDatabaseUnavailable,
	idemhttp.ProblemRequestInvalid, idemhttp.ProblemOperationIncomplete, idemhttp.ProblemOperationStopped,
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

// directEndpoint is a payments endpoint that calls idem.Run itself, with
// m's ParseKey and WriteError, as one that cannot sit behind the middleware
// does. It waits for a concurrent request as long as m's Config.Wait.
func directEndpoint(m *idemhttp.Middleware, db idem.TxBeginner, wait time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, err := m.ParseKey(r)
		if err != nil {
			m.WriteError(w, r, err)
			return
		}
		scope, err := tenantScope(r)
		if err != nil {
			http.Error(w, "who are you?", http.StatusUnauthorized)
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "body unreadable", http.StatusBadRequest)
			return
		}
		res, err := idem.Run(r.Context(), db, scope, key, idemhttp.DefaultFingerprint(r, body),
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "paid", nil },
			idem.WithWait(wait))
		if err != nil {
			m.WriteError(w, r, err)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, res.Value)
	})
}

// sameProblem fails the test unless got is want again, byte for byte, in its
// status, body and every header but Date.
func sameProblem(t *testing.T, got, want response) {
	t.Helper()
	if got.status != want.status || !bytes.Equal(got.body, want.body) {
		t.Fatalf("got %d %s, want %d %s", got.status, got.body, want.status, want.body)
	}
	g, w := got.header.Clone(), want.header.Clone()
	g.Del("Date")
	w.Del("Date")
	if !maps.EqualFunc(g, w, slices.Equal) {
		t.Fatalf("headers %v, want %v", g, w)
	}
}

func TestWriteErrorAnswersAsTheMiddlewareDoes(t *testing.T) {
	const wait = 50 * time.Millisecond
	cfg := idemhttp.Config{
		Scope:           tenantScope,
		Required:        true,
		Wait:            wait,
		ProblemTypeBase: "https://api.example.com/docs/errors#",
		Logger:          slog.New(slog.DiscardHandler),
	}
	// servers returns a server with the middleware on db around a handler
	// that answers 201, and one with directEndpoint on db.
	servers := func(t *testing.T, db idem.TxBeginner) (behind, direct *httptest.Server) {
		m, err := idemhttp.NewMiddleware(db, cfg)
		if err != nil {
			t.Fatal(err)
		}
		paid := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "paid")
		})
		return serveHandler(t, m.Wrap(paid)), serveHandler(t, directEndpoint(m, db, wait))
	}

	t.Run("key missing and invalid", func(t *testing.T) {
		_, pool, tenant := setup(t)
		behind, direct := servers(t, pool)
		for _, c := range []struct{ key, code string }{{noKey, idemhttp.ProblemKeyMissing}, {`"open`, idemhttp.ProblemKeyInvalid}} {
			want := post(t, behind, "/payments", tenant, c.key, `{}`)
			wantProblem(t, want, http.StatusBadRequest, cfg.ProblemTypeBase, c.code)
			sameProblem(t, post(t, direct, "/payments", tenant, c.key, `{}`), want)
		}
	})
	t.Run("fingerprint mismatch", func(t *testing.T) {
		_, pool, tenant := setup(t)
		behind, direct := servers(t, pool)
		var answers []response
		for _, srv := range []*httptest.Server{behind, direct} {
			key := "reused-" + strconv.Itoa(len(answers))
			if first := post(t, srv, "/payments", tenant, key, `{"amount_cents":100}`); first.status != http.StatusCreated {
				t.Fatalf("first: %d %s", first.status, first.body)
			}
			answers = append(answers, post(t, srv, "/payments", tenant, key, `{"amount_cents":200}`))
		}
		wantProblem(t, answers[0], http.StatusUnprocessableEntity, cfg.ProblemTypeBase, idemhttp.ProblemKeyReused)
		sameProblem(t, answers[1], answers[0])
	})
	t.Run("in progress", func(t *testing.T) {
		ctx, pool, tenant := setup(t)
		behind, direct := servers(t, pool)
		// An open transaction holds both keys' claims until it ends, so
		// that each request's wait runs out, however slow the machine.
		holder, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Rollback(ctx)
		for _, key := range []string{"busy-0", "busy-1"} {
			if _, err := idem.Do(ctx, holder, tenant, key, nil, func(context.Context, pgx.Tx) (int, error) { return 0, nil }); err != nil {
				t.Fatal(err)
			}
		}
		want := post(t, behind, "/payments", tenant, "busy-0", `{}`)
		wantProblem(t, want, http.StatusConflict, cfg.ProblemTypeBase, idemhttp.ProblemKeyInProgress)
		if want.header.Get("Retry-After") != "1" {
			t.Fatalf("Retry-After %q, want 1", want.header.Get("Retry-After"))
		}
		sameProblem(t, post(t, direct, "/payments", tenant, "busy-1", `{}`), want)
	})
	t.Run("database unavailable", func(t *testing.T) {
		ctx, _, tenant := setup(t)
		// A port that nothing listens on any more: every connection is
		// refused.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		down, err := pgxpool.New(ctx, "postgres://postgres@"+addr+"/postgres?sslmode=disable&connect_timeout=10")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(down.Close)
		behind, direct := servers(t, down)
		want := post(t, behind, "/payments", tenant, "k", `{}`)
		wantProblem(t, want, http.StatusServiceUnavailable, cfg.ProblemTypeBase, idemhttp.ProblemDatabaseUnavailable)
		if want.header.Get("Retry-After") != "1" {
			t.Fatalf("Retry-After %q, want 1", want.header.Get("Retry-After"))
		}
		sameProblem(t, post(t, direct, "/payments", tenant, "k", `{}`), want)
	})
}
