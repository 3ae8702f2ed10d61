package idemhttp_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

// The crash test runs a flow in a crash child (testdb.CrashChild), which
// kills itself once the provider answered its call and before the answer
// is recorded. The provider is an HTTP server of the parent's.
const transportCrashEnv = "IDEMHTTP_TRANSPORT_CRASH"

// transportCrashJob is what the child runs.
type transportCrashJob struct{ Provider, Flow, Scope, Key string }

func init() {
	testdb.CrashChild(transportCrashEnv, func(ctx context.Context, pool *pgxpool.Pool, j transportCrashJob) error {
		_, err := chargeFlow(j.Flow, j.Provider, testdb.KillSelf).Run(ctx, pool, j.Scope, j.Key, nil, 2500)
		return err
	})
}

// chargeFlow is a flow of one call, a charge at the provider over a
// Transport that sends the call's provider key; its function never names
// the key. afterAnswer, when set, runs once the provider answered.
func chargeFlow(name, providerURL string, afterAnswer func()) *idem.Flow[int64, string] {
	client := &http.Client{Transport: &idemhttp.Transport{UseProviderKey: true, BaseDelay: -1}}
	return idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		return idem.Call(s, "charge", func(ctx context.Context, _ string) (string, error) {
			id, err := postCharge(ctx, client, providerURL, amount, nil)
			if err == nil && afterAnswer != nil {
				afterAnswer()
			}
			return id, err
		})
	}, idem.WithLease(2*time.Second))
}

// postCharge posts a charge of amount to the provider, with the header
// fields in fields, and returns the charge's id.
func postCharge(ctx context.Context, client *http.Client, providerURL string, amount int64, fields http.Header) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, providerURL, strings.NewReader(strconv.FormatInt(amount, 10)))
	if err != nil {
		return "", err
	}
	for name, values := range fields {
		req.Header[name] = values
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("the provider answered %d %s", resp.StatusCode, body)
	}
	return string(body), nil
}

// keyedProvider is a provider that honours idempotency keys, under the
// header field it is given: a request with a key it has seen gets the
// charge it made for it. It records the key of every request.
type keyedProvider struct {
	header string
	url    string

	mu      sync.Mutex
	keys    []string
	charges map[string]string
}

func newKeyedProvider(t *testing.T, header string) *keyedProvider {
	p := &keyedProvider{header: header, charges: map[string]string{}}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	p.url = srv.URL
	return p
}

func (p *keyedProvider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(p.header)
	p.mu.Lock()
	p.keys = append(p.keys, key)
	id, ok := p.charges[key]
	if !ok {
		id = "ch_" + strconv.Itoa(len(p.charges)+1)
		p.charges[key] = id
	}
	p.mu.Unlock()
	_, _ = io.WriteString(w, id)
}

// seen returns the key of every request the provider got, and how many
// charges it made.
func (p *keyedProvider) seen() ([]string, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.keys...), len(p.charges)
}

func TestTransportSendsAFlowCallsProviderKeyAgainAfterACrash(t *testing.T) {
	ctx, pool, scope := setup(t)
	p := newKeyedProvider(t, idemhttp.DefaultHeader)
	name := testdb.Name("charge")

	testdb.RunCrashChild(t, ctx, transportCrashEnv, env.URL(t), transportCrashJob{Provider: p.url, Flow: name, Scope: scope, Key: "k"})
	if keys, charges := p.seen(); len(keys) != 1 || charges != 1 {
		t.Fatalf("before the retry the provider saw the keys %q, made %d charges; want one request", keys, charges)
	}

	// The retry waits for the dead executor's lease to run out, and
	// calls again: the provider recognises the key.
	res, err := chargeFlow(name, p.url, nil).Run(ctx, pool, scope, "k", nil, 2500, idem.WithWait(time.Minute))
	if err != nil || res.Replayed || res.Value != "ch_1" {
		t.Fatalf("the retry: %+v, %v; want the flow completed now with the charge the provider made before the crash", res, err)
	}
	want := testdb.FlowStep(t, ctx, pool, scope, "k", "charge").ProviderKey
	keys, charges := p.seen()
	if len(keys) != 2 || keys[0] != want || keys[1] != want || charges != 1 {
		t.Fatalf("the provider saw the keys %q and made %d charges; want the call's provider key %q twice, one charge", keys, charges, want)
	}
}

