//go:build citus

package idem_test

// The tests of idem on a real Citus cluster, a coordinator and two
// workers started for the run (internal/citustemp), with idem's tables
// distributed by docs/citus.sql. They need an installation that holds
// Citus and run only with -tags citus (bash .ci/citus); the rest of the
// suite does not build them, so that a machine without Citus skips
// nothing.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/citustemp"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

// citusAppSchema is the tests' business table on Citus: distributed by
// its tenant, the scope, on the shards of idem's records.
const citusAppSchema = `
CREATE TABLE payment (
    id           bigserial,
    scope        text   NOT NULL,
    key          text   NOT NULL,
    amount_cents bigint NOT NULL,
    PRIMARY KEY (scope, id)
);
SELECT create_distributed_table('payment', 'scope', colocate_with => 'idempotency_key');
`

// startCitus starts a cluster and makes a database on it, migrated by
// idem.Migrate through the coordinator and distributed by docs/citus.sql,
// with the tests' payment table. The cluster is removed when t ends.
func startCitus(t testing.TB) (*citustemp.Cluster, *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, err := citustemp.Start(ctx, citustemp.Config{Fast: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Error(err)
		}
	})
	const db = "idem_citus"
	if err := c.CreateDatabase(ctx, db); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(c.URL(db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 40
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		t.Fatalf("migrate through the coordinator: %v", err)
	}
	script, err := os.ReadFile("docs/citus.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, string(script)); err != nil {
		t.Fatalf("docs/citus.sql: %v", err)
	}
	if _, err := pool.Exec(ctx, citusAppSchema); err != nil {
		t.Fatalf("payment table: %v", err)
	}
	return c, pool
}

// TestCitus runs idem's public API through the coordinator of a cluster
// whose tables docs/citus.sql distributed: one cluster for all of its
// subtests, which run one after the other (the machine is small).
func TestCitus(t *testing.T) {
	c, pool := startCitus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	t.Run("TablesDistributedAsTheProfileSays", func(t *testing.T) {
		rows, err := pool.Query(ctx, `SELECT table_name::text, citus_table_type, coalesce(distribution_column, '')
			FROM citus_tables ORDER BY 1`)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Table, Type, Column string }])
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{
			"entity_version": "distributed scope", "idem_flow": "distributed scope",
			"idem_flow_step_row": "distributed scope", "idempotency_key": "distributed scope",
			"payment": "distributed scope", "idem_installation": "reference <none>",
			"outbox_message": "local <none>",
		}
		if len(got) != len(want) {
			t.Fatalf("citus_tables: %v, want %v", got, want)
		}
		for _, r := range got {
			if w := want[r.Table]; w != r.Type+" "+r.Column {
				t.Errorf("%s: %s %s, want %s", r.Table, r.Type, r.Column, w)
			}
		}
		// Every distributed table of idem's and the payments share one
		// co-location group: a scope's rows are on one shard's node.
		var groups int
		if err := pool.QueryRow(ctx, `SELECT count(DISTINCT colocation_id) FROM citus_tables WHERE citus_table_type = 'distributed'`).Scan(&groups); err != nil {
			t.Fatal(err)
		}
		if groups != 1 {
			t.Errorf("%d co-location groups, want 1", groups)
		}
	})

	t.Run("RunStorm", func(t *testing.T) { citusRunStorm(t, ctx, pool) })
	t.Run("DoInCallersTransaction", func(t *testing.T) { citusDo(t, ctx, c, pool) })
	t.Run("CrashMidTransaction", func(t *testing.T) { citusCrash(t, ctx, pool) })
	t.Run("OnceAndAdvance", func(t *testing.T) { citusOnceAdvance(t, ctx, pool) })
	t.Run("KeyLocksPerWorker", func(t *testing.T) { citusKeyLocks(t, ctx, c, pool) })
	t.Run("ExpiredRecordsTakenOver", func(t *testing.T) { citusExpired(t, ctx, pool) })
	t.Run("OnceEach", func(t *testing.T) { citusOnceEach(t, ctx, c, pool) })
	t.Run("WaitBudgetOnTheWorker", func(t *testing.T) { citusWaitBudget(t, ctx, pool) })
	t.Run("Flows", func(t *testing.T) { citusFlows(t, ctx, pool) })
	t.Run("FlowsReconcile", func(t *testing.T) { citusReconcile(t, ctx, pool) })
	t.Run("FlowCrashes", func(t *testing.T) { citusFlowCrashes(t, ctx, c, pool) })
	t.Run("FlowsAPersonResolves", func(t *testing.T) { citusResolve(t, ctx, pool) })
	t.Run("FlowLocalStepHoldsTheFlowsRow", func(t *testing.T) { stepHoldsTheFlowsRow(t, ctx, pool, testdb.Name("rowlock")) })
	t.Run("FlowDuplicateOfAStartingFlow", func(t *testing.T) { duplicateOfAStartingFlow(t, ctx, pool, testdb.Name("dup")) })
	t.Run("FlowClaimCrashes", func(t *testing.T) { citusClaimCrashes(t, ctx, c, pool) })
	t.Run("FlowStartedThroughTwoNodes", func(t *testing.T) { citusFlowStartedThroughTwoNodes(t, ctx, c, pool) })
	t.Run("AnyNode", func(t *testing.T) { citusAnyNode(t, ctx, c, pool) })
	t.Run("Outbox", func(t *testing.T) { citusOutbox(t, ctx, c, pool) })
	t.Run("IdemHTTP", func(t *testing.T) { citusHTTP(t, ctx, pool) })
	t.Run("Purge", func(t *testing.T) { citusPurge(t, ctx, pool) })
	t.Run("ReadStatsCountsTheShards", func(t *testing.T) { citusStats(t, ctx, pool) })
}

