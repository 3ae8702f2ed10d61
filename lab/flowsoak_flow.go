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
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
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
}

// The points at which a worker is killed, in the order the soak uses
// them. killAnywhere is the soak killing a worker, whatever it is doing;
// the others are the worker running an operation marked with the point
// (flowSoakRequest.Kill): it kills itself there, or, for the two points in
// the call, the provider kills it.
const (
	killAfterReserve  = "after-reserve"      // the reserve committed, the call not made
	killBeforeApply   = "call-before-apply"  // the call sent, not applied
	killAfterApply    = "call-after-apply"   // the call applied, its answer not received
	killInRecord      = "in-record"          // the record's writes made, not committed
	killBeforeAnswer  = "before-answer"      // every step recorded, the answer not stored
	killAnywhere      = "anywhere"           // whatever the worker is doing
	flowSoakReadyLine = "ready "             // a worker's first line, before its address
	flowSoakKillLine  = "killing myself at " // a worker's last line, before a kill point
)

var flowKillPoints = []string{killAfterReserve, killBeforeApply, killAfterApply, killInRecord, killBeforeAnswer, killAnywhere}

// flowSoakRequest is one attempt of an operation, as a client sends it to
// a worker.
type flowSoakRequest struct {
	Scope  string `json:"scope"`
	Key    string `json:"key"`
	Amount int64  `json:"amount"`
	// Kill, when set, is the point at which the worker is to die.
	Kill string `json:"kill,omitempty"`
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
}

// runFlowSoakWorker runs a worker process until ctx ends or stdin closes.
func runFlowSoakWorker(ctx context.Context, specJSON string, stdin io.Reader, stdout, stderr io.Writer) error {
	var spec flowSoakWorkerSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		return usageError{fmt.Errorf("%s: %w", flowSoakWorkerEnv, err)}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		cancel()
	}()
	pool, err := connectTo(ctx, spec.DatabaseURL, spec.MaxConns)
	if err != nil {
		return err
	}
	defer pool.Close()
	w := &flowSoakWorker{spec: spec, pool: pool, stdout: stdout,
		provider: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}}
	w.flow = w.newFlow()

	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	resumer, err := w.flow.StartResumer(ctx, pool, idem.ResumerConfig{Interval: spec.ResumeEvery, Logger: logger})
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

// flowSoakKillKey is the context key of the point at which the worker is
// to die while it runs an operation.
type flowSoakKillKey struct{}

func killPoint(ctx context.Context) string {
	point, _ := ctx.Value(flowSoakKillKey{}).(string)
	return point
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

// newFlow is the soak's flow: reserve the payment, charge it at the
// provider with the call's provider key, record the provider's answer.
func (w *flowSoakWorker) newFlow() *idem.Flow[flowSoakInput, flowSoakAnswer] {
	return idem.MustNewFlow(w.spec.Flow, func(s *idem.Steps, in flowSoakInput) (flowSoakAnswer, error) {
		kill := killPoint(s.Context())
		paymentID, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO idem_flowsoak_payment (scope, key, amount_cents, status)
				VALUES ($1, $2, $3, 'reserved') RETURNING id`, s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return flowSoakAnswer{}, err
		}
		if kill == killAfterReserve {
			w.die(kill)
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (flowSoakCharge, error) {
			return w.charge(ctx, providerKey, in.Amount, kill)
		})
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
			if kill == killInRecord {
				w.die(kill)
			}
			return struct{}{}, nil
		})
		if err != nil {
			return flowSoakAnswer{}, err
		}
		if kill == killBeforeAnswer {
			w.die(kill)
		}
		return flowSoakAnswer{PaymentID: paymentID, ChargeID: charge.ID, Status: charge.Status, Amount: in.Amount}, nil
	}, idem.WithLease(w.spec.Lease), idem.WithWait(w.spec.Wait))
}

// flowSoakProviderError is a call to the provider that got no answer: an
// uncertain outcome, never stored.
type flowSoakProviderError struct {
	kind string
	err  error
}

func (e *flowSoakProviderError) Error() string { return "provider: " + e.kind + ": " + e.err.Error() }
func (e *flowSoakProviderError) Unwrap() error { return e.err }

// charge charges amount at the provider under providerKey. An operation
// marked to die in the call tells the provider, which kills the worker.
func (w *flowSoakWorker) charge(ctx context.Context, providerKey string, amount int64, kill string) (flowSoakCharge, error) {
	ctx, cancel := context.WithTimeout(ctx, w.spec.ProviderTimeout)
	defer cancel()
	body, _ := json.Marshal(flowSoakInput{Amount: amount})
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
	if kill == killBeforeApply || kill == killAfterApply {
		req.Header.Set(flowSoakKillHeader, kill)
	}
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
	ctx := context.WithValue(r.Context(), flowSoakKillKey{}, req.Kill)
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
