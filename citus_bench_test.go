//go:build citus

package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// BenchmarkCitusRatios measures, through the coordinator of a cluster of
// startCitus (a coordinator and two workers on this machine, docs/citus.sql),
// with 16 clients, in interleaved rounds, each phase on the payment table
// (distributed by scope, co-located with idem's records):
//
//   - bare: BEGIN; the payment's INSERT; COMMIT;
//   - floor: BEGIN; the payment's INSERT; the key's complete row INSERTed
//     into idempotency_key with its values, pipelined with COMMIT, both
//     routed to the scope's shard, nothing locked or read: what any design
//     with a separate key table must pay;
//   - run-first: idem.Run on a new key, fn the payment's INSERT;
//   - run-replay: idem.Run on a key that completed;
//   - flow: an idem flow of a local step (the payment's INSERT), a call to
//     a provider in this process that answers at once, and a local step
//     (an UPDATE of the payment);
//   - held: the same by hand, one transaction held open across the call.
//
// Each iteration is one round of every phase. It reports the ratios of
// issue 39 (first/floor, first/bare, replay/bare, floor/bare, flow/held)
// and each phase's throughput; then, one operation at a time on a
// connection of its own, the deterministic figures per operation: the
// statements a phase sends the coordinator (stmts), its round trips to
// the coordinator (rtts), and the commands the coordinator sends the
// workers for it (remote, counted from citus.log_remote_commands's
// notices). Every node shares this machine's cores: the ratios say what
// the routing costs here, not how it scales.
//
//	go test -tags citus -run '^$' -bench CitusRatios -benchtime 15x .
func BenchmarkCitusRatios(b *testing.B) {
	_, pool := startCitus(b)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, citusClaimFunctions); err != nil {
		b.Fatalf("the claim's functions: %v", err)
	}
	// The design the functions prototype must keep Run's promise before
	// it is measured: a duplicate that waited for the key's holder
	// replays what the holder committed.
	if err := citusFunctionClaimReplaysAfterItsWait(ctx, pool); err != nil {
		b.Fatal(err)
	}
	const clients, tenants = 16, 20
	phases := citusPhases(pool, tenants)
	b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
		// Open the connections and warm their statement caches.
		if _, err := citusInterleave(ctx, pool, phases, clients, 1, 4*clients); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		totals, err := citusInterleave(ctx, pool, phases, clients, b.N, 300)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		rate := func(name string) float64 { return float64(totals[name].ops) / totals[name].elapsed.Seconds() }
		bare, floor := rate("bare"), rate("floor")
		for _, v := range citusVariants {
			first, replay := rate("run-first"+v.suffix), rate("run-replay"+v.suffix)
			b.ReportMetric(first/floor, "first"+v.suffix+"/floor")
			b.ReportMetric(first/bare, "first"+v.suffix+"/bare")
			b.ReportMetric(replay/bare, "replay"+v.suffix+"/bare")
		}
		fnFirst, fnReplay := rate("fn-first"), rate("fn-replay")
		b.ReportMetric(fnFirst/floor, "fn-first/floor")
		b.ReportMetric(fnFirst/bare, "fn-first/bare")
		b.ReportMetric(fnReplay/bare, "fn-replay/bare")
		b.ReportMetric(floor/bare, "floor/bare")
		b.ReportMetric(rate("floor+1")/floor, "floor+1/floor")
		b.ReportMetric(rate("floor+3")/floor, "floor+3/floor")
		b.ReportMetric(rate("flow")/rate("held"), "flow/held")
		for _, p := range phases {
			b.ReportMetric(rate(p.name), p.name+"-ops/s")
		}
		if load, err := os.ReadFile("/proc/loadavg"); err == nil {
			if f, err := strconv.ParseFloat(strings.Fields(string(load))[0], 64); err == nil {
				b.ReportMetric(f, "load1")
			}
		}
	})
	// The figures do not depend on b.N: one pass whatever it is.
	b.Run("statements", func(b *testing.B) {
		counts, err := citusCounts(ctx, b, pool, tenants)
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range counts {
			b.ReportMetric(c.stmts, c.name+"-stmts/op")
			b.ReportMetric(c.rtts, c.name+"-rtts/op")
			b.ReportMetric(c.remote, c.name+"-remote/op")
		}
	})
}

