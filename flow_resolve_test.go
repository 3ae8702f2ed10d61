package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
	"github.com/pgidem/idem/internal/testdb"
)

// The tests of a person in the loop: a checkout that charges, then texts
// the customer at most once, stops when the text's answer is lost; a
// person finds out what happened and resolves it (ResolveFlow), and the
// client's retry gets the flow's answer.

// smsGateway sends texts; it loses the answer of the sends lose says to.
type smsGateway struct {
	mu   sync.Mutex
	sent map[string]int // provider key → texts sent
	lose func(send int) bool
	n    int
}

func newSMS() *smsGateway { return &smsGateway{sent: make(map[string]int)} }

func (g *smsGateway) send(ctx context.Context, key string) (string, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.n++
	g.sent[key]++
	if g.lose != nil && g.lose(g.n) {
		return "", errors.New("read tcp: i/o timeout")
	}
	return fmt.Sprintf("sms_%d", g.n), ctx.Err()
}

func (g *smsGateway) sends() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

type receipt struct {
	PaymentID int64  `json:"payment_id"`
	ChargeID  string `json:"charge_id"`
	SMS       string `json:"sms"`
}

type texted struct {
	ID string `json:"id"`
}

// checkoutFlow reserves, charges at p, and texts at g with the call option
// opt (AtMostOnce, BestEffort), answering a receipt; a text whose outcome
// is unknown is answered "unknown".
func checkoutFlow(p *provider, g *smsGateway, opt idem.CallOption, opts ...idem.FlowOption) *idem.Flow[chargeIn, receipt] {
	return idem.MustNewFlow(testdb.Name("checkout"), func(ctx context.Context, s *idem.Steps, in chargeIn) (receipt, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return receipt{}, err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
		if err != nil {
			return receipt{}, err
		}
		sms, err := idem.Call(s, "sms", func(ctx context.Context, key string) (texted, error) {
			id, err := g.send(ctx, key)
			return texted{ID: id}, err
		}, opt)
		switch {
		case errors.Is(err, idem.ErrOutcomeUnknown):
			sms.ID = "unknown"
		case err != nil:
			return receipt{}, err
		}
		return receipt{PaymentID: id, ChargeID: charge, SMS: sms.ID}, nil
	}, opts...)
}

// stopAtSMS runs flow for key so that its text's answer is lost, then
// again, which stops it at the text, an AtMostOnce call.
func stopAtSMS(t *testing.T, ctx context.Context, pool *pgxpool.Pool, flow *idem.Flow[chargeIn, receipt], g *smsGateway, scope, key string) {
	t.Helper()
	lose := g.lose
	g.lose = func(int) bool { return true }
	defer func() { g.lose = lose }()
	if _, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("%s: the run whose text's answer is lost: %v, want ErrFlowIncomplete", key, err)
	}
	if _, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("%s: the retry: %v, want ErrFlowStopped", key, err)
	}
}

func applied(result any) idem.Resolution {
	return idem.Resolution{Step: "sms", Outcome: idem.Applied, Result: result, By: "alice", Reason: "the gateway's log shows sms_1 delivered"}
}

func TestResolvedAsAppliedTheClientsRetryGetsTheFlowsAnswer(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce())
	stopAtSMS(t, ctx, pool, flow, g, scope, "order-1")

	if err := idem.ResolveFlow(ctx, pool, scope, "order-1", applied(json.RawMessage(`{"id": "sms_1"}`))); err != nil {
		t.Fatal(err)
	}
	res, err := flow.Run(ctx, pool, scope, "order-1", nil, chargeIn{Amount: 2500})
	if err != nil || res.Replayed || res.Value.SMS != "sms_1" || res.Value.ChargeID != "ch_1" || res.Value.PaymentID == 0 {
		t.Fatalf("the client's retry: %+v, %v; want the receipt with the resolved text", res, err)
	}
	if charges, _ := p.effects(); charges != 1 || g.sends() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d charges, %d texts, %d payments; want one of each", charges, g.sends(), countPayments(t, pool, scope))
	}
	again, err := flow.Run(ctx, pool, scope, "order-1", nil, chargeIn{Amount: 2500})
	if err != nil || !again.Replayed || again.Value != res.Value {
		t.Fatalf("a later retry: %+v, %v; want the answer replayed", again, err)
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "order-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Resolutions) != 1 {
		t.Fatalf("resolutions %+v, want one", info.Resolutions)
	}
	r := info.Resolutions[0]
	if r.Step != "sms" || r.Outcome != idem.Applied || r.By != "alice" || !strings.Contains(r.Reason, "delivered") ||
		!strings.Contains(r.Stopped, "at most once") || time.Since(r.At) > time.Minute || time.Since(r.At) < 0 {
		t.Fatalf("the resolution as recorded: %+v", r)
	}
	sms := info.Steps[2]
	if sms.State != "done" || string(sms.Result) != `{"id":"sms_1"}` || sms.Attempts != 2 || sms.CompletedAt.IsZero() {
		t.Fatalf("the text's step: %+v", sms)
	}
}

