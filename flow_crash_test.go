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
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The crash tests run a flow in a child process, this test binary run
// again with crashEnv set (see TestMain), which kills itself, as SIGKILL
// kills a process, at the point the test names: nothing of it gets to
// clean up or give its lease up. The freeze tests stop the child there
// (SIGSTOP), as a paused VM or a frozen host would, let another executor
// or an operator act meanwhile, and wake it (SIGCONT). The provider is an
// HTTP server of the parent's, so that what it applied outlives the
// child.

const crashEnv = "IDEM_FLOW_CRASH"

// Where the child kills or freezes itself.
const (
	crashAfterCall = "after-call" // the provider applied the call; its result is not recorded
	// crashBeforeCall: the local step committed, with the call's intent;
	// the call was not made.
	crashBeforeCall = "before-call"
	// crashBeforeCommit: the local step's function returned; its
	// transaction, left open for the call's intent, did not commit.
	crashBeforeCommit = "before-commit"
	// crashInStep: inside the first local step's function, its INSERT
	// made, in the round trip that began its transaction and took the
	// flow's lock: the transaction is open, nothing of the flow committed.
	crashInStep = "in-step"
	// crashInCommit: the local step's record, the call's intent and
	// COMMIT were sent in one round trip; the process dies before it
	// reads the COMMIT's answer, so the server may or may not have
	// committed (see crashingTracer).
	crashInCommit = "in-commit"
	// crashAfterCallReturned: the call returned its result, which is
	// recorded only with the flow's next statement (the answer here).
	crashAfterCallReturned = "after-call-returned"
	// crashAfterLastStep: in a flow with a local step after the call
	// (lastStepSuffix), that step's function returned; its transaction,
	// which began by locking the flow's row without writing it, is open,
	// and the one write that records the call's result, the step's and
	// the answer has not been sent.
	crashAfterLastStep = "after-last-step"
	// freezeAfterIntent: the call's intent is recorded and the call is
	// about to be made (the start of its span).
	freezeAfterIntent = "freeze-after-intent"
	// freezeInCall: the provider applied the call and answered; the
	// answer is not yet back from the call's function.
	freezeInCall = "freeze-in-call"
	// freezeInStep: inside the local step's function, its INSERT made,
	// its transaction open.
	freezeInStep = "freeze-in-step"
	// freezeBeforeCommit: where crashBeforeCommit dies: the local step
	// returned, its transaction left open for the flow's next statement.
	freezeBeforeCommit = "freeze-before-commit"
	// crashBeforeFirstStep: in the flow's function, before any step: the
	// run holds the claim's open transaction, which holds the flow's lock
	// and has written nothing. freezeBeforeFirstStep freezes there.
	crashBeforeFirstStep  = "before-first-step"
	freezeBeforeFirstStep = "freeze-before-first-step"
)

// freezes reports whether at is a point where the child freezes, rather
// than dies: a frozen child, once woken, writes what its run returned.
func freezes(at string) bool {
	switch at {
	case freezeAfterIntent, freezeInCall, freezeInStep, freezeBeforeCommit, freezeBeforeFirstStep:
		return true
	}
	return false
}

// crashJob is what the child runs, passed as JSON in crashEnv.
type crashJob struct {
	URL, Flow, Scope, Key, Provider, At string
	// Window is the flow's provider window, when not the default.
	Window *time.Duration
	// Reconcile gives the call a lookup at the provider by the
	// operation's reference (see reconcileOverHTTP).
	Reconcile bool
	// Compensate runs compensationFlow instead of crashFlow (see
	// flow_compensation_test.go).
	Compensate bool
	// IdleTimeout is the flow's idle timeout, when not the default.
	IdleTimeout *time.Duration
	// Lease is the flow's lease, when not crashLease.
	Lease *time.Duration
	// App is the application_name of the child's sessions, so that the
	// test can find them in pg_stat_activity.
	App string
}

// childResult is what a frozen child's run returned once woken, written as
// JSON to its standard output.
type childResult struct {
	Value    chargeOut
	Replayed bool
	Err      string
	Stopped  bool // errors.Is(err, idem.ErrFlowStopped)
}

// crashLease is the crash flows' lease: after a crash, the retry waits for
// it to run out. It is long enough that the child, which renews it at each
// step, does not lose it to a stall of a loaded machine before it reaches
// its crash point (300ms did, under -race at a load of 20).
const crashLease = 2 * time.Second

