package idem_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

func TestListFlowsPagesThroughEachStateNewestFirst(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	flow := checkoutFlow(p, g, idem.AtMostOnce())
	other := checkoutFlow(p, g, idem.AtMostOnce())
	for i := range 5 {
		stopAtSMS(t, ctx, pool, flow, g, scope, fmt.Sprintf("stopped-%d", i))
	}
	stopAtSMS(t, ctx, pool, other, g, scope, "other-flow")
	g.lose = func(int) bool { return true }
	for i := range 2 {
		if _, err := flow.Run(ctx, pool, scope, fmt.Sprintf("running-%d", i), nil, chargeIn{Amount: 1}); err == nil {
			t.Fatal("the run meant to fail succeeded")
		}
	}
	g.lose = nil
	if _, err := flow.Run(ctx, pool, scope, "done", nil, chargeIn{Amount: 1}); err != nil {
		t.Fatal(err)
	}
	if ended, err := idem.EndFlow(ctx, pool, scope, "stopped-4", "refunded"); err != nil || !ended {
		t.Fatalf("EndFlow: %t, %v", ended, err)
	}

	// Stopped for attention, two a page, newest first, for the flow.
	var keys []string
	filter := idem.FlowFilter{State: "attention", Scope: scope, Name: flowName(t, ctx, pool, scope, "stopped-0"), Limit: 2}
	for pages := 0; ; pages++ {
		page, err := idem.ListFlows(ctx, pool, filter)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range page.Flows {
			if f.State != "attention" || f.Step != "sms" || !strings.Contains(f.LastError, "at most once") || f.Scope != scope ||
				f.Runs != 2 || f.CreatedAt.IsZero() || f.Leased {
				t.Fatalf("a stopped flow as listed: %+v", f)
			}
			keys = append(keys, f.Key)
		}
		if page.Next == "" {
			if pages != 1 {
				t.Fatalf("%d pages, want 2 of 2 and 1 of 1", pages+1)
			}
			break
		}
		filter.After = page.Next
	}
	if want := []string{"stopped-3", "stopped-2", "stopped-1", "stopped-0"}; !slices.Equal(keys, want) {
		t.Fatalf("listed %v, want %v", keys, want)
	}

	// Running, any flow of the scope, with their leases and runs.
	page, err := idem.ListFlows(ctx, pool, idem.FlowFilter{State: "running", Scope: scope})
	if err != nil || len(page.Flows) != 2 || page.Next != "" || page.Flows[0].Key != "running-1" || page.Flows[0].Leased ||
		page.Flows[0].LeasedUntil.IsZero() || page.Flows[0].Runs != 1 {
		t.Fatalf("running: %+v, %v", page, err)
	}
	// Ended, every scope's, by the flow's name.
	page, err = idem.ListFlows(ctx, pool, idem.FlowFilter{State: "ended", Name: filter.Name})
	if err != nil || len(page.Flows) != 1 || page.Flows[0].Key != "stopped-4" || page.Flows[0].LastError != "refunded" ||
		page.Flows[0].CompletedAt.IsZero() {
		t.Fatalf("ended: %+v, %v", page, err)
	}
	// Every scope's stopped flows include the other flow's.
	page, err = idem.ListFlows(ctx, pool, idem.FlowFilter{State: "attention", Limit: 1000})
	if err != nil || !slices.ContainsFunc(page.Flows, func(f idem.FlowSummary) bool { return f.Scope == scope && f.Key == "other-flow" }) {
		t.Fatalf("every scope's: %v", err)
	}
}

func TestListFlowsRefusesAFilterThatCannotWork(t *testing.T) {
	ctx, pool, _ := setup(t)
	for name, f := range map[string]idem.FlowFilter{
		"no state":        {},
		"state done":      {State: "done"},
		"a limit too big": {State: "running", Limit: 1001},
		"a negative one":  {State: "running", Limit: -1},
		"a cursor":        {State: "running", After: "not-a-cursor"},
		"a scope":         {State: "running", Scope: strings.Repeat("s", 256)},
		"a name":          {State: "running", Name: "a\x00b"},
	} {
		var fe *idem.FieldError
		if _, err := idem.ListFlows(ctx, pool, f); !errors.As(err, &fe) {
			t.Errorf("%s: %v, want a FieldError", name, err)
		}
	}
	if _, err := idem.ListFlows(ctx, pool, idem.FlowFilter{State: "running", Scope: "\xff"}); !errors.Is(err, idem.ErrInvalidScope) {
		t.Errorf("a scope that is not UTF-8: %v, want ErrInvalidScope", err)
	}
}

// flowName returns the name of the flow of (scope, key).
func flowName(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) string {
	t.Helper()
	info, err := idem.InspectFlow(ctx, pool, scope, key)
	if err != nil || !info.Found {
		t.Fatalf("the flow of %s: %+v, %v", key, info, err)
	}
	return info.Name
}