// citusRunStorm is the storm: 20 tenants × 50 keys × 3 concurrent
// duplicates through the coordinator. Each key's fn runs once, its
// duplicates wait for it and replay, and a reused key with another request
// is refused.
func citusRunStorm(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	const tenants, keys, dups = 20, 50, 3
	prefix := testdb.Name("storm")
	var calls, replays, errs atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, 30)
	for tn := range tenants {
		scope := fmt.Sprintf("%s-%d", prefix, tn)
		for k := range keys {
			key := fmt.Sprintf("k%d", k)
			for range dups {
				wg.Go(func() {
					sem <- struct{}{}
					defer func() { <-sem }()
					res, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 100, &calls))
					switch {
					case err != nil:
						errs.Add(1)
						t.Errorf("%s/%s: %v", scope, key, err)
					case res.Replayed:
						replays.Add(1)
					}
				})
			}
		}
	}
	wg.Wait()
	if calls.Load() != tenants*keys || replays.Load() != tenants*keys*(dups-1) || errs.Load() != 0 {
		t.Fatalf("fn ran %d times, %d replays, %d errors; want %d, %d, 0",
			calls.Load(), replays.Load(), errs.Load(), tenants*keys, tenants*keys*(dups-1))
	}
	var payments, records int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payment WHERE scope LIKE $1), (SELECT count(*) FROM idempotency_key WHERE scope LIKE $1)`,
		prefix+"-%").Scan(&payments, &records); err != nil {
		t.Fatal(err)
	}
	if payments != tenants*keys || records != tenants*keys {
		t.Fatalf("%d payments, %d records; want %d each", payments, records, tenants*keys)
	}
	// A key reused with another request is refused, and runs nothing.
	_, err := idem.Run(ctx, pool, prefix+"-0", "k0", fpB, pay(prefix+"-0", "k0", 100, &calls))
	if !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("reused key with another request: %v, want ErrFingerprintMismatch", err)
	}
	if calls.Load() != tenants*keys {
		t.Fatalf("the refused call ran fn")
	}
	// A scope's record and its payment are on one node.
	var nodes int
	if err := pool.QueryRow(ctx, `SELECT count(DISTINCT nodeport) FROM citus_shards
		WHERE shardid IN (get_shard_id_for_distribution_column('idempotency_key', $1::text),
		                  get_shard_id_for_distribution_column('payment', $1::text))`, prefix+"-7").Scan(&nodes); err != nil {
		t.Fatal(err)
	}
	if nodes != 1 {
		t.Fatalf("a scope's record and payment are on %d nodes", nodes)
	}
}

// citusDo runs Do in the caller's transaction, its duplicate waiting on
// the key's lock, which ReadStats and Inspect count on the worker.
func citusDo(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	scope, key := testdb.Name("do"), "k"
	var calls atomic.Int64
	release := make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
				p, err := pay(scope, key, 5, &calls)(ctx, tx)
				<-release
				return p, err
			})
			return err
		})
	}()
	// The duplicate waits for the first, which holds the key's lock on the
	// node of the scope's shard, and replays its answer once it commits.
	second := make(chan idem.Result[payment], 1)
	go func() {
		for calls.Load() == 0 {
			time.Sleep(5 * time.Millisecond)
		}
		var res idem.Result[payment]
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			res, err = idem.Do(ctx, tx, scope, key, fpA, pay(scope, key, 5, &calls))
			return err
		})
		if err != nil {
			t.Error(err)
		}
		second <- res
	}()
	waitWaiting(t, ctx, c)
	// The lock and its waiter are on a worker: ReadStats and Inspect
	// count them there.
	s, err := idem.ReadStats(ctx, pool)
	if err != nil || s.Running != 1 || s.Waiting != 1 || s.OldestRunning.IsZero() {
		t.Errorf("ReadStats while the key is held: %d running since %v, %d waiting, %v; want 1, 1",
			s.Running, s.OldestRunning, s.Waiting, err)
	}
	info, err := idem.Inspect(ctx, pool, scope, key)
	if err != nil || !info.Running || info.Waiting != 1 || info.RunningSince.IsZero() {
		t.Errorf("Inspect while the key is held: %+v, %v; want running, 1 waiting", info, err)
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	res := <-second
	if !res.Replayed || res.Value.AmountCents != 5 || calls.Load() != 1 {
		t.Fatalf("duplicate: %+v, fn ran %d times", res, calls.Load())
	}
	if n := countPayments(t, pool, scope); n != 1 {
		t.Fatalf("%d payments", n)
	}
}

// waitWaiting waits until a worker has a session waiting for an advisory
// lock: the duplicate's wait for the key's lock, which it takes on the node
// of the scope's shard.
func waitWaiting(t *testing.T, ctx context.Context, c *citustemp.Cluster) {
	t.Helper()
	waitWorkerLock(t, ctx, c, "advisory")
}

// waitWorkerLock waits until a worker has a session waiting for a lock of
// type locktype: progress, not a clock, says that a statement the
// coordinator routed there waits.
func waitWorkerLock(t *testing.T, ctx context.Context, c *citustemp.Cluster, locktype string) {
	t.Helper()
	for {
		for i := range c.Workers {
			conn, err := pgx.Connect(ctx, c.WorkerURL(i, "idem_citus"))
			if err != nil {
				t.Fatal(err)
			}
			var n int
			err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = $1 AND NOT granted`, locktype).Scan(&n)
			conn.Close(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// citusCrash ends the coordinator's session of a Run mid-transaction, its
// payment written on a worker's shard: nothing of it commits, and the
// retry runs fn once more and commits once.
func citusCrash(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	scope, key := testdb.Name("crash"), "k"
	var calls atomic.Int64
	_, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, key, 7, &calls)(ctx, tx)
		if err != nil {
			return p, err
		}
		// The session dies here, before COMMIT.
		if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1::int)`, tx.Conn().PgConn().PID()); err != nil {
			t.Error(err)
		}
		_, err = tx.Exec(ctx, `SELECT 1`)
		return p, err
	})
	if err == nil {
		t.Fatal("the killed run succeeded")
	}
	if n := countPayments(t, pool, scope); n != 0 {
		t.Fatalf("the killed run left %d payments", n)
	}
	res, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 7, &calls))
	if err != nil || res.Replayed {
		t.Fatalf("retry: %+v, %v", res, err)
	}
	if n := countPayments(t, pool, scope); n != 1 || calls.Load() != 2 {
		t.Fatalf("%d payments, fn ran %d times", n, calls.Load())
	}
}

func citusOnceAdvance(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	scope := testdb.Name("once")
	var ran []bool
	for range 2 {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			r, err := idem.Once(ctx, tx, scope, "evt-1", func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'evt-1', 1)`, scope)
				return err
			})
			ran = append(ran, r)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if !ran[0] || ran[1] || countPayments(t, pool, scope) != 1 {
		t.Fatalf("Once ran %v, %d payments", ran, countPayments(t, pool, scope))
	}
	var applied []bool
	for _, v := range []int64{1, 3, 2, 3} {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			a, err := idem.Advance(ctx, tx, scope, "order-1", v)
			applied = append(applied, a)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if fmt.Sprint(applied) != "[true true false false]" {
		t.Fatalf("Advance 1, 3, 2, 3 applied %v", applied)
	}
}