// crashFlow is the flow the child and the parent run: reserve a payment,
// charge it at the provider over HTTP, with the operation's scope and key
// as the charge's reference, record it. at names the point where the
// process kills or freezes itself, if any.
func crashFlow(name, providerURL, at string, opts ...idem.FlowOption) *idem.Flow[chargeIn, chargeOut] {
	return crashFlowWith(name, providerURL, at, nil, opts...)
}

// reconcileOverHTTP is the lookup of crashFlow's call: it asks the
// provider for the charge made with the operation's reference.
func reconcileOverHTTP(providerURL, ref string) idem.CallOption {
	return idem.Reconcile(func(ctx context.Context, _ idem.Attempt) (string, bool, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, providerURL+"/lookup?"+url.Values{"ref": {ref}}.Encode(), nil)
		if err != nil {
			return "", false, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return "", false, err
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusNotFound {
			return "", false, nil
		}
		var id string
		return id, true, json.NewDecoder(resp.Body).Decode(&id)
	})
}

// crashFlowWith is crashFlow, whose call has a lookup (reconcileOverHTTP)
// when reconcile is set.
// callFirstSuffix ends the name of a crash flow that takes no reserve
// step: its first step is the call, whose intent carries the flow's row.
const callFirstSuffix = "-call-first"

// lastStepSuffix ends the name of a crash flow that takes a local step,
// "settle", after its call: it adds 1 to the payment's amount.
const lastStepSuffix = "-last-step"

func crashFlowWith(name, providerURL, at string, reconcile *bool, opts ...idem.FlowOption) *idem.Flow[chargeIn, chargeOut] {
	kill := func(point string) {
		switch {
		case at != point:
		case freezes(point):
			freezeSelf()
		default:
			self, _ := os.FindProcess(os.Getpid())
			_ = self.Kill()
			select {} // the signal is on its way
		}
	}
	if at == freezeAfterIntent {
		obs, err := idem.NewObserver(idem.ObserverConfig{TracerProvider: freezingTracer{at: "idem.Call"}})
		if err != nil {
			panic(err)
		}
		opts = append(opts, idem.WithObserver(obs))
	}
	callFirst := strings.HasSuffix(name, callFirstSuffix)
	return idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		kill(crashBeforeFirstStep)
		kill(freezeBeforeFirstStep)
		var id int64
		var err error
		if !callFirst {
			id, err = idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
				var id int64
				err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
					s.Scope(), s.Key(), in.Amount).Scan(&id)
				if err == nil {
					kill(crashInStep)
					kill(freezeInStep)
				}
				return id, err
			})
		}
		if err != nil {
			return chargeOut{}, err
		}
		kill(crashBeforeCommit)
		kill(freezeBeforeCommit)
		ref := s.Scope() + "/" + s.Key()
		var callOpts []idem.CallOption
		if reconcile != nil && *reconcile {
			callOpts = append(callOpts, reconcileOverHTTP(providerURL, ref))
		}
		chargeID, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			kill(crashBeforeCall)
			q := url.Values{"key": {providerKey}, "ref": {ref}, "amount": {strconv.FormatInt(in.Amount, 10)}}
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
			kill(freezeInCall)
			return id, nil
		}, callOpts...)
		if err != nil {
			return chargeOut{}, err
		}
		kill(crashAfterCallReturned)
		if strings.HasSuffix(name, lastStepSuffix) {
			_, err := idem.Local(s, "settle", func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
				_, err := tx.Exec(ctx, `UPDATE payment SET amount_cents = amount_cents + 1 WHERE id = $1`, id)
				return struct{}{}, err
			})
			if err != nil {
				return chargeOut{}, err
			}
			kill(crashAfterLastStep)
		}
		return chargeOut{PaymentID: id, ChargeID: chargeID}, nil
	}, append([]idem.FlowOption{idem.WithLease(crashLease)}, opts...)...)
}

// freezeSelf stops the process (SIGSTOP) and returns once it is woken
// (SIGCONT). A process does not stop the moment it signals itself: the
// signal is handled by one of its threads, which then stops the others,
// and on a loaded machine the calling goroutine would run on meanwhile, so
// it waits for the signal that continues it.
func freezeSelf() {
	woken := make(chan os.Signal, 1)
	signal.Notify(woken, syscall.SIGCONT)
	defer signal.Stop(woken)
	_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
	<-woken
}