func TestTransportSendsTheProviderKeyUnderTheProvidersHeader(t *testing.T) {
	ctx, pool, scope := setup(t)
	p := newKeyedProvider(t, "Cko-Idempotency-Key")
	client := &http.Client{Transport: &idemhttp.Transport{UseProviderKey: true, Header: "Cko-Idempotency-Key"}}
	var safe *http.Request
	flow := idem.MustNewFlow(testdb.Name("cko"), func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		return idem.Call(s, "charge", func(ctx context.Context, _ string) (string, error) {
			id, err := postCharge(ctx, client, p.url, amount, nil)
			if err != nil {
				return "", err
			}
			// A safe request, such as a lookup's, gets no key.
			resp, err := (&http.Client{Transport: &idemhttp.Transport{UseProviderKey: true, Header: "Cko-Idempotency-Key",
				Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
					safe = r
					return http.DefaultTransport.RoundTrip(r)
				})}}).Get(p.url + "/lookup")
			if err != nil {
				return "", err
			}
			resp.Body.Close()
			return id, nil
		})
	})
	if _, err := flow.Run(ctx, pool, scope, "k", nil, 100); err != nil {
		t.Fatal(err)
	}
	want := testdb.FlowStep(t, ctx, pool, scope, "k", "charge").ProviderKey
	if keys, _ := p.seen(); len(keys) != 2 || keys[0] != want || keys[1] != "" {
		t.Fatalf("the provider saw Cko-Idempotency-Key %q; want the call's provider key %q, as it is, then none on the GET", keys, want)
	}
	if safe == nil || len(safe.Header.Values("Cko-Idempotency-Key")) != 0 {
		t.Fatal("the GET was not sent, or was sent with a key")
	}
}

func TestTransportRefusesAFlowCallsRequestThatCarriesAnotherKey(t *testing.T) {
	ctx, pool, scope := setup(t)
	p := newKeyedProvider(t, idemhttp.DefaultHeader)
	client := &http.Client{Transport: &idemhttp.Transport{UseProviderKey: true}}
	// The first run sets a key of its own; the next one sets the call's
	// own, which is kept.
	var run atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("other-key"), func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		return idem.Call(s, "send", func(ctx context.Context, providerKey string) (string, error) {
			key := "a-key-of-its-own"
			if run.Add(1) > 1 {
				key = providerKey
			}
			return postCharge(ctx, client, p.url, amount, http.Header{idemhttp.DefaultHeader: {key}})
		}, idem.AtMostOnce())
	})
	_, err := flow.Run(ctx, pool, scope, "k", nil, 100)
	for _, want := range []error{idemhttp.ErrKeyConflict, idem.ErrInvalidKey, idem.ErrNotSent, idem.ErrFlowIncomplete} {
		if !errors.Is(err, want) {
			t.Fatalf("a request with another key: %v; want an error that wraps %v", err, want)
		}
	}
	if keys, _ := p.seen(); len(keys) != 0 {
		t.Fatalf("the provider got %q; want nothing sent", keys)
	}
	// Refused before it was sent, the at-most-once call is not one that
	// may have been applied: the next run makes it, rather than stop.
	if step := testdb.FlowStep(t, ctx, pool, scope, "k", "send"); step.State != "unsent" {
		t.Fatalf("the call's state is %q after its request was refused; want unsent", step.State)
	}
	res, err := flow.Run(ctx, pool, scope, "k", nil, 100)
	want := testdb.FlowStep(t, ctx, pool, scope, "k", "send").ProviderKey
	if keys, _ := p.seen(); err != nil || res.Value != "ch_1" || len(keys) != 1 || keys[0] != want {
		t.Fatalf("the next run: %+v, %v, keys %q; want the call made once, with its key %q", res, err, keys, want)
	}
}

