package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/testdb"
)

// TestFailoverIs503WithRetryAfterAndNothingIsStored follows requests
// through a failover, behind a pool on both servers with
// target_session_attrs=read-write: a request in flight when the primary
// dies, one sent while no server accepts writes, and one sent to a
// middleware whose pool reached the standby are each answered 503
// database-unavailable with Retry-After, soon; none is stored. Once the
// standby is promoted, their retries run the handler, and a request
// answered before the failover replays its answer.
func TestFailoverIs503WithRetryAfterAndNothingIsStored(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pair := testdb.StartPair(t, ctx)
	tenant := testdb.Name("tenant")

	var calls atomic.Int64
	var held atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		var id int64
		err := idemhttp.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 100) RETURNING id`,
			r.Header.Get(tenantHeader), idemhttp.Key(r.Context())).Scan(&id)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		// The first "in-flight" request waits, its transaction open, while
		// the primary dies.
		if idemhttp.Key(r.Context()) == "in-flight" && held.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	})
	pool, err := pgxpool.New(ctx, pair.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	srv := serve(t, pool, idemhttp.Config{}, pay)
	// unavailable checks that a request was answered 503 with Retry-After
	// within bound.
	unavailable := func(name string, res response, took time.Duration) {
		t.Helper()
		wantProblem(t, res, http.StatusServiceUnavailable, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemDatabaseUnavailable)
		if res.header.Get("Retry-After") != "1" {
			t.Errorf("%s: Retry-After %q, want 1", name, res.header.Get("Retry-After"))
		}
		// Each server is tried for at most connect_timeout (2s).
		if took > 10*time.Second {
			t.Errorf("%s: answered after %s", name, took)
		}
	}

	paid := post(t, srv, "/payments", tenant, "paid", `{}`)
	if paid.status != http.StatusCreated {
		t.Fatalf("before the failover: %d %s", paid.status, paid.body)
	}
	pair.WaitForReplay(t, ctx)

	inFlight := sendAsync(srv.Client(), newPost(t, srv, "/payments", tenant, "in-flight", `{}`))
	<-entered
	killed := time.Now()
	// An immediate shutdown: every backend is gone when Kill returns, so
	// none can take the request's commit (after a SIGKILL of the
	// postmaster alone, one may, for a moment: see docs/failover.md).
	if err := pair.Primary.Kill(syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	close(release)
	unavailable("the request in flight", <-inFlight, time.Since(killed))

	started := time.Now()
	unavailable("a request with no primary", post(t, srv, "/payments", tenant, "no-primary", `{}`), time.Since(started))

	// A pool without target_session_attrs reaches the standby, which
	// refuses the claim: 503 too, not 500, since a failover ends it.
	onStandby := serve(t, pair.StandbyPool, idemhttp.Config{}, pay)
	started = time.Now()
	unavailable("a request on the standby", post(t, onStandby, "/payments", tenant, "on-standby", `{}`), time.Since(started))

	pair.Promote(t, ctx)
	for _, key := range []string{"in-flight", "no-primary", "on-standby"} {
		retry := retryUntilServed(t, ctx, srv, tenant, key)
		if retry.status != http.StatusCreated || retry.replayed() {
			t.Errorf("%s after the promotion: %d %s, replayed %v; want a first run", key, retry.status, retry.body, retry.replayed())
		}
	}
	again := post(t, srv, "/payments", tenant, "paid", `{}`)
	if !again.replayed() {
		t.Errorf("the request answered before the failover: %d %s, not replayed", again.status, again.body)
	}
	sameAnswer(t, again, paid)
	// "paid" once, "in-flight" twice (the first rolled back with the
	// primary), the others once.
	if calls.Load() != 5 || countPayments(t, pair.StandbyPool, tenant) != 4 || countRecords(t, pair.StandbyPool, tenant) != 4 {
		t.Errorf("handler ran %d times, %d payments, %d records; want 5, 4, 4",
			calls.Load(), countPayments(t, pair.StandbyPool, tenant), countRecords(t, pair.StandbyPool, tenant))
	}
}

// retryUntilServed sends a request with key until the answer is not a
// 503: the pool's connections to the dead primary fail one by one.
func retryUntilServed(t *testing.T, ctx context.Context, srv *httptest.Server, tenant, key string) response {
	t.Helper()
	for {
		res := post(t, srv, "/payments", tenant, key, `{}`)
		if res.status != http.StatusServiceUnavailable || ctx.Err() != nil {
			return res
		}
		time.Sleep(100 * time.Millisecond)
	}
}
