package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem/cmd/idem/cli"
)

// The flow soak runs its workers as this program run again, with
// flowSoakWorkerEnv set: in the tests, this test binary, which must then be
// a worker and nothing else, before TestMain starts a database.
func init() {
	spec := os.Getenv(flowSoakWorkerEnv)
	if spec == "" {
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := runFlowSoakWorker(ctx, spec, os.Stdin, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(cli.ExitFailure)
	}
	os.Exit(cli.ExitOK)
}

// TestFlowSoakEffectsEqualOperationsWhileWorkersAreKilledAndFrozen runs a
// short flow soak: 320 operations on two worker processes, a worker
// killed with SIGKILL during one operation in 20, and another frozen with
// SIGSTOP during one in 20 (woken with SIGCONT only once another executor
// took its flows over), each at the point of a flow that has had the
// fewest so far (a fault that missed its point is made again), so each
// point about twice, once with the client retrying and once with the
// client gone until the end, leaving the flow to a resumer; provider
// calls failing before applying, or applied
// and then timed out or cut, and a fifth of the operations sent twice at
// once. The provider must have charged each operation once, no call may
// arrive after its flow was done (a fenced executor calling) but from a
// process frozen after handing it to its HTTP client (the residue
// docs/flows.md names, which a keyed provider answers with its charge), the business
// tables hold one payment and one ledger row for each, and every answer be
// the stored one; and every fault must have hit.
func TestFlowSoakEffectsEqualOperationsWhileWorkersAreKilledAndFrozen(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 8*time.Minute)
	defer cancel()
	cfg := defaultFlowSoakConfig()
	// A database of its own: the soak's tables are created on the way.
	cfg.DatabaseURL = env.EmptyDatabase(t)
	cfg.Ops, cfg.Clients, cfg.Workers, cfg.KillEvery, cfg.FreezeEvery = 320, 8, 2, 20, 20
	cfg.FailBeforeApply, cfg.TimeoutAfterApply, cfg.CutAfterApply = 0.05, 0.05, 0.05

	rep := runFlowSoakTest(t, ctx, cfg)
	if rep.Effects != cfg.Ops || rep.MissingEffects != 0 || rep.UnknownKeys != 0 || rep.Doubled != 0 {
		t.Errorf("%d provider effects for %d operations (%d never applied, %d under unknown keys, %d charged twice)",
			rep.Effects, cfg.Ops, rep.MissingEffects, rep.UnknownKeys, rep.Doubled)
	}
	if rep.Payments != cfg.Ops || rep.Ledger != cfg.Ops || rep.MissingRows != 0 || rep.DoubledRows != 0 {
		t.Errorf("%d payments and %d ledger rows for %d operations", rep.Payments, rep.Ledger, cfg.Ops)
	}
	if rep.WrongAnswers != 0 || rep.Unanswered != 0 || len(rep.NotDone) != 0 {
		t.Errorf("%d wrong answers, %d operations unanswered, flows not done %v; want none", rep.WrongAnswers, rep.Unanswered, rep.NotDone)
	}
	// A call that arrives after its flow was done is a fenced executor's,
	// unless its process was frozen while the call was under way: the
	// residue docs/flows.md names, which a keyed provider answers with the
	// charge it made.
	t.Logf("%d provider calls after their flow was done, %d of them from a process frozen while the call was under way",
		rep.CallsAfterDone, rep.FrozenLate)
	if rep.CallsAfterDone != rep.FrozenLate || rep.WokenEarly != 0 || rep.OverlappingFreezes != 0 {
		t.Errorf("%d provider calls after their flow was done from a process not frozen during the call, %d workers woken before their flows were taken over, "+
			"%d freezes while another worker was frozen; want none", rep.CallsAfterDone-rep.FrozenLate, rep.WokenEarly, rep.OverlappingFreezes)
	}
	// A soak in which a fault never hit proves nothing about that fault.
	for _, point := range flowKillPoints {
		if rep.Kills[point] == 0 {
			t.Errorf("no worker was killed at %s", point)
		}
		if rep.Freezes[point] == 0 {
			t.Errorf("no worker was frozen at %s", point)
		}
	}
	for what, n := range map[string]int64{
		"provider calls failed before applying":            rep.FailedBefore,
		"provider calls applied and timed out":             rep.TimedOutAfter,
		"provider calls applied and cut":                   rep.CutAfter,
		"operations sent twice at once":                    int64(rep.Twins),
		"operations completed while their client was away": int64(rep.CompletedAway),
		"keys the provider was called with again":          int64(rep.Recalled),
	} {
		if n == 0 {
			t.Errorf("no %s: the soak did not exercise that", what)
		}
	}
}

