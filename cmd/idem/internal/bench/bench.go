// Package bench measures idem against the plain transaction it protects, on
// one database, with the phases interleaved so that drift in the machine's
// load or the table's size hits them alike.
package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// Schema is what the benchmark writes besides idem's own table: the
// business table (the same as the tests'), and the key tables of the two
// designs idem is compared with. Each statement creates what is missing.
var Schema = []string{
	`CREATE TABLE IF NOT EXISTS payment (
    id           bigserial PRIMARY KEY,
    scope        text   NOT NULL,
    key          text   NOT NULL,
    amount_cents bigint NOT NULL
)`,
	// The naive design checks, then inserts: nothing stops two inserts.
	`CREATE TABLE IF NOT EXISTS bench_naive_key (
    scope    text  NOT NULL,
    key      text  NOT NULL,
    response jsonb
)`,
	`CREATE INDEX IF NOT EXISTS bench_naive_key_idx ON bench_naive_key (scope, key)`,
	// The two-phase design reserves the key in a transaction of its own.
	`CREATE TABLE IF NOT EXISTS bench_two_phase_key (
    scope    text  NOT NULL,
    key      text  NOT NULL,
    state    text  NOT NULL,
    response jsonb,
    PRIMARY KEY (scope, key)
)`,
}

// claimFirstSchema is the key table of the claim-first design, laid out as
// idem's own table was when it used that design.
var claimFirstSchema = []string{
	`CREATE TABLE IF NOT EXISTS bench_claim_first_key (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    state       text        NOT NULL,
    response    jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
) WITH (fillfactor = 90)`,
	`CREATE INDEX IF NOT EXISTS bench_claim_first_key_expires_at_idx ON bench_claim_first_key (expires_at)`,
}

func init() { Schema = append(Schema, claimFirstSchema...) }

// CreateSchema creates the benchmark's tables where missing.
func CreateSchema(ctx context.Context, pool *pgxpool.Pool) error {
	for _, stmt := range Schema {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("create benchmark schema: %w", err)
		}
	}
	return nil
}

// Payment is what the protected write returns and a replay gives back.
type Payment struct {
	ID          int64 `json:"id"`
	AmountCents int64 `json:"amount_cents"`
}

// Phase is one way of doing the write, measured one operation at a time.
type Phase struct {
	Name string
	// Op performs operation i.
	Op func(ctx context.Context, i int64) error
}

// Stats is what a phase measured.
type Stats struct {
	Ops       int64
	Elapsed   time.Duration
	latencies []time.Duration
}

// Throughput is operations per second.
func (s *Stats) Throughput() float64 { return float64(s.Ops) / s.Elapsed.Seconds() }

// Percentile returns the latency below which fraction p of operations fell.
func (s *Stats) Percentile(p float64) time.Duration {
	if len(s.latencies) == 0 {
		return 0
	}
	slices.Sort(s.latencies)
	return s.latencies[min(int(p*float64(len(s.latencies))), len(s.latencies)-1)]
}

func (s *Stats) add(o *Stats) {
	s.Ops += o.Ops
	s.Elapsed += o.Elapsed
	s.latencies = append(s.latencies, o.latencies...)
}

