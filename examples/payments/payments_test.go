package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemtest"
	"github.com/pgidem/idem/outbox"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// lossyProxy passes requests on to target and drops every dropEvery-th
// answer after target gave it, answering 502 instead: the client cannot
// tell whether its request was applied, and retries.
type lossyProxy struct {
	target    string
	dropEvery int64
	passed    atomic.Int64 // requests passed on to target
	dropped   atomic.Int64 // answers dropped
}

func (p *lossyProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req, err := http.NewRequestWithContext(r.Context(), r.Method, p.target+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if n := p.passed.Add(1); err != nil || n%p.dropEvery == 0 {
		p.dropped.Add(1)
		http.Error(w, "answer lost", http.StatusBadGateway)
		return
	}
	for name, values := range resp.Header {
		w.Header()[name] = values
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(answer)
}

// setup runs the service on a database of its own, its API and its
// receiver behind lossy proxies, until the test ends. It returns the
// service's pool, the API's URL, and the two proxies.
func setup(t *testing.T) (pool *pgxpool.Pool, apiURL string, api, receiver *lossyProxy) {
	t.Helper()
	t.Parallel()
	pool = idemtest.Pool(t)
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	apiLn, receiverLn := listen(), listen()
	api = &lossyProxy{target: "http://" + apiLn.Addr().String(), dropEvery: 5}
	receiver = &lossyProxy{target: "http://" + receiverLn.Addr().String(), dropEvery: 5}
	apiProxy, receiverProxy := httptest.NewServer(api), httptest.NewServer(receiver)
	t.Cleanup(apiProxy.Close)
	t.Cleanup(receiverProxy.Close)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	cfg := config{
		DatabaseURL: pool.Config().ConnString(),
		WebhookURL:  receiverProxy.URL + "/webhooks/payments",
		// Retry lost webhooks soon: the test waits for all of them.
		Relay: outbox.Config{
			RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 100 * time.Millisecond, PollInterval: 50 * time.Millisecond,
			Logger: slog.New(slog.DiscardHandler), // the lost answers' retries, by design
		},
	}
	go func() { done <- run(ctx, cfg, apiLn, receiverLn) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("the service stopped with %v", err)
		}
	})
	return pool, apiProxy.URL, api, receiver
}

// answer is what a client finally got for a request.
type answer struct {
	status  int
	payment Payment
}

// post sends a payment request with key until it gets an answer it must
// not retry, as a client should: it retries network errors, 5xx and 409
// with Retry-After (the same key still running), and nothing else.
func post(ctx context.Context, url, merchant, key string, req PaymentRequest) (answer, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return answer{}, err
	}
	for attempt := 1; attempt <= 100; attempt++ {
		r, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/payments", bytes.NewReader(body))
		if err != nil {
			return answer{}, err
		}
		r.Header.Set("Authorization", "Bearer "+merchant)
		r.Header.Set("Idempotency-Key", key)
		r.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			if ctx.Err() != nil {
				return answer{}, err
			}
			continue
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		retry := resp.StatusCode >= 500 || (resp.StatusCode == http.StatusConflict && resp.Header.Get("Retry-After") != "")
		if err != nil || retry {
			time.Sleep(time.Duration(attempt) * time.Millisecond)
			continue
		}
		a := answer{status: resp.StatusCode}
		if resp.StatusCode < 300 {
			if err := json.Unmarshal(b, &a.payment); err != nil {
				return answer{}, fmt.Errorf("%d %s: %w", resp.StatusCode, b, err)
			}
		}
		return a, nil
	}
	return answer{}, errors.New("no answer after 100 attempts")
}

