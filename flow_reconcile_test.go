package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The tests of calls whose outcome is not known: a lookup that settles it
// (Reconcile), calls never made twice (AtMostOnce), and attempts that
// surely never left (ErrNotSent).

// keylessFlow charges in.Amount at p, a provider that ignores keys, with
// the operation's scope and key as the charge's reference, and answers the
// charge's id; its call has opts.
func keylessFlow(p *provider, opts []idem.CallOption, flowOpts ...idem.FlowOption) *idem.Flow[chargeIn, string] {
	return idem.MustNewFlow(testdb.Name("keyless"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		ref := s.Scope() + "/" + s.Key()
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.chargeRef(ctx, key, ref, in.Amount)
			return id, err
		}, opts...)
	}, flowOpts...)
}

// lookupByRef is a lookup of the charge at p by the operation's
// reference, which the attempt it resolves names.
func lookupByRef(p *provider) idem.CallOption {
	return idem.Reconcile(func(_ context.Context, a idem.Attempt) (string, bool, error) {
		id, found := p.lookup(a.Scope + "/" + a.Key)
		return id, found, nil
	})
}

// TestFlowReconcileIsToldTheAttemptItResolves: a lookup gets the call's
// provider key, the operation's scope and key, the step, and the attempts
// that may have reached the provider, the first when the record says.
func TestFlowReconcileIsToldTheAttemptItResolves(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	p.keyless = true
	var got idem.Attempt
	flow := keylessFlow(p, []idem.CallOption{idem.Reconcile(func(_ context.Context, a idem.Attempt) (string, bool, error) {
		got = a
		return "", false, nil
	})})
	loseFirstAnswer(p)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 100}); err == nil {
		t.Fatal("the attempt whose answer was lost succeeded")
	}
	before, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 100}); err != nil {
		t.Fatal(err)
	}
	call := before.Steps[0]
	want := idem.Attempt{ProviderKey: call.ProviderKey, Scope: scope, Key: "k", Step: "charge", Attempts: 1, FirstSentAt: call.FirstCalledAt}
	if got != want || got.FirstSentAt.IsZero() {
		t.Fatalf("the lookup was told %+v, want %+v", got, want)
	}
}

// loseFirstAnswer makes p's first call fail after it was applied, as a
// timeout loses an answer.
func loseFirstAnswer(p *provider) {
	p.after = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("timeout")
		}
		return nil
	}
}

func TestFlowReconcileFindsTheChargeWhoseAnswerWasLost(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	p.keyless = true
	observer, rec, _ := setupObserver(t, false)
	flow := keylessFlow(p, []idem.CallOption{lookupByRef(p)}, idem.WithObserver(observer))
	// A first attempt never looks up.
	if _, err := flow.Run(ctx, pool, scope, "first-time", fpCharge, chargeIn{Amount: 100}); err != nil || p.lookups.Load() != 0 {
		t.Fatalf("a first attempt: %v, %d lookups; want none", err, p.lookups.Load())
	}
	loseFirstAnswer(p)
	p.calls.Store(0)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("the attempt whose answer was lost: %v", err)
	}
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Value != "ch_2" {
		t.Fatalf("the retry: %+v, %v; want the charge the lookup found, ch_2", res, err)
	}
	if p.calls.Load() != 1 || p.lookups.Load() != 1 {
		t.Fatalf("%d calls and %d lookups; want the charge once and one lookup", p.calls.Load(), p.lookups.Load())
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.Steps[0].Reconciles != 1 || info.Steps[0].LastReconcile != "found" {
		t.Fatalf("the call's lookups: %+v, %v", info.Steps, err)
	}
	if got := rec.Count("idem.flow.reconciliations"); got["found"] != 1 || len(got) != 1 {
		t.Fatalf("lookups counted by outcome: %v, want 1 found", got)
	}
}

