//go:build citus

package idem_test

// The fault tests of idem on Citus (issue 39): a worker and the
// coordinator stopped the hard way (SIGQUIT, PostgreSQL's immediate stop,
// what a crash leaves) and started again in the middle of storms of Run
// and of flows whose clients come in through every node, and Citus's
// recovery of the prepared transactions of a transaction that spanned
// nodes. They start a cluster of their own, which they restart: never
// TestCitus's.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/citustemp"
	"github.com/pgidem/idem/internal/testdb"
)

// faultsDB is the database of the fault tests' cluster.
const faultsDB = "idem_faults"

// faultCluster is the fault tests' cluster and a pool on each node.
type faultCluster struct {
	c *citustemp.Cluster
	// nodes are pools on the coordinator (first) and on each worker,
	// which clients come in through (Citus's metadata is on every node).
	nodes []*pgxpool.Pool
	names []string
}

func (fc *faultCluster) coord() *pgxpool.Pool { return fc.nodes[0] }

// startCitusFaults starts a cluster as startCitus does, with durable
// commits: Fast turns synchronous_commit off, and a commit that a client
// was told of must outlive the node's crash.
func startCitusFaults(t *testing.T) *faultCluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, err := citustemp.Start(ctx, citustemp.Config{Fast: true, Settings: map[string]string{"synchronous_commit": "on"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Error(err)
		}
	})
	if err := c.CreateDatabase(ctx, faultsDB); err != nil {
		t.Fatal(err)
	}
	fc := &faultCluster{c: c}
	urls := []string{c.URL(faultsDB)}
	fc.names = []string{"coordinator"}
	for i := range c.Workers {
		urls = append(urls, c.WorkerURL(i, faultsDB))
		fc.names = append(fc.names, fmt.Sprintf("worker %d", i))
	}
	for _, url := range urls {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 16
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		fc.nodes = append(fc.nodes, pool)
	}
	sqlDB := stdlib.OpenDBFromPool(fc.coord())
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		t.Fatalf("migrate through the coordinator: %v", err)
	}
	script, err := os.ReadFile("docs/citus.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fc.coord().Exec(ctx, string(script)); err != nil {
		t.Fatalf("docs/citus.sql: %v", err)
	}
	if _, err := fc.coord().Exec(ctx, citusAppSchema); err != nil {
		t.Fatalf("payment table: %v", err)
	}
	return fc
}