func TestResolvedAsNotAppliedTheCallIsMadeAgainOnceWithItsKey(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce())
	stopAtSMS(t, ctx, pool, flow, g, scope, "k")
	r := idem.Resolution{Step: "sms", Outcome: idem.NotApplied, By: "bob", Reason: "the gateway has no text for the key"}
	if err := idem.ResolveFlow(ctx, pool, scope, "k", r); err != nil {
		t.Fatal(err)
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); info.State != "running" || info.Leased || info.Steps[2].State != "unsent" {
		t.Fatalf("the resolved flow: %+v", info)
	}
	// The call made again loses its answer too: at most once, so the flow
	// stops again, having called once more.
	g.lose = func(int) bool { return true }
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("the retry whose text is lost again: %v", err)
	}
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the next retry: %v, want ErrFlowStopped", err)
	}
	key := providerKeyOf(t, ctx, pool, scope, "k", "sms")
	if g.sends() != 2 || g.sent[key] != 2 {
		t.Fatalf("texts %d, %v; want 2, both with the call's key %s", g.sends(), g.sent, key)
	}
	// Resolved again, the flow finishes without a third text.
	g.lose = nil
	if err := idem.ResolveFlow(ctx, pool, scope, "k", applied(texted{ID: "sms_2"})); err != nil {
		t.Fatal(err)
	}
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil || res.Value.SMS != "sms_2" || g.sends() != 2 {
		t.Fatalf("the retry: %+v, %v, %d texts", res, err, g.sends())
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); len(info.Resolutions) != 2 || info.Resolutions[0].Outcome != idem.NotApplied ||
		info.Resolutions[1].By != "alice" {
		t.Fatalf("the resolutions: %+v", info.Resolutions)
	}
}

func TestResolveFlowRefusesAFlowNotStoppedOrAnotherStep(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce())
	if err := idem.ResolveFlow(ctx, pool, scope, "none", applied(texted{})); !errors.Is(err, idem.ErrFlowNotStopped) {
		t.Fatalf("a key without a flow: %v, want ErrFlowNotStopped", err)
	}
	if _, err := flow.Run(ctx, pool, scope, "done", nil, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	if err := idem.ResolveFlow(ctx, pool, scope, "done", applied(texted{})); !errors.Is(err, idem.ErrFlowNotStopped) {
		t.Fatalf("a flow that completed: %v, want ErrFlowNotStopped", err)
	}
	g.lose = func(int) bool { return true }
	if _, err := flow.Run(ctx, pool, scope, "abandoned", nil, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the run meant to fail succeeded")
	}
	g.lose = nil
	if err := idem.ResolveFlow(ctx, pool, scope, "abandoned", applied(texted{})); !errors.Is(err, idem.ErrFlowNotStopped) {
		t.Fatalf("a running flow: %v, want ErrFlowNotStopped", err)
	}
	stopAtSMS(t, ctx, pool, flow, g, scope, "stopped")
	other := applied(json.RawMessage(`"ch_9"`))
	other.Step = "charge"
	if err := idem.ResolveFlow(ctx, pool, scope, "stopped", other); !errors.Is(err, idem.ErrStepMismatch) {
		t.Fatalf("a resolution of another step: %v, want ErrStepMismatch", err)
	}
	// Nothing reaches the database that cannot work.
	for name, r := range map[string]idem.Resolution{
		"no step":               {Outcome: idem.Applied, Result: 1, By: "a", Reason: "r"},
		"no outcome":            {Step: "sms", By: "a", Reason: "r"},
		"no result":             {Step: "sms", Outcome: idem.Applied, By: "a", Reason: "r"},
		"a result not applied":  {Step: "sms", Outcome: idem.NotApplied, Result: 1, By: "a", Reason: "r"},
		"nobody":                {Step: "sms", Outcome: idem.NotApplied, Reason: "r"},
		"no reason":             {Step: "sms", Outcome: idem.NotApplied, By: "a"},
		"a result not storable": {Step: "sms", Outcome: idem.Applied, Result: json.RawMessage(`"\u0000"`), By: "a", Reason: "r"},
	} {
		var fe *idem.FieldError
		if err := idem.ResolveFlow(ctx, pool, scope, "stopped", r); !errors.As(err, &fe) || !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("%s: %v, want a FieldError", name, err)
		}
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "stopped"); info.State != "attention" || len(info.Resolutions) != 0 {
		t.Fatalf("the stopped flow after the refusals: %+v", info)
	}
	if err := idem.ResolveFlow(ctx, pool, scope, "stopped", applied(texted{ID: "x"})); err != nil {
		t.Fatal(err)
	}
	if err := idem.ResolveFlow(ctx, pool, scope, "stopped", applied(texted{ID: "y"})); !errors.Is(err, idem.ErrFlowNotStopped) {
		t.Fatalf("a second resolution: %v, want ErrFlowNotStopped", err)
	}
}