func TestFlowReconcileThatFindsNothingCallsAgainWithTheSameKey(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	p.keyless = true
	flow := keylessFlow(p, []idem.CallOption{lookupByRef(p), idem.AtMostOnce()}, idem.WithProviderWindow(0))
	// The first attempt fails before the provider applied it, which the
	// flow cannot tell from a lost answer.
	p.before = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("timeout")
		}
		return nil
	}
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first attempt succeeded")
	}
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatalf("the retry: %+v, %v", res, err)
	}
	charges, keys := p.effects()
	if charges != 1 || len(keys) != 1 || p.lookups.Load() != 1 {
		t.Fatalf("charges %d, keys %v, lookups %d; want 1 charge, one key, 1 lookup", charges, keys, p.lookups.Load())
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.Steps[0].LastReconcile != "not_found" || info.Steps[0].Attempts != 2 {
		t.Fatalf("the call: %+v, %v", info.Steps, err)
	}
}

func TestFlowReconcileThatFailsRecordsNothingAndAsksAgain(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	p.keyless = true
	var failures atomic.Int64
	lookup := idem.Reconcile(func(context.Context, idem.Attempt) (string, bool, error) {
		if failures.Add(1) == 1 {
			return "", false, errors.New("provider's search is down")
		}
		id, found := p.lookup(scope + "/k")
		return id, found, nil
	})
	flow := keylessFlow(p, []idem.CallOption{lookup})
	loseFirstAnswer(p)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first attempt succeeded")
	}
	_, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if !errors.Is(err, idem.ErrFlowIncomplete) || !strings.Contains(err.Error(), "search is down") {
		t.Fatalf("the attempt whose lookup failed: %v, want the flow incomplete with the lookup's error", err)
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); info.Steps[0].State != "calling" || !strings.HasPrefix(info.Steps[0].LastReconcile, "failed") {
		t.Fatalf("the call after a failed lookup: %+v", info.Steps[0])
	}
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Value != "ch_1" || p.calls.Load() != 1 {
		t.Fatalf("the next attempt: %+v, %v, %d calls; want ch_1 found, called once", res, err, p.calls.Load())
	}
}

func TestFlowReconcileThatFailsPastTheWindowStopsTheFlow(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	p.keyless = true
	lookup := idem.Reconcile(func(context.Context, idem.Attempt) (string, bool, error) {
		return "", false, errors.New("provider's search is down")
	})
	flow := keylessFlow(p, []idem.CallOption{lookup}, idem.WithProviderWindow(0))
	loseFirstAnswer(p)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first attempt succeeded")
	}
	for range 2 {
		if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
			t.Fatalf("a retry: %v, want ErrFlowStopped", err)
		}
	}
	if p.calls.Load() != 1 {
		t.Fatalf("the provider was called %d times, want once", p.calls.Load())
	}
}

func TestFlowReconcileOfAnotherTypeIsRefusedBeforeAnything(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	wrong := idem.Reconcile(func(context.Context, idem.Attempt) (int, bool, error) { return 0, false, nil })
	flow := keylessFlow(p, []idem.CallOption{wrong})
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("a lookup of ints for a call of strings: %v, want ErrInvalidOption", err)
	}
	if p.calls.Load() != 0 {
		t.Fatal("the call was made")
	}
}

func TestFlowAtMostOnceCallIsNeverMadeTwice(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	flow := keylessFlow(p, []idem.CallOption{idem.AtMostOnce()})
	loseFirstAnswer(p)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first attempt succeeded")
	}
	for range 2 {
		_, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		if !errors.Is(err, idem.ErrFlowStopped) || !strings.Contains(err.Error(), "at most once") {
			t.Fatalf("a retry: %v, want ErrFlowStopped saying the call is made at most once", err)
		}
	}
	if p.calls.Load() != 1 {
		t.Fatalf("the provider was called %d times, want once", p.calls.Load())
	}
}

