package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
)

// go run ./lab flowsoak: flows (a local reserve, a call to a payment provider, a
// local record) run by worker processes that are killed at every point of
// a flow, against a fake provider that honours idempotency keys and counts
// what it applied, with provider calls that fail, time out or lose their
// answer after applying, and duplicates sent at once; then a check that
// provider effects, business rows and logical operations are equal, and
// that every answer a client got is the one stored.
//
// The parts: flowsoak_flow.go is the worker process (the flow, served over
// HTTP, and its resumer); flowsoak_workers.go starts, kills and restarts
// the workers; flowsoak_provider.go is the fake provider; flowsoak_load.go
// the clients; flowsoak_report.go the final check and report.

// flowSoakSchema is the flow's business tables: a payment per operation,
// written by the reserve step, and a ledger entry per operation, written
// by the record step with the provider's answer. Neither has a unique
// constraint, so that a step run twice shows as a second row instead of
// failing.
var flowSoakSchema = []string{
	`CREATE TABLE IF NOT EXISTS idem_flowsoak_payment (
    id           bigserial   PRIMARY KEY,
    scope        text        NOT NULL,
    key          text        NOT NULL,
    amount_cents bigint      NOT NULL,
    status       text        NOT NULL,
    charge_id    text,
    created_at   timestamptz NOT NULL DEFAULT now()
)`,
	`CREATE INDEX IF NOT EXISTS idem_flowsoak_payment_scope_key_idx ON idem_flowsoak_payment (scope, key)`,
	`CREATE TABLE IF NOT EXISTS idem_flowsoak_ledger (
    id         bigserial   PRIMARY KEY,
    scope      text        NOT NULL,
    key        text        NOT NULL,
    payment_id bigint      NOT NULL,
    charge_id  text        NOT NULL,
    status     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)`,
	`CREATE INDEX IF NOT EXISTS idem_flowsoak_ledger_scope_key_idx ON idem_flowsoak_ledger (scope, key)`,
}

// maxFlowSoakOps is the most operations one run may make.
const maxFlowSoakOps = 100_000

// flowSoakConfig is one run of the flow soak. A zero chance, or a zero
// KillEvery, turns that fault off.
type flowSoakConfig struct {
	// DatabaseURL is the database to soak: one made for the soak
	// (runFlowSoak makes one).
	DatabaseURL string
	// Ops is how many logical operations (payments) to make.
	Ops int
	// Clients is how many operations are in flight at once (a duplicate
	// sent at once adds one for its operation).
	Clients int
	// Workers is how many worker processes run the flow.
	Workers int
	// KillEvery, when positive, kills a worker with SIGKILL during one
	// operation in KillEvery, at the kill point hit least so far (see
	// flowKillPoints): the faults are paced by the operations, not by the
	// clock.
	KillEvery int
	// FreezeEvery, when positive, freezes a worker with SIGSTOP during one
	// operation in FreezeEvery, at the point frozen least so far, and wakes it
	// with SIGCONT once every flow that was running when it froze has been
	// taken over by another executor or has ended: paced by the flows'
	// progress, not by the clock. The frozen worker wakes fenced, and must
	// act no more on those flows.
	FreezeEvery int
	// Provider is how the fake provider treats idempotency keys:
	// providerKeyed (it applies a key once, as Stripe does) or
	// providerKeyless (it applies every request it gets).
	Provider string
	// Reconcile gives the charge a lookup at the provider by its provider
	// key (idem.Reconcile); AtMostOnce marks it idem.AtMostOnce.
	Reconcile, AtMostOnce bool
	// Twin is the chance that an operation is sent by two clients at once,
	// to different workers.
	Twin float64
	// Abandon is the chance that an operation's client gives up after a
	// failed attempt, leaving the flow to the workers' resumers, and comes
	// back for the answer only at the end. Half the operations whose
	// worker is killed are abandoned too.
	Abandon float64
	// FailBeforeApply, TimeoutAfterApply and CutAfterApply are the chances
	// that a provider call fails with a 503 before the provider applies
	// it, is applied and then left unanswered until the caller times out,
	// or is applied and then has its connection cut.
	FailBeforeApply, TimeoutAfterApply, CutAfterApply float64
	// Lease is the flow's lease (idem.WithLease): how long a killed
	// worker's flows wait before another executor may take them over.
	Lease time.Duration
	// ProviderTimeout is how long a worker waits for the provider's
	// answer.
	ProviderTimeout time.Duration
	// OpTimeout bounds an operation, its retries included, and the wait
	// for the resumers at the end: past it the soak fails.
	OpTimeout time.Duration
	// Verbose prints the workers' logs and an example of each failure.
	Verbose bool
}