// Insert is the business write: one payment row.
func Insert(ctx context.Context, tx pgx.Tx, scope, key string, amount int64) (Payment, error) {
	p := Payment{AmountCents: amount}
	err := tx.QueryRow(ctx,
		`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
		scope, key, amount).Scan(&p.ID)
	return p, err
}

// StandardPhases returns the phases every comparison has: the bare
// transaction (the floor for this write), then idem.Run on new keys (first
// executions) and on keys that completed before (replays), each both ways:
// claim first (the default) and with idem.WithLookupFirst. Replays use keys
// that earlier first executions completed, so a first-execution phase must
// run before any replay phase.
func StandardPhases(pool *pgxpool.Pool, scope string) []Phase {
	var completed atomic.Int64
	fp := idem.Fingerprint([]byte("benchmark payment"))
	key := func(n int64) string { return fmt.Sprintf("k-%d", n) }
	run := func(ctx context.Context, n int64, opts ...idem.Option) (idem.Result[Payment], error) {
		return idem.Run(ctx, pool, scope, key(n), fp, func(ctx context.Context, tx pgx.Tx) (Payment, error) {
			return Insert(ctx, tx, scope, key(n), n)
		}, opts...)
	}
	first := func(opts ...idem.Option) func(context.Context, int64) error {
		return func(ctx context.Context, _ int64) error {
			n := completed.Add(1)
			res, err := run(ctx, n, opts...)
			if err == nil && res.Replayed {
				err = fmt.Errorf("key %d replayed on its first execution", n)
			}
			return err
		}
	}
	replay := func(opts ...idem.Option) func(context.Context, int64) error {
		return func(ctx context.Context, i int64) error {
			done := completed.Load()
			if done == 0 {
				return fmt.Errorf("no completed keys to replay")
			}
			n := 1 + i%done
			res, err := run(ctx, n, opts...)
			if err == nil && !res.Replayed {
				err = fmt.Errorf("key %d ran again instead of replaying", n)
			}
			return err
		}
	}
	return []Phase{
		{Name: "bare", Op: func(ctx context.Context, i int64) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if _, err := Insert(ctx, tx, scope, "bare", i); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}},
		{Name: "run-first", Op: first()},
		{Name: "run-replay", Op: replay()},
		{Name: "lookup-first", Op: first(idem.WithLookupFirst())},
		{Name: "lookup-replay", Op: replay(idem.WithLookupFirst())},
	}
}

// Design is one way of making the payment once per key, for the
// comparison of designs: each operation is a first execution on a new key.
type Design struct {
	Name string
	// Pay makes the payment for key, or replays it.
	Pay func(ctx context.Context, key string, amount int64) (Payment, error)
}

// Designs returns idem.Run and the designs it is compared with, all writing
// the same payment row:
//   - naive: read the key table, then insert the key and the payment
//     (check-then-act, in one transaction, without a unique constraint);
//   - two-phase: reserve the key in a committed transaction of its own, then
//     write the payment and complete the key in a second transaction;
//   - single-statement: the claim and the payment in one statement, for a
//     response known before the write (see the README);
//   - key-row-only: not a design but the floor of every design that writes
//     a key row: the payment, then the key's row pipelined with COMMIT,
//     nothing read, locked or waited for (a duplicate fails on the primary
//     key instead of getting an answer);
//   - claim-first: idem's own earlier design, kept to measure against: BEGIN
//     and a claim row inserted in progress in one round trip, fn, then the
//     response stored over the claim (a second tuple version) and COMMIT in
//     one round trip.
func Designs(pool *pgxpool.Pool, scope string) []Design {
	fp := idem.Fingerprint([]byte("benchmark payment"))
	return []Design{
		{Name: "idem.Run", Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			res, err := idem.Run(ctx, pool, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (Payment, error) {
				return Insert(ctx, tx, scope, key, amount)
			})
			return res.Value, err
		}},
		{Name: "naive", Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			var p Payment
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var stored []byte
				err := tx.QueryRow(ctx, `SELECT response FROM bench_naive_key WHERE scope = $1 AND key = $2 LIMIT 1`,
					scope, key).Scan(&stored)
				if err == nil {
					return json.Unmarshal(stored, &p)
				}
				if !errors.Is(err, pgx.ErrNoRows) {
					return err
				}
				if p, err = Insert(ctx, tx, scope, key, amount); err != nil {
					return err
				}
				_, err = tx.Exec(ctx, `INSERT INTO bench_naive_key (scope, key, response) VALUES ($1, $2, $3)`, scope, key, p)
				return err
			})
			return p, err
		}},
		{Name: "two-phase", Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			var p Payment
			tag, err := pool.Exec(ctx, `INSERT INTO bench_two_phase_key (scope, key, state) VALUES ($1, $2, 'reserved')
ON CONFLICT (scope, key) DO NOTHING`, scope, key)
			if err != nil {
				return p, err
			}
			if tag.RowsAffected() == 0 {
				// Reserved before: a real library would wait for it; the
				// benchmark's first executions never get here.
				var stored []byte
				err := pool.QueryRow(ctx, `SELECT response FROM bench_two_phase_key WHERE scope = $1 AND key = $2 AND state = 'done'`,
					scope, key).Scan(&stored)
				if err != nil {
					return p, err
				}
				return p, json.Unmarshal(stored, &p)
			}
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var err error
				if p, err = Insert(ctx, tx, scope, key, amount); err != nil {
					return err
				}
				_, err = tx.Exec(ctx, `UPDATE bench_two_phase_key SET state = 'done', response = $3 WHERE scope = $1 AND key = $2`,
					scope, key, p)
				return err
			})
			return p, err
		}},
		{Name: "single-statement", Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			p := Payment{AmountCents: amount}
			err := pool.QueryRow(ctx, singleStatement, scope, key, fp, amount).Scan(&p.ID)
			if !errors.Is(err, pgx.ErrNoRows) {
				return p, err
			}
			// No row: the key was taken, and its statement has committed by
			// now (the claim waited for it). Answer from the record.
			var stored []byte
			if err := pool.QueryRow(ctx, `SELECT response FROM idempotency_key WHERE scope = $1 AND key = $2`,
				scope, key).Scan(&stored); err != nil {
				return p, err
			}
			return p, json.Unmarshal(stored, &p)
		}},
		{Name: "key-row-only", Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return Payment{}, err
			}
			defer tx.Rollback(ctx)
			p, err := Insert(ctx, tx, scope, key, amount)
			if err != nil {
				return p, err
			}
			response, err := json.Marshal(p)
			if err != nil {
				return p, err
			}
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
VALUES ($1, $2, $3, 'done', $4::text::jsonb, now() + interval '24 hours')`, scope, key, fp, string(response))
			b.Queue(`COMMIT`)
			return p, tx.SendBatch(ctx, b).Close()
		}},
		{Name: "claim-first", Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			return claimFirst(ctx, pool, scope, key, fp, amount)
		}},
	}
}

