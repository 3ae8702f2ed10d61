package interop_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// ledger stands in for a payment provider that honours idempotency keys,
// and counts what it applied per logical operation (the amount, which
// each logical call has of its own): a charge per provider key it has not
// seen. Its faults are tied to the count of calls: every loseEvery-th call
// is applied and its answer lost; every failEvery-th fails before it is
// applied; either way its caller cannot tell which.
type ledger struct {
	loseEvery, failEvery int64

	calls, lost, failed atomic.Int64
	mu                  sync.Mutex
	keys                map[int64]map[string]bool // amount → provider keys applied
}

func (l *ledger) charge(key string, amount int64) (string, error) {
	n := l.calls.Add(1)
	if n%l.failEvery == 0 {
		l.failed.Add(1)
		return "", &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}
	}
	l.mu.Lock()
	if l.keys[amount] == nil {
		l.keys[amount] = map[string]bool{}
	}
	l.keys[amount][key] = true
	l.mu.Unlock()
	if n%l.loseEvery == 0 {
		l.lost.Add(1)
		return "", errors.New("read tcp: i/o timeout, after the provider charged")
	}
	return "ch_" + key, nil
}

// serveFlowGRPC serves Pay with flow on a TCP listener on 127.0.0.1,
// listed in the interceptor's Config.Flows, until the test ends, and
// returns its address.
func serveFlowGRPC(t *testing.T, pool *pgxpool.Pool, flow *idem.Flow[flowOrder, flowOrder]) string {
	t.Helper()
	interceptor, err := idemgrpc.NewServerInterceptor(pool, idemgrpc.Config{
		Scope: tenantScope, Required: true, Flows: []string{testpb.PaymentsPay}, Logger: discardLogger})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptor))
	(&testpb.PaymentsServer{Pay: func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
		out, err := idemgrpc.RunFlow(ctx, flow, flowOrder{AmountCents: req.GetAmountCents()})
		if err != nil {
			return nil, err
		}
		return &testpb.Payment{Id: out.PaymentID, AmountCents: out.AmountCents, Status: out.ChargeID}, nil
	}}).Register(s)
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

// flowOrder is the storm's flow's input and answer.
type flowOrder struct {
	AmountCents int64  `json:"amount_cents"`
	PaymentID   int64  `json:"payment_id,omitempty"`
	ChargeID    string `json:"charge_id,omitempty"`
}

// TestFlowRetryStormThroughAConnectionCutter serves Pay with a flow
// (record the payment, charge the card at a provider), and sends logical
// payments from several clients through a proxy that cuts the connection
// carrying every third answer after the server sent it, while the
// provider loses the answer of every fifth call it applied and fails
// every seventh before applying it. Each client retries with
// go-grpc-middleware's retry interceptor, beneath idemgrpc's client
// interceptor. Every logical call must end with one charge, applied under
// one provider key, and the answer of the flow that made it: 0 lost, 0
// doubled.
func TestFlowRetryStormThroughAConnectionCutter(t *testing.T) {
	ctx, pool, tenant := setup(t)
	l := &ledger{loseEvery: 5, failEvery: 7, keys: map[int64]map[string]bool{}}
	flow := idem.MustNewFlow("pay", func(ctx context.Context, s *idem.Steps, in flowOrder) (flowOrder, error) {
		id, err := idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.AmountCents).Scan(&id)
			return id, err
		})
		if err != nil {
			return flowOrder{}, err
		}
		charge, err := idem.Call(s, "charge", func(_ context.Context, key string) (string, error) {
			return l.charge(key, in.AmountCents)
		})
		if err != nil {
			return flowOrder{}, err
		}
		return flowOrder{AmountCents: in.AmountCents, PaymentID: id, ChargeID: charge}, nil
	})
	cut := newCutter(t, serveFlowGRPC(t, pool, flow), 3)

	const clients, workers, perWorker = 4, 4, 15
	const logical = clients * workers * perWorker
	st := storm(t, ctx, cut, tenant, clients, workers, perWorker)

	var charges, lost, doubled int
	for n := range logical {
		keys := l.keys[int64(n+1)]
		charges += len(keys)
		switch {
		case len(keys) == 0:
			lost++
		case len(keys) > 1:
			doubled++
		}
		res := st.answers[n]
		if res == nil || len(keys) != 1 {
			continue
		}
		var id int64
		if err := pool.QueryRow(ctx, `SELECT id FROM payment WHERE amount_cents = $1`, int64(n+1)).Scan(&id); err != nil || res.GetId() != id {
			t.Errorf("logical call %d got payment %d, the committed row is %d (%v)", n, res.GetId(), id, err)
		}
		for key := range keys {
			if res.GetStatus() != "ch_"+key {
				t.Errorf("logical call %d got charge %q, the provider applied %q", n, res.GetStatus(), "ch_"+key)
			}
		}
	}
	payments := count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1`, tenant)
	completed := count(t, pool, `SELECT count(*) FROM idem_flow WHERE scope = $1 AND state = 'done'`, tenant)
	t.Logf("flow storm: %d logical calls, %d attempts sent, %d connections cut after the server answered (of %d answers), "+
		"%d provider calls (%d answers lost after applying, %d failed before), %d answers replayed, %d calls failed; "+
		"%d charges, %d lost, %d doubled, %d payments, %d flows completed",
		logical, st.sent, cut.cuts.Load(), cut.answers.Load(), l.calls.Load(), l.lost.Load(), l.failed.Load(),
		st.replayed, st.failed, charges, lost, doubled, payments, completed)
	if lost != 0 || doubled != 0 || charges != logical || payments != logical || completed != logical || st.failed != 0 {
		t.Fatalf("%d charges (%d lost, %d doubled), %d payments, %d flows completed for %d logical calls (%d failed)",
			charges, lost, doubled, payments, completed, logical, st.failed)
	}
	if cut.cuts.Load() == 0 || st.replayed == 0 || l.lost.Load() == 0 || l.failed.Load() == 0 {
		t.Fatalf("%d cuts, %d replays, %d lost and %d failed provider answers: the storm did not storm",
			cut.cuts.Load(), st.replayed, l.lost.Load(), l.failed.Load())
	}
}

// discardLogger keeps the storm's expected failures out of the output.
var discardLogger = slog.New(slog.DiscardHandler)
