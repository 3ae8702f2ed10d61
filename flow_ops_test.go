package idem_test

import (
	"errors"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
)

var uuidV8 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestInspectFlowShowsItsStepsAndTheCallsProviderKey(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	if info, err := idem.InspectFlow(ctx, pool, scope, "k"); err != nil || info.Found {
		t.Fatalf("a key without a flow: %+v, %v", info, err)
	}
	abandon(t, ctx, pool, flow, p, scope, "k")
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil {
		t.Fatal(err)
	}
	if !info.Found || info.State != "running" || info.Step != "charge" || info.Runs != 1 || info.Leased ||
		!strings.Contains(info.LastError, "connection reset") || string(info.Input) != `{"amount": 2500}` {
		t.Fatalf("an abandoned flow: %+v", info)
	}
	if len(info.Steps) != 2 || info.Steps[0].Name != "reserve" || info.Steps[0].State != "done" ||
		info.Steps[1].Kind != "call" || info.Steps[1].State != "calling" || info.Steps[1].Attempts != 1 ||
		!uuidV8.MatchString(info.Steps[1].ProviderKey) || info.Steps[1].FirstCalledAt.IsZero() {
		t.Fatalf("its steps: %+v", info.Steps)
	}
	if _, keys := p.effects(); keys[info.Steps[1].ProviderKey] != 1 {
		t.Fatalf("the provider saw the keys %v, want %s once", keys, info.Steps[1].ProviderKey)
	}
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	info, err = idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.State != "done" || info.Runs != 2 || info.ExpiresAt.IsZero() || info.Steps[1].Attempts != 2 ||
		len(info.Output) == 0 {
		t.Fatalf("once completed: %+v, %v", info, err)
	}
}

func TestEndFlowStopsItAndFencesItsExecutor(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	calling, answer := make(chan struct{}), make(chan struct{})
	p.after = func(string, int) error {
		close(calling)
		<-answer
		return nil
	}
	running := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		running <- err
	}()
	<-calling
	if ended, err := idem.EndFlow(ctx, pool, scope, "k", "refunded by hand, ticket 42"); err != nil || !ended {
		t.Fatalf("EndFlow = %t, %v", ended, err)
	}
	// Its executor records nothing more, and answers what a retry would
	// get.
	close(answer)
	if err := <-running; !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the executor of the ended flow: %v, want ErrFlowStopped", err)
	}
	_, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if !errors.Is(err, idem.ErrFlowStopped) || !strings.Contains(err.Error(), "ticket 42") {
		t.Fatalf("a retry of the ended flow: %v, want ErrFlowStopped with the reason", err)
	}
	if ended, err := idem.EndFlow(ctx, pool, scope, "k", "again"); err != nil || ended {
		t.Fatalf("EndFlow of an ended flow = %t, %v; want false", ended, err)
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, "k"); err != nil || info.State != "ended" || info.ExpiresAt.IsZero() {
		t.Fatalf("the ended flow: %+v, %v", info, err)
	}
}

func TestReadStatsCountsFlows(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t) // stats count every flow
	p := newProvider()
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	if _, err := flow.Run(ctx, pool, scope, "done", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	abandon(t, ctx, pool, flow, p, scope, "abandoned")
	abandon(t, ctx, pool, flow, p, scope, "attention")
	ageCalls(t, pool, scope, "attention", 48*time.Hour)
	if _, err := flow.Run(ctx, pool, scope, "attention", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("past the window: %v, want ErrFlowStopped", err)
	}
	s, err := idem.ReadStats(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	if s.FlowsRunning != 0 || s.FlowsAbandoned != 1 || s.FlowsAttention != 1 || s.FlowsFinished != 1 || s.FlowsExpired != 0 ||
		s.OldestFlowRunning.IsZero() {
		t.Fatalf("stats %+v; want 0 running, 1 abandoned, 1 needing attention, 1 finished, 0 expired", s)
	}
}