// defaultFlowSoakConfig is the configuration of "go run ./lab flowsoak" without
// flags.
func defaultFlowSoakConfig() flowSoakConfig {
	return flowSoakConfig{
		Ops:               2000,
		Clients:           16,
		Workers:           3,
		KillEvery:         25,
		FreezeEvery:       25,
		Provider:          providerKeyed,
		Twin:              0.2,
		Abandon:           0.05,
		FailBeforeApply:   0.03,
		TimeoutAfterApply: 0.03,
		CutAfterApply:     0.03,
		Lease:             2 * time.Second,
		ProviderTimeout:   time.Second,
		OpTimeout:         3 * time.Minute,
	}
}

func (c flowSoakConfig) validate() error {
	chance := func(name string, p float64) error {
		if p < 0 || p > 1 {
			return fmt.Errorf("%s must be between 0 and 1, got %g", name, p)
		}
		return nil
	}
	switch {
	case c.Ops < 1 || c.Ops > maxFlowSoakOps:
		return fmt.Errorf("-ops must be between 1 and %d, got %d", maxFlowSoakOps, c.Ops)
	case c.Clients < 1 || c.Clients > 256:
		return fmt.Errorf("-clients must be between 1 and 256, got %d", c.Clients)
	case c.Workers < 1 || c.Workers > 16:
		return fmt.Errorf("-workers must be between 1 and 16, got %d", c.Workers)
	case c.KillEvery < 0 || c.FreezeEvery < 0:
		return errors.New("-kill-every and -freeze-every must not be negative")
	case c.FreezeEvery > 0 && c.Workers < 2:
		return errors.New("-freeze-every needs at least 2 workers, one to take over the frozen one's flows (or -freeze-every 0)")
	case c.Provider != providerKeyed && c.Provider != providerKeyless:
		return fmt.Errorf("-provider must be %s or %s, got %q", providerKeyed, providerKeyless, c.Provider)
	case c.Lease < 10*time.Millisecond:
		return fmt.Errorf("-lease must be at least 10ms, got %s", c.Lease)
	case c.ProviderTimeout <= 0 || c.OpTimeout <= 0:
		return errors.New("-provider-timeout and -op-timeout must be positive")
	}
	return errors.Join(chance("-twin", c.Twin), chance("-abandon", c.Abandon), chance("-fail-before-apply", c.FailBeforeApply),
		chance("-timeout-after-apply", c.TimeoutAfterApply), chance("-cut-after-apply", c.CutAfterApply),
		chance("the three provider faults together", c.FailBeforeApply+c.TimeoutAfterApply+c.CutAfterApply))
}

func runFlowSoak(ctx context.Context, args []string, stdout io.Writer) error {
	// A worker process is this program run again by a flow soak, told so
	// in its environment.
	if spec := os.Getenv(flowSoakWorkerEnv); spec != "" {
		return runFlowSoakWorker(ctx, spec, os.Stdin, os.Stdout, os.Stderr)
	}
	cfg := defaultFlowSoakConfig()
	fs := program.NewFlagSet(stdout, "flowsoak", `flowsoak [flags]

Runs many payments as flows (reserve locally, charge at a payment provider,
record locally) in worker processes that it kills with SIGKILL, and freezes
with SIGSTOP until another executor took their flows over, at every point
of a flow, against a fake provider, and then counts the provider's charges
per logical operation, checks that each operation left one payment row and
one ledger row, and that every answer a client got is the one stored. Like
soak, it runs in a database (or schema, or server) of its own, removed at
the end.

-provider keyless makes the provider apply every request it gets, keys or
not: with -reconcile (a lookup at the provider by the call's provider key)
no operation may be charged twice; with -at-most-once none may be charged
twice, and the operations whose outcome was unknown stop for a person's
decision (counted); with neither, the run counts the operations charged
twice, which only a provider that honours keys, or a lookup, prevents.

Every fault is paced by the operations, not by the clock, so a slow machine
meets the same faults, only later.`)
	fs.IntVar(&cfg.Ops, "ops", cfg.Ops, fmt.Sprintf("logical operations to make (at most %d)", maxFlowSoakOps))
	fs.IntVar(&cfg.Clients, "clients", cfg.Clients, "operations in flight at once")
	fs.IntVar(&cfg.Workers, "workers", cfg.Workers, "worker processes running the flow")
	fs.IntVar(&cfg.KillEvery, "kill-every", cfg.KillEvery, "kill a worker during one operation in `N`, at the kill point hit least so far (0: never)")
	fs.IntVar(&cfg.FreezeEvery, "freeze-every", cfg.FreezeEvery, "freeze a worker with SIGSTOP during one operation in `N`, at the point frozen least so far, until its flows are taken over (0: never)")
	fs.StringVar(&cfg.Provider, "provider", cfg.Provider, "the fake provider: `keyed` (applies each idempotency key once) or keyless (applies every request)")
	fs.BoolVar(&cfg.Reconcile, "reconcile", cfg.Reconcile, "give the charge a lookup at the provider by its provider key (idem.Reconcile)")
	fs.BoolVar(&cfg.AtMostOnce, "at-most-once", cfg.AtMostOnce, "mark the charge idem.AtMostOnce: an attempt of unknown outcome stops the flow for a person")
	fs.Float64Var(&cfg.Twin, "twin", cfg.Twin, "chance that an operation is sent by two clients at once")
	fs.Float64Var(&cfg.Abandon, "abandon", cfg.Abandon, "chance that a client gives up after a failed attempt and comes back at the end")
	fs.Float64Var(&cfg.FailBeforeApply, "fail-before-apply", cfg.FailBeforeApply, "chance that a provider call fails with 503 before it is applied")
	fs.Float64Var(&cfg.TimeoutAfterApply, "timeout-after-apply", cfg.TimeoutAfterApply, "chance that a provider call is applied and then left unanswered until the caller times out")
	fs.Float64Var(&cfg.CutAfterApply, "cut-after-apply", cfg.CutAfterApply, "chance that a provider call is applied and then has its connection cut")
	fs.DurationVar(&cfg.Lease, "lease", cfg.Lease, "the flow's lease: how long a killed worker's flows wait to be taken over")
	fs.DurationVar(&cfg.ProviderTimeout, "provider-timeout", cfg.ProviderTimeout, "how long a worker waits for the provider's answer")
	fs.DurationVar(&cfg.OpTimeout, "op-timeout", cfg.OpTimeout, "longest an operation may take, retries included, and the longest wait for the resumers at the end")
	fs.BoolVar(&cfg.Verbose, "v", cfg.Verbose, "print the workers' logs and an example error of every kind of failed attempt")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.UsageError{Err: fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))}
	}
	if err := cfg.validate(); err != nil {
		return cli.UsageError{Err: err}
	}
	sc, err := openScratch(ctx, stdout, "flowsoak")
	if err != nil {
		return err
	}
	defer sc.Close()
	cfg.DatabaseURL = sc.URL
	_, err = flowSoak(ctx, cfg, stdout)
	return err
}