// citusFlows runs a flow of a local step and a call through the
// coordinator: concurrent duplicates, a replay, a flow whose executor gave
// up resumed by a completer, InspectFlow and EndFlow.
func citusFlows(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	var charges sync.Map // provider key -> times charged
	var fail atomic.Bool
	flow := idem.MustNewFlow("citus-charge", func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		if _, err := idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'flow', $2) RETURNING id`,
				s.Scope(), amount).Scan(&id)
			return id, err
		}); err != nil {
			return "", err
		}
		return idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			if fail.Load() {
				return "", errors.New("provider down")
			}
			n, _ := charges.LoadOrStore(providerKey, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			return "ch-" + providerKey[:8], nil
		})
	}, idem.WithLease(2*time.Second), idem.WithGrace(0))

	scope := testdb.Name("flow")
	var wg sync.WaitGroup
	var replays atomic.Int64
	for range 4 {
		wg.Go(func() {
			res, err := flow.Run(ctx, pool, scope, "f1", fpA, 100)
			if err != nil {
				t.Error(err)
			} else if res.Replayed {
				replays.Add(1)
			}
		})
	}
	wg.Wait()
	if replays.Load() != 3 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d replays, %d payments", replays.Load(), countPayments(t, pool, scope))
	}
	// A flow whose call fails gives its lease up; a completer finishes it.
	fail.Store(true)
	if _, err := flow.Run(ctx, pool, scope, "f2", fpA, 200); err == nil {
		t.Fatal("the flow succeeded with its provider down")
	}
	fail.Store(false)
	resumed, err := flow.Resume(ctx, pool)
	if err != nil || resumed != 1 {
		t.Fatalf("Resume: %d, %v", resumed, err)
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "f2")
	if err != nil || info.State != "done" {
		t.Fatalf("InspectFlow: %+v, %v", info, err)
	}
	charges.Range(func(k, v any) bool {
		if n := v.(*atomic.Int64).Load(); n != 1 {
			t.Errorf("provider key %s charged %d times", k, n)
		}
		return true
	})
	// An operator ends a flow that cannot go on.
	fail.Store(true)
	if _, err := flow.Run(ctx, pool, scope, "f3", fpA, 300); err == nil {
		t.Fatal("the flow succeeded with its provider down")
	}
	ended, err := idem.EndFlow(ctx, pool, scope, "f3", "given up")
	if err != nil || !ended {
		t.Fatalf("EndFlow: %v, %v", ended, err)
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "f3"); info.State != "ended" {
		t.Fatalf("after EndFlow: %+v", info)
	}
	// A flow whose row records a large result records its further steps
	// as rows of their own (FlowStepRecord, FlowStepRows, and
	// FlowStepRowsUpdate as its call is resumed).
	large := strings.Repeat("y", 400)
	long := idem.MustNewFlow("citus-long", func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		if _, err := idem.Call(s, "large", func(ctx context.Context, providerKey string) (string, error) {
			return large, nil
		}); err != nil {
			return "", err
		}
		if _, err := idem.Local(s, "after", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return "", err
		}
		return idem.Call(s, "last", func(ctx context.Context, providerKey string) (string, error) {
			if fail.Load() {
				return "", errors.New("provider down")
			}
			return "ch-" + providerKey[:8], nil
		})
	})
	if _, err := long.Run(ctx, pool, scope, "long", fpA, 400); err == nil {
		t.Fatal("the long flow succeeded with its provider down")
	}
	fail.Store(false)
	if res, err := long.Run(ctx, pool, scope, "long", fpA, 400); err != nil || !strings.HasPrefix(res.Value, "ch-") {
		t.Fatalf("the long flow, resumed: %+v, %v", res, err)
	}
	var rows string
	if err := pool.QueryRow(ctx, `SELECT string_agg(seq || ':' || state || ':' || attempts, ',' ORDER BY seq)
		FROM idem_flow_step_row WHERE scope = $1 AND key = 'long'`, scope).Scan(&rows); err != nil || rows != "1:done:1,2:done:2" {
		t.Fatalf("the long flow's steps as rows: %q, %v; want the local step and the call, resumed", rows, err)
	}
}

// citusOnceEach claims batches of messages with OnceEach through the
// coordinator: a new batch, a redelivered one, an expired record taken
// over, a key Do recorded refused, another consumer's open batch waited
// for (on the worker, where the records' shard is), and the caller's
// lock_timeout kept.
func citusOnceEach(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	scope := testdb.Name("batch")
	ran, calls, err := applyBatch(ctx, pool, scope, batchOf(0, 50))
	if err != nil || calls != 50 || count(ran) != 50 {
		t.Fatalf("a new batch: %v, %d calls, %d ran; want 50", err, calls, count(ran))
	}
	ran, calls, err = applyBatch(ctx, pool, scope, batchOf(25, 75))
	if err != nil || calls != 25 || slices.Index(ran, true) != 25 {
		t.Fatalf("a batch half redelivered: %v, %d calls, ran %v; want the last 25", err, calls, ran)
	}
	if _, err := pool.Exec(ctx, `UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE scope = $1 AND key = 'm-1'`, scope); err != nil {
		t.Fatal(err)
	}
	ran, calls, err = applyBatch(ctx, pool, scope, batchOf(0, 3))
	if err != nil || calls != 1 || !slices.Equal(ran, []bool{false, true, false}) {
		t.Fatalf("m-1 expired: %v, %d calls, ran %v", err, calls, ran)
	}
	if n := countPayments(t, pool, scope); n != 76 {
		t.Fatalf("%d payments, want 76", n)
	}
	var doCalls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "paid", fpA, pay(scope, "paid", 1, &doCalls)); err != nil {
		t.Fatal(err)
	}
	if _, calls, err := applyBatch(ctx, pool, scope, []string{"new-1", "paid"}); !errors.Is(err, idem.ErrFingerprintMismatch) || calls != 0 {
		t.Fatalf("a key Do recorded: %v, %d calls; want ErrFingerprintMismatch and none", err, calls)
	}

	// Another consumer holds m-0..m-19 in an open transaction: m-1 on its
	// key lock and an uncommitted record, m-19, past MaxKeyLocks, on its
	// record alone (KeyClaimIfFull).
	const held = idem.MaxKeyLocks + 4
	// The batch waits for it on the worker, under its wait budget, which
	// is set there (citusWaitBudget has the budget run out).
	for _, end := range []string{"commits", "rolls back"} {
		scope := scope + " " + end
		_, finish := holdBatch(t, ctx, pool, scope, held)
		ids := []string{"m-1", fmt.Sprintf("m-%d", held-1), "fresh"}
		type result struct {
			ran   []bool
			calls int64
			err   error
		}
		done := make(chan result, 1)
		go func() {
			ran, calls, err := applyBatch(ctx, pool, scope, ids, idem.WithWait(time.Minute))
			done <- result{ran, calls, err}
		}()
		waitWorkerLock(t, ctx, c, "transactionid")
		commit := end == "commits"
		finish(commit)
		r := <-done
		want := []bool{!commit, !commit, true}
		if r.err != nil || !slices.Equal(r.ran, want) || r.calls != int64(count(want)) {
			t.Fatalf("other batch %s: %v, ran %v with %d calls; want %v", end, r.err, r.ran, r.calls, want)
		}
	}

	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`); err != nil {
			return err
		}
		if _, err := idem.OnceEach(ctx, tx, scope, batchOf(70, 80), func(context.Context, pgx.Tx, int) error { return nil },
			idem.WithWait(300*time.Millisecond)); err != nil {
			return err
		}
		var got string
		if err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got); err != nil {
			return err
		}
		if got != "7s" {
			t.Errorf("lock_timeout = %s after OnceEach, want the caller's 7s", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// citusWaitBudget has duplicates wait for keys that another transaction
// holds by records in progress, on a worker, with a short wait budget:
// OnceEach's batch (KeyClaimBatch), Run's record written after fn
// (KeyInsertCitus), and a claim past MaxKeyLocks (KeyClaimIfFull). Each
// gives up with ErrInProgress while the holder stays open, near its budget,
// and leaves the worker's lock_timeout as it found it.
func citusWaitBudget(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	scope := testdb.Name("budget")
	// m-0 to m-15 are held on their key locks and records, m-16 to m-19,
	// past MaxKeyLocks, on their records alone.
	const held = idem.MaxKeyLocks + 4
	_, finish := holdBatch(t, ctx, pool, scope, held)
	defer finish(false)
	const wait = 500 * time.Millisecond
	// What a wait that does not end with the holder may take past its
	// budget: the round trips through the coordinator, on a busy machine.
	const slack = 10 * time.Second
	onRecord := fmt.Sprintf("m-%d", held-1)
	// workerLockTimeout reads lock_timeout on the worker of the scope's
	// shard, in tx, over the connection the coordinator uses there: the
	// statement names the scope's rows (and reads none), so Citus runs it
	// there.
	workerLockTimeout := func(t *testing.T, tx pgx.Tx) string {
		var got string
		if err := tx.QueryRow(ctx, `SELECT current_setting('lock_timeout')
			WHERE NOT EXISTS (SELECT FROM idempotency_key WHERE scope = $1 LIMIT 0)`, scope).Scan(&got); err != nil {
			t.Fatal(err)
		}
		return got
	}
	for _, c := range []struct {
		name string
		call func(ctx context.Context, tx pgx.Tx) error
	}{
		{"OnceEach", func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.OnceEach(ctx, tx, scope, []string{"fresh-1", onRecord}, func(context.Context, pgx.Tx, int) error { return nil }, idem.WithWait(wait))
			return err
		}},
		{"DoStoringOverARecord", func(ctx context.Context, tx pgx.Tx) error {
			var calls atomic.Int64
			_, err := idem.Do(ctx, tx, scope, onRecord, nil, pay(scope, onRecord, 1, &calls), idem.WithWait(wait))
			return err
		}},
		{"OncePastMaxKeyLocks", func(ctx context.Context, tx pgx.Tx) error {
			for i := range idem.MaxKeyLocks {
				if _, err := idem.Once(ctx, tx, scope, fmt.Sprintf("own-%d", i), func(context.Context, pgx.Tx) error { return nil }); err != nil {
					return err
				}
			}
			_, err := idem.Once(ctx, tx, scope, onRecord, func(context.Context, pgx.Tx) error { return nil }, idem.WithWait(wait))
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			// The same worker's session, and what its lock_timeout is.
			before := workerLockTimeout(t, tx)
			// A wait that the budget does not bound ends only with the
			// holder: the call's context ends it first.
			callCtx, cancel := context.WithTimeout(ctx, wait+slack)
			defer cancel()
			started := time.Now()
			err = c.call(callCtx, tx)
			took := time.Since(started)
			if !errors.Is(err, idem.ErrInProgress) {
				t.Fatalf("a duplicate of a key held on a worker by a record in progress, WithWait(%s): %v, want ErrInProgress", wait, err)
			}
			if took > wait+slack {
				t.Fatalf("the duplicate gave up after %s, past its budget of %s", took, wait)
			}
			t.Logf("gave up after %s (budget %s)", took, wait)
			_ = tx.Rollback(ctx)

			// A call that waits for nothing leaves the worker's
			// lock_timeout as it was.
			tx, err = pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			if _, err := idem.OnceEach(ctx, tx, scope, []string{"free-" + c.name}, func(context.Context, pgx.Tx, int) error { return nil }, idem.WithWait(wait)); err != nil {
				t.Fatal(err)
			}
			var calls atomic.Int64
			if _, err := idem.Do(ctx, tx, scope, "do-"+c.name, nil, pay(scope, "do-"+c.name, 1, &calls), idem.WithWait(wait)); err != nil {
				t.Fatal(err)
			}
			if after := workerLockTimeout(t, tx); after != before {
				t.Fatalf("the worker's lock_timeout is %s after the calls, was %s", after, before)
			}
		})
	}
}

// citusKeyLocks claims 20 keys of a scope on each worker in one
// transaction with Once, one scope after the other, and then alternating
// between the workers' scopes: each worker holds MaxKeyLocks key locks,
// and the rest of its keys are claimed by records in progress. The bound
// is per node (each worker's part of the transaction counts its own), so
// that no worker's lock table gets more than MaxKeyLocks entries from one
// transaction, in whatever order its keys come.
func citusKeyLocks(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	prefix := testdb.Name("locks")
	scopes := make([]string, len(c.Workers))
	for i, found := 0, 0; found < len(scopes); i++ {
		s := fmt.Sprintf("%s-%d", prefix, i)
		var port int
		if err := pool.QueryRow(ctx, `SELECT nodeport FROM citus_shards
			WHERE shardid = get_shard_id_for_distribution_column('idempotency_key', $1::text)`, s).Scan(&port); err != nil {
			t.Fatal(err)
		}
		for w, node := range c.Workers {
			if node.Port == port && scopes[w] == "" {
				scopes[w] = s
				found++
			}
		}
	}
	const perWorker = 20
	for _, order := range []string{"ScopeByScope", "Alternating"} {
		t.Run(order, func(t *testing.T) {
			var claims [][2]string
			if order == "ScopeByScope" {
				for _, scope := range scopes {
					for i := range perWorker {
						claims = append(claims, [2]string{scope, fmt.Sprint(i)})
					}
				}
			} else {
				for i := range perWorker {
					for _, scope := range scopes {
						claims = append(claims, [2]string{scope, fmt.Sprint(i)})
					}
				}
			}
			err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
				for _, cl := range claims {
					ran, err := idem.Once(ctx, tx, cl[0], order+"-"+cl[1], func(context.Context, pgx.Tx) error { return nil })
					if err != nil {
						return err
					}
					if !ran {
						t.Errorf("%s/%s did not run", cl[0], cl[1])
					}
				}
				for i := range c.Workers {
					conn, err := pgx.Connect(ctx, c.WorkerURL(i, "idem_citus"))
					if err != nil {
						return err
					}
					var locks int
					err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted`).Scan(&locks)
					conn.Close(ctx)
					if err != nil {
						return err
					}
					if locks != idem.MaxKeyLocks {
						t.Errorf("worker %d holds %d key locks for %d keys, want MaxKeyLocks, %d", i, locks, perWorker, idem.MaxKeyLocks)
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			var records int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_key WHERE scope = ANY($1) AND key LIKE $2`, scopes, order+"-%").Scan(&records); err != nil {
				t.Fatal(err)
			}
			if records != perWorker*len(scopes) {
				t.Fatalf("%d records, want %d", records, perWorker*len(scopes))
			}
		})
	}
}

// citusExpired runs each claim over an expired record through the
// coordinator, which takes it over (an ON CONFLICT DO UPDATE whose WHERE
// Citus runs only without functions): Run at READ COMMITTED (KeyReplace),
// Do at REPEATABLE READ (KeyClaim), and Once past MaxKeyLocks in one
// transaction (KeyClaimIfFull). Each runs its function again, once.
func citusExpired(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	scope := testdb.Name("expired")
	var calls atomic.Int64
	for range 2 {
		if res, err := idem.Run(ctx, pool, scope, "run", fpA, pay(scope, "run", 1, &calls)); err != nil || res.Replayed {
			t.Fatalf("Run: %+v, %v; want a first execution", res, err)
		}
		expire(t, pool, scope, "run")
	}
	for range 2 {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, func(ctx context.Context, tx pgx.Tx) error {
			res, err := idem.Do(ctx, tx, scope, "do", fpA, pay(scope, "do", 1, &calls))
			if err == nil && res.Replayed {
				t.Error("Do at REPEATABLE READ replayed an expired record")
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		expire(t, pool, scope, "do")
	}
	ids := batchOf(0, idem.MaxKeyLocks+4)
	for round := range 3 {
		var ran int
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			ran = 0
			for _, id := range ids {
				r, err := idem.Once(ctx, tx, scope, id, func(ctx context.Context, tx pgx.Tx) error {
					_, err := pay(scope, id, 1, &calls)(ctx, tx)
					return err
				})
				if err != nil {
					return err
				}
				if r {
					ran++
				}
			}
			return nil
		})
		if want := []int{len(ids), 0, len(ids)}[round]; err != nil || ran != want {
			t.Fatalf("Once, round %d: %d ran, %v; want %d", round, ran, err, want)
		}
		if round == 1 {
			if _, err := pool.Exec(ctx, `UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE scope = $1 AND key LIKE 'm-%'`, scope); err != nil {
				t.Fatal(err)
			}
		}
	}
	if want := 4 + 2*len(ids); calls.Load() != int64(want) || countPayments(t, pool, scope) != want {
		t.Fatalf("fn ran %d times, %d payments; want %d each", calls.Load(), countPayments(t, pool, scope), want)
	}
}

// citusReconcile runs calls whose outcome is not known through the
// coordinator: a lookup that finds the charge whose answer was lost, one
// that finds nothing (the call made again, with the same key), and an
// attempt that surely never left (ErrNotSent), recorded as unsent.
func citusReconcile(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	scope := testdb.Name("reconcile")
	p := newProvider()
	p.keyless = true
	flow := keylessFlow(p, []idem.CallOption{lookupByRef(p)})
	loseFirstAnswer(p)
	if _, err := flow.Run(ctx, pool, scope, "found", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("the attempt whose answer was lost: %v", err)
	}
	res, err := flow.Run(ctx, pool, scope, "found", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Value != "ch_1" || p.calls.Load() != 1 || p.lookups.Load() != 1 {
		t.Fatalf("the retry: %+v, %v, %d calls, %d lookups; want ch_1 found, one call, one lookup", res, err, p.calls.Load(), p.lookups.Load())
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, "found"); err != nil || info.Steps[0].Reconciles != 1 || info.Steps[0].LastReconcile != "found" {
		t.Fatalf("the call's lookups: %+v, %v", info.Steps, err)
	}

	p = newProvider()
	p.keyless = true
	p.before = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("timeout")
		}
		return nil
	}
	flow = keylessFlow(p, []idem.CallOption{lookupByRef(p), idem.AtMostOnce()}, idem.WithProviderWindow(0))
	if _, err := flow.Run(ctx, pool, scope, "not-found", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first attempt succeeded")
	}
	if _, err := flow.Run(ctx, pool, scope, "not-found", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatalf("the retry: %v", err)
	}
	if charges, keys := p.effects(); charges != 1 || len(keys) != 1 || p.lookups.Load() != 1 {
		t.Fatalf("charges %d, keys %v, lookups %d; want 1 charge, one key, 1 lookup", charges, keys, p.lookups.Load())
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, "not-found"); err != nil || info.Steps[0].LastReconcile != "not_found" || info.Steps[0].Attempts != 2 {
		t.Fatalf("the call: %+v, %v", info.Steps, err)
	}

	p = newProvider()
	var refused atomic.Bool
	refused.Store(true)
	unsent := idem.MustNewFlow(testdb.Name("unsent"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		return idem.Call(s, "notify", func(ctx context.Context, key string) (string, error) {
			if refused.Load() {
				return "", fmt.Errorf("connection refused: %w", idem.ErrNotSent)
			}
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		}, idem.AtMostOnce())
	}, idem.WithProviderWindow(0))
	if _, err := unsent.Run(ctx, pool, scope, "unsent", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrNotSent) {
		t.Fatalf("an attempt that was refused: %v, want ErrNotSent", err)
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "unsent"); info.Steps[0].State != "unsent" {
		t.Fatalf("the call after a refused attempt: %+v", info.Steps[0])
	}
	refused.Store(false)
	if res, err := unsent.Run(ctx, pool, scope, "unsent", fpCharge, chargeIn{Amount: 2500}); err != nil || res.Value != "ch_1" {
		t.Fatalf("the attempt once the other system is up: %+v, %v", res, err)
	}
}