// claimFirst is the claim-first design's payment; see Designs.
func claimFirst(ctx context.Context, pool *pgxpool.Pool, scope, key string, fp []byte, amount int64) (Payment, error) {
	var p Payment
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return p, err
	}
	defer conn.Release()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	var claimed bool
	var stored []byte
	var restored string
	b.Queue(claimFirstClaim, scope, key, "5000", fp).QueryRow(func(row pgx.Row) error {
		return row.Scan(&claimed, &stored, &restored)
	})
	results := conn.SendBatch(ctx, b)
	tx := results.Tx()
	if err := results.Close(); err != nil {
		_ = tx.Rollback(ctx)
		return p, err
	}
	if !claimed {
		// Taken: the claim waited for the holder; read its record afresh.
		defer tx.Rollback(ctx)
		if stored == nil {
			if err := tx.QueryRow(ctx, `SELECT response FROM bench_claim_first_key WHERE scope = $1 AND key = $2`,
				scope, key).Scan(&stored); err != nil {
				return p, err
			}
		}
		return p, json.Unmarshal(stored, &p)
	}
	if p, err = Insert(ctx, tx, scope, key, amount); err != nil {
		_ = tx.Rollback(ctx)
		return p, err
	}
	response, err := json.Marshal(p)
	if err != nil {
		_ = tx.Rollback(ctx)
		return p, err
	}
	b = &pgx.Batch{}
	b.Queue(claimFirstStore, scope, key, string(response))
	b.Queue(`COMMIT`)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		_ = tx.Rollback(ctx)
		return p, err
	}
	return p, nil
}