// citusVariant is a way of Run's on Citus that the benchmark compares
// with the others in the same rounds: suffix names its phases, use sets
// it and returns the function that puts the previous one back, opts are
// Run's options.
type citusVariant struct {
	suffix string
	use    func() (restore func())
	opts   []idem.Option
}

// citusVariants are the ways Run's first executions and replays are
// measured.
var citusVariants = []citusVariant{
	{suffix: "", use: func() func() { return func() {} }},
	// Run's statements before KeyLockCitus and KeyStoreBudgetCitus.
	{suffix: "-before", use: func() func() { return idem.CitusStatementsAsBefore(true) }},
	// WithLookupFirst: a replay found by a read outside any transaction,
	// a first execution after it.
	{suffix: "-lookup", use: func() func() { return func() {} }, opts: []idem.Option{idem.WithLookupFirst()}},
}

// citusPhase is one phase of BenchmarkCitusRatios: op performs one
// operation; use, when not nil, is called before the phase's operations
// and what it returns after them.
type citusPhase struct {
	name string
	op   func(ctx context.Context, db *pgxpool.Pool) error
	use  func() (restore func())
}

// citusPhases returns the phases of BenchmarkCitusRatios, on tenants
// scopes. Each takes the pool it runs on, so that the counting pass can
// run it on a pool of its own.
func citusPhases(_ *pgxpool.Pool, tenants int64) []citusPhase {
	// Each set of phases numbers its keys from 1, under a prefix of its own.
	var seq atomic.Int64
	set := "s" + strconv.FormatInt(citusPhaseSets.Add(1), 10)
	scopeOf := func(n int64) string { return "bench-" + strconv.FormatInt(n%tenants, 10) }
	fp := idem.Fingerprint([]byte("benchmark payment"))
	var calls atomic.Int64
	// floorOp is the key-row floor's operation, with claimReads reads of
	// the key's row sent with BEGIN and storeReads with the row's INSERT.
	floorOp := func(claimReads, storeReads int) func(ctx context.Context, db *pgxpool.Pool) error {
		const read = `SELECT fingerprint FROM idempotency_key WHERE scope = $1 AND key = $2`
		return func(ctx context.Context, db *pgxpool.Pool) error {
			n := seq.Add(1)
			scope, key := scopeOf(n), set+"f"+strconv.FormatInt(n, 10)
			conn, err := db.Acquire(ctx)
			if err != nil {
				return err
			}
			defer conn.Release()
			rollback := func() { _, _ = conn.Exec(ctx, "ROLLBACK") }
			batch := &pgx.Batch{}
			batch.Queue("begin")
			for range claimReads {
				batch.Queue(read, scope, key)
			}
			if err := conn.SendBatch(ctx, batch).Close(); err != nil {
				rollback()
				return err
			}
			p := payment{AmountCents: n}
			if err := conn.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				scope, key, n).Scan(&p.ID); err != nil {
				rollback()
				return err
			}
			response, err := json.Marshal(p)
			if err != nil {
				rollback()
				return err
			}
			batch = &pgx.Batch{}
			for range storeReads {
				batch.Queue(read, scope, key)
			}
			batch.Queue(`INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
VALUES ($1, $2, $3, 'done', $4::text::jsonb, now() + interval '24 hours')`, scope, key, fp, string(response))
			batch.Queue(`COMMIT`)
			if err := conn.SendBatch(ctx, batch).Close(); err != nil {
				rollback()
				return err
			}
			return nil
		}
	}
	phases := []citusPhase{
		{"bare", func(ctx context.Context, db *pgxpool.Pool) error {
			n := seq.Add(1)
			tx, err := db.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, scopeOf(n), "bare", n); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}, nil},
		{"floor", floorOp(0, 0), nil},
		// The floor with reads of the key's row added, each a statement
		// Citus plans on its fast path and routes to the scope's worker:
		// one in BEGIN's round trip; two there and one in COMMIT's, the
		// commands Run's first execution sends the workers (7).
		{"floor+1", floorOp(1, 0), nil},
		{"floor+3", floorOp(2, 1), nil},
	}
	for _, v := range citusVariants {
		var completed atomic.Int64
		run := func(ctx context.Context, db *pgxpool.Pool, n int64) (idem.Result[payment], error) {
			scope, key := scopeOf(n), set+"r"+v.suffix+"-"+strconv.FormatInt(n, 10)
			return idem.Run(ctx, db, scope, key, fp, pay(scope, key, n, &calls), v.opts...)
		}
		var mu sync.Mutex
		var done []int64
		phases = append(phases,
			citusPhase{"run-first" + v.suffix, func(ctx context.Context, db *pgxpool.Pool) error {
				n := seq.Add(1)
				res, err := run(ctx, db, n)
				if err == nil && res.Replayed {
					return fmt.Errorf("key %d replayed on its first execution", n)
				}
				if err == nil {
					mu.Lock()
					done = append(done, n)
					mu.Unlock()
					completed.Add(1)
				}
				return err
			}, v.use},
			citusPhase{"run-replay" + v.suffix, func(ctx context.Context, db *pgxpool.Pool) error {
				i := seq.Add(1)
				mu.Lock()
				if len(done) == 0 {
					mu.Unlock()
					return fmt.Errorf("no completed keys to replay")
				}
				n := done[i%int64(len(done))]
				mu.Unlock()
				res, err := run(ctx, db, n)
				if err == nil && !res.Replayed {
					return fmt.Errorf("key %d ran again instead of replaying", n)
				}
				return err
			}, v.use})
	}
	// The prototype of a claim and a record each in one statement that
	// Citus delegates to the worker of the scope's shard (citusClaimFunctions),
	// driven by hand as Run drives its statements.
	var fnMu sync.Mutex
	var fnDone []int64
	phases = append(phases,
		citusPhase{"fn-first", func(ctx context.Context, db *pgxpool.Pool) error {
			n := seq.Add(1)
			scope, key := scopeOf(n), set+"fn-"+strconv.FormatInt(n, 10)
			replayed, err := citusRunViaFunctions(ctx, db, scope, key, fp, n)
			if err == nil && replayed {
				return fmt.Errorf("key %s replayed on its first execution", key)
			}
			if err == nil {
				fnMu.Lock()
				fnDone = append(fnDone, n)
				fnMu.Unlock()
			}
			return err
		}, nil},
		citusPhase{"fn-replay", func(ctx context.Context, db *pgxpool.Pool) error {
			i := seq.Add(1)
			fnMu.Lock()
			if len(fnDone) == 0 {
				fnMu.Unlock()
				return fmt.Errorf("no completed keys to replay")
			}
			n := fnDone[i%int64(len(fnDone))]
			fnMu.Unlock()
			scope, key := scopeOf(n), set+"fn-"+strconv.FormatInt(n, 10)
			replayed, err := citusRunViaFunctions(ctx, db, scope, key, fp, n)
			if err == nil && !replayed {
				return fmt.Errorf("key %s ran again instead of replaying", key)
			}
			return err
		}, nil})
	flow := idem.MustNewFlow("bench-citus-charge", func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return "", err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			return "ch_" + providerKey, nil
		})
		if err != nil {
			return "", err
		}
		_, err = idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
			_, err := tx.Exec(ctx, `UPDATE payment SET key = $3 WHERE scope = $1 AND id = $2`, s.Scope(), id, charge)
			return struct{}{}, err
		})
		return charge, err
	})
	phases = append(phases,
		citusPhase{"flow", func(ctx context.Context, db *pgxpool.Pool) error {
			n := seq.Add(1)
			res, err := flow.Run(ctx, db, scopeOf(n), set+"flow-"+strconv.FormatInt(n, 10), fp, n)
			if err == nil && (res.Replayed || res.Value == "") {
				return fmt.Errorf("flow %d: %+v on its first execution", n, res)
			}
			return err
		}, nil},
		citusPhase{"held", func(ctx context.Context, db *pgxpool.Pool) error {
			n := seq.Add(1)
			scope, key := scopeOf(n), "held-"+strconv.FormatInt(n, 10)
			return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
				var id int64
				if err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
					scope, key, n).Scan(&id); err != nil {
					return err
				}
				charge := "ch_" + key // the provider answers at once
				_, err := tx.Exec(ctx, `UPDATE payment SET key = $3 WHERE scope = $1 AND id = $2`, scope, id, charge)
				return err
			})
		}, nil})
	return phases
}