func count(t *testing.T, pool *pgxpool.Pool, sql string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// TestEveryPaymentIsRecordedOnceAndReachesTheReceiverOnce pays orders
// through a proxy that loses every fifth answer after the service gave
// it, some requests sent twice at once and some orders asked for again
// with another key, while another such proxy loses every fifth of the
// relay's webhook answers: each order has one payment, every answer for
// it names that payment, and the receiver applied each webhook once.
func TestEveryPaymentIsRecordedOnceAndReachesTheReceiverOnce(t *testing.T) {
	pool, url, api, receiver := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	const orders = 40
	answers := make([][]answer, orders)
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, 3*orders)
	sem := make(chan struct{}, 8) // clients at once
	for i := range orders {
		req := PaymentRequest{OrderID: fmt.Sprintf("order-%d", i), AmountCents: int64(100 + i), Currency: "EUR"}
		send := func(key string) {
			sem <- struct{}{}
			defer func() { <-sem }()
			a, err := post(ctx, url, "merchant-1", key, req)
			if err != nil {
				errs <- fmt.Errorf("%s, key %s: %w", req.OrderID, key, err)
				return
			}
			mu.Lock()
			answers[i] = append(answers[i], a)
			mu.Unlock()
		}
		key := fmt.Sprintf("key-%d", i)
		wg.Go(func() {
			var inner sync.WaitGroup
			inner.Go(func() { send(key) })
			if i%4 == 0 { // a double submit: the same request twice at once
				inner.Go(func() { send(key) })
			}
			inner.Wait()
			if i%6 == 0 { // the same order again, from a request with a key of its own
				send(key + "-again")
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}

	for i, as := range answers {
		for _, a := range as {
			if (a.status != http.StatusCreated && a.status != http.StatusOK) || a.payment.ID != as[0].payment.ID {
				t.Errorf("order-%d: answers %+v; want every one to name the same payment", i, as)
				break
			}
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM payment`); n != orders {
		t.Fatalf("%d payments for %d orders", n, orders)
	}
	if api.dropped.Load() == 0 {
		t.Fatal("the proxy lost no answer: no client retried")
	}

	// Every webhook delivered, none parked.
	for {
		s, err := idem.ReadStats(ctx, pool)
		if err != nil {
			t.Fatal(err)
		}
		if s.OutboxParked > 0 {
			t.Fatalf("%d webhooks parked", s.OutboxParked)
		}
		if s.OutboxPending == 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d webhooks still pending: %v", s.OutboxPending, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM ledger_entry`); n != orders {
		t.Fatalf("the receiver applied %d webhooks for %d payments", n, orders)
	}
	if n := count(t, pool, `SELECT count(*) FROM payment p JOIN ledger_entry l ON l.payment_id = p.id AND l.order_id = p.order_id AND l.amount_cents = p.amount_cents`); n != orders {
		t.Fatalf("%d ledger entries match their payment, of %d", n, orders)
	}
	if receiver.passed.Load() <= orders {
		t.Fatalf("the receiver got %d webhooks for %d payments: the relay retried none", receiver.passed.Load(), orders)
	}
}

// TestAnOrderIsPaidOnceWithOneAmount asks for an order already paid with
// another amount: 409, the first payment kept, and the answer stored for
// the second request's key.
func TestAnOrderIsPaidOnceWithOneAmount(t *testing.T) {
	pool, url, _, _ := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	first, err := post(ctx, url, "merchant-2", "k1", PaymentRequest{OrderID: "o-1", AmountCents: 500, Currency: "EUR"})
	if err != nil || first.status != http.StatusCreated {
		t.Fatalf("first: %+v, %v", first, err)
	}
	for range 2 { // and its retry gets the stored answer
		other, err := post(ctx, url, "merchant-2", "k2", PaymentRequest{OrderID: "o-1", AmountCents: 900, Currency: "EUR"})
		if err != nil || other.status != http.StatusConflict {
			t.Fatalf("the order with another amount: %+v, %v; want 409", other, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM payment WHERE amount_cents = 900`); n != 0 {
		t.Fatalf("%d payments of the second amount", n)
	}
	// The payment is the caller's: the handler took the merchant from
	// idemhttp.Scope.
	if n := count(t, pool, `SELECT count(*) FROM payment WHERE merchant = 'merchant-2' AND order_id = 'o-1'`); n != 1 {
		t.Fatalf("%d payments of order o-1 recorded for merchant-2, want 1", n)
	}
}
