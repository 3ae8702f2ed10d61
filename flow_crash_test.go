package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The crash tests run a flow in a child process, this test binary run
// again with crashEnv set (see TestMain), which kills itself, as SIGKILL
// kills a process, at the point the test names: nothing of it gets to
// clean up or give its lease up. The provider is an HTTP server of the
// parent's, so that what it applied outlives the child.

const crashEnv = "IDEM_FLOW_CRASH"

// Where the child kills itself.
const (
	crashAfterCall  = "after-call"  // the provider applied the call; its result is not recorded
	crashBeforeCall = "before-call" // the local step committed; the call was not made
)

// crashJob is what the child runs, passed as JSON in crashEnv.
type crashJob struct {
	URL, Flow, Scope, Key, Provider, At string
}

// crashLease is the crash flows' lease: after a crash, the retry waits for
// it to run out. It is long enough that the child, which renews it at each
// step, does not lose it to a stall of a loaded machine before it reaches
// its crash point (300ms did, under -race at a load of 20).
const crashLease = 2 * time.Second

// crashFlow is the flow the child and the parent run: reserve a payment,
// charge it at the provider over HTTP, record it. at names the point
// where the process kills itself, if any.
func crashFlow(name, providerURL, at string) *idem.Flow[chargeIn, chargeOut] {
	kill := func(point string) {
		if at == point {
			self, _ := os.FindProcess(os.Getpid())
			_ = self.Kill()
			select {} // the signal is on its way
		}
	}
	return idem.NewFlow(name, func(s *idem.Steps, in chargeIn) (chargeOut, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		kill(crashBeforeCall)
		chargeID, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			q := url.Values{"key": {providerKey}, "amount": {strconv.FormatInt(in.Amount, 10)}}
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, providerURL+"?"+q.Encode(), nil)
			if err != nil {
				return "", err
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return "", err
			}
			defer resp.Body.Close()
			var id string
			if err := json.NewDecoder(resp.Body).Decode(&id); err != nil {
				return "", err
			}
			kill(crashAfterCall)
			return id, nil
		})
		if err != nil {
			return chargeOut{}, err
		}
		return chargeOut{PaymentID: id, ChargeID: chargeID}, nil
	}, idem.WithLease(crashLease))
}

// crashChild runs the job in crashEnv and returns the exit code; it exits
// only if the job's crash point was never reached.
func crashChild() int {
	var job crashJob
	if err := json.Unmarshal([]byte(os.Getenv(crashEnv)), &job); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, job.URL)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer pool.Close()
	_, err = crashFlow(job.Flow, job.Provider, job.At).Run(ctx, pool, job.Scope, job.Key, fpCharge, chargeIn{Amount: 2500})
	fmt.Fprintf(os.Stderr, "the flow ended without a crash: %v\n", err)
	return 3
}

// setupCrash returns the context, pool and scope of the test, the
// provider behind its HTTP server, and the function that runs the flow
// named flow in a child process killed at the point at.
func setupCrash(t *testing.T) (context.Context, *pgxpool.Pool, string, *provider, string, func(flow, key, at string)) {
	ctx, pool, scope, p := setupFlow(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		amount, _ := strconv.ParseInt(r.URL.Query().Get("amount"), 10, 64)
		id, _, err := p.charge(r.Context(), r.URL.Query().Get("key"), amount)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_ = json.NewEncoder(w).Encode(id)
	}))
	t.Cleanup(srv.Close)
	dbURL := env.URL(t)
	crash := func(flow, key, at string) {
		t.Helper()
		job, _ := json.Marshal(crashJob{URL: dbURL, Flow: flow, Scope: scope, Key: key, Provider: srv.URL, At: at})
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), crashEnv+"="+string(job))
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != -1 {
			t.Fatalf("the child was not killed: %v\n%s", err, out)
		}
	}
	return ctx, pool, scope, p, srv.URL, crash
}

func TestFlowCrashAfterTheCallIsResumedByTheClientsRetry(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	name := testdb.Name("crash")
	crash(name, "k", crashAfterCall)
	if charges, _ := p.effects(); charges != 1 {
		t.Fatalf("the provider applied %d charges before the crash, want 1", charges)
	}
	flow := crashFlow(name, providerURL, "")
	// The retry waits for the dead executor's lease to run out.
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Replayed {
		t.Fatalf("the retry: %+v, %v; want the flow completed now", res, err)
	}
	again, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || !again.Replayed || again.Value != res.Value {
		t.Fatalf("a later retry: %+v, %v; want %+v replayed", again, err, res.Value)
	}
	checkOneCharge(t, pool, scope, "k", p, 2)
}

func TestFlowCrashAfterTheCallIsResumedByResume(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	name := testdb.Name("crash")
	crash(name, "k", crashAfterCall)
	flow := crashFlow(name, providerURL, "")
	leaseRanOut(t, ctx, pool, scope, "k")
	resumed, err := flow.Resume(ctx, pool)
	if err != nil || resumed != 1 {
		t.Fatalf("Resume = %d, %v; want 1", resumed, err)
	}
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || !res.Replayed || res.Value.ChargeID != "ch_1" || res.Value.PaymentID == 0 {
		t.Fatalf("the client's retry: %+v, %v; want the answer Resume recorded", res, err)
	}
	checkOneCharge(t, pool, scope, "k", p, 2)
}

func TestFlowCrashBeforeTheCallDoesNotRepeatTheLocalStep(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	name := testdb.Name("crash")
	crash(name, "k", crashBeforeCall)
	if countPayments(t, pool, scope) != 1 || p.calls.Load() != 0 {
		t.Fatalf("before the retry: %d payments, %d calls; want 1, 0", countPayments(t, pool, scope), p.calls.Load())
	}
	res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v", res, err)
	}
	checkOneCharge(t, pool, scope, "k", p, 1)
}

// checkOneCharge checks that the provider applied one charge, seen calls
// times with the call's provider key and no other, and that the operation
// left one payment.
func checkOneCharge(t *testing.T, pool *pgxpool.Pool, scope, key string, p *provider, calls int) {
	t.Helper()
	charges, keys := p.effects()
	want := providerKeyOf(t, context.Background(), pool, scope, key, "charge")
	if charges != 1 || len(keys) != 1 || keys[want] != calls || countPayments(t, pool, scope) != 1 {
		t.Fatalf("charges %d, keys %v, payments %d; want 1, {%s: %d}, 1", charges, keys, countPayments(t, pool, scope), want, calls)
	}
}