// freezingTracer stops its process (SIGSTOP) as a span named at starts.
type freezingTracer struct {
	noop.TracerProvider
	at string
}

func (f freezingTracer) Tracer(string, ...trace.TracerOption) trace.Tracer {
	return freezingTracerOf{at: f.at}
}

type freezingTracerOf struct {
	noop.Tracer
	at string
}

func (f freezingTracerOf) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if name == f.at {
		freezeSelf()
	}
	return f.Tracer.Start(ctx, name, opts...)
}

// crashingTracer kills its process (SIGKILL) as it reads the answer to
// the call's intent in a batch that ends with COMMIT: the batch, COMMIT
// included, is sent, and the COMMIT's answer not read.
type crashingTracer struct{}

func (crashingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (crashingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (crashingTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (crashingTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	// The intent travels with the flow's row, which a new flow's first
	// step writes as it commits (FlowStartHeld), or alone.
	if strings.HasPrefix(data.SQL, "-- name: FlowCallIntent") || strings.HasPrefix(data.SQL, "-- name: FlowStartHeld") {
		self, _ := os.FindProcess(os.Getpid())
		_ = self.Kill()
		select {}
	}
}

func (crashingTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// crashChild runs the job in crashEnv and returns the exit code; it exits
// only if the job's crash point was never reached.
func crashChild() int {
	var job crashJob
	if err := json.Unmarshal([]byte(os.Getenv(crashEnv)), &job); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(job.URL)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if job.At == crashInCommit {
		cfg.ConnConfig.Tracer = crashingTracer{}
	}
	if job.App != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = job.App
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer pool.Close()
	if job.Compensate {
		_, err := compensationFlow(job.Flow, job.Provider, job.At).Run(ctx, pool, job.Scope, job.Key, nil, Order{AmountCents: 402})
		fmt.Fprintf(os.Stderr, "the flow ended without a crash: %v\n", err)
		return 3
	}
	var opts []idem.FlowOption
	if job.Window != nil {
		opts = append(opts, idem.WithProviderWindow(*job.Window))
	}
	if job.IdleTimeout != nil {
		opts = append(opts, idem.WithIdleTimeout(*job.IdleTimeout))
	}
	if job.Lease != nil {
		opts = append(opts, idem.WithLease(*job.Lease))
	}
	res, err := crashFlowWith(job.Flow, job.Provider, job.At, &job.Reconcile, opts...).Run(ctx, pool, job.Scope, job.Key, fpCharge, chargeIn{Amount: 2500})
	if freezes(job.At) {
		out := childResult{Value: res.Value, Replayed: res.Replayed, Stopped: errors.Is(err, idem.ErrFlowStopped)}
		if err != nil {
			out.Err = err.Error()
		}
		_ = json.NewEncoder(os.Stdout).Encode(out)
		return 0
	}
	fmt.Fprintf(os.Stderr, "the flow ended without a crash: %v\n", err)
	return 3
}

// setupCrash returns the context, pool and scope of the test, the
// provider behind its HTTP server, and the function that runs the flow
// named flow in a child process killed at the point at.
func setupCrash(t *testing.T) (context.Context, *pgxpool.Pool, string, *provider, string, func(flow, key, at string, reconcile ...bool)) {
	ctx, pool, scope, p := setupFlow(t)
	providerURL, crash := crashRunner(t, ctx, env.URL(t), scope, p)
	return ctx, pool, scope, p, providerURL, crash
}

// crashRunner serves p over HTTP for the test, and returns its URL and the
// function that runs the flow named flow in a child process connected to
// dbURL, for the operation (scope, key), killed at the point at.
func crashRunner(t *testing.T, ctx context.Context, dbURL, scope string, p *provider) (string, func(flow, key, at string, reconcile ...bool)) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if r.URL.Path == "/lookup" {
			id, found := p.lookup(q.Get("ref"))
			if !found {
				http.NotFound(w, r)
				return
			}
			_ = json.NewEncoder(w).Encode(id)
			return
		}
		amount, _ := strconv.ParseInt(q.Get("amount"), 10, 64)
		id, _, err := p.chargeRef(r.Context(), q.Get("key"), q.Get("ref"), amount)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_ = json.NewEncoder(w).Encode(id)
	}))
	t.Cleanup(srv.Close)
	crash := func(flow, key, at string, reconcile ...bool) {
		t.Helper()
		job, _ := json.Marshal(crashJob{URL: dbURL, Flow: flow, Scope: scope, Key: key, Provider: srv.URL, At: at,
			Reconcile: len(reconcile) > 0 && reconcile[0]})
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), crashEnv+"="+string(job))
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != -1 {
			t.Fatalf("the child was not killed: %v\n%s", err, out)
		}
	}
	return srv.URL, crash
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

