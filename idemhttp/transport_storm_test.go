package idemhttp_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem/idemhttp"
)

// cutProxy stands between a client and a server and spoils some of the
// exchanges, by the count of requests it has received, whatever the speed
// of the machine: of every six, one is dropped before it reaches the
// server, one has its answer cut after the server gave it (the
// connection closes without a byte of it), and one has its answer
// replaced by a 502. The client cannot tell, for any of them, whether the
// server ran the request.
type cutProxy struct {
	target   string
	upstream *http.Client

	received, dropped, cut, replaced atomic.Int64
}

func newCutProxy(t *testing.T, target string) (*cutProxy, string) {
	p := &cutProxy{target: target, upstream: &http.Client{Transport: &http.Transport{}}}
	t.Cleanup(p.upstream.CloseIdleConnections)
	return p, serveHandler(t, p).URL
}

func (p *cutProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := p.received.Add(1)
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	if n%6 == 1 {
		p.dropped.Add(1)
		hangUp(w)
		return
	}
	req, err := http.NewRequestWithContext(r.Context(), r.Method, p.target+r.URL.RequestURI(), strings.NewReader(string(body)))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	req.Header = r.Header.Clone()
	resp, err := p.upstream.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	switch {
	case err != nil:
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	case n%6 == 3:
		p.cut.Add(1)
		hangUp(w)
		return
	case n%6 == 5:
		p.replaced.Add(1)
		http.Error(w, "answer lost", http.StatusBadGateway)
		return
	}
	for name, values := range resp.Header {
		w.Header()[name] = values
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(answer)
}

// hangUp closes the client's connection without answering.
func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	_ = conn.Close()
}

func TestTransportStormThroughCutAnswersLosesAndDoublesNothing(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var runs atomic.Int64
	srv := serve(t, pool, idemhttp.Config{Required: true, Wait: time.Minute}, payHandler(&runs))
	proxy, proxyURL := newCutProxy(t, srv.URL)

	const calls, clients = 200, 16
	base := &http.Transport{MaxIdleConnsPerHost: clients}
	t.Cleanup(base.CloseIdleConnections)
	client := &http.Client{Transport: &idemhttp.Transport{
		Base: base, MaxAttempts: -1, BaseDelay: time.Millisecond, MaxDelay: 20 * time.Millisecond,
	}}

	type result struct {
		res      response
		key      string
		attempts int
		err      error
	}
	results := make([]result, calls)
	next := make(chan int)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for i := range next {
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, proxyURL+"/payments",
					strings.NewReader(fmt.Sprintf(`{"amount_cents": %d}`, i+1)))
				if err != nil {
					results[i].err = err
					continue
				}
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set(tenantHeader, tenant)
				resp, err := client.Do(req)
				if err != nil {
					results[i].err = err
					continue
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				key, attempts := idemhttp.Attempts(resp)
				results[i] = result{response{status: resp.StatusCode, header: resp.Header, body: body}, key, attempts, err}
			}
		})
	}
	for i := range calls {
		next <- i
	}
	close(next)
	wg.Wait()

	attempts, replayed, keys := 0, 0, make(map[string]bool)
	for i, r := range results {
		if r.err != nil {
			t.Fatalf("call %d: %v", i, r.err)
		}
		var p payment
		if err := json.Unmarshal(r.res.body, &p); err != nil || r.res.status != http.StatusCreated || p.AmountCents != int64(i+1) {
			t.Fatalf("call %d got %d %q, want its payment of %d", i, r.res.status, r.res.body, i+1)
		}
		if keys[r.key] {
			t.Fatalf("call %d has the key %q of another call", i, r.key)
		}
		keys[r.key] = true
		attempts += r.attempts
		if r.res.replayed() {
			replayed++
		}
		// The first answer is the stored one: a retry straight to the
		// server replays it, byte for byte.
		stored := post(t, srv, "/payments", tenant, `"`+r.key+`"`, fmt.Sprintf(`{"amount_cents": %d}`, i+1))
		if !stored.replayed() {
			t.Fatalf("call %d: a retry of its key was not replayed: %d %s", i, stored.status, stored.body)
		}
		sameAnswer(t, r.res, stored, "Content-Type", "Location")
		// And its payment is the one row of its key.
		var id int64
		if err := pool.QueryRow(ctx, `SELECT id FROM payment WHERE scope = $1 AND key = $2`, tenant, r.key).Scan(&id); err != nil || id != p.ID {
			t.Fatalf("call %d: the row of its key is %d (%v), its answer says %d", i, id, err, p.ID)
		}
	}
	payments := countPayments(t, pool, tenant)
	lost, doubled := calls-min(payments, calls), max(payments-calls, 0)
	t.Logf("%d logical calls through %d clients: %d attempts by the Transport, %d requests reached the proxy "+
		"(%d re-sent by net/http itself); %d dropped before the server, %d answers cut, %d replaced by 502; "+
		"%d handler runs, %d payments: %d lost, %d doubled; %d calls got a replay, every call the stored answer",
		calls, clients, attempts, proxy.received.Load(), proxy.received.Load()-int64(attempts),
		proxy.dropped.Load(), proxy.cut.Load(), proxy.replaced.Load(), runs.Load(), payments, lost, doubled, replayed)
	if payments != calls {
		t.Fatalf("%d payments for %d calls", payments, calls)
	}
	if proxy.dropped.Load() == 0 || proxy.cut.Load() == 0 || proxy.replaced.Load() == 0 || attempts <= calls {
		t.Fatal("the proxy spoiled nothing, or the Transport retried nothing: the test proves nothing")
	}
}