// citusFlowCrashes kills a flow's executor, a child process connected to
// the coordinator, after the provider applied its call and before the
// result was recorded, and before a call, after its local step committed;
// the client's retry, or a completer, finishes each flow with one charge
// and one payment. At a provider that ignores keys, the lookup finds the
// charge.
func citusFlowCrashes(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	url := c.URL("idem_citus")
	t.Run("AfterTheCallRetried", func(t *testing.T) {
		scope, p := testdb.Name("crash"), newProvider()
		providerURL, crash := crashRunner(t, ctx, url, scope, p)
		name := testdb.Name("crash")
		crash(name, "k", crashAfterCall)
		if charges, _ := p.effects(); charges != 1 {
			t.Fatalf("the provider applied %d charges before the crash, want 1", charges)
		}
		flow := crashFlow(name, providerURL, "")
		res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
		if err != nil || res.Replayed {
			t.Fatalf("the retry: %+v, %v; want the flow completed now", res, err)
		}
		again, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		if err != nil || !again.Replayed || again.Value != res.Value {
			t.Fatalf("a later retry: %+v, %v; want %+v replayed", again, err, res.Value)
		}
		checkOneCharge(t, pool, scope, "k", p, 2)
	})
	t.Run("AfterTheCallResumed", func(t *testing.T) {
		scope, p := testdb.Name("crash"), newProvider()
		providerURL, crash := crashRunner(t, ctx, url, scope, p)
		name := testdb.Name("crash")
		crash(name, "k", crashAfterCall)
		leaseRanOut(t, ctx, pool, scope, "k")
		if resumed, err := crashFlow(name, providerURL, "").Resume(ctx, pool); err != nil || resumed != 1 {
			t.Fatalf("Resume = %d, %v; want 1", resumed, err)
		}
		checkOneCharge(t, pool, scope, "k", p, 2)
	})
	t.Run("BeforeTheCall", func(t *testing.T) {
		scope, p := testdb.Name("crash"), newProvider()
		providerURL, crash := crashRunner(t, ctx, url, scope, p)
		name := testdb.Name("crash")
		crash(name, "k", crashBeforeCall)
		if countPayments(t, pool, scope) != 1 || p.calls.Load() != 0 {
			t.Fatalf("before the retry: %d payments, %d calls; want 1, 0", countPayments(t, pool, scope), p.calls.Load())
		}
		res, err := crashFlow(name, providerURL, "").Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
		if err != nil || res.Value.ChargeID != "ch_1" {
			t.Fatalf("the retry: %+v, %v", res, err)
		}
		checkOneCharge(t, pool, scope, "k", p, 1)
	})
	t.Run("AfterTheCallAtAKeylessProvider", func(t *testing.T) {
		scope, p := testdb.Name("crash"), newProvider()
		p.keyless = true
		providerURL, crash := crashRunner(t, ctx, url, scope, p)
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
	})
}

