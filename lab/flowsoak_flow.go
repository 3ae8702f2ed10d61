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
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
)

// The flow soak's worker process: the flow, served over HTTP on 127.0.0.1
// to the soak's clients, with a resumer completing the flows whose
// clients went away. The soak runs this program again to start one, with
// flowSoakWorkerEnv set to its spec; it prints "ready ADDR" once it
// serves, and exits when its standard input closes (the soak stopped it,
// or died).

// flowSoakWorkerEnv holds a worker's spec, as JSON.
const flowSoakWorkerEnv = "IDEM_FLOWSOAK_WORKER"

// flowSoakWorkerSpec is what a worker process runs.
type flowSoakWorkerSpec struct {
	// Slot numbers the worker among the soak's; Gen counts its restarts.
	Slot, Gen       int
	DatabaseURL     string
	ProviderURL     string
	Flow            string // the flow's name
	Lease, Wait     time.Duration
	ResumeEvery     time.Duration
	ProviderTimeout time.Duration
	MaxConns        int32
	// Reconcile and AtMostOnce are the charge's call options.
	Reconcile, AtMostOnce bool
}

// The points at which a worker is killed or frozen, in the order the soak
// uses them. killAnywhere is the soak killing or freezing a worker,
// whatever it is doing; the others are the worker running an operation
// marked with the point (flowSoakRequest.Kill): it kills or freezes
// itself there, or, for the two points in the call, the provider kills or
// freezes it.
const (
	killAfterReserve   = "after-reserve"       // the reserve's fn returned, its transaction open (it commits with the call's intent)
	killBeforeSend     = "call-before-send"    // the call's intent recorded, the request not sent
	killBeforeApply    = "call-before-apply"   // the call sent, not applied
	killAfterApply     = "call-after-apply"    // the call applied, its answer not received
	killInRecord       = "in-record"           // the record's writes made, not committed
	killAtCommit       = "at-commit"           // the record's COMMIT done by the server, its answer not received
	killBeforeAnswer   = "before-answer"       // every step recorded, the answer not stored
	killAnywhere       = "anywhere"            // whatever the worker is doing
	killPending        = "pending"             // an operation's kill, its point chosen when it starts
	flowSoakReadyLine  = "ready "              // a worker's first line, before its address
	flowSoakKillLine   = "killing myself at "  // a worker's last line, before a kill point
	flowSoakFreezeLine = "freezing myself at " // a worker's line before it stops itself
)

var flowKillPoints = []string{killAfterReserve, killBeforeSend, killBeforeApply, killAfterApply, killInRecord, killAtCommit, killBeforeAnswer, killAnywhere}

// flowSoakRequest is one attempt of an operation, as a client sends it to
// a worker.
type flowSoakRequest struct {
	Scope  string `json:"scope"`
	Key    string `json:"key"`
	Amount int64  `json:"amount"`
	// Kill, when set, is the point at which the worker is to die, or to
	// freeze when Freeze is set.
	Kill   string `json:"kill,omitempty"`
	Freeze bool   `json:"freeze,omitempty"`
}

// flowSoakInput is the flow's input, stored with it.
type flowSoakInput struct {
	Amount int64 `json:"amount"`
}

// flowSoakAnswer is the flow's answer: the payment, and the provider's
// charge, approved ("charged") or declined, a definite outcome either way.
type flowSoakAnswer struct {
	PaymentID int64  `json:"payment_id"`
	ChargeID  string `json:"charge_id"`
	Status    string `json:"status"`
	Amount    int64  `json:"amount"`
}

// flowSoakCharge is the provider's answer to a charge.
type flowSoakCharge struct {
	ID     string `json:"id"`
	Status string `json:"status"`
}

// flowSoakReply is a worker's answer to an attempt: the operation's
// answer, or why there is none yet (Kind, for the report).
type flowSoakReply struct {
	Answer   *flowSoakAnswer `json:"answer,omitempty"`
	Replayed bool            `json:"replayed,omitempty"`
	Kind     string          `json:"kind,omitempty"`
	Error    string          `json:"error,omitempty"`
}