// citusPhaseSets counts the sets of phases citusPhases made.
var citusPhaseSets atomic.Int64

// citusTotals is what a phase measured over the rounds.
type citusTotals struct {
	ops     int64
	elapsed time.Duration
}

// citusInterleave runs rounds of every phase in turn, ops operations each
// time on clients goroutines, and returns each phase's totals by name.
func citusInterleave(ctx context.Context, pool *pgxpool.Pool, phases []citusPhase, clients, rounds, ops int) (map[string]*citusTotals, error) {
	totals := make(map[string]*citusTotals, len(phases))
	for _, p := range phases {
		totals[p.name] = &citusTotals{}
	}
	for range rounds {
		for _, p := range phases {
			var next atomic.Int64
			var firstErr atomic.Value
			var wg sync.WaitGroup
			restore := func() {}
			if p.use != nil {
				restore = p.use()
			}
			start := time.Now()
			for range clients {
				wg.Go(func() {
					for next.Add(1) <= int64(ops) {
						if err := p.op(ctx, pool); err != nil {
							firstErr.CompareAndSwap(nil, fmt.Errorf("%s: %w", p.name, err))
							return
						}
					}
				})
			}
			wg.Wait()
			elapsed := time.Since(start)
			restore()
			if err, _ := firstErr.Load().(error); err != nil {
				return nil, err
			}
			totals[p.name].ops += int64(ops)
			totals[p.name].elapsed += elapsed
		}
	}
	return totals, nil
}

