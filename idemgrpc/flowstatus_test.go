package idemgrpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// TestFlowMethodAnswersEachWayAFlowFailsAsIdemhttpDoes serves, for each
// error with which a flow gives no answer (the sentinels that idemhttp's
// FlowHandler answers with a problem of its own), a flow that meets it,
// and checks the status of the call, as docs/grpc.md's table gives it.
// A function's error that wraps one of idem's sentinels (a provider's
// client that says ErrInvalidKey, as idemhttp.Transport does for a request
// that carries another key) is the flow's own, incomplete, whatever it
// wraps: over HTTP it is 503 operation-incomplete, not the sentinel's
// problem, and the call must not tell its client that its key is invalid,
// reused or in progress.
func TestFlowMethodAnswersEachWayAFlowFailsAsIdemhttpDoes(t *testing.T) {
	ctx, pool, tenant := setup(t)
	uncertain := errors.New("read tcp: i/o timeout")
	callFails := func(opts ...idem.CallOption) flowFunc {
		return func(ctx context.Context, s *idem.Steps, in order) (order, error) {
			_, err := idem.Call(s, "charge", func(context.Context, string) (string, error) { return "", uncertain }, opts...)
			return order{}, err
		}
	}
	callFailsWith := func(sentinel error) flowFunc {
		return func(ctx context.Context, s *idem.Steps, in order) (order, error) {
			_, err := idem.Call(s, "charge", func(context.Context, string) (string, error) {
				return "", fmt.Errorf("the provider's client: %w", sentinel)
			})
			return order{}, err
		}
	}
	completes := func(ctx context.Context, s *idem.Steps, in order) (order, error) { return in, nil }
	req := &testpb.PayRequest{AmountCents: 2500}
	once := func(pay payFunc, _ string) error { return pay(req) }

	for i, c := range []struct {
		name string
		fn   flowFunc
		// calls makes the calls, with pay, for the flow's key, and returns
		// the last one's error.
		calls  func(pay payFunc, key string) error
		code   codes.Code
		reason string
	}{
		{"a call failed (ErrFlowIncomplete)", callFails(), once,
			codes.Unavailable, idemgrpc.ReasonOperationIncomplete},
		{"the function's error wraps ErrInvalidKey", callFailsWith(idem.ErrInvalidKey), once,
			codes.Unavailable, idemgrpc.ReasonOperationIncomplete},
		{"the function's error wraps ErrFingerprintMismatch", callFailsWith(idem.ErrFingerprintMismatch), once,
			codes.Unavailable, idemgrpc.ReasonOperationIncomplete},
		{"the function's error wraps ErrInProgress", callFailsWith(idem.ErrInProgress), once,
			codes.Unavailable, idemgrpc.ReasonOperationIncomplete},
		{"the function's error wraps ErrInputNotStorable", callFailsWith(idem.ErrInputNotStorable), once,
			codes.Unavailable, idemgrpc.ReasonOperationIncomplete},
		{"stopped: a call made at most once may have reached the provider (ErrFlowStopped)", callFails(idem.AtMostOnce()),
			func(pay payFunc, _ string) error { _ = pay(req); return pay(req) },
			codes.FailedPrecondition, idemgrpc.ReasonOperationStopped},
		{"the steps changed under the operation (ErrFlowChanged)", changingSteps(),
			func(pay payFunc, _ string) error { _ = pay(req); return pay(req) },
			codes.Internal, idemgrpc.ReasonRequestFailed},
		{"another executor took the flow over at each step (ErrLeaseLost)", stealsItsLease(pool), once,
			codes.Aborted, idemgrpc.ReasonKeyInProgress},
		{"another executor holds the flow past Config.Wait (ErrInProgress)", callFails(),
			func(pay payFunc, key string) error {
				_ = pay(req)
				holdFlow(t, ctx, pool, tenant, key)
				return pay(req)
			},
			codes.Aborted, idemgrpc.ReasonKeyInProgress},
		{"the key was used for another request (ErrFingerprintMismatch)", completes,
			func(pay payFunc, _ string) error { _ = pay(req); return pay(&testpb.PayRequest{AmountCents: 9900}) },
			codes.FailedPrecondition, idemgrpc.ReasonKeyReused},
		{"the input cannot be stored (ErrInputNotStorable)", completes,
			func(pay payFunc, _ string) error {
				return pay(&testpb.PayRequest{AmountCents: 2500, Labels: map[string]string{"note": "a\x00b"}})
			},
			codes.InvalidArgument, idemgrpc.ReasonInputNotStorable},
		{"the answer cannot be stored (ErrResponseNotStorable)",
			func(ctx context.Context, s *idem.Steps, in order) (order, error) { in.Note = "a\x00b"; return in, nil }, once,
			codes.Internal, idemgrpc.ReasonRequestFailed},
	} {
		flow := idem.MustNewFlow("status-"+strconv.Itoa(i), c.fn)
		conn := serve(t, pool, idemgrpc.Config{Flows: []string{testpb.PaymentsPay}, Wait: -1, Logger: discard},
			&testpb.PaymentsServer{Pay: payByFlow(flow)})
		key := "k" + strconv.Itoa(i)
		err := c.calls(func(req *testpb.PayRequest) error { return pay(ctx, conn, tenant, key, req).err }, key)
		t.Run(c.name, func(t *testing.T) { wantReason(t, err, c.code, c.reason) })
	}
}