// flowSoakWorker is a running worker process.
type flowSoakWorker struct {
	spec     flowSoakWorkerSpec
	pool     *pgxpool.Pool
	flow     *idem.Flow[flowSoakInput, flowSoakAnswer]
	provider *http.Client
	stdout   io.Writer
	// cont gets SIGCONT, which wakes a worker that froze itself;
	// freezing lets one goroutine at a time freeze it.
	cont     chan os.Signal
	freezing sync.Mutex
}

// runFlowSoakWorker runs a worker process until ctx ends or stdin closes.
func runFlowSoakWorker(ctx context.Context, specJSON string, stdin io.Reader, stdout, stderr io.Writer) error {
	var spec flowSoakWorkerSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		return cli.UsageError{Err: fmt.Errorf("%s: %w", flowSoakWorkerEnv, err)}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		cancel()
	}()
	w := &flowSoakWorker{spec: spec, stdout: stdout, cont: make(chan os.Signal, 1),
		provider: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}}
	signal.Notify(w.cont, syscall.SIGCONT)
	defer signal.Stop(w.cont)
	poolCfg, err := cli.ParseConfig(spec.DatabaseURL)
	if err != nil {
		return err
	}
	// The tracer dies or freezes at the record's COMMIT (killAtCommit).
	poolCfg.ConnConfig.Tracer = flowSoakTracer{w}
	pool, err := cli.OpenPool(ctx, poolCfg, spec.MaxConns)
	if err != nil {
		return err
	}
	defer pool.Close()
	w.pool = pool
	w.flow = w.newFlow()

	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	resumer, err := idem.StartResumer(ctx, pool, idem.ResumerConfig{Interval: spec.ResumeEvery, Logger: logger}, w.flow)
	if err != nil {
		return err
	}
	defer resumer.Stop()

	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: http.HandlerFunc(w.serve), ReadHeaderTimeout: time.Minute}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(listener) }()
	fmt.Fprintf(stdout, "%s%s\n", flowSoakReadyLine, listener.Addr())
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	shutdownCtx, cancelShutdown := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancelShutdown()
	return srv.Shutdown(shutdownCtx)
}

// flowSoakKillKey is the context key of the fault (*flowSoakFault) the
// worker is to meet while it runs an operation.
type flowSoakKillKey struct{}

// flowSoakFault is the point at which a worker is to die, or freeze, while
// it runs an operation.
type flowSoakFault struct {
	point  string
	freeze bool
	// op is the operation, scope/key.
	op string
	// woke is the point at which the worker froze and woke during this
	// run of the operation, if it did: its provider call says so, for the
	// report of where doubled charges came from.
	woke atomic.Value
	// armed is set by the record step, for killAtCommit: its COMMIT is
	// the one to stop at.
	armed atomic.Bool
	// fired is set once the fault was met. An attempt meets its fault
	// once: Flow.Run runs the function again when it finds that another
	// executor took the flow over while it was frozen (it reclaims the
	// flow, to answer what a retry would get), and a second freeze in
	// that run, outside the soak's freezing turn, could freeze a worker
	// while another is frozen: with two workers, none would serve, and
	// neither could take the other's flows over.
	fired atomic.Bool
}

// fire reports whether the fault is for point and not yet met, and marks
// it met.
func (f *flowSoakFault) fire(point string) bool {
	return f.point != "" && f.point == point && f.fired.CompareAndSwap(false, true)
}

func faultOf(ctx context.Context) *flowSoakFault {
	f, _ := ctx.Value(flowSoakKillKey{}).(*flowSoakFault)
	if f == nil {
		return &flowSoakFault{}
	}
	return f
}

// at kills or freezes the worker when f is for point and was not met yet
// in this attempt (see flowSoakFault.fired).
func (w *flowSoakWorker) at(f *flowSoakFault, point string) {
	switch {
	case !f.fire(point):
	case f.freeze:
		w.freeze(point, f.op)
		f.woke.Store(point)
	default:
		w.die(point)
	}
}

