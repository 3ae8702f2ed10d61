package interop

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

const tenantHeader = "X-Tenant"

// service is an idemhttp payments endpoint behind a proxy that loses every
// other answer after the endpoint gave it, answering 502 instead. It
// records the key of every request that reaches the endpoint, by amount.
type service struct {
	url    string
	pool   *pgxpool.Pool
	tenant string

	mu   sync.Mutex
	keys map[string][]string // amount -> the key field of each request
}

// setup marks the test parallel and starts a service of its own.
func setup(t *testing.T) *service {
	t.Helper()
	t.Parallel()
	s := &service{pool: env.Pool(t), tenant: testdb.Name("tenant"), keys: make(map[string][]string)}
	mw := idemhttp.MustNew(s.pool, idemhttp.Config{
		Scope:    func(r *http.Request) (string, error) { return r.Header.Get(tenantHeader), nil },
		Required: true,
	})
	pay := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		amount, err := strconv.ParseInt(r.URL.Query().Get("amount"), 10, 64)
		if err != nil {
			http.Error(w, "amount must be an integer", http.StatusBadRequest)
			return
		}
		var id int64
		err = idemhttp.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			idemhttp.Scope(r.Context()), idemhttp.Key(r.Context()), amount).Scan(&id)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "payment %d of %d", id, amount)
	}))
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		amount := r.URL.Query().Get("amount")
		s.keys[amount] = append(s.keys[amount], r.Header.Get(idemhttp.DefaultHeader))
		s.mu.Unlock()
		pay.ServeHTTP(w, r)
	}))
	t.Cleanup(server.Close)

	var answers atomic.Int64
	upstream := &http.Transport{}
	t.Cleanup(upstream.CloseIdleConnections)
	target := server.URL
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, err := http.NewRequestWithContext(r.Context(), r.Method, target+r.URL.RequestURI(), r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		req.Header = r.Header.Clone()
		resp, err := upstream.RoundTrip(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil || answers.Add(1)%2 == 1 {
			http.Error(w, "answer lost", http.StatusBadGateway)
			return
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(body)
	}))
	t.Cleanup(proxy.Close)
	s.url = proxy.URL
	return s
}

// retryable returns a go-retryablehttp client with short waits that sends
// over base, and logs nothing.
func retryable(t *testing.T, base http.RoundTripper) *retryablehttp.Client {
	c := retryablehttp.NewClient()
	c.Logger = nil
	c.RetryWaitMin, c.RetryWaitMax, c.RetryMax = time.Millisecond, 10*time.Millisecond, 4
	c.HTTPClient = &http.Client{Transport: base}
	t.Cleanup(c.HTTPClient.CloseIdleConnections)
	return c
}

// check fails the test unless each amount's requests, retries included,
// reached the endpoint with one key, and the number of payments is want.
func (s *service) check(t *testing.T, amounts []string, want int) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, amount := range amounts {
		keys := s.keys[amount]
		if len(keys) < 2 {
			t.Fatalf("the payment of %s reached the endpoint %d times: nothing was retried", amount, len(keys))
		}
		for _, k := range keys {
			if k == "" || k != keys[0] {
				t.Fatalf("the payment of %s was sent with the keys %q, want one key", amount, keys)
			}
		}
	}
	var payments int
	if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM payment WHERE scope = $1`, s.tenant).Scan(&payments); err != nil {
		t.Fatal(err)
	}
	if payments != want {
		t.Fatalf("%d payments, want %d", payments, want)
	}
}

// pay sends a payment of amount with do and checks that it got a 201.
func (s *service) pay(t *testing.T, amount string, key string, do func(*http.Request) (*http.Response, error)) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, s.url+"/payments?amount="+amount, strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(tenantHeader, s.tenant)
	if key != "" {
		req.Header.Set(idemhttp.DefaultHeader, key)
	}
	resp, err := do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated || !strings.HasSuffix(string(body), " of "+amount) {
		t.Fatalf("payment of %s: got %d %q", amount, resp.StatusCode, body)
	}
}

// doRetryable returns what sends a request through c.
func doRetryable(c *retryablehttp.Client) func(*http.Request) (*http.Response, error) {
	return func(req *http.Request) (*http.Response, error) {
		r, err := retryablehttp.FromRequest(req)
		if err != nil {
			return nil, err
		}
		return c.Do(r)
	}
}

var amounts = []string{"100", "200", "300", "400", "500", "600"}

// With the Transport outside, go-retryablehttp is its Base: every retry of
// go-retryablehttp's carries the key that the Transport set.
func TestTransportOnTopOfRetryablehttpKeepsOneKey(t *testing.T) {
	s := setup(t)
	inner := retryable(t, &http.Transport{})
	// One attempt of the Transport's own: every retry is go-retryablehttp's.
	client := &http.Client{Transport: &idemhttp.Transport{
		Base:        &retryablehttp.RoundTripper{Client: inner},
		MaxAttempts: 1,
	}}
	for _, amount := range amounts {
		s.pay(t, amount, "", client.Do)
	}
	s.check(t, amounts, len(amounts))
}

// With go-retryablehttp outside, each of its attempts is a new request to
// the Transport inside, which never modifies the caller's request: the
// caller sets the key, and both keep it.
func TestRetryablehttpOnTopOfTransportNeedsTheKeySetOutside(t *testing.T) {
	t.Parallel()
	t.Run("key set on the request", func(t *testing.T) {
		s := setup(t)
		do := doRetryable(retryable(t, &idemhttp.Transport{MaxAttempts: 1}))
		for _, amount := range amounts {
			s.pay(t, amount, testdb.Name("order"), do)
		}
		s.check(t, amounts, len(amounts))
	})

	t.Run("no key: each retry is another operation", func(t *testing.T) {
		s := setup(t)
		do := doRetryable(retryable(t, &idemhttp.Transport{MaxAttempts: 1}))
		s.pay(t, "100", "", do)
		s.mu.Lock()
		keys := s.keys["100"]
		s.mu.Unlock()
		if len(keys) != 2 || keys[0] == keys[1] {
			t.Fatalf("keys %q: want two attempts with two keys, as docs/http.md warns", keys)
		}
		var payments int
		if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM payment WHERE scope = $1`, s.tenant).Scan(&payments); err != nil {
			t.Fatal(err)
		}
		if payments != 2 {
			t.Fatalf("%d payments, want the 2 that the warning is about", payments)
		}
	})
}