// flowSoak runs a flow soak and returns what it found. The error is nil
// only when every operation was answered and applied exactly once, and
// every answer was the one stored.
func flowSoak(ctx context.Context, cfg flowSoakConfig, stdout io.Writer) (*flowSoakReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, cli.UsageError{Err: err}
	}
	stdout = &lockedWriter{w: stdout}
	admin, err := connectTo(ctx, cfg.DatabaseURL, 4)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	sqlDB := stdlib.OpenDBFromPool(admin)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		return nil, cli.DatabaseError{Err: err}
	}
	for _, ddl := range flowSoakSchema {
		if _, err := admin.Exec(ctx, ddl); err != nil {
			return nil, cli.DatabaseError{Err: fmt.Errorf("create the flow soak's tables: %w", err)}
		}
	}

	// The run's own scope and flow name: a run never counts, or resumes,
	// another's operations.
	run := "flowsoak-" + randomSuffix()
	provider, err := startFlowSoakProvider(cfg)
	if err != nil {
		return nil, err
	}
	defer provider.close()
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this program to run its workers: %w", err)
	}
	workers := newFlowSoakWorkers(exe, flowSoakWorkerSpec{
		DatabaseURL:     cfg.DatabaseURL,
		ProviderURL:     provider.url(),
		Flow:            run,
		Lease:           cfg.Lease,
		Wait:            2*cfg.Lease + time.Second,
		ResumeEvery:     250 * time.Millisecond,
		ProviderTimeout: cfg.ProviderTimeout,
		MaxConns:        8,
		Reconcile:       cfg.Reconcile,
		AtMostOnce:      cfg.AtMostOnce,
	}, cfg.Verbose, stdout)
	workers.admin, workers.lease, workers.limit = admin, cfg.Lease, cfg.OpTimeout
	provider.workers = workers

	fmt.Fprintf(stdout, "idem flowsoak: %d operations from %d clients on %d worker processes, scope %s\n",
		cfg.Ops, cfg.Clients, cfg.Workers, run)
	fmt.Fprintf(stdout, "  flow: reserve (local step), charge (call to the fake provider on %s), record (local step); lease %s\n",
		provider.listener.Addr(), cfg.Lease)
	fmt.Fprintf(stdout, "  provider: %s; the charge %s\n", describeFlowSoakProvider(cfg.Provider), describeFlowSoakCall(cfg))
	fmt.Fprintf(stdout, "  faults: %s\n", describeFlowSoakFaults(cfg))

	if err := workers.start(ctx, cfg.Workers); err != nil {
		workers.stop()
		return nil, err
	}
	load := &flowSoakLoad{cfg: cfg, scope: run, workers: workers, client: newFlowSoakClient(), freezeTurn: make(chan struct{}, 1),
		failures: make(map[string]int64), samples: make(map[string]string), killing: make(map[string]int64)}
	started := time.Now()
	ops := load.runAll(ctx, stdout)
	answered := time.Since(started)

	// The operations whose clients gave up are left to the resumers; their
	// clients come back once no flow runs any more.
	settled, settleErr := waitForFlows(ctx, admin, run, cfg.OpTimeout)
	load.comeBack(ctx, ops)
	elapsed := time.Since(started)
	stopErr := workers.stop()
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("interrupted: %w", err)
	}

	rep := load.report(ops, provider, workers)
	rep.AnsweredIn, rep.SettledIn, rep.Elapsed = answered, settled, elapsed
	if err := checkFlowSoak(ctx, admin, run, ops, provider, rep); err != nil {
		return rep, cli.DatabaseError{Err: err}
	}
	load.print(stdout, rep)

	violations := rep.violations()
	if settleErr != nil {
		violations = append(violations, settleErr.Error())
	}
	if stopErr != nil {
		violations = append(violations, stopErr.Error())
	}
	if len(violations) > 0 {
		workers.printLogs(stdout)
		return rep, fmt.Errorf("VIOLATION: %s", strings.Join(violations, "; "))
	}
	fmt.Fprintf(stdout, "\n%s\n", rep.verdict())
	return rep, nil
}