// die kills the worker process at point, as SIGKILL would: nothing gets
// to clean up, nor to give its lease up. It says so on stdout first, so
// that the soak knows what killed it.
func (w *flowSoakWorker) die(point string) {
	fmt.Fprintf(w.stdout, "%s%s\n", flowSoakKillLine, point)
	self, _ := os.FindProcess(os.Getpid())
	_ = self.Kill()
	select {} // the signal is on its way
}

// freeze stops the worker process at point with SIGSTOP, as a pause of
// the machine or a debugger would: every goroutine stops, its lease runs
// on. It says so on stdout first, so that the soak knows, and wakes it
// with SIGCONT once another executor has taken its flows over; the
// goroutine that froze it goes on only then, since a process does not stop
// the moment it signals itself.
func (w *flowSoakWorker) freeze(point, op string) {
	w.freezing.Lock()
	defer w.freezing.Unlock()
	select {
	case <-w.cont: // an earlier SIGCONT, from a freeze by the soak
	default:
	}
	fmt.Fprintf(w.stdout, "%s%s %s\n", flowSoakFreezeLine, point, op)
	_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
	<-w.cont
}

// flowSoakTracer kills or freezes the worker once the record step's
// COMMIT is done by the server, before the worker has seen its answer, for
// an operation marked killAtCommit.
type flowSoakTracer struct{ w *flowSoakWorker }

type flowSoakCommitKey struct{}

func (t flowSoakTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, flowSoakCommitKey{}, isCommit(data.SQL))
}

func (t flowSoakTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if commit, _ := ctx.Value(flowSoakCommitKey{}).(bool); commit && data.Err == nil {
		t.committed(ctx)
	}
}

func (t flowSoakTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, flowSoakCommitKey{}, new(bool))
}

func (t flowSoakTracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	if seen, _ := ctx.Value(flowSoakCommitKey{}).(*bool); seen != nil && data.Err == nil && isCommit(data.SQL) {
		*seen = true
	}
}

func (t flowSoakTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	if seen, _ := ctx.Value(flowSoakCommitKey{}).(*bool); seen != nil && *seen && data.Err == nil {
		t.committed(ctx)
	}
}

// committed stops the worker after a COMMIT, if the operation asks for it.
func (t flowSoakTracer) committed(ctx context.Context) {
	if f := faultOf(ctx); f.point == killAtCommit && f.armed.CompareAndSwap(true, false) {
		t.w.at(f, killAtCommit)
	}
}

// isCommit reports whether sql is a COMMIT, comments aside.
func isCommit(sql string) bool {
	s := strings.TrimSpace(sql)
	for strings.HasPrefix(s, "--") {
		_, rest, _ := strings.Cut(s, "\n")
		s = strings.TrimSpace(rest)
	}
	return strings.EqualFold(strings.TrimSuffix(s, ";"), "commit")
}

// newFlow is the soak's flow: reserve the payment, charge it at the
// provider with the call's provider key, record the provider's answer.
func (w *flowSoakWorker) newFlow() *idem.Flow[flowSoakInput, flowSoakAnswer] {
	return idem.MustNewFlow(w.spec.Flow, func(ctx context.Context, s *idem.Steps, in flowSoakInput) (flowSoakAnswer, error) {
		fault := faultOf(ctx)
		paymentID, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO idem_flowsoak_payment (scope, key, amount_cents, status)
				VALUES ($1, $2, $3, 'reserved') RETURNING id`, s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return flowSoakAnswer{}, err
		}
		w.at(fault, killAfterReserve)
		charge, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (flowSoakCharge, error) {
			entered := time.Now()
			if err := w.enter(ctx, providerKey); err != nil {
				return flowSoakCharge{}, fmt.Errorf("%w: %w", idem.ErrNotSent, err)
			}
			w.at(fault, killBeforeSend)
			return w.charge(ctx, entered, providerKey, s.Scope(), s.Key(), in.Amount, fault)
		}, w.callOptions()...)
		if err != nil {
			return flowSoakAnswer{}, err
		}
		_, err = idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO idem_flowsoak_ledger (scope, key, payment_id, charge_id, status) VALUES ($1, $2, $3, $4, $5)`,
				s.Scope(), s.Key(), paymentID, charge.ID, charge.Status)
			b.Queue(`UPDATE idem_flowsoak_payment SET status = $2, charge_id = $3 WHERE id = $1`, paymentID, charge.Status, charge.ID)
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return struct{}{}, err
			}
			w.at(fault, killInRecord)
			fault.armed.Store(true)
			return struct{}{}, nil
		})
		if err != nil {
			return flowSoakAnswer{}, err
		}
		w.at(fault, killBeforeAnswer)
		return flowSoakAnswer{PaymentID: paymentID, ChargeID: charge.ID, Status: charge.Status, Amount: in.Amount}, nil
	}, idem.WithLease(w.spec.Lease), idem.WithWait(w.spec.Wait))
}

