package idemhttp_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/otelrec"
)

func TestLargestAcceptedConfigWorks(t *testing.T) {
	_, pool, tenant := setup(t)
	var calls atomic.Int64
	// The largest wait idem accepts, and a response limit far beyond any
	// real one: MustNew must not reject them, nor idem refuse them per request.
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
	t.Run("StoreDefinite leaves out the answers that ask for a retry", func(t *testing.T) {
		_, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{Store: idemhttp.StoreDefinite}, statusHandler(tenant, &calls))
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

func TestNewMiddlewareRefusesEveryInvalidField(t *testing.T) {
	t.Parallel()
	scope := func(*http.Request) (string, error) { return "s", nil }
	pool := &pgxpool.Pool{} // never used: the checks come first
	cases := []struct {
		name  string
		db    idem.TxBeginner
		cfg   idemhttp.Config
		field string
	}{
		{"nil database", nil, idemhttp.Config{Scope: scope}, "NewMiddleware"},
		{"nil scope", pool, idemhttp.Config{}, "Config.Scope"},
		{"empty method list", pool, idemhttp.Config{Scope: scope, Methods: []string{}}, "Config.Methods"},
		{"method with a space", pool, idemhttp.Config{Scope: scope, Methods: []string{"POST "}}, "Config.Methods"},
		{"empty method", pool, idemhttp.Config{Scope: scope, Methods: []string{"POST", ""}}, "Config.Methods"},
		{"header with a space", pool, idemhttp.Config{Scope: scope, Header: "Idempotency Key"}, "Config.Header"},
		{"header with a colon", pool, idemhttp.Config{Scope: scope, Header: "Idempotency-Key:"}, "Config.Header"},
		{"negative retention", pool, idemhttp.Config{Scope: scope, Retention: -time.Second}, "Config.Retention"},
		// idem wants at least a microsecond, the resolution of PostgreSQL's
		// timestamps: accepted here, every keyed request would answer 500.
		{"sub-microsecond retention", pool, idemhttp.Config{Scope: scope, Retention: 500 * time.Nanosecond}, "Config.Retention"},
		// Past what lock_timeout can express, idem refuses the wait.
		{"wait too long", pool, idemhttp.Config{Scope: scope, Wait: math.MaxInt32*time.Millisecond + time.Millisecond}, "Config.Wait"},
		// The stored size, base64 and an allowance for headers, would wrap.
		{"largest response", pool, idemhttp.Config{Scope: scope, MaxResponseBytes: math.MaxInt}, "Config.MaxResponseBytes"},
		{"top quarter response", pool, idemhttp.Config{Scope: scope, MaxResponseBytes: math.MaxInt/4*3 + 1}, "Config.MaxResponseBytes"},
		// Sealed, the stored form is base64 twice over: a limit that fits
		// without a codec wraps with one.
		{"largest response sealed", pool, idemhttp.Config{Scope: scope, MaxResponseBytes: math.MaxInt / 3 * 2, Codec: &xorCodec{}}, "Config.MaxResponseBytes"},
		{"replay header with a space", pool, idemhttp.Config{Scope: scope, ReplayHeaders: []string{"Location", "X Trace"}}, "Config.ReplayHeaders"},
		{"relative problem type", pool, idemhttp.Config{Scope: scope, ProblemTypeBase: "errors#"}, "Config.ProblemTypeBase"},
		{"path-only problem type", pool, idemhttp.Config{Scope: scope, ProblemTypeBase: "/docs/errors#"}, "Config.ProblemTypeBase"},
		{"problem type with a space", pool, idemhttp.Config{Scope: scope, ProblemTypeBase: "https://example.com/a b#"}, "Config.ProblemTypeBase"},
		{"problem type with angle brackets", pool, idemhttp.Config{Scope: scope, ProblemTypeBase: "https://example.com/<x>#"}, "Config.ProblemTypeBase"},
		{"problem type that is no URI", pool, idemhttp.Config{Scope: scope, ProblemTypeBase: "::"}, "Config.ProblemTypeBase"},
		{"unknown isolation level", pool, idemhttp.Config{Scope: scope, TxOptions: pgx.TxOptions{IsoLevel: "snapshot"}}, "Config.TxOptions.IsoLevel"},
		// idem records keys only in read-write transactions.
		{"read-only transaction", pool, idemhttp.Config{Scope: scope, TxOptions: pgx.TxOptions{AccessMode: pgx.ReadOnly}}, "Config.TxOptions.AccessMode"},
		{"unknown access mode", pool, idemhttp.Config{Scope: scope, TxOptions: pgx.TxOptions{AccessMode: "read mostly"}}, "Config.TxOptions.AccessMode"},
		{"unknown deferrable mode", pool, idemhttp.Config{Scope: scope, TxOptions: pgx.TxOptions{DeferrableMode: "later"}}, "Config.TxOptions.DeferrableMode"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			m, err := idemhttp.NewMiddleware(c.db, c.cfg)
			if m != nil || !errors.Is(err, idem.ErrInvalidOption) {
				t.Fatalf("NewMiddleware = %v, %v; want nil and an error wrapping idem.ErrInvalidOption", m, err)
			}
			if want := "idemhttp: " + c.field + ": "; !strings.HasPrefix(err.Error(), want) {
				t.Fatalf("error %q does not start with %q", err, want)
			}
			// New panics with the very error NewMiddleware returns.
			defer func() {
				p, _ := recover().(error)
				if !errors.Is(p, idem.ErrInvalidOption) || p.Error() != err.Error() {
					t.Fatalf("New panicked with %v, want NewMiddleware's error %q", p, err)
				}
			}()
			idemhttp.MustNew(c.db, c.cfg)
		})
	}
}

func TestNegativeMeansNone(t *testing.T) {
	t.Run("no wait", func(t *testing.T) {
		ctx, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{Wait: -1}, payHandler(&calls))
		// An open transaction holds the key's claim until it ends: only a
		// request that does not wait at all is answered while it is open.
		holder, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Rollback(ctx)
		if _, err := idem.Do(ctx, holder, tenant, "held", nil, func(context.Context, pgx.Tx) (int, error) { return 0, nil }); err != nil {
			t.Fatal(err)
		}
		busy := post(t, srv, "/payments", tenant, "held", `{"amount_cents":100}`)
		wantProblem(t, busy, http.StatusConflict, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemKeyInProgress)
		if got := busy.header.Get("Retry-After"); got != "1" {
			t.Fatalf("Retry-After %q, want 1", got)
		}
		if calls.Load() != 0 {
			t.Fatalf("handler ran %d times under a held key", calls.Load())
		}
	})
	t.Run("no size limits", func(t *testing.T) {
		_, pool, tenant := setup(t)
		var calls atomic.Int64
		srv := serve(t, pool, idemhttp.Config{MaxBodyBytes: -1, MaxResponseBytes: -1},
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				_, _ = io.Copy(w, r.Body)
			}))
		// Past both defaults, 1 MiB: accepted, stored and replayed whole.
		body := `"` + strings.Repeat("x", idemhttp.DefaultMaxBodyBytes+1) + `"`
		first := post(t, srv, "/echo", tenant, "big", body)
		replay := post(t, srv, "/echo", tenant, "big", body)
		if first.status != http.StatusOK || string(first.body) != body {
			t.Fatalf("first: %d with %d bytes, want 200 echoing %d", first.status, len(first.body), len(body))
		}
		if !replay.replayed() {
			t.Fatalf("second: %d %.100s, want a replay", replay.status, replay.body)
		}
		sameAnswer(t, replay, first, "Content-Length")
		if calls.Load() != 1 {
			t.Fatalf("handler ran %d times, want 1", calls.Load())
		}
	})
}