// citusHTTP puts idemhttp's middleware over the coordinator: concurrent
// duplicates of each keyed POST run the handler once and get its answer,
// and a key reused with another body is refused.
func citusHTTP(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	scope := testdb.Name("http")
	mw, err := idemhttp.NewMiddleware(pool, idemhttp.Config{
		Scope: func(*http.Request) (string, error) { return scope, nil },
		Wait:  time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		var id int64
		if err := idemhttp.Tx(r.Context()).QueryRow(r.Context(), `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 100) RETURNING id`,
			scope, idemhttp.Key(r.Context())).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "payment %d", id)
	})))
	defer srv.Close()
	post := func(key, body string) (int, string) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(body))
		if err != nil {
			t.Error(err)
			return 0, ""
		}
		req.Header.Set(idemhttp.DefaultHeader, key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return 0, ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	const keys, dups = 10, 3
	var answers sync.Map
	var wg sync.WaitGroup
	for k := range keys {
		for range dups {
			wg.Go(func() {
				key := fmt.Sprintf("k%d", k)
				code, body := post(key, `{"amount":100}`)
				if code != http.StatusCreated {
					t.Errorf("%s: %d %s", key, code, body)
				}
				if first, loaded := answers.LoadOrStore(key, body); loaded && first != body {
					t.Errorf("%s: answered %q and %q", key, first, body)
				}
			})
		}
	}
	wg.Wait()
	if calls.Load() != keys || countPayments(t, pool, scope) != keys {
		t.Fatalf("the handler ran %d times, %d payments; want %d each", calls.Load(), countPayments(t, pool, scope), keys)
	}
	if code, body := post("k0", `{"amount":999}`); code < 400 || code >= 500 || calls.Load() != keys {
		t.Fatalf("a key reused with another body: %d %s, the handler ran %d times", code, body, calls.Load())
	}
}