// TestResolutionsAtOnceOneWins: people resolving, and ending, the same
// stopped flow at once: one of them wins, the others are told it is no
// longer stopped, and the flow records one decision.
func TestResolutionsAtOnceOneWins(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce())
	for round := range 5 {
		key := fmt.Sprintf("k%d", round)
		stopAtSMS(t, ctx, pool, flow, g, scope, key)
		var wins, refused atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range 6 {
			wg.Go(func() {
				<-start
				var err error
				switch i % 3 {
				case 0:
					err = idem.ResolveFlow(ctx, pool, scope, key, applied(texted{ID: fmt.Sprint(i)}))
				case 1:
					err = idem.ResolveFlow(ctx, pool, scope, key, idem.Resolution{Step: "sms", Outcome: idem.NotApplied, By: "b", Reason: "r"})
				default:
					var ended bool
					ended, err = idem.EndFlow(ctx, pool, scope, key, "ended")
					if err == nil && !ended {
						err = idem.ErrFlowNotStopped
					}
				}
				switch {
				case err == nil:
					wins.Add(1)
				case errors.Is(err, idem.ErrFlowNotStopped):
					refused.Add(1)
				default:
					t.Errorf("%s, %d: %v", key, i, err)
				}
			})
		}
		close(start)
		wg.Wait()
		info, err := idem.InspectFlow(ctx, pool, scope, key)
		if err != nil {
			t.Fatal(err)
		}
		// EndFlow also ends a running flow: it may win after a resolution.
		decided := len(info.Resolutions)
		if info.State == "ended" && decided == 0 || info.State == "running" && decided == 1 {
			decided = 1
		}
		if decided != 1 || len(info.Resolutions) > 1 || wins.Load() < 1 || wins.Load()+refused.Load() != 6 {
			t.Fatalf("%s: %d won, %d refused; the flow %s with resolutions %+v", key, wins.Load(), refused.Load(), info.State, info.Resolutions)
		}
	}
}

// TestAnExecutorThatWakesLateCannotUndoAResolution: the executor that made
// the text, frozen past its lease, wakes after another run stopped the
// flow and a person resolved it: it records nothing, and the flow answers
// with what the person recorded.
func TestAnExecutorThatWakesLateCannotUndoAResolution(t *testing.T) {
	ctx, pool, scope := setup(t)
	g := newSMS()
	frozen, wake := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	first.Store(true)
	flow := idem.MustNewFlow(testdb.Name("late"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		return idem.Call(s, "sms", func(ctx context.Context, key string) (string, error) {
			if first.CompareAndSwap(true, false) {
				close(frozen)
				<-wake // frozen past its lease; its context ended long ago
				return "sms_late", nil
			}
			return g.send(ctx, key)
		}, idem.AtMostOnce())
	}, idem.WithLease(300*time.Millisecond), idem.WithWait(0))
	// On a connection of its own, whose lease is not renewed during a
	// call (as in a process frozen, whose renewals stop).
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	late := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, conn, scope, "k", nil, chargeIn{Amount: 1})
		late <- err
	}()
	<-frozen
	time.Sleep(400 * time.Millisecond) // past the lease
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the takeover: %v, want ErrFlowStopped", err)
	}
	var stopped int64
	if err := pool.QueryRow(ctx, `SELECT epoch FROM idem_flow WHERE scope = $1`, scope).Scan(&stopped); err != nil {
		t.Fatal(err)
	}
	if err := idem.ResolveFlow(ctx, pool, scope, "k", applied(json.RawMessage(`"sms_person"`))); err != nil {
		t.Fatal(err)
	}
	// The epoch of the executor that stopped the flow no longer holds it:
	// its statements (here its lease's renewal) write nothing, although
	// the flow runs again.
	n, err := dbsqlc.New(pool).FlowLease(ctx, dbsqlc.FlowLeaseParams{Lease: pgtime.Interval(time.Minute), Step: "sms",
		Scope: scope, Key: "k", Epoch: stopped})
	if err != nil || n != 0 {
		t.Fatalf("a statement under the epoch the flow stopped with: %d rows, %v; want none", n, err)
	}
	close(wake)
	err = <-late
	// The late executor's own run looks again, finds the flow resolved,
	// and finishes it: with the person's result, not its own.
	info, ierr := idem.InspectFlow(ctx, pool, scope, "k")
	if ierr != nil {
		t.Fatal(ierr)
	}
	if info.Steps[0].State != "done" || string(info.Steps[0].Result) != `"sms_person"` {
		t.Fatalf("the late executor (%v) changed the resolved call: %+v", err, info.Steps[0])
	}
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1})
	if err != nil || res.Value != "sms_person" || g.sends() != 0 {
		t.Fatalf("the client's retry: %+v, %v, %d texts; want the person's result, no text", res, err, g.sends())
	}
}