// claimFirstClaim is the claim-first design's claim, as idem sent it: set
// the wait budget, insert the claim in progress, restore lock_timeout, and
// read the record in the way, in one statement.
const claimFirstClaim = `
WITH budget AS (
    SELECT current_setting('lock_timeout') AS saved,
           set_config('lock_timeout', $3::text, true) AS applied
),
inserted AS (
    INSERT INTO bench_claim_first_key (scope, key, fingerprint, state, expires_at)
    SELECT $1::text, $2::text, $4::bytea, 'in_progress', now() + interval '24 hours'
    FROM budget
    WHERE budget.applied IS NOT NULL
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 1
),
outcome AS (
    SELECT count(*) > 0 AS claimed FROM inserted
)
SELECT outcome.claimed::bool AS claimed,
       existing.response,
       set_config('lock_timeout', budget.saved, outcome.claimed IS NOT NULL) AS restored
FROM budget
CROSS JOIN outcome
LEFT JOIN bench_claim_first_key AS existing
    ON existing.scope = $1::text
   AND existing.key = $2::text`

// claimFirstStore completes the claim, failing when it is gone.
const claimFirstStore = `
WITH stored AS (
    UPDATE bench_claim_first_key
    SET state = 'done', response = $3::text::jsonb
    WHERE scope = $1::text AND key = $2::text AND state = 'in_progress'
    RETURNING 1
)
SELECT 1 / count(*) FROM stored`

// singleStatement is the README's pattern for a hot path whose response is
// known before the write: the payment insert reads the claim, so it runs only
// when the key was free, and both commit in one implicit transaction.
const singleStatement = `
WITH claim AS (
    INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
    VALUES ($1, $2, $3, 'done', jsonb_build_object('amount_cents', $4::bigint), now() + interval '24 hours')
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING key
)
INSERT INTO payment (scope, key, amount_cents)
SELECT $1, claim.key, $4 FROM claim
RETURNING id`

// DesignPhases turns designs into phases of first executions on new keys.
func DesignPhases(designs []Design) []Phase {
	var next atomic.Int64
	phases := make([]Phase, len(designs))
	for i, d := range designs {
		phases[i] = Phase{Name: d.Name, Op: func(ctx context.Context, _ int64) error {
			n := next.Add(1)
			_, err := d.Pay(ctx, fmt.Sprintf("%s-%d", d.Name, n), n)
			return err
		}}
	}
	return phases
}

// StormResult is what a design did with concurrent duplicates.
type StormResult struct {
	// Duplicates counts payment rows beyond one per key: effects doubled.
	Duplicates int64
	// Rejected counts calls that ended in an error instead of an answer.
	Rejected int64
}

// Storm sends each of keys payments from clientsPerKey clients at once.
func Storm(ctx context.Context, pool *pgxpool.Pool, scope string, d Design, keys, clientsPerKey int) (StormResult, error) {
	prefix := fmt.Sprintf("storm-%s-%d", d.Name, time.Now().UnixNano())
	var rejected atomic.Int64
	for k := range keys {
		key := fmt.Sprintf("%s-%d", prefix, k)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range clientsPerKey {
			wg.Go(func() {
				<-start
				if _, err := d.Pay(ctx, key, int64(k)); err != nil {
					rejected.Add(1)
				}
			})
		}
		close(start)
		wg.Wait()
	}
	var rows int64
	err := pool.QueryRow(ctx, `SELECT count(*) FROM payment WHERE scope = $1 AND starts_with(key, $2)`, scope, prefix+"-").Scan(&rows)
	if err != nil {
		return StormResult{}, err
	}
	return StormResult{Duplicates: rows - int64(keys), Rejected: rejected.Load()}, nil
}

// Measure runs ops operations of phase on clients goroutines and times them.
func Measure(ctx context.Context, phase Phase, clients int, ops int64) (*Stats, error) {
	var next atomic.Int64
	var firstErr error
	var mu sync.Mutex
	latencies := make([][]time.Duration, clients)
	var wg sync.WaitGroup
	start := time.Now()
	for c := range clients {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > ops {
					return
				}
				t0 := time.Now()
				if err := phase.Op(ctx, i); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("%s: %w", phase.Name, err)
					}
					mu.Unlock()
					return
				}
				latencies[c] = append(latencies[c], time.Since(t0))
			}
		})
	}
	wg.Wait()
	s := &Stats{Ops: ops, Elapsed: time.Since(start)}
	for _, l := range latencies {
		s.latencies = append(s.latencies, l...)
	}
	return s, firstErr
}

