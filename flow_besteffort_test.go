package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The tests of BestEffort: a text after the charge whose outcome is not
// known does not hold up the answer.

func TestBestEffortCallWhoseAnswerIsLostDoesNotHoldUpTheAnswer(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	g := newSMS()
	g.lose = func(int) bool { return true }
	flow := checkoutFlow(p, g, idem.BestEffort())
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil || res.Value.SMS != "unknown" || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the first run: %+v, %v; want the receipt, its text unknown", res, err)
	}
	again, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil || !again.Replayed || again.Value != res.Value || g.sends() != 1 {
		t.Fatalf("the retry: %+v, %v, %d texts; want the answer replayed, one text", again, err, g.sends())
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.State != "done" || info.Steps[2].State != "unknown" || info.Steps[2].Attempts != 1 ||
		info.Steps[2].CompletedAt.IsZero() {
		t.Fatalf("the flow: %+v, %v; want its text unknown", info, err)
	}
}

// TestBestEffortCallFoundCallingIsRecordedUnknownOnEveryRun: a run that
// died during the call leaves its intent; the next run records the
// outcome as unknown without calling, and every run after it gets the
// same.
func TestBestEffortCallFoundCallingIsRecordedUnknownOnEveryRun(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	g := newSMS()
	var unknowns []error
	flow := idem.MustNewFlow(testdb.Name("notify"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		id, err := idem.Call(s, "sms", func(ctx context.Context, key string) (string, error) {
			return g.send(ctx, key)
		}, idem.BestEffort())
		if errors.Is(err, idem.ErrOutcomeUnknown) {
			unknowns = append(unknowns, err)
			return "", err // this flow's function gives up: it never completes
		}
		return id, err
	})
	// As a run whose process died during the call: its intent recorded.
	g.lose = func(int) bool { return true }
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{}); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("the first run: %v, want ErrOutcomeUnknown", err)
	}
	setCalling(t, ctx, pool, scope, 0)
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); info.Steps[0].State != "calling" {
		t.Fatalf("the call set back to calling: %+v", info.Steps[0])
	}
	for run := range 2 {
		_, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{})
		if !errors.Is(err, idem.ErrOutcomeUnknown) || !errors.Is(err, idem.ErrFlowIncomplete) {
			t.Fatalf("run %d: %v, want ErrOutcomeUnknown", run+2, err)
		}
	}
	if g.sends() != 1 || len(unknowns) != 3 || !strings.Contains(unknowns[1].Error(), "may have reached") {
		t.Fatalf("%d texts, the function saw %v; want one text, three unknowns", g.sends(), unknowns)
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); info.State != "running" || info.Steps[0].State != "unknown" {
		t.Fatalf("the flow: %+v", info)
	}
}

func TestBestEffortCallNotSentIsMadeByTheNextRun(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	g := newSMS()
	refused := true
	flow := idem.MustNewFlow(testdb.Name("notify"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		return idem.Call(s, "sms", func(ctx context.Context, key string) (string, error) {
			if refused {
				return "", fmt.Errorf("connection refused: %w", idem.ErrNotSent)
			}
			return g.send(ctx, key)
		}, idem.BestEffort())
	})
	_, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{})
	if !errors.Is(err, idem.ErrNotSent) || errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("a call refused: %v, want ErrNotSent, not unknown", err)
	}
	refused = false
	if res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{}); err != nil || res.Value != "sms_1" {
		t.Fatalf("the next run: %+v, %v; want the text sent", res, err)
	}
}

func TestBestEffortLookupThatFailsRecordsUnknown(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	p.keyless = true
	lookups := 0
	flow := keylessFlow(p, []idem.CallOption{idem.BestEffort(), idem.Reconcile(func(context.Context, idem.Attempt) (string, bool, error) {
		lookups++
		return "", false, errors.New("the provider's search is down")
	})})
	loseFirstAnswer(p)
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1}); !errors.Is(err, idem.ErrOutcomeUnknown) {
		t.Fatalf("the first attempt: %v, want ErrOutcomeUnknown", err)
	}
	setCalling(t, ctx, pool, scope, 0) // as if its process died during the call
	for run := range 2 {
		_, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1})
		if !errors.Is(err, idem.ErrOutcomeUnknown) || run == 0 && !strings.Contains(err.Error(), "search is down") {
			t.Fatalf("run %d: %v, want ErrOutcomeUnknown", run+2, err)
		}
	}
	if lookups != 1 || p.calls.Load() != 1 {
		t.Fatalf("%d lookups, %d calls; want one of each", lookups, p.calls.Load())
	}
}

// setCalling sets the record of the step at seq of the flow in scope back
// to calling, as a run that died during the call leaves it.
func setCalling(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope string, seq int) {
	t.Helper()
	if _, err := pool.Exec(ctx, `UPDATE idem_flow SET steps = jsonb_set(steps, ARRAY[$2::text],
		to_jsonb(regexp_replace(steps->>$2::text, '^([^,;]*,[^,;]*,)[?]', '\1c'))) WHERE scope = $1`, scope, fmt.Sprint(seq)); err != nil {
		t.Fatal(err)
	}
}