func TestResumeFinishesAResolvedFlow(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce())
	stopAtSMS(t, ctx, pool, flow, g, scope, "k")
	if err := idem.ResolveFlow(ctx, pool, scope, "k", applied(texted{ID: "sms_1"})); err != nil {
		t.Fatal(err)
	}
	// Its runs (two) would make a completer wait a second after a failed
	// run: a resolved flow is due at once.
	if n, err := flow.Resume(ctx, pool); err != nil || n != 1 {
		t.Fatalf("Resume = %d, %v; want the resolved flow finished", n, err)
	}
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil || !res.Replayed || res.Value.SMS != "sms_1" {
		t.Fatalf("the client's retry: %+v, %v; want the completer's answer", res, err)
	}
}

func TestASealedFlowIsResolvedByItsFlowsResolve(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce(), idem.WithCodec(&reverseCodec{}))
	stopAtSMS(t, ctx, pool, flow, g, scope, "k")
	if err := idem.ResolveFlow(ctx, pool, scope, "k", applied(texted{ID: "sms_1"})); !errors.Is(err, idem.ErrFlowSealed) {
		t.Fatalf("ResolveFlow with a result: %v, want ErrFlowSealed", err)
	}
	other := checkoutFlow(p, g, idem.AtMostOnce(), idem.WithCodec(&reverseCodec{}))
	if err := other.Resolve(ctx, pool, scope, "k", applied(texted{ID: "sms_1"})); !errors.Is(err, idem.ErrFlowNotStopped) {
		t.Fatalf("another flow's Resolve: %v, want ErrFlowNotStopped", err)
	}
	if err := flow.Resolve(ctx, pool, scope, "k", applied(texted{ID: "sms_1"})); err != nil {
		t.Fatal(err)
	}
	info, _ := idem.InspectFlow(ctx, pool, scope, "k")
	if strings.Contains(string(info.Steps[2].Result), "sms_1") || !strings.HasPrefix(info.Resolutions[0].Stopped, "sealed:") {
		t.Fatalf("the resolved call's result is stored in the clear: %s; stopped %q", info.Steps[2].Result, info.Resolutions[0].Stopped)
	}
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil || res.Value.SMS != "sms_1" {
		t.Fatalf("the client's retry: %+v, %v", res, err)
	}
}

// TestAResolvedCallRecordedAsARowIsWrittenThere: a flow whose steps went
// to rows of their own (maxInlineSteps) has its stopped call resolved in
// its row.
func TestAResolvedCallRecordedAsARowIsWrittenThere(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	flow := spilledCallFlow(p, errors.New("timeout"), idem.AtMostOnce())
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the retry: %v, want ErrFlowStopped", err)
	}
	r := idem.Resolution{Step: "charge", Outcome: idem.Applied, Result: "ch_by_hand", By: "carol", Reason: "dashboard"}
	if err := idem.ResolveFlow(ctx, pool, scope, "k", r); err != nil {
		t.Fatal(err)
	}
	var state, result string
	if err := pool.QueryRow(ctx, `SELECT state, result::text FROM idem_flow_step_row WHERE scope = $1 AND name = 'charge'`,
		scope).Scan(&state, &result); err != nil || state != "done" || result != `"ch_by_hand"` {
		t.Fatalf("the call's row: %s %s, %v", state, result, err)
	}
	if res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err != nil || res.Value != "ch_by_hand" || p.applied != 0 {
		t.Fatalf("the retry: %+v, %v, %d charges", res, err, p.applied)
	}
}