// Interleave runs rounds of every phase in turn, opsPerPhase operations each
// time, and returns each phase's totals by name.
func Interleave(ctx context.Context, phases []Phase, clients, rounds int, opsPerPhase int64) (map[string]*Stats, error) {
	totals := make(map[string]*Stats, len(phases))
	for _, p := range phases {
		totals[p.Name] = &Stats{}
	}
	for range rounds {
		for _, p := range phases {
			s, err := Measure(ctx, p, clients, opsPerPhase)
			if err != nil {
				return nil, err
			}
			totals[p.Name].add(s)
		}
	}
	return totals, nil
}

// WALPart is the WAL that one kind of record adds to an operation.
type WALPart struct {
	Part  string  // resource manager, record type and relation
	Bytes float64 // per operation, full-page images included
}

// WAL runs ops operations of phase one at a time and returns the WAL bytes
// each wrote, broken down by kind, read back with pg_walinspect (which it
// creates in the database): the records of the transactions that inserted
// a payment row meanwhile, and the records without a transaction (page
// pruning, say) on this database's relations. Counting so keeps what other
// databases on the server write out of the figure. Full-page images are in
// it, so a checkpoint during the run shows.
func WAL(ctx context.Context, pool *pgxpool.Pool, phase Phase, ops int64) (perOp float64, parts []WALPart, err error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, nil, err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_walinspect`); err != nil {
		return 0, nil, fmt.Errorf("pg_walinspect: %w", err)
	}
	// A temporary replication slot keeps the server from recycling the WAL
	// to be read while others write a lot of it; it goes with the session.
	var start string
	if err := conn.QueryRow(ctx, `SELECT lsn::text FROM pg_create_physical_replication_slot(
		'idem_bench_' || pg_backend_pid(), immediately_reserve => true, temporary => true)`).Scan(&start); err != nil {
		return 0, nil, fmt.Errorf("reserve WAL: %w", err)
	}
	defer conn.Exec(context.WithoutCancel(ctx), `SELECT pg_drop_replication_slot('idem_bench_' || pg_backend_pid())`)
	var firstID int64
	if err := conn.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM payment`).Scan(&firstID); err != nil {
		return 0, nil, err
	}
	for i := range ops {
		if err := phase.Op(ctx, i); err != nil {
			return 0, nil, fmt.Errorf("%s: %w", phase.Name, err)
		}
	}
	rows, err := conn.Query(ctx, walQuery, start, firstID)
	if err != nil {
		return 0, nil, err
	}
	for rows.Next() {
		var part WALPart
		var total int64
		if err := rows.Scan(&part.Part, &total); err != nil {
			return 0, nil, err
		}
		part.Bytes = float64(total) / float64(ops)
		perOp += part.Bytes
		parts = append(parts, part)
	}
	return perOp, parts, rows.Err()
}

// walQuery sums the WAL records since $1 of the transactions that inserted
// payment rows after id $2, and those of no transaction on the database's
// own relations, by resource manager, record type and relation.
const walQuery = `
WITH ours AS (
    SELECT DISTINCT xmin AS xid FROM payment WHERE id > $2::bigint
),
records AS (
    SELECT w.resource_manager || ' ' || w.record_type AS kind,
           substring(w.block_ref from 'rel \d+/\d+/(\d+)')::oid AS filenode,
           w.record_length
    FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn()) AS w
    WHERE w.xid IN (SELECT xid FROM ours)
       OR (w.xid = '0'::xid
           AND substring(w.block_ref from 'rel \d+/(\d+)/')::oid =
               (SELECT oid FROM pg_database WHERE datname = current_database()))
)
SELECT records.kind || coalesce(' ' || c.relname, ''), sum(records.record_length)::bigint
FROM records
LEFT JOIN pg_class AS c ON c.relfilenode = records.filenode
GROUP BY 1
ORDER BY 2 DESC`