// keylessProvider is a provider that ignores idempotency keys: it charges
// every request it reads, and answers the first with 502, as a gateway
// that lost the answer does. It records the key field of each request.
type keylessProvider struct {
	mu      sync.Mutex
	keys    [][]string
	charges int
}

func (p *keylessProvider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	p.mu.Lock()
	p.charges++
	n := p.charges
	p.keys = append(p.keys, r.Header.Values(idemhttp.DefaultHeader))
	p.mu.Unlock()
	if n == 1 {
		http.Error(w, "bad gateway", http.StatusBadGateway)
		return
	}
	_, _ = io.WriteString(w, "ch_"+strconv.Itoa(n))
}

func (p *keylessProvider) seen() ([][]string, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([][]string(nil), p.keys...), p.charges
}

// A flow's call whose requests carry no key (the Transport without
// UseProviderKey, for a provider that ignores keys) is made once per
// attempt of the call: the Transport retries none of its answers, and
// sends no key of its own, which would let net/http send it again by
// itself. What happens next is the flow's to decide: an AtMostOnce call
// that may have been applied stops for a person, rather than charge
// twice.
func TestTransportSendsAFlowCallsRequestWithoutAKeyOnce(t *testing.T) {
	ctx, pool, scope := setup(t)
	p := &keylessProvider{}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	client := &http.Client{Transport: &idemhttp.Transport{BaseDelay: -1}}
	flow := idem.MustNewFlow(testdb.Name("keyless"), func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		return idem.Call(s, "charge", func(ctx context.Context, _ string) (string, error) {
			return postCharge(ctx, client, srv.URL, amount, nil)
		}, idem.AtMostOnce())
	})
	_, err := flow.Run(ctx, pool, scope, "k", nil, 100)
	if !errors.Is(err, idem.ErrFlowIncomplete) || errors.Is(err, idem.ErrNotSent) {
		t.Fatalf("the first run: %v; want the call's 502, incomplete and uncertain", err)
	}
	if keys, charges := p.seen(); charges != 1 || len(keys[0]) != 0 {
		t.Fatalf("the provider charged %d times, the keys %q; want one request, without a key", charges, keys)
	}
	if _, err := flow.Run(ctx, pool, scope, "k", nil, 100); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the next run: %v; want the at-most-once call that may have been applied stopped for a person", err)
	}
	if _, charges := p.seen(); charges != 1 {
		t.Fatalf("the provider charged %d times; want once", charges)
	}
}

// A request of a flow's call without a key is not one that net/http sends
// again by itself when its kept-alive connection breaks after the server
// read it: that needs a key field, which the Transport does not set.
func TestTransportSendsNoKeyThatNetHTTPWouldReSendAFlowCallsRequestOn(t *testing.T) {
	ctx, pool, scope := setup(t)
	var reads atomic.Int64
	// The first request is answered on a kept-alive connection; the
	// second goes out on it, is read, and the connection is cut.
	addr := rawServer(t, func(_ int, conn net.Conn, _ net.Listener) {
		r := bufio.NewReader(conn)
		for n := 0; ; n++ {
			if readRequest(r) != nil {
				return
			}
			if reads.Add(1); n == 1 {
				return
			}
			_, _ = io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nch_1")
		}
	})
	client := &http.Client{Transport: &idemhttp.Transport{Base: &http.Transport{}, BaseDelay: -1}}
	flow := idem.MustNewFlow(testdb.Name("keyless-resend"), func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		for _, step := range []string{"first", "second"} {
			if _, err := idem.Call(s, step, func(ctx context.Context, _ string) (string, error) {
				return postCharge(ctx, client, "http://"+addr+"/pay", amount, nil)
			}); err != nil {
				return "", err
			}
		}
		return "done", nil
	})
	if _, err := flow.Run(ctx, pool, scope, "k", nil, 100); !errors.Is(err, idem.ErrFlowIncomplete) || errors.Is(err, idem.ErrNotSent) {
		t.Fatalf("the run: %v; want the second call cut, incomplete and uncertain", err)
	}
	if n := reads.Load(); n != 2 {
		t.Fatalf("the provider read %d requests; want 2: the second sent once", n)
	}
}