// citusOutbox enqueues into the outbox, a Citus local table on the
// coordinator, in transactions that write distributed payments, and a
// relay delivers each message once; then citus_outbox_test.go's
// subtests.
func citusOutbox(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	scope := testdb.Name("outbox")
	const n = 20
	var calls atomic.Int64
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		_, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			p, err := pay(scope, key, 1, &calls)(ctx, tx)
			if err != nil {
				return p, err
			}
			_, err = outbox.Enqueue(ctx, tx, outbox.Entry{Scope: scope, Key: key, Destination: "ledger", Payload: []byte(`{}`)})
			return p, err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	var delivered sync.Map
	var count atomic.Int64
	relayCtx, stop := context.WithCancel(ctx)
	defer stop()
	relay, err := outbox.StartRelay(relayCtx, pool, func(ctx context.Context, msg outbox.Message) error {
		if _, dup := delivered.LoadOrStore(msg.IdempotencyKey, true); dup {
			t.Errorf("%s delivered twice", msg.IdempotencyKey)
		}
		if count.Add(1) == n {
			stop()
		}
		return nil
	}, &outbox.Config{Destinations: []string{"ledger"}, PollInterval: 50 * time.Millisecond, Logger: slog.New(failOnError{t})})
	if err != nil {
		t.Fatal(err)
	}
	<-relayCtx.Done()
	relay.Stop()
	if count.Load() != n {
		t.Fatalf("%d of %d delivered", count.Load(), n)
	}

	t.Run("TwoPhaseCommit", func(t *testing.T) { citusOutboxTwoPhase(t, ctx, c, pool) })
	t.Run("CoordinatorsCommitFails", func(t *testing.T) { citusOutboxWriteSkew(t, ctx, c, pool) })
	t.Run("Relays", func(t *testing.T) { citusOutboxRelay(t, ctx, pool) })
}