// enter tells the provider that the call's function was entered for
// providerKey, before anything is sent, so that the soak can tell a flow
// stopped for an attempt whose function never ran (which idem must not
// do) from one stopped for an attempt that may have been sent.
func (w *flowSoakWorker) enter(ctx context.Context, providerKey string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.spec.ProviderURL+"/entered?reference="+url.QueryEscape(providerKey), nil)
	if err != nil {
		return err
	}
	resp, err := w.provider.Do(req)
	if err != nil {
		return err
	}
	return resp.Body.Close()
}

// flowSoakProviderError is a call to the provider that got no answer: an
// uncertain outcome, never stored.
type flowSoakProviderError struct {
	kind string
	err  error
}

func (e *flowSoakProviderError) Error() string { return "provider: " + e.kind + ": " + e.err.Error() }
func (e *flowSoakProviderError) Unwrap() error { return e.err }

// callOptions are the charge's options, as the spec asks.
func (w *flowSoakWorker) callOptions() []idem.CallOption {
	var opts []idem.CallOption
	if w.spec.Reconcile {
		opts = append(opts, idem.Reconcile(w.lookup))
	}
	if w.spec.AtMostOnce {
		opts = append(opts, idem.AtMostOnce())
	}
	return opts
}

// lookup asks the provider for the charge made with the attempt's
// provider key as its reference: found, not found (404), or an error (no
// answer).
func (w *flowSoakWorker) lookup(ctx context.Context, a idem.Attempt) (flowSoakCharge, bool, error) {
	providerKey := a.ProviderKey
	ctx, cancel := context.WithTimeout(ctx, w.spec.ProviderTimeout)
	defer cancel()
	var c flowSoakCharge
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.spec.ProviderURL+"/charges?reference="+url.QueryEscape(providerKey), nil)
	if err != nil {
		return c, false, err
	}
	resp, err := w.provider.Do(req)
	if err != nil {
		return c, false, &flowSoakProviderError{kind: "lookup: no answer", err: err}
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusNotFound:
		return c, false, nil
	case http.StatusOK:
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			return c, false, &flowSoakProviderError{kind: "lookup: answer cut", err: err}
		}
		return c, true, nil
	}
	return c, false, &flowSoakProviderError{kind: "lookup: " + resp.Status, err: errors.New("unexpected status")}
}