// TestCitusFaults stops a worker and the coordinator the hard way during
// storms of Run and of flows through every node, and a worker while
// transactions that span nodes commit with two-phase commit: no operation
// is lost or doubled, and each client gets one answer.
func TestCitusFaults(t *testing.T) {
	fc := startCitusFaults(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

	t.Run("WorkersHaveMetadata", func(t *testing.T) { faultsMetadata(t, ctx, fc) })

	worker := fault{
		name: "worker 0",
		kill: func() error { return fc.c.Workers[0].Kill(syscall.SIGQUIT) },
		restart: func(ctx context.Context) error {
			return fc.c.RestartWorker(ctx, 0)
		},
	}
	coordinator := fault{
		name:    "the coordinator",
		kill:    func() error { return fc.c.Coordinator.Kill(syscall.SIGQUIT) },
		restart: fc.c.RestartCoordinator,
	}
	t.Run("WorkerRestartedDuringRunStorm", func(t *testing.T) { runStormWithFault(t, ctx, fc, worker) })
	t.Run("CoordinatorRestartedDuringRunStorm", func(t *testing.T) { runStormWithFault(t, ctx, fc, coordinator) })
	t.Run("WorkerRestartedDuringFlowStorm", func(t *testing.T) { flowStormWithFault(t, ctx, fc, worker) })
	t.Run("CoordinatorRestartedDuringFlowStorm", func(t *testing.T) { flowStormWithFault(t, ctx, fc, coordinator) })
	t.Run("PreparedTransactions", func(t *testing.T) {
		t.Run("WhichCallsMakeThem", func(t *testing.T) { whichCallsPrepare(t, ctx, fc) })
		t.Run("WorkerStoppedWhileCommitting", func(t *testing.T) { preparedRecovered(t, ctx, fc, false) })
		t.Run("CoordinatorStoppedWhileCommitting", func(t *testing.T) { preparedRecovered(t, ctx, fc, true) })
	})
}

// faultsMetadata checks that the workers have Citus's metadata (MX): the
// storms' clients come in through them.
func faultsMetadata(t *testing.T, ctx context.Context, fc *faultCluster) {
	var synced int
	if err := fc.coord().QueryRow(ctx, `SELECT count(*) FROM pg_dist_node
		WHERE groupid <> 0 AND noderole = 'primary' AND isactive AND hasmetadata AND metadatasynced`).Scan(&synced); err != nil {
		t.Fatal(err)
	}
	if synced != len(fc.c.Workers) {
		t.Fatalf("%d workers with synced metadata, want %d", synced, len(fc.c.Workers))
	}
	for i, pool := range fc.nodes[1:] {
		var tables int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_dist_partition
			WHERE logicalrelid IN ('payment'::regclass, 'idempotency_key'::regclass, 'idem_flow'::regclass)`).Scan(&tables); err != nil {
			t.Fatalf("worker %d: %v", i, err)
		}
		if tables != 3 {
			t.Fatalf("worker %d knows %d of the distributed tables, want 3", i, tables)
		}
	}
}

// fault is a node stopped the hard way and started again.
type fault struct {
	name    string
	kill    func() error
	restart func(context.Context) error
}

// faultStorm counts what the clients of a storm saw.
type faultStorm struct {
	answered atomic.Int64 // client calls answered
	errs     atomic.Int64 // failed attempts, retried
	mu       sync.Mutex
	kinds    map[string]int // failed attempts by kind
}

// digits are stripped from an error to tell its kind: ports, pids, ids.
var digits = regexp.MustCompile(`[0-9]+`)

func (s *faultStorm) failed(err error) {
	s.errs.Add(1)
	kind := digits.ReplaceAllString(err.Error(), "N")
	if len(kind) > 110 {
		kind = kind[:110]
	}
	s.mu.Lock()
	if s.kinds == nil {
		s.kinds = make(map[string]int)
	}
	s.kinds[kind]++
	s.mu.Unlock()
}

// report logs the kinds of errors the clients saw, the most frequent first.
func (s *faultStorm) report(t *testing.T) {
	s.mu.Lock()
	defer s.mu.Unlock()
	kinds := slices.Collect(func(yield func(string) bool) {
		for k := range s.kinds {
			if !yield(k) {
				return
			}
		}
	})
	slices.SortFunc(kinds, func(a, b string) int { return s.kinds[b] - s.kinds[a] })
	for i, k := range kinds {
		if i == 8 {
			t.Logf("  ... %d more kinds", len(kinds)-i)
			break
		}
		t.Logf("  %5d × %s", s.kinds[k], k)
	}
}

// fatal are the errors a retry does not cure: a client that gets one has
// been given a wrong answer.
func fatal(err error) bool {
	return errors.Is(err, idem.ErrFingerprintMismatch) || errors.Is(err, idem.ErrFlowStopped) ||
		errors.Is(err, idem.ErrInvalidOption)
}

// untilAnswered makes attempts, backing off between them, until one
// answers, one fails for good, or ctx ends: a client that retries its
// operation with its key until it gets an answer.
func untilAnswered[T any](ctx context.Context, s *faultStorm, attempt func(context.Context) (T, error)) (T, error) {
	backoff := 20 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		v, err := attempt(actx)
		cancel()
		if err == nil {
			s.answered.Add(1)
			return v, nil
		}
		if fatal(err) || ctx.Err() != nil {
			return v, err
		}
		s.failed(err)
		select {
		case <-ctx.Done():
			return v, fmt.Errorf("%w (last: %w)", ctx.Err(), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// outage is what happened around a fault.
type outage struct {
	answeredAtKill, errs int64
	down                 time.Duration
}

// faultAt stops the node once trigger client calls have answered, waits
// until the clients have failed minErrs attempts more, and starts it
// again; done ends the wait early (every client finished: the storm did
// not see the fault, which the caller asserts against).
func faultAt(t *testing.T, ctx context.Context, s *faultStorm, f fault, trigger, minErrs int64, done <-chan struct{}) <-chan outage {
	out := make(chan outage, 1)
	go func() {
		var o outage
		defer func() { out <- o }()
		wait := func(cond func() bool) bool {
			for !cond() {
				select {
				case <-done:
					return false
				case <-ctx.Done():
					return false
				case <-time.After(5 * time.Millisecond):
				}
			}
			return true
		}
		if !wait(func() bool { return s.answered.Load() >= trigger }) {
			return
		}
		o.answeredAtKill = s.answered.Load()
		errsAtKill := s.errs.Load()
		start := time.Now()
		if err := f.kill(); err != nil {
			t.Errorf("stop %s: %v", f.name, err)
		}
		wait(func() bool { return s.errs.Load()-errsAtKill >= minErrs })
		o.errs = s.errs.Load() - errsAtKill
		if err := f.restart(ctx); err != nil {
			t.Errorf("restart %s: %v", f.name, err)
		}
		o.down = time.Since(start)
	}()
	return out
}

// stormOps is how many logical operations a storm makes, each sent
// through every node at once; stormParallel is how many operations run at
// once.
const stormOps, stormParallel, stormTenants = 150, 8, 16

// clientsThroughEveryNode runs ops operations, each as concurrent
// duplicates through every node of fc, each duplicate a client that
// retries until answered, and stops and restarts f's node once a quarter
// of the clients have answered. call makes one attempt of operation op
// through node n.
func clientsThroughEveryNode(t *testing.T, ctx context.Context, fc *faultCluster, f fault, s *faultStorm, ops int,
	call func(ctx context.Context, op, n int) error,
) outage {
	total := int64(ops * len(fc.nodes))
	// A generous deadline for every client: answered, or lost.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	done := make(chan struct{})
	faulted := faultAt(t, ctx, s, f, total/4, 10, done)
	var wg sync.WaitGroup
	sem := make(chan struct{}, stormParallel)
	var unanswered atomic.Int64
	for op := range ops {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			var dups sync.WaitGroup
			for n := range fc.nodes {
				dups.Go(func() {
					if _, err := untilAnswered(ctx, s, func(ctx context.Context) (struct{}, error) {
						return struct{}{}, call(ctx, op, n)
					}); err != nil {
						unanswered.Add(1)
						t.Errorf("operation %d through %s: never answered: %v", op, fc.names[n], err)
					}
				})
			}
			dups.Wait()
		})
	}
	wg.Wait()
	close(done)
	o := <-faulted
	t.Logf("%d operations × %d nodes: %d answered, %d unanswered; %s stopped after %d answers, down %s, %d failed attempts during the outage, %d in all",
		ops, len(fc.nodes), s.answered.Load(), unanswered.Load(), f.name, o.answeredAtKill, o.down.Round(time.Millisecond), o.errs, s.errs.Load())
	s.report(t)
	if o.errs == 0 || o.answeredAtKill >= total {
		t.Fatalf("the faultStorm did not see the fault: %d failed attempts during the outage, %d of %d answered before it", o.errs, o.answeredAtKill, total)
	}
	if unanswered.Load() != 0 || s.answered.Load() != total {
		t.Fatalf("%d clients answered of %d (lost: %d)", s.answered.Load(), total, unanswered.Load())
	}
	return o
}

// opKey is the scope and key of operation op of a storm.
func opKey(prefix string, op int) (scope, key string) {
	return fmt.Sprintf("%s-%d", prefix, op%stormTenants), fmt.Sprintf("op%d", op)
}

// paymentsByOp counts the payments of a storm's operations, through the
// coordinator, with the id of each operation's (any) payment.
func paymentsByOp(t *testing.T, ctx context.Context, pool *pgxpool.Pool, prefix string) map[[2]string][2]int64 {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT scope, key, count(*), max(id) FROM payment WHERE scope LIKE $1 || '-%' GROUP BY scope, key`, prefix)
	if err != nil {
		t.Fatal(err)
	}
	got := make(map[[2]string][2]int64)
	var scope, key string
	var n, id int64
	_, err = pgx.ForEachRow(rows, []any{&scope, &key, &n, &id}, func() error {
		got[[2]string{scope, key}] = [2]int64{n, id}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// runStormWithFault is issue 39's Run storm with a node stopped and
// restarted: every operation's fn inserts a payment, and each operation's
// clients, through every node, get the payment's id.
func runStormWithFault(t *testing.T, ctx context.Context, fc *faultCluster, f fault) {
	start := time.Now()
	prefix := testdb.Name("runfault")
	var s faultStorm
	var calls atomic.Int64
	answers := make([][]payment, stormOps)
	for op := range answers {
		answers[op] = make([]payment, len(fc.nodes))
	}
	clientsThroughEveryNode(t, ctx, fc, f, &s, stormOps, func(ctx context.Context, op, n int) error {
		scope, key := opKey(prefix, op)
		res, err := idem.Run(ctx, fc.nodes[n], scope, key, fpA, pay(scope, key, int64(op+1), &calls), idem.WithWait(20*time.Second))
		if err == nil {
			answers[op][n] = res.Value
		}
		return err
	})
	payments := paymentsByOp(t, ctx, fc.coord(), prefix)
	records := make(map[[2]string]string)
	rows, err := fc.coord().Query(ctx, `SELECT scope, key, state FROM idempotency_key WHERE scope LIKE $1 || '-%'`, prefix)
	if err != nil {
		t.Fatal(err)
	}
	var scope, key, state string
	if _, err := pgx.ForEachRow(rows, []any{&scope, &key, &state}, func() error {
		records[[2]string{scope, key}] = state
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var lost, doubled, differ int
	for op := range stormOps {
		scope, key := opKey(prefix, op)
		p := payments[[2]string{scope, key}]
		switch {
		case p[0] == 0:
			lost++
			t.Errorf("%s/%s: no payment", scope, key)
		case p[0] > 1:
			doubled++
			t.Errorf("%s/%s: %d payments", scope, key, p[0])
		}
		if records[[2]string{scope, key}] != "done" {
			t.Errorf("%s/%s: record %q, want done", scope, key, records[[2]string{scope, key}])
		}
		for n, a := range answers[op] {
			if a.ID != p[1] || a.AmountCents != int64(op+1) {
				differ++
				t.Errorf("%s/%s through %s: answered %+v; the payment committed is %d", scope, key, fc.names[n], a, p[1])
			}
		}
	}
	if len(payments) != stormOps || len(records) != stormOps {
		t.Errorf("%d operations with payments, %d records; want %d each", len(payments), len(records), stormOps)
	}
	t.Logf("%d operations: %d lost, %d doubled, %d answers unlike the committed payment; fn ran %d times (rolled back: %d); %s",
		stormOps, lost, doubled, differ, calls.Load(), calls.Load()-int64(stormOps), time.Since(start).Round(time.Millisecond))
}

// faultProvider is a provider that honours idempotency keys, and counts
// the charges it applied for each flow operation and under which keys.
type faultProvider struct {
	mu      sync.Mutex
	charges map[string]string         // provider key → charge id
	byOp    map[string]map[string]int // operation → provider key → calls
	applied map[string]int            // operation → charges applied
	n       int
}

func newFaultProvider() *faultProvider {
	return &faultProvider{charges: make(map[string]string), byOp: make(map[string]map[string]int), applied: make(map[string]int)}
}

func (p *faultProvider) charge(op, providerKey string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byOp[op] == nil {
		p.byOp[op] = make(map[string]int)
	}
	p.byOp[op][providerKey]++
	id, ok := p.charges[providerKey]
	if !ok {
		p.n++
		id = fmt.Sprintf("ch_%d", p.n)
		p.charges[providerKey] = id
		p.applied[op]++
	}
	return id
}

// flowStormWithFault is the flow storm with a node stopped and restarted:
// each operation's flow writes a payment in a local step and charges the
// provider, its clients come in through every node, and a resumer runs
// against the coordinator.
func flowStormWithFault(t *testing.T, ctx context.Context, fc *faultCluster, f fault) {
	start := time.Now()
	prefix := testdb.Name("flowfault")
	prov := newFaultProvider()
	var entries atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("fault"), func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		entries.Add(1)
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		op := s.Scope() + "/" + s.Key()
		ch, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			return prov.charge(op, providerKey), nil
		})
		if err != nil {
			return chargeOut{}, err
		}
		return chargeOut{PaymentID: id, ChargeID: ch}, nil
	}, idem.WithLease(3*time.Second), idem.WithGrace(0))

	resumerCtx, stopResumer := context.WithCancel(ctx)
	defer stopResumer()
	resumer, err := idem.StartResumer(resumerCtx, fc.coord(), idem.ResumerConfig{
		Interval: 200 * time.Millisecond,
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	}, flow)
	if err != nil {
		t.Fatal(err)
	}
	defer resumer.Stop()

	var s faultStorm
	answers := make([][]chargeOut, stormOps)
	for op := range answers {
		answers[op] = make([]chargeOut, len(fc.nodes))
	}
	clientsThroughEveryNode(t, ctx, fc, f, &s, stormOps, func(ctx context.Context, op, n int) error {
		scope, key := opKey(prefix, op)
		res, err := flow.Run(ctx, fc.nodes[n], scope, key, fpCharge, chargeIn{Amount: int64(op + 1)}, idem.WithWait(20*time.Second))
		if err == nil {
			answers[op][n] = res.Value
		}
		return err
	})
	resumer.Stop()

	payments := paymentsByOp(t, ctx, fc.coord(), prefix)
	prov.mu.Lock()
	defer prov.mu.Unlock()
	var lost, doubled, differ, unfinished int
	for op := range stormOps {
		scope, key := opKey(prefix, op)
		p := payments[[2]string{scope, key}]
		keys, applied := prov.byOp[scope+"/"+key], prov.applied[scope+"/"+key]
		switch {
		case p[0] == 0 || applied == 0:
			lost++
			t.Errorf("%s/%s: %d payments, %d charges", scope, key, p[0], applied)
		case p[0] > 1 || applied > 1 || len(keys) > 1:
			doubled++
			t.Errorf("%s/%s: %d payments, %d charges under %d provider keys", scope, key, p[0], applied, len(keys))
		}
		var charge string
		for k := range keys {
			charge = prov.charges[k]
		}
		for n, a := range answers[op] {
			if a.PaymentID != p[1] || a.ChargeID != charge {
				differ++
				t.Errorf("%s/%s through %s: answered %+v; committed payment %d, charge %s", scope, key, fc.names[n], a, p[1], charge)
			}
		}
		info, err := idem.InspectFlow(ctx, fc.coord(), scope, key)
		if err != nil || info.State != "done" {
			unfinished++
			t.Errorf("%s/%s: the flow is %q (%v), want done", scope, key, info.State, err)
		}
	}
	calls := 0
	for _, keys := range prov.byOp {
		for _, n := range keys {
			calls += n
		}
	}
	t.Logf("%d flows: %d unfinished, %d lost, %d doubled, %d answers unlike the committed effects; the function ran %d times, the provider was called %d times and applied %d charges; the resumer completed %d; %s",
		stormOps, unfinished, lost, doubled, differ, entries.Load(), calls, prov.n, resumer.Resumed(), time.Since(start).Round(time.Millisecond))
	if prov.n != stormOps {
		t.Errorf("the provider applied %d charges, want %d", prov.n, stormOps)
	}
}
