package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// frozenChild is a child process (see flow_crash_test.go) stopped at its
// job's freeze point.
type frozenChild struct {
	cmd    *exec.Cmd
	stdout bytes.Buffer
	stderr bytes.Buffer
}

// freezeChild runs job in a child process and waits until it has stopped
// itself at job.At; the test wakes it with wake. A child left frozen is
// killed when the test ends.
func freezeChild(t *testing.T, ctx context.Context, job crashJob) *frozenChild {
	t.Helper()
	job.URL = env.URL(t)
	spec, err := json.Marshal(job)
	if err != nil {
		t.Fatal(err)
	}
	c := &frozenChild{cmd: exec.CommandContext(ctx, os.Args[0], "-test.run=^$")}
	c.cmd.Env = append(os.Environ(), crashEnv+"="+string(spec))
	c.cmd.Stdout, c.cmd.Stderr = &c.stdout, &c.stderr
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if c.cmd.ProcessState == nil {
			_ = c.cmd.Process.Kill()
			_ = c.cmd.Process.Signal(syscall.SIGCONT)
			_ = c.cmd.Wait()
		}
	})
	for !c.stopped(t) {
		if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
			t.Fatalf("the child did not stop at %s: %v\n%s", job.At, err, c.stderr.String())
		}
	}
	return c
}

// stopped reports whether the child is stopped by a signal, as the kernel
// says in /proc/<pid>/stat; it fails the test if the child exited.
func (c *frozenChild) stopped(t *testing.T) bool {
	t.Helper()
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.cmd.Process.Pid))
	if err != nil {
		t.Fatalf("read the child's state: %v", err)
	}
	// pid (comm) state ...: the state follows the last ')'.
	fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	switch fields[0] {
	case "T":
		return true
	case "Z", "X":
		t.Fatalf("the child exited before its freeze point:\n%s", c.stderr.String())
	}
	return false
}

// wake continues the child and returns what its run returned.
func (c *frozenChild) wake(t *testing.T) childResult {
	t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Wait(); err != nil {
		t.Fatalf("the woken child: %v\n%s", err, c.stderr.String())
	}
	var res childResult
	if err := json.Unmarshal(c.stdout.Bytes(), &res); err != nil {
		t.Fatalf("the woken child's answer %q: %v\n%s", c.stdout.String(), err, c.stderr.String())
	}
	return res
}

func TestFlowFrozenAfterItsIntentCallsNobodyOnceAnotherCompletedIt(t *testing.T) {
	ctx, pool, scope, p, providerURL, _ := setupCrash(t)
	name := testdb.Name("freeze")
	child := freezeChild(t, ctx, crashJob{Flow: name, Scope: scope, Key: "k", Provider: providerURL, At: freezeAfterIntent})
	leaseRanOut(t, ctx, pool, scope, "k")
	res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Replayed {
		t.Fatalf("the retry that took the flow over: %+v, %v", res, err)
	}
	// The frozen executor wakes past its lease: it calls nobody, and
	// answers its client what a retry gets.
	got := child.wake(t)
	if got.Err != "" || !got.Replayed || got.Value != res.Value {
		t.Fatalf("the woken executor answered %+v, want %+v replayed", got, res.Value)
	}
	checkOneCharge(t, pool, scope, "k", p, 1)
}

func TestFlowFrozenAfterItsIntentCallsNobodyOnceAnOperatorEndedIt(t *testing.T) {
	ctx, pool, scope, p, providerURL, _ := setupCrash(t)
	name := testdb.Name("freeze")
	never := time.Duration(0) // a call is never made twice
	child := freezeChild(t, ctx, crashJob{Flow: name, Scope: scope, Key: "k", Provider: providerURL, At: freezeAfterIntent, Window: &never})
	leaseRanOut(t, ctx, pool, scope, "k")
	// A retry finds the call's intent without a result, and stops the
	// flow for a person, who learns from the provider that nothing was
	// charged, and ends it.
	_, err := crashFlow(name, providerURL, "", idem.WithProviderWindow(never)).Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the retry: %v, want ErrFlowStopped", err)
	}
	if ended, err := idem.EndFlow(ctx, pool, scope, "k", "not charged: checked with the provider"); err != nil || !ended {
		t.Fatalf("EndFlow = %t, %v", ended, err)
	}
	got := child.wake(t)
	if !got.Stopped {
		t.Fatalf("the woken executor answered %+v, want ErrFlowStopped", got)
	}
	if p.calls.Load() != 0 {
		t.Fatalf("the provider was called %d times on a flow an operator ended as not charged\n%s", p.calls.Load(), child.stderr.String())
	}
}

func TestFlowFrozenMidCallAnswersItsClientWhatARetryGets(t *testing.T) {
	ctx, pool, scope, p, providerURL, _ := setupCrash(t)
	name := testdb.Name("freeze")
	child := freezeChild(t, ctx, crashJob{Flow: name, Scope: scope, Key: "k", Provider: providerURL, At: freezeInCall})
	leaseRanOut(t, ctx, pool, scope, "k")
	res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Replayed {
		t.Fatalf("the retry that took the flow over: %+v, %v", res, err)
	}
	// The frozen executor wakes with its call's answer: it records nothing,
	// and answers its client the completed operation's answer, not "in
	// progress".
	got := child.wake(t)
	if got.Err != "" || !got.Replayed || got.Value != res.Value {
		t.Fatalf("the woken executor answered %+v, want %+v replayed", got, res.Value)
	}
	checkOneCharge(t, pool, scope, "k", p, 2)
}
