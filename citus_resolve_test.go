//go:build citus

package idem_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// citusResolve: flows stopped in scopes on different shards are listed
// through the coordinator, a page at a time, and resolved there; a
// BestEffort call's unknown outcome is recorded on the shard.
func citusResolve(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	p, g := newProvider(), newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce())
	var scopes []string
	for i := range 4 {
		scope := fmt.Sprintf("citus-resolve-%d", i)
		scopes = append(scopes, scope)
		stopAtSMS(t, ctx, pool, flow, g, scope, "order")
	}
	var listed []string
	filter := idem.FlowFilter{State: "attention", Name: flowName(t, ctx, pool, scopes[0], "order"), Limit: 3}
	for {
		page, err := idem.ListFlows(ctx, pool, filter)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range page.Flows {
			listed = append(listed, f.Scope)
		}
		if page.Next == "" {
			break
		}
		filter.After = page.Next
	}
	if want := []string{scopes[3], scopes[2], scopes[1], scopes[0]}; !slices.Equal(listed, want) {
		t.Fatalf("listed %v through the coordinator, want %v", listed, want)
	}
	if page, err := idem.ListFlows(ctx, pool, idem.FlowFilter{State: "attention", Scope: scopes[1]}); err != nil ||
		len(page.Flows) != 1 || page.Flows[0].Scope != scopes[1] {
		t.Fatalf("one scope's: %+v, %v", page, err)
	}
	if err := idem.ResolveFlow(ctx, pool, scopes[0], "order", applied(texted{ID: "sms_by_hand"})); err != nil {
		t.Fatal(err)
	}
	notApplied := idem.Resolution{Step: "sms", Outcome: idem.NotApplied, By: "bob", Reason: "no such text at the gateway"}
	if err := idem.ResolveFlow(ctx, pool, scopes[1], "order", notApplied); err != nil {
		t.Fatal(err)
	}
	if err := idem.ResolveFlow(ctx, pool, scopes[1], "order", notApplied); !errors.Is(err, idem.ErrFlowNotStopped) {
		t.Fatalf("a second resolution: %v, want ErrFlowNotStopped", err)
	}
	for i, want := range []string{"sms_by_hand", ""} {
		res, err := flow.Run(ctx, pool, scopes[i], "order", nil, chargeIn{Amount: 2500})
		if err != nil || want != "" && res.Value.SMS != want || res.Value.SMS == "" {
			t.Fatalf("the client's retry in %s: %+v, %v", scopes[i], res, err)
		}
	}
	if info, err := idem.InspectFlow(ctx, pool, scopes[0], "order"); err != nil || len(info.Resolutions) != 1 || info.State != "done" {
		t.Fatalf("the resolved flow: %+v, %v", info, err)
	}
	best := checkoutFlow(p, g, idem.BestEffort())
	g.lose = func(int) bool { return true }
	defer func() { g.lose = nil }()
	if res, err := best.Run(ctx, pool, "citus-best-effort", "order", nil, chargeIn{Amount: 1}); err != nil || res.Value.SMS != "unknown" {
		t.Fatalf("a BestEffort text whose answer is lost: %+v, %v", res, err)
	}
}