// A flow whose first step is a call has its row committed with the call's
// intent, with no claim committed before it: killed after that commit,
// before the request is sent, its retry takes the flow over once the lease
// has run out and calls the provider once, with the same provider key.
func TestFlowCrashBeforeAFirstCallCallsOnceWithTheSameKey(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	name := testdb.Name("crash") + callFirstSuffix
	crash(name, "k", crashBeforeCall)
	if countFlows(t, pool, scope) != 1 || p.calls.Load() != 0 {
		t.Fatalf("before the retry: %d flows, %d calls; want 1 (committed with the intent), 0", countFlows(t, pool, scope), p.calls.Load())
	}
	res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v", res, err)
	}
	charges, keys := p.effects()
	if want := providerKeyOf(t, ctx, pool, scope, "k", "charge"); charges != 1 || len(keys) != 1 || keys[want] != 1 {
		t.Fatalf("charges %d, keys %v; want 1, {%s: 1}", charges, keys, want)
	}
}

func TestFlowCrashDuringTheCommitOfTheLocalStepAndIntent(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	name := testdb.Name("crash")
	crash(name, "k", crashInCommit)
	// Whether the server committed or not, the call was not made; the
	// step's writes, its record and the flow's row (which the flow's first
	// step writes) are all there, or none is.
	var payments, steps int
	err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payment WHERE scope = $1),
		(SELECT count(*) FROM idem_flow f, jsonb_each(f.steps) s WHERE f.scope = $1 AND s.value #>> '{}' LIKE '%;reserve%')`,
		scope).Scan(&payments, &steps)
	if err != nil {
		t.Fatal(err)
	}
	if flows := countFlows(t, pool, scope); payments != steps || flows != steps || p.calls.Load() != 0 {
		t.Fatalf("before the retry: %d payments, %d step records, %d flows, %d calls; want as many of the three, 0 calls",
			payments, steps, flows, p.calls.Load())
	}
	res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v", res, err)
	}
	checkOneCharge(t, pool, scope, "k", p, 1)
}

func TestFlowCrashBeforeTheCallsResultIsRecordedCallsAgainWithTheSameKey(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	name := testdb.Name("crash")
	crash(name, "k", crashAfterCallReturned)
	if charges, _ := p.effects(); charges != 1 {
		t.Fatalf("the provider applied %d charges before the crash, want 1", charges)
	}
	res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Replayed || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v; want the flow completed now", res, err)
	}
	// Called again with the same provider key, applied once.
	checkOneCharge(t, pool, scope, "k", p, 2)
}

// A local step after a call begins by locking the flow's row, without
// writing it: the call's result is recorded with the step's own record and
// the answer, in one write as the step's transaction commits. Killed
// before that commit, the step's writes, the call's result and the answer
// are all lost: the retry calls again with the same provider key (applied
// once) and runs the step again, whose writes then commit once.
func TestFlowCrashAfterTheLastLocalStepReturnedCallsAgainAndRunsTheStepOnce(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	name := testdb.Name("crash") + lastStepSuffix
	crash(name, "k", crashAfterLastStep)
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.State != "running" || len(info.Steps) != 2 || info.Steps[1].State != "calling" {
		t.Fatalf("before the retry: %+v, %v; want the call's intent recorded, not its result", info, err)
	}
	res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Replayed || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v", res, err)
	}
	checkOneCharge(t, pool, scope, "k", p, 2)
	var amount int64
	if err := pool.QueryRow(ctx, `SELECT amount_cents FROM payment WHERE scope = $1`, scope).Scan(&amount); err != nil || amount != 2501 {
		t.Fatalf("the payment's amount: %d, %v; want 2501, settled once", amount, err)
	}
	info, err = idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.State != "done" || len(info.Steps) != 3 || info.Steps[1].Attempts != 2 || info.Steps[2].State != "done" {
		t.Fatalf("after the retry: %+v, %v", info, err)
	}
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

// countFlows counts the flows' rows of scope.
func countFlows(t *testing.T, pool *pgxpool.Pool, scope string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_flow WHERE scope = $1`, scope).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
