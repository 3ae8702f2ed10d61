//go:build citus

package idem_test

// The prototype of a claim made by functions Citus delegates to the node
// of the scope's shard (create_distributed_function, colocated with
// idempotency_key, force_delegation), which BenchmarkCitusRatios measures
// beside Run: not a part of idem.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// citusFunctionClaim is what idem_bench_claim answers.
type citusFunctionClaim struct {
	lock            int
	waited, found   bool
	fingerprint     []byte
	state, response *string
	expired         *bool
}

// queueFunctionClaim queues idem_bench_claim's call on b.
func queueFunctionClaim(b *pgx.Batch, scope, key string, c *citusFunctionClaim) {
	b.Queue(`SELECT lock, waited, has_record, fingerprint, state, response, expired FROM idem_bench_claim($1, $2, $3, $4)`,
		scope, key, citusLockID(scope, key), "5s").QueryRow(func(r pgx.Row) error {
		return r.Scan(&c.lock, &c.waited, &c.found, &c.fingerprint, &c.state, &c.response, &c.expired)
	})
}

// citusLockID is a key's lock id for the prototype (idem's own is
// internal).
func citusLockID(scope, key string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(scope))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(key))
	return int64(h.Sum64())
}

// citusRunViaFunctions is Run's first execution or replay through the
// prototype's functions: BEGIN and the claim in one round trip, the
// payment, then the record and COMMIT in one round trip.
func citusRunViaFunctions(ctx context.Context, db *pgxpool.Pool, scope, key string, fp []byte, n int64) (replayed bool, err error) {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Release()
	var c citusFunctionClaim
	b := &pgx.Batch{}
	b.Queue("begin isolation level read committed")
	queueFunctionClaim(b, scope, key, &c)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		_, _ = conn.Exec(ctx, "ROLLBACK")
		return false, err
	}
	if c.found && !*c.expired && *c.state == "done" {
		_, err := conn.Exec(ctx, "COMMIT")
		return true, err
	}
	p := payment{AmountCents: n}
	if err := conn.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
		scope, key, n).Scan(&p.ID); err != nil {
		_, _ = conn.Exec(ctx, "ROLLBACK")
		return false, err
	}
	response, err := json.Marshal(p)
	if err != nil {
		_, _ = conn.Exec(ctx, "ROLLBACK")
		return false, err
	}
	b = &pgx.Batch{}
	b.Queue(`SELECT idem_bench_store($1, $2, $3, $4, $5, $6)`, scope, key, fp, string(response), 24*time.Hour, "5s")
	b.Queue("COMMIT")
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		_, _ = conn.Exec(ctx, "ROLLBACK")
		return false, err
	}
	return false, nil
}

// citusFunctionClaimReplaysAfterItsWait checks, through the coordinator,
// that a duplicate whose claim (idem_bench_claim) waits for the key's
// holder, which then commits its record, reads that record after its
// wait and replays it: that the function's read after the lock is not
// made with a snapshot taken before the lock was granted. It also checks
// that the lock is taken on the worker of the scope's shard.
func citusFunctionClaimReplaysAfterItsWait(ctx context.Context, pool *pgxpool.Pool) error {
	scope, key := "claim-fn-check", "k1"
	holder, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = holder.Rollback(ctx) }()
	var h citusFunctionClaim
	b := &pgx.Batch{}
	queueFunctionClaim(b, scope, key, &h)
	if err := holder.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("holder's claim: %w", err)
	}
	if h.lock != 1 || h.found {
		return fmt.Errorf("holder's claim: %+v, want the lock taken and no record", h)
	}
	// The lock is on the worker of the scope's shard, none on the coordinator.
	var onCoordinator int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted`).Scan(&onCoordinator); err != nil {
		return err
	}
	var onWorkers int
	if err := pool.QueryRow(ctx, `SELECT coalesce(sum(result::int), 0) FROM run_command_on_workers(
		$$SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted$$)`).Scan(&onWorkers); err != nil {
		return err
	}
	if onCoordinator != 0 || onWorkers != 1 {
		return fmt.Errorf("the claim's lock: %d on the coordinator, %d on the workers, want 0 and 1", onCoordinator, onWorkers)
	}
	type answer struct {
		c   citusFunctionClaim
		err error
	}
	waiting := make(chan answer, 1)
	go func() {
		var d citusFunctionClaim
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			queueFunctionClaim(b, scope, key, &d)
			return tx.SendBatch(ctx, b).Close()
		})
		waiting <- answer{d, err}
	}()
	// The duplicate's claim waits on the worker for the holder's lock.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiters int
		if err := pool.QueryRow(ctx, `SELECT coalesce(sum(result::int), 0) FROM run_command_on_workers(
			$$SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted$$)`).Scan(&waiters); err != nil {
			return err
		}
		if waiters == 1 {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("the duplicate's claim never waited for the holder's lock")
		}
		time.Sleep(10 * time.Millisecond)
	}
	b = &pgx.Batch{}
	b.Queue(`SELECT idem_bench_store($1, $2, $3, $4, $5, $6)`, scope, key, []byte("fp"), `{"id": 1}`, 24*time.Hour, "5s")
	if err := holder.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("holder's record: %w", err)
	}
	if err := holder.Commit(ctx); err != nil {
		return err
	}
	a := <-waiting
	if a.err != nil {
		return fmt.Errorf("duplicate's claim: %w", a.err)
	}
	if !a.c.waited || !a.c.found || a.c.state == nil || *a.c.state != "done" {
		return fmt.Errorf("duplicate's claim after its wait: %+v, want the holder's record, done", a.c)
	}
	return nil
}