func TestFlowCallThatWasNotSentIsMadeAgainEvenAtMostOnce(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var refused atomic.Bool
	refused.Store(true)
	flow := idem.MustNewFlow(testdb.Name("unsent"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		return idem.Call(s, "notify", func(ctx context.Context, key string) (string, error) {
			if refused.Load() {
				return "", fmt.Errorf("dial tcp 127.0.0.1:1: connect: connection refused: %w", idem.ErrNotSent)
			}
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		}, idem.AtMostOnce())
	}, idem.WithProviderWindow(0))
	for range 2 {
		if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("an attempt that was refused: %v, want ErrNotSent", err)
		}
	}
	// Neither attempt counts: neither may have reached the other system.
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); info.Steps[0].State != "unsent" || info.Steps[0].Attempts != 0 {
		t.Fatalf("the call after two refused attempts: %+v", info.Steps[0])
	}
	refused.Store(false)
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Value != "ch_1" || p.calls.Load() != 1 {
		t.Fatalf("the attempt once the other system is up: %+v, %v, %d calls", res, err, p.calls.Load())
	}
}

func TestFlowNotSentDoesNotUndoAnEarlierAttemptThatMayHaveBeenApplied(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var attempt atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("unsent"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		return idem.Call(s, "notify", func(ctx context.Context, key string) (string, error) {
			if attempt.Add(1) == 2 {
				return "", fmt.Errorf("connection refused: %w", idem.ErrNotSent)
			}
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		}, idem.AtMostOnce())
	})
	loseFirstAnswer(p)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first attempt succeeded")
	}
	// The second attempt is stopped before it calls: the first may have
	// been applied.
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the retry: %v, want ErrFlowStopped", err)
	}
	if attempt.Load() != 1 || p.calls.Load() != 1 {
		t.Fatalf("%d attempts, %d calls; want 1, 1", attempt.Load(), p.calls.Load())
	}
}

func TestProviderKeyFromContextIsTheCallsKey(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var seen, inLookup string
	flow := idem.MustNewFlow(testdb.Name("ctxkey"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		if _, ok := idem.ProviderKeyFromContext(ctx); ok {
			return "", errors.New("the flow's own context has a provider key")
		}
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			got, _ := idem.ProviderKeyFromContext(ctx)
			seen = got
			id, _, err := p.charge(ctx, got, in.Amount)
			return id, err
		}, idem.Reconcile(func(ctx context.Context, a idem.Attempt) (string, bool, error) {
			inLookup, _ = idem.ProviderKeyFromContext(ctx)
			return "", false, nil
		}))
	})
	loseFirstAnswer(p)
	_, _ = flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	want := providerKeyOf(t, ctx, pool, scope, "k", "charge")
	if seen != want || inLookup != want {
		t.Fatalf("the call's context had %q, its lookup's %q; want %q", seen, inLookup, want)
	}
}

func TestFlowCrashAfterTheCallAtAKeylessProviderIsReconciled(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	p.keyless = true
	name := testdb.Name("crash")
	crash(name, "k", crashAfterCall, true)
	reconcile := true
	res, err := crashFlowWith(name, providerURL, "", &reconcile).Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v; want the charge the lookup found", res, err)
	}
	if p.calls.Load() != 1 || p.lookups.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d calls, %d lookups, %d payments; want 1, 1, 1", p.calls.Load(), p.lookups.Load(), countPayments(t, pool, scope))
	}
}

// Without a lookup, the same crash charges a keyless provider twice: what
// Reconcile is for, and a check that the provider above ignores keys.
func TestFlowCrashAfterTheCallAtAKeylessProviderWithoutALookupChargesTwice(t *testing.T) {
	ctx, pool, scope, p, providerURL, crash := setupCrash(t)
	p.keyless = true
	name := testdb.Name("crash")
	crash(name, "k", crashAfterCall)
	if _, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if charges, _ := p.effects(); charges != 2 {
		t.Fatalf("%d charges; a keyless provider charges the call made again", charges)
	}
}