// TestFlowSoakKeylessProvider runs the flow soak against a provider that
// applies every request it gets, keys or not, with a worker killed at each
// point of a flow and another frozen at each, three ways: with a lookup at
// the provider (idem.Reconcile), no operation may be charged twice or
// not at all; with idem.AtMostOnce, none may be charged twice, and those
// whose outcome was unknown stop for a person; with neither, the soak
// must see the doubles that the documentation warns of (a killed worker
// whose call was applied is certain to make one). The one double a lookup
// or AtMostOnce cannot prevent is the residue docs/flows.md names: a call
// whose process froze after its last look at the call's context and
// before its request was written, sent when it wakes, after another
// executor completed the flow. The soak identifies such a call (its
// process was frozen while the call was under way, and it arrived after
// the flow was done); a double made by any other call fails the test.
func TestFlowSoakKeylessProvider(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	base := defaultFlowSoakConfig()
	base.Ops, base.Clients, base.Workers, base.KillEvery, base.FreezeEvery = 128, 8, 2, 16, 16
	base.Provider = providerKeyless

	t.Run("reconcile", func(t *testing.T) {
		cfg := base
		cfg.DatabaseURL, cfg.Reconcile = env.EmptyDatabase(t), true
		rep := runFlowSoakTest(t, ctx, cfg)
		t.Logf("reconcile: %d of %d operations charged twice by a call whose process froze while it was under way (the residue)", rep.DoubledFrozen, cfg.Ops)
		if rep.Doubled != rep.DoubledFrozen || rep.Effects != cfg.Ops+rep.ExtraFrozen || rep.MissingEffects != 0 || rep.Stopped != 0 {
			t.Errorf("%d effects for %d operations, %d charged twice (%d by the residue), %d never, %d stopped; want one each",
				rep.Effects, cfg.Ops, rep.Doubled, rep.DoubledFrozen, rep.MissingEffects, rep.Stopped)
		}
		if rep.Found == 0 || rep.Lookups == rep.Found {
			t.Errorf("%d lookups, %d found the charge: want lookups that found it and lookups that did not", rep.Lookups, rep.Found)
		}
	})
	t.Run("at most once", func(t *testing.T) {
		cfg := base
		cfg.DatabaseURL, cfg.AtMostOnce = env.EmptyDatabase(t), true
		rep := runFlowSoakTest(t, ctx, cfg)
		t.Logf("at most once: %d of %d operations stopped for a person (%d charged once, %d not charged)",
			rep.Stopped, cfg.Ops, rep.StoppedCharged, rep.StoppedUncharged)
		if rep.Doubled != rep.DoubledFrozen || rep.MissingEffects != 0 {
			t.Errorf("%d operations charged twice (%d by the residue), %d done but never charged; want none", rep.Doubled, rep.DoubledFrozen, rep.MissingEffects)
		}
		if rep.Stopped == 0 || rep.StoppedCharged == 0 {
			t.Errorf("%d operations stopped, %d of them charged: a worker killed after the provider applied its call must stop one", rep.Stopped, rep.StoppedCharged)
		}
	})
	t.Run("neither", func(t *testing.T) {
		cfg := base
		cfg.DatabaseURL = env.EmptyDatabase(t)
		rep := runFlowSoakTest(t, ctx, cfg)
		t.Logf("neither: %d of %d operations charged more than once (%d extra charges)", rep.Doubled, cfg.Ops, rep.Extra)
		if rep.Doubled == 0 || rep.Effects != cfg.Ops+rep.Extra {
			t.Errorf("%d operations charged twice, %d effects for %d operations: a worker killed after the provider applied its call must make a double",
				rep.Doubled, rep.Effects, cfg.Ops)
		}
	})
}