// waitForFlows waits until no flow of the run is running, for at most
// limit, and returns how long that took.
func waitForFlows(ctx context.Context, admin *pgxpool.Pool, flow string, limit time.Duration) (time.Duration, error) {
	started := time.Now()
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	for {
		var running int64
		err := admin.QueryRow(ctx, `SELECT count(*) FROM idem_flow WHERE name = $1 AND state = 'running'`, flow).Scan(&running)
		if err == nil && running == 0 {
			return time.Since(started), nil
		}
		if sleep(ctx, 100*time.Millisecond) != nil {
			return time.Since(started), fmt.Errorf("%d flows still running %s after the clients were done", running, limit)
		}
	}
}

func describeFlowSoakProvider(mode string) string {
	if mode == providerKeyless {
		return "keyless (applies every request it gets, keys or not)"
	}
	return "keyed (applies each idempotency key once, as Stripe does)"
}

func describeFlowSoakCall(cfg flowSoakConfig) string {
	var parts []string
	if cfg.Reconcile {
		parts = append(parts, "has a lookup at the provider by its provider key (idem.Reconcile)")
	}
	if cfg.AtMostOnce {
		parts = append(parts, "is made at most once (idem.AtMostOnce)")
	}
	if len(parts) == 0 {
		return "is made again, with its provider key, after an attempt of unknown outcome"
	}
	return strings.Join(parts, " and ")
}

func describeFlowSoakFaults(cfg flowSoakConfig) string {
	var parts []string
	if cfg.KillEvery > 0 {
		parts = append(parts, fmt.Sprintf("a worker killed (SIGKILL) during one operation in %d, at the least-hit of %d points", cfg.KillEvery, len(flowKillPoints)))
	}
	if cfg.FreezeEvery > 0 {
		parts = append(parts, fmt.Sprintf("a worker frozen (SIGSTOP, then SIGCONT once its flows were taken over) during one operation in %d, at the least-hit of %d points",
			cfg.FreezeEvery, len(flowKillPoints)))
	}
	for _, f := range []struct {
		p    float64
		what string
	}{
		{cfg.FailBeforeApply, "provider calls failed before applying"},
		{cfg.TimeoutAfterApply, "applied and left to time out"},
		{cfg.CutAfterApply, "applied and cut"},
		{cfg.Twin, "operations sent twice at once"},
		{cfg.Abandon, "clients giving up after a failure"},
	} {
		if f.p > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f%%", f.what, f.p*100))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// flowSoakTail keeps the last lines written to it, for a report.
type flowSoakTail struct {
	mu    sync.Mutex
	lines []string
	part  string
	echo  io.Writer // when set, every line is written there too
	tag   string
}

const flowSoakTailLines = 20

func (t *flowSoakTail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	text := t.part + string(p)
	lines := strings.Split(text, "\n")
	t.part = lines[len(lines)-1]
	for _, line := range lines[:len(lines)-1] {
		if t.echo != nil {
			fmt.Fprintf(t.echo, "  %s %s\n", t.tag, line)
		}
		t.lines = append(t.lines, line)
		if len(t.lines) > flowSoakTailLines {
			t.lines = t.lines[1:]
		}
	}
	return len(p), nil
}

func (t *flowSoakTail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(append(t.lines, t.part), "\n")
}