// citusCount is what one operation of a phase sends, on average.
type citusCount struct {
	name                string
	stmts, rtts, remote float64
}

// citusCounter counts, on a pool of one connection, the statements and
// round trips sent to the coordinator (a pgx tracer) and the commands the
// coordinator sends the workers (the notices of citus.log_remote_commands).
type citusCounter struct {
	stmts, rtts, remote atomic.Int64
	// sent is what the last operation sent, for -v: its statements and
	// the coordinator's remote commands, in order.
	mu   sync.Mutex
	sent []string
}

func (c *citusCounter) log(s string) {
	c.mu.Lock()
	c.sent = append(c.sent, s)
	c.mu.Unlock()
}

func (c *citusCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.log("> " + d.SQL)
	c.stmts.Add(1)
	c.rtts.Add(1)
	return ctx
}

func (c *citusCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *citusCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		c.log("> (batch) " + q.SQL)
	}
	c.rtts.Add(1)
	return ctx
}

func (c *citusCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.stmts.Add(1)
}

func (c *citusCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *citusCounter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

// TracePrepareEnd counts a statement prepared, a round trip: one pgx
// found in its cache is not.
func (c *citusCounter) TracePrepareEnd(_ context.Context, _ *pgx.Conn, d pgx.TracePrepareEndData) {
	if !d.AlreadyPrepared {
		c.rtts.Add(1)
	}
}

// citusCounts runs each phase one operation at a time on a pool of one
// connection that logs the coordinator's remote commands, and returns
// what an operation sent, on average, once the connection's statement
// cache is warm.
func citusCounts(ctx context.Context, tb testing.TB, base *pgxpool.Pool, tenants int64) ([]citusCount, error) {
	counter := &citusCounter{}
	cfg := base.Config().Copy()
	cfg.MaxConns, cfg.MinConns = 1, 0
	cfg.ConnConfig.Tracer = counter
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if strings.HasPrefix(n.Message, "issuing ") {
			counter.remote.Add(1)
			counter.log("    " + n.Message)
		}
	}
	cfg.ConnConfig.RuntimeParams["citus.log_remote_commands"] = "on"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	var counts []citusCount
	for _, p := range citusPhases(pool, tenants) {
		const warm, ops = 10, 20
		restore := func() {}
		if p.use != nil {
			restore = p.use()
		}
		for range warm {
			if err := p.op(ctx, pool); err != nil {
				return nil, fmt.Errorf("%s: %w", p.name, err)
			}
		}
		stmts, rtts, remote := counter.stmts.Load(), counter.rtts.Load(), counter.remote.Load()
		for range ops {
			counter.mu.Lock()
			counter.sent = counter.sent[:0]
			counter.mu.Unlock()
			if err := p.op(ctx, pool); err != nil {
				return nil, fmt.Errorf("%s: %w", p.name, err)
			}
		}
		restore()
		if testing.Verbose() {
			var sent []string
			for _, s := range counter.sent {
				sent = append(sent, strings.Join(strings.Fields(s), " "))
			}
			tb.Logf("%s, one operation:\n%s", p.name, strings.Join(sent, "\n"))
		}
		counts = append(counts, citusCount{
			name:   p.name,
			stmts:  float64(counter.stmts.Load()-stmts) / ops,
			rtts:   float64(counter.rtts.Load()-rtts) / ops,
			remote: float64(counter.remote.Load()-remote) / ops,
		})
	}
	return counts, nil
}