// charge charges amount at the provider, with providerKey as its
// Idempotency-Key and its reference, and the operation in its metadata.
// An operation marked to die or freeze in the call tells the provider,
// which kills or freezes the worker.
//
// The call says which process sends it and when the call's function was
// entered (entered), after idem's last look at the lease, so that the
// soak can tell a call that arrived after its flow was done because its
// process was frozen after that look (see flowSoakReport.FrozenLate). Not
// when the request was handed to the HTTP client: the client looks at
// the call's context, but a process woken from a freeze can get past
// that look before the timer that ends the context, overdue, has run.
func (w *flowSoakWorker) charge(ctx context.Context, entered time.Time, providerKey, scope, key string, amount int64, fault *flowSoakFault) (flowSoakCharge, error) {
	ctx, cancel := context.WithTimeout(ctx, w.spec.ProviderTimeout)
	defer cancel()
	body, _ := json.Marshal(flowSoakChargeRequest{Amount: amount, Reference: providerKey, Scope: scope, Key: key})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.spec.ProviderURL+"/charges", bytes.NewReader(body))
	if err != nil {
		return flowSoakCharge{}, err
	}
	// net/http resends by itself a request with an Idempotency-Key header
	// whose reused connection broke; without GetBody it cannot, and a cut
	// reaches the flow as the uncertain outcome the soak means it to be.
	req.GetBody = nil
	req.Header.Set("Idempotency-Key", providerKey)
	req.Header.Set(flowSoakWorkerHeader, strconv.Itoa(w.spec.Slot))
	req.Header.Set(flowSoakProcessHeader, flowSoakProcess(w.spec.Slot, w.spec.Gen))
	if woke, _ := fault.woke.Load().(string); woke != "" {
		req.Header.Set(flowSoakWokeHeader, woke)
	}
	if (fault.point == killBeforeApply || fault.point == killAfterApply) && fault.fire(fault.point) {
		req.Header.Set(flowSoakKillHeader, fault.point)
		if fault.freeze {
			req.Header.Set(flowSoakFreezeHeader, "1")
		}
	}
	req.Header.Set(flowSoakStartedHeader, strconv.FormatInt(entered.UnixNano(), 10))
	resp, err := w.provider.Do(req)
	if err != nil {
		kind := "no answer"
		if errors.Is(err, context.DeadlineExceeded) {
			kind = "timed out"
		}
		return flowSoakCharge{}, &flowSoakProviderError{kind: kind, err: err}
	}
	defer resp.Body.Close()
	var c flowSoakCharge
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return c, &flowSoakProviderError{kind: resp.Status, err: errors.New(string(bytes.TrimSpace(msg)))}
	}
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
		return c, &flowSoakProviderError{kind: "answer cut", err: err}
	}
	return c, nil
}

// serve runs one attempt of an operation and answers with its outcome.
func (w *flowSoakWorker) serve(rw http.ResponseWriter, r *http.Request) {
	var req flowSoakRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(rw, err.Error(), http.StatusBadRequest)
		return
	}
	in := flowSoakInput{Amount: req.Amount}
	fp, err := idem.FingerprintJSON(in)
	if err != nil {
		http.Error(rw, err.Error(), http.StatusBadRequest)
		return
	}
	// The flow runs on when its client goes away, as a job would: a frozen
	// worker whose clients left meanwhile must be stopped by its lease
	// alone.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), flowSoakAttemptTimeout)
	defer cancel()
	ctx = context.WithValue(ctx, flowSoakKillKey{}, &flowSoakFault{point: req.Kill, freeze: req.Freeze, op: req.Scope + "/" + req.Key})
	res, err := w.flow.Run(ctx, w.pool, req.Scope, req.Key, fp, in)
	status, reply := http.StatusOK, flowSoakReply{Answer: &res.Value, Replayed: res.Replayed}
	if err != nil {
		status, reply = flowSoakFailure(err)
	}
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	_ = json.NewEncoder(rw).Encode(reply)
}

// flowSoakFailure is the status and reply of an attempt that failed with
// err: 409 for a flow that another executor still runs, 503 for what a
// retry can complete (the provider's uncertain outcomes, a lost lease, the
// database), and statuses a client does not retry for its misuses.
func flowSoakFailure(err error) (int, flowSoakReply) {
	reply := flowSoakReply{Error: err.Error()}
	var pe *flowSoakProviderError
	switch {
	case errors.Is(err, idem.ErrInProgress):
		reply.Kind = "in progress elsewhere (409)"
		return http.StatusConflict, reply
	case errors.Is(err, idem.ErrFingerprintMismatch):
		reply.Kind = "fingerprint mismatch (422)"
		return http.StatusUnprocessableEntity, reply
	case errors.Is(err, idem.ErrFlowStopped):
		reply.Kind = "flow stopped (410)"
		return http.StatusGone, reply
	case errors.Is(err, idem.ErrFlowChanged):
		reply.Kind = "flow changed (500)"
		return http.StatusInternalServerError, reply
	case errors.Is(err, idem.ErrLeaseLost):
		reply.Kind = "lease lost (503)"
	case errors.As(err, &pe):
		reply.Kind = "provider " + pe.kind + " (503)"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		reply.Kind = "context ended (503)"
	default:
		reply.Kind = "other error (503)"
	}
	return http.StatusServiceUnavailable, reply
}
