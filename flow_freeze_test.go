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

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/keylock"
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
// killed when the test ends. The child reaches the tests' database unless
// job.URL says otherwise.
func freezeChild(t *testing.T, ctx context.Context, job crashJob) *frozenChild {
	t.Helper()
	if job.URL == "" {
		job.URL = env.URL(t)
	}
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

// kill kills the child, frozen or not, and waits for it.
func (c *frozenChild) kill(t *testing.T) {
	t.Helper()
	_ = c.cmd.Process.Kill()
	_ = c.cmd.Process.Signal(syscall.SIGCONT)
	_ = c.cmd.Wait()
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

// TestFlowFrozenInALocalStepIsEndedByTheServerAndTakenOver freezes an
// executor (SIGSTOP) with its local step's transaction open, in the step's
// function or in the wait for the flow's next statement that commits it:
// its session holds the flow's row, which no retry can take over, and TCP
// keepalives never end it, since the frozen process's kernel answers them.
// With an idle timeout, the server ends that session once it has sat idle
// that long, the child still frozen; a retry then takes the flow over and
// completes it, the step's write applied once. Woken, the frozen executor
// cannot act: its commit fails, it calls nobody, records nothing, and
// answers its client what a retry gets. Without one (WithIdleTimeout(-1),
// the server's own setting being off), the flow stays held past its lease
// and a retry's wait.
func TestFlowFrozenInALocalStepIsEndedByTheServerAndTakenOver(t *testing.T) {
	for _, at := range []string{freezeInStep, freezeBeforeCommit} {
		t.Run(at, func(t *testing.T) {
			ctx, pool, scope, p, providerURL, _ := setupCrash(t)
			name, app := testdb.Name("freeze"), testdb.Name("frozen")
			// Small, so that the test does not wait long, but not tiny: the
			// child must reach its freeze point, with its step's statements
			// no further apart than this, and the test see it frozen.
			idle := 2 * time.Second
			child := freezeChild(t, ctx, crashJob{Flow: name, Scope: scope, Key: "k", Provider: providerURL, At: at,
				IdleTimeout: &idle, App: app})
			pid := heldIdleInTransaction(t, ctx, pool, app, scope, "k")

			// The server ends the session while the child is still frozen:
			// after the idle timeout, surely before the default's minute.
			deadline := time.Now().Add(idem.DefaultFlowIdleTimeout / 2)
			for sessionAlive(t, ctx, pool, pid) {
				if time.Now().After(deadline) {
					t.Fatalf("the frozen child's session still open %s after it froze, with an idle timeout of %s", idem.DefaultFlowIdleTimeout/2, idle)
				}
				if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
					t.Fatal(err)
				}
			}
			if !child.stopped(t) {
				t.Fatal("the child woke before the server ended its session")
			}
			res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500},
				idem.WithWait(time.Minute))
			if err != nil || res.Replayed || res.Value.ChargeID != "ch_1" {
				t.Fatalf("the retry that took the flow over: %+v, %v", res, err)
			}
			got := child.wake(t)
			if got.Err != "" || !got.Replayed || got.Value != res.Value {
				t.Fatalf("the woken executor answered %+v, want %+v replayed\n%s", got, res.Value, child.stderr.String())
			}
			// One payment (the child's INSERT died with its session), one
			// charge, called once: by the retry.
			checkOneCharge(t, pool, scope, "k", p, 1)
		})
	}
	t.Run("unbounded", func(t *testing.T) {
		ctx, pool, scope, p, providerURL, _ := setupCrash(t)
		var server string
		if err := pool.QueryRow(ctx, `SHOW idle_in_transaction_session_timeout`).Scan(&server); err != nil || server != "0" {
			t.Fatalf("the server's idle_in_transaction_session_timeout is %q (%v), want 0 (off)", server, err)
		}
		name, app := testdb.Name("freeze"), testdb.Name("frozen")
		none := -time.Second
		freezeChild(t, ctx, crashJob{Flow: name, Scope: scope, Key: "k", Provider: providerURL, At: freezeInStep,
			IdleTimeout: &none, App: app})
		heldIdleInTransaction(t, ctx, pool, app, scope, "k")
		if flowCommitted(t, ctx, pool, scope, "k") {
			// A new flow's row is not there to take over, lease or not.
			leaseRanOut(t, ctx, pool, scope, "k")
		}
		_, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500},
			idem.WithWait(time.Second))
		if !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("a retry of a flow whose frozen executor has no idle timeout: %v, want ErrInProgress", err)
		}
		if p.calls.Load() != 0 || countPayments(t, pool, scope) != 0 {
			t.Fatalf("%d calls, %d payments; want none", p.calls.Load(), countPayments(t, pool, scope))
		}
	})
}

// heldIdleInTransaction returns the pid of the session of application app
// that is idle in a transaction holding the row of (scope, key)'s flow,
// as a frozen executor's is. The session is looked for once: the child
// stopped after its last statement, and the server ends it only after its
// idle timeout, far longer than one look takes.
func heldIdleInTransaction(t *testing.T, ctx context.Context, pool *pgxpool.Pool, app, scope, key string) int32 {
	t.Helper()
	var pid int32
	err := pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle in transaction'`,
		app).Scan(&pid)
	if err != nil {
		t.Fatalf("the frozen child's session idle in a transaction: %v", err)
	}
	if !flowCommitted(t, ctx, pool, scope, key) {
		// A new flow, whose first step's open transaction holds its row,
		// uncommitted, and the flow's lock (on Citus, on the node of the
		// scope's shard: the statement names the flow's row, as the
		// claim's lock does, so that Citus runs it there).
		var taken bool
		if err := pool.QueryRow(ctx, `SELECT NOT pg_try_advisory_xact_lock($1)
			WHERE NOT EXISTS (SELECT FROM idem_flow WHERE scope = $2 AND key = $3 LIMIT 0)`,
			keylock.FlowID(scope, key), scope, key).Scan(&taken); err != nil || !taken {
			t.Fatalf("the flow's lock taken: %t, %v; want the frozen session to hold it", taken, err)
		}
		return pid
	}
	_, err = pool.Exec(ctx, `SELECT FROM idem_flow WHERE scope = $1 AND key = $2 FOR UPDATE NOWAIT`, scope, key)
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); !ok || pgErr.Code != "55P03" {
		t.Fatalf("locking the flow's row: %v, want lock_not_available (55P03): the frozen session holds it", err)
	}
	return pid
}

// flowCommitted reports whether the flow (scope, key) has a committed row.
func flowCommitted(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) bool {
	t.Helper()
	var found bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM idem_flow WHERE scope = $1 AND key = $2)`, scope, key).Scan(&found); err != nil {
		t.Fatal(err)
	}
	return found
}

// sessionAlive reports whether the server still has the session of pid.
func sessionAlive(t *testing.T, ctx context.Context, pool *pgxpool.Pool, pid int32) bool {
	t.Helper()
	var alive bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&alive); err != nil {
		t.Fatal(err)
	}
	return alive
}
