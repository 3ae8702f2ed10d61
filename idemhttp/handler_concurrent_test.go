package idemhttp_test

import (
	"bytes"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

// blockingHandler inserts a payment and reports its backend's pid on
// started, then answers only once release is closed. Its first run answers
// firstStatus; later runs answer 201.
type blockingHandler struct {
	tenant      string
	firstStatus int
	calls       atomic.Int64
	started     chan int32
	release     chan struct{}
	releaseOnce sync.Once
}

func newBlockingHandler(t *testing.T, tenant string, firstStatus int) *blockingHandler {
	h := &blockingHandler{tenant: tenant, firstStatus: firstStatus, started: make(chan int32, 10), release: make(chan struct{})}
	// Never leave a handler blocked: the server waits for it to close.
	t.Cleanup(h.unblock)
	return h
}

func (h *blockingHandler) unblock() { h.releaseOnce.Do(func() { close(h.release) }) }

// awaitStarted returns the pid that the handler reports once it has
// started on the request answered by first. It fails the test at once when
// that request is answered without the handler having started (the
// database cannot be reached, say), and after a minute when neither
// happens, rather than wait forever.
func (h *blockingHandler) awaitStarted(t *testing.T, first <-chan response) int32 {
	t.Helper()
	select {
	case pid := <-h.started:
		return pid
	case res := <-first:
		t.Fatalf("first request answered %d %s before its handler started", res.status, res.body)
	case <-time.After(time.Minute):
		t.Fatal("the first request's handler did not start within a minute")
	}
	return 0
}

func (h *blockingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	tx := idemhttp.Tx(r.Context())
	var pid int32
	err := tx.QueryRow(r.Context(), `SELECT pg_backend_pid()`).Scan(&pid)
	if err == nil {
		_, err = tx.Exec(r.Context(), `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 100)`, h.tenant)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	h.started <- pid
	<-h.release
	status := http.StatusCreated
	if n == 1 {
		status = h.firstStatus
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, "run %d answered %d", n, status)
}

// sendAsync sends req on its own goroutine and delivers the answer.
func sendAsync(client *http.Client, req *http.Request) <-chan response {
	out := make(chan response, 1)
	go func() {
		res, err := fetch(client, req)
		if err != nil {
			res = response{status: -1, body: []byte(err.Error())}
		}
		out <- res
	}()
	return out
}

func TestConcurrentDuplicateWaitsAndReplays(t *testing.T) {
	ctx, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusCreated)
	srv := serve(t, pool, idemhttp.Config{Wait: time.Minute}, h)

	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	pid := h.awaitStarted(t, firstDone)
	secondDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	testdb.WaitForBlocked(ctx, t, pool, pid)
	h.unblock()

	first, second := <-firstDone, <-secondDone
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d %s replayed=%v", first.status, first.body, first.replayed())
	}
	if !second.replayed() {
		t.Fatalf("second: %d %s, want a replay of the first", second.status, second.body)
	}
	sameAnswer(t, second, first)
	if h.calls.Load() != 1 || countPayments(t, pool, tenant) != 1 {
		t.Fatalf("handler ran %d times, want 1", h.calls.Load())
	}
}

func TestConcurrentDuplicateRunsWhenFirstRollsBack(t *testing.T) {
	ctx, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusInternalServerError)
	srv := serve(t, pool, idemhttp.Config{Wait: time.Minute}, h)

	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	pid := h.awaitStarted(t, firstDone)
	secondDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	testdb.WaitForBlocked(ctx, t, pool, pid)
	h.unblock()

	if first := <-firstDone; first.status != http.StatusInternalServerError {
		t.Fatalf("first: %d %s, want its own 500", first.status, first.body)
	}
	second := <-secondDone
	if second.status != http.StatusCreated || second.replayed() || string(second.body) != "run 2 answered 201" {
		t.Fatalf("second: %d %q replayed=%v, want its own run", second.status, second.body, second.replayed())
	}
	if countPayments(t, pool, tenant) != 1 {
		t.Fatalf("%d payments, want only the second run's", countPayments(t, pool, tenant))
	}
}

func TestConcurrentDuplicatePastWaitGets409(t *testing.T) {
	_, pool, tenant := setup(t)
	h := newBlockingHandler(t, tenant, http.StatusCreated)
	srv := serve(t, pool, idemhttp.Config{Wait: 50 * time.Millisecond}, h)

	firstDone := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "k", `{}`))
	h.awaitStarted(t, firstDone)
	// The first request holds the key until released, so this one's wait
	// runs out whatever the machine's speed.
	busy := post(t, srv, "/payments", tenant, "k", `{}`)
	wantProblem(t, busy, http.StatusConflict, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemKeyInProgress)
	if busy.header.Get("Retry-After") != "1" {
		t.Fatalf("Retry-After %q, want 1", busy.header.Get("Retry-After"))
	}
	h.unblock()

	first := <-firstDone
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	later := post(t, srv, "/payments", tenant, "k", `{}`)
	if !later.replayed() {
		t.Fatalf("later retry: %d %s, want a replay", later.status, later.body)
	}
	sameAnswer(t, later, first)
	if h.calls.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", h.calls.Load())
	}
}

func TestRetryStorm(t *testing.T) {
	_, pool, tenant := setup(t)
	const clients = 100
	var calls atomic.Int64
	pay := payHandler(&calls)
	srv := serve(t, pool, idemhttp.Config{Wait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Hold the claim a while so that the storm piles up on it; the
		// assertions hold however the requests interleave.
		time.Sleep(100 * time.Millisecond)
		pay.ServeHTTP(w, r)
	}))
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	t.Cleanup(client.CloseIdleConnections)

	start := make(chan struct{})
	answers := make([]response, clients)
	errs := make([]error, clients)
	var wg sync.WaitGroup
	for i := range clients {
		req := newPost(t, srv, "/payments", tenant, `"storm-1"`, `{"amount_cents": 4200}`)
		wg.Go(func() {
			<-start
			answers[i], errs[i] = fetch(client, req)
		})
	}
	close(start)
	wg.Wait()

	firsts := 0
	for i, a := range answers {
		if errs[i] != nil {
			t.Fatalf("client %d: %v", i, errs[i])
		}
		if a.status != http.StatusCreated || !bytes.Equal(a.body, answers[0].body) {
			t.Fatalf("client %d got %d %q, client 0 got %d %q", i, a.status, a.body, answers[0].status, answers[0].body)
		}
		if !a.replayed() {
			firsts++
		}
	}
	if firsts != 1 || calls.Load() != 1 || countPayments(t, pool, tenant) != 1 || countRecords(t, pool, tenant) != 1 {
		t.Fatalf("%d first answers, %d runs, %d payments, %d records; want 1 of each",
			firsts, calls.Load(), countPayments(t, pool, tenant), countRecords(t, pool, tenant))
	}
}