// citusClaimFunctions prototypes, for BenchmarkCitusRatios, Run's claim
// and record on Citus each as one statement: plpgsql functions
// distributed by their scope argument, co-located with idempotency_key,
// with force_delegation, so that the coordinator delegates a call inside
// a transaction block to the worker of the scope's shard, over the
// transaction's connection there, in one remote command.
//
// idem_bench_claim reads the key's record; a live completed one is
// replayed, with no lock. Otherwise it takes the key's lock, waiting for
// it under @lock_timeout (KeyLockWait) when another transaction holds it,
// and restores the worker's lock_timeout, then reads the record again, in
// a statement of its own whose snapshot (a VOLATILE function's statements
// each take one, at READ COMMITTED) follows the lock, and so sees a record
// its previous holder committed meanwhile. idem_bench_store is KeyWaitBudgetCitus then
// KeyInsertCitus, for a record sent with COMMIT (no restore).
const citusClaimFunctions = `
CREATE FUNCTION idem_bench_claim(p_scope text, p_key text, p_lock_id bigint, p_lock_timeout text)
RETURNS TABLE (lock int, waited bool, has_record bool, fingerprint bytea, state text, response text, expired bool)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    saved text;
BEGIN
    waited := false;
    SELECT k.fingerprint, k.state, k.response::text, k.expires_at <= now()
      INTO fingerprint, state, response, expired
      FROM idempotency_key k
     WHERE k.scope = p_scope AND k.key = p_key;
    has_record := FOUND;
    IF has_record AND NOT expired AND state = 'done' THEN
        -- A live completed record this snapshot sees committed: a replay,
        -- which takes no lock.
        lock := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    IF pg_try_advisory_xact_lock(p_lock_id) THEN
        lock := 1;
    ELSE
        lock := 2;
        waited := true;
        saved := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_lock_timeout, true);
        PERFORM pg_advisory_xact_lock(p_lock_id);
        PERFORM set_config('lock_timeout', saved, true);
    END IF;
    -- A statement of its own, after the lock: at READ COMMITTED its
    -- snapshot sees what the lock's previous holder committed.
    SELECT k.fingerprint, k.state, k.response::text, k.expires_at <= now()
      INTO fingerprint, state, response, expired
      FROM idempotency_key k
     WHERE k.scope = p_scope AND k.key = p_key;
    has_record := FOUND;
    RETURN NEXT;
END
$fn$;
CREATE FUNCTION idem_bench_store(p_scope text, p_key text, p_fingerprint bytea, p_response text,
                                 p_retention interval, p_lock_timeout text)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    PERFORM set_config('lock_timeout', p_lock_timeout, true);
    INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
    VALUES (p_scope, p_key, p_fingerprint, 'done', p_response::jsonb, now() + p_retention);
END
$fn$;
SELECT create_distributed_function('idem_bench_claim(text,text,bigint,text)', 'p_scope',
                                   colocate_with => 'idempotency_key', force_delegation => true);
SELECT create_distributed_function('idem_bench_store(text,text,bytea,text,interval,text)', 'p_scope',
                                   colocate_with => 'idempotency_key', force_delegation => true);
`