// citusPurge expires records and flows in many scopes, on every shard,
// and purges them in small batches, leaving the live ones.
func citusPurge(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	prefix := testdb.Name("purge")
	var calls atomic.Int64
	const scopes, keys = 16, 5
	for s := range scopes {
		scope := fmt.Sprintf("%s-%d", prefix, s)
		for k := range keys {
			if _, err := idem.Run(ctx, pool, scope, fmt.Sprint(k), fpA, pay(scope, fmt.Sprint(k), 1, &calls)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// All but the live key "0" of each scope expire; so does every
	// finished flow.
	if _, err := pool.Exec(ctx, `UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE scope LIKE $1 AND key <> '0'`, prefix+"-%"); err != nil {
		t.Fatal(err)
	}
	tag, err := pool.Exec(ctx, `UPDATE idem_flow SET expires_at = now() - interval '1 second' WHERE expires_at IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	var before int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_key WHERE expires_at <= now()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	deleted, err := idem.Purge(ctx, pool, 7)
	if err != nil {
		t.Fatalf("Purge: %v", err)
	}
	if deleted != before+tag.RowsAffected() {
		t.Fatalf("Purge deleted %d, want %d records and %d flows", deleted, before, tag.RowsAffected())
	}
	var live, expired, steps int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE expires_at > now()), count(*) FILTER (WHERE expires_at <= now())
		FROM idempotency_key WHERE scope LIKE $1`, prefix+"-%").Scan(&live, &expired); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow_step_row s
		LEFT JOIN idem_flow f ON f.scope = s.scope AND f.key = s.key WHERE f.key IS NULL`).Scan(&steps); err != nil {
		t.Fatal(err)
	}
	if live != scopes || expired != 0 || steps != 0 {
		t.Fatalf("after Purge: %d live, %d expired records, %d orphan steps", live, expired, steps)
	}
}

// citusStats checks that ReadStats's sizes are the shards', not the
// coordinator's empty shell.
func citusStats(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	s, err := idem.ReadStats(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	var table, total, shell int64
	if err := pool.QueryRow(ctx, `SELECT citus_table_size('idempotency_key'), citus_total_relation_size('idempotency_key'),
		pg_table_size('idempotency_key')`).Scan(&table, &total, &shell); err != nil {
		t.Fatal(err)
	}
	if s.TableBytes != table || s.IndexBytes != total-table {
		t.Fatalf("ReadStats: table %d, index %d bytes; the shards hold %d and %d", s.TableBytes, s.IndexBytes, table, total-table)
	}
	if s.TableBytes <= shell || s.Done == 0 {
		t.Fatalf("ReadStats: %+v (the coordinator's shell: %d bytes)", s, shell)
	}
}
