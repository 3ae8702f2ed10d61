package idem_test

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem"
)

func TestObserverRecordsFlowsStepsAndCalls(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	observer, rec, logs := setupObserver(t, false)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithObserver(observer), idem.WithWait(0))
	p.after = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("timeout")
		}
		return nil
	}
	_, _ = flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}) // started, failed at the call
	_, _ = flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}) // resumed, completed
	_, _ = flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}) // replayed
	_, _ = flow.Run(ctx, pool, scope, "k", fpA, chargeIn{Amount: 2500})      // mismatch

	events := rec.Count("idem.flow.events")
	for event, n := range map[string]float64{"started": 1, "failed": 1, "resumed": 1, "completed": 1, "replayed": 1, "mismatch": 1} {
		if events[event] != n {
			t.Errorf("event %s counted %v times, want %v (all: %v)", event, events[event], n, events)
		}
	}
	// reserve and record ran once each; the call twice, failing once.
	if attempts := rec.Count("idem.flow.step.attempts"); attempts["done"] != 3 || attempts["failed"] != 1 {
		t.Errorf("step attempts by outcome %v, want 3 done, 1 failed", attempts)
	}
	names := map[string]int{}
	providerKey := providerKeyOf(t, ctx, pool, scope, "k", "charge")
	for _, s := range rec.Ended() {
		names[s.Name]++
		if s.Name == "idem.Call" && s.Attrs["idem.provider_key"] != providerKey {
			t.Errorf("a call's span has provider key %q", s.Attrs["idem.provider_key"])
		}
		if s.Attrs["idem.flow"] == "" {
			t.Errorf("span %s names no flow", s.Name)
		}
	}
	// The replay and the mismatch run none of the flow's code.
	if names["idem.Flow.Run"] != 4 || names["idem.Local"] != 2 || names["idem.Call"] != 2 || len(names) != 3 {
		t.Errorf("spans %v, want 4 idem.Flow.Run, 2 idem.Local, 2 idem.Call", names)
	}
	if logs.Len() != 0 {
		t.Errorf("logged %q, want nothing: no flow needs attention", logs)
	}
}
