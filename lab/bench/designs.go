package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// Design is one way of making the payment once per key, for the
// comparison of designs: each operation is a first execution on a new key.
type Design struct {
	Name string
	// Pay makes the payment for key, or replays it.
	Pay func(ctx context.Context, key string, amount int64) (Payment, error)
}

// Floor names the key-row-only design (see Designs): the floor of every
// design that writes a key row, which the others are measured against
// besides the bare transaction.
const Floor = "key-row-only"

// Designs returns idem.Run and the designs it is compared with, all writing
// the same payment row:
//   - naive: read the key table, then insert the key and the payment
//     (check-then-act, in one transaction, without a unique constraint);
//   - two-phase: reserve the key in a committed transaction of its own, then
//     write the payment and complete the key in a second transaction;
//   - single-statement: the claim and the payment in one statement, for a
//     response known before the write (see docs/performance.md);
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
		{Name: Floor, Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			return keyRowOnly(ctx, pool, scope, key, fp, amount)
		}},
		{Name: "claim-first", Pay: func(ctx context.Context, key string, amount int64) (Payment, error) {
			return claimFirst(ctx, pool, scope, key, fp, amount)
		}},
	}
}

// keyRowOnly is the floor's payment (see Designs): BEGIN, the payment, then
// the key's complete row pipelined with COMMIT, three round trips.
func keyRowOnly(ctx context.Context, pool *pgxpool.Pool, scope, key string, fp []byte, amount int64) (Payment, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return Payment{}, err
	}
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return Payment{}, err
	}
	p, err := Insert(ctx, tx, scope, key, amount)
	if err != nil {
		_ = tx.Rollback(ctx)
		return p, err
	}
	response, err := json.Marshal(p)
	if err != nil {
		_ = tx.Rollback(ctx)
		return p, err
	}
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO idempotency_key (scope, key, fingerprint, state, response, expires_at)
VALUES ($1, $2, $3, 'done', $4::text::jsonb, now() + interval '24 hours')`, scope, key, fp, string(response))
	b.Queue(`COMMIT`)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		_ = tx.Rollback(ctx)
		return p, err
	}
	// The batch's COMMIT ended the transaction. tx does not know it: its
	// Rollback would send a ROLLBACK, a fourth round trip for nothing.
	return p, nil
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

// singleStatement is docs/performance.md's pattern for a hot path whose response is
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
		prefix := d.Name + "-"
		phases[i] = Phase{Name: d.Name, Op: func(ctx context.Context, _ int64) error {
			n := next.Add(1)
			_, err := d.Pay(ctx, numbered(prefix, n), n)
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