type (
	flowFunc = func(ctx context.Context, s *idem.Steps, in order) (order, error)
	payFunc  = func(req *testpb.PayRequest) error
)

// changingSteps is a flow whose first run records a step and fails, and
// whose next runs, as after a deployment, take a step of another name.
func changingSteps() flowFunc {
	var runs atomic.Int64
	return func(ctx context.Context, s *idem.Steps, in order) (order, error) {
		name := "reserve"
		if runs.Add(1) > 1 {
			name = "reserve-v2"
		}
		if _, err := idem.Local(s, name, func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return order{}, err
		}
		return order{}, errors.New("read tcp: i/o timeout")
	}
}

// stealsItsLease is a flow that, at each run, loses the flow to another
// executor (a new epoch, whose lease has run out) in its call, before its
// local step: the step is fenced, and each run that takes the flow over
// again meets the same.
func stealsItsLease(pool *pgxpool.Pool) flowFunc {
	return func(ctx context.Context, s *idem.Steps, in order) (order, error) {
		// A new flow's row commits with its first statement, here the
		// call's intent: the call makes the flow another executor's.
		_, err := idem.Call(s, "steal", func(ctx context.Context, _ string) (int64, error) {
			tag, err := pool.Exec(ctx, `UPDATE idem_flow SET epoch = epoch + 1, leased_until = now() - interval '1 second'
				WHERE scope = $1 AND key = $2`, s.Scope(), s.Key())
			return tag.RowsAffected(), err
		})
		if err != nil {
			return order{}, err
		}
		return idem.Local(s, "record", func(context.Context, pgx.Tx) (order, error) { return in, nil })
	}
}

// holdFlow makes the flow of (scope, key) another executor's, under a
// lease that holds for an hour.
func holdFlow(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) {
	t.Helper()
	tag, err := pool.Exec(ctx, `UPDATE idem_flow SET epoch = epoch + 1, leased_until = now() + interval '1 hour'
		WHERE scope = $1 AND key = $2 AND state = 'running'`, scope, key)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("hold the flow: %v, %d rows", err, tag.RowsAffected())
	}
}

// A flow that did not complete is an outcome its client's retry mends,
// not a failure for a person: it is logged at INFO, not WARN.
func TestFlowMethodLogsAnIncompleteFlowAtInfo(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var logs lockedBuffer
	conn, p := serveFlow(t, pool, idemgrpc.Config{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	p.fail = func(attempt int64) error {
		if attempt == 1 {
			return errors.New("provider timeout")
		}
		return nil
	}
	req := &testpb.PayRequest{AmountCents: 2500}
	wantReason(t, pay(ctx, conn, tenant, "k", req).err, codes.Unavailable, idemgrpc.ReasonOperationIncomplete)
	if err := pay(ctx, conn, tenant, "k", req).err; err != nil {
		t.Fatalf("the retry: %v", err)
	}
	text := logs.String()
	if !strings.Contains(text, `level=INFO msg="idemgrpc: flow did not complete; a retry continues it"`) || !strings.Contains(text, "provider timeout") {
		t.Errorf("logs %q; want the incomplete flow at INFO, with its error", text)
	}
	if strings.Contains(text, "level=WARN") || strings.Contains(text, "level=ERROR") {
		t.Errorf("logs %q; want nothing at WARN or above", text)
	}
}

// lockedBuffer is a log sink that the server's goroutines and the test
// may share.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