// runFlowSoakTest runs a flow soak with cfg, logs its output, and fails the
// test if it found a violation.
func runFlowSoakTest(t *testing.T, ctx context.Context, cfg flowSoakConfig) *flowSoakReport {
	t.Helper()
	var out bytes.Buffer
	rep, err := flowSoak(ctx, cfg, &out)
	t.Logf("flow soak output:\n%s", out.String())
	if err != nil {
		t.Fatalf("flow soak: %v", err)
	}
	return rep
}

// TestFlowSoakWritesOnlyToADatabaseOfItsOwn runs the command as a user
// would, pointed at an empty database: it must run in a database it
// created and dropped, leaving the given one as it was.
func TestFlowSoakWritesOnlyToADatabaseOfItsOwn(t *testing.T) {
	url := env.EmptyDatabase(t)
	code, out := runCommand(t, url, "flowsoak", "-ops", "40", "-clients", "4", "-workers", "1", "-kill-every", "10", "-freeze-every", "0")
	if code != cli.ExitOK {
		t.Fatalf("idem flowsoak: exit %d\n%s", code, out)
	}
	m := createdDatabase.FindStringSubmatch(out)
	if m == nil || !strings.Contains(out, `removed database "`+m[1]+`"`) {
		t.Fatalf("idem flowsoak did not say it created and removed a database of its own:\n%s", out)
	}
	if databaseExists(t, url, m[1]) {
		t.Errorf("idem flowsoak left its database %s behind", m[1])
	}
	if tables := userTables(t, url); len(tables) != 0 {
		t.Fatalf("idem flowsoak wrote into the database it was given: %v", tables)
	}
}

// TestFlowSoakConfigRejectsOutOfBounds checks the bounds that keep a flow
// soak finite and its chances meaningful.
func TestFlowSoakConfigRejectsOutOfBounds(t *testing.T) {
	t.Parallel()
	for name, change := range map[string]func(*flowSoakConfig){
		"no operations":          func(c *flowSoakConfig) { c.Ops = 0 },
		"too many operations":    func(c *flowSoakConfig) { c.Ops = maxFlowSoakOps + 1 },
		"no clients":             func(c *flowSoakConfig) { c.Clients = 0 },
		"no workers":             func(c *flowSoakConfig) { c.Workers = 0 },
		"negative kill-every":    func(c *flowSoakConfig) { c.KillEvery = -1 },
		"negative freeze-every":  func(c *flowSoakConfig) { c.FreezeEvery = -1 },
		"freezes on one worker":  func(c *flowSoakConfig) { c.Workers = 1 },
		"unknown provider":       func(c *flowSoakConfig) { c.Provider = "sloppy" },
		"chance above one":       func(c *flowSoakConfig) { c.Twin = 1.5 },
		"negative chance":        func(c *flowSoakConfig) { c.Abandon = -0.1 },
		"provider faults over 1": func(c *flowSoakConfig) { c.FailBeforeApply, c.TimeoutAfterApply, c.CutAfterApply = 0.5, 0.4, 0.2 },
		"lease too short":        func(c *flowSoakConfig) { c.Lease = time.Millisecond },
		"no provider timeout":    func(c *flowSoakConfig) { c.ProviderTimeout = 0 },
		"no operation timeout":   func(c *flowSoakConfig) { c.OpTimeout = 0 },
	} {
		cfg := defaultFlowSoakConfig()
		change(&cfg)
		if err := cfg.validate(); err == nil {
			t.Errorf("%s: validate accepted %+v", name, cfg)
		}
	}
	if err := defaultFlowSoakConfig().validate(); err != nil {
		t.Errorf("the default configuration is invalid: %v", err)
	}
}
