package bench

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// WALPart is the WAL that one kind of record adds to an operation.
type WALPart struct {
	Part  string  // resource manager, record type and relation
	Bytes float64 // per operation (with full-page images from WAL, without from DatabaseWAL)
	// Records is the number of records per operation: "Transaction
	// COMMIT"'s is the transactions committed that wrote.
	Records float64
}

// WAL runs ops operations of phase one at a time and returns the WAL bytes
// each wrote, broken down by kind, read back with pg_walinspect (which it
// creates in the database): the records of the transactions that inserted
// a payment row meanwhile, and the records without a transaction (page
// pruning, say) on this database's relations. Counting so keeps what other
// databases on the server write out of the figure. Full-page images are in
// it, so a checkpoint during the run shows.
func WAL(ctx context.Context, pool *pgxpool.Pool, phase Phase, ops int64) (perOp float64, parts []WALPart, err error) {
	return measureWAL(ctx, pool, phase, ops, walQuery, func(conn *pgxpool.Conn, slotLSN string) ([]any, error) {
		var firstID int64
		err := conn.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM payment`).Scan(&firstID)
		return []any{slotLSN, firstID}, err
	})
}

// measureWAL runs ops operations of phase one at a time and returns the
// WAL that query finds, by part (each row a part and its bytes), per
// operation. The session that reads it holds a temporary replication slot
// meanwhile, which keeps the server from recycling the WAL to be read while
// others write a lot of it, and goes with the session; mark runs on that
// session before the operations, given the slot's LSN, and returns query's
// arguments.
func measureWAL(ctx context.Context, pool *pgxpool.Pool, phase Phase, ops int64, query string,
	mark func(conn *pgxpool.Conn, slotLSN string) ([]any, error)) (perOp float64, parts []WALPart, err error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, nil, err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_walinspect`); err != nil {
		return 0, nil, fmt.Errorf("pg_walinspect: %w", err)
	}
	var slotLSN string
	if err := conn.QueryRow(ctx, `SELECT lsn::text FROM pg_create_physical_replication_slot(
		'idem_bench_' || pg_backend_pid(), immediately_reserve => true, temporary => true)`).Scan(&slotLSN); err != nil {
		return 0, nil, fmt.Errorf("reserve WAL: %w", err)
	}
	defer conn.Exec(context.WithoutCancel(ctx), `SELECT pg_drop_replication_slot('idem_bench_' || pg_backend_pid())`)
	args, err := mark(conn, slotLSN)
	if err != nil {
		return 0, nil, err
	}
	for i := range ops {
		if err := phase.Op(ctx, i); err != nil {
			return 0, nil, fmt.Errorf("%s: %w", phase.Name, err)
		}
	}
	if err := flushWAL(ctx, conn); err != nil {
		return 0, nil, err
	}
	rows, err := conn.Query(ctx, query, args...)
	if err != nil {
		return 0, nil, err
	}
	for rows.Next() {
		var part WALPart
		var total, records int64
		if err := rows.Scan(&part.Part, &total, &records); err != nil {
			return 0, nil, err
		}
		part.Bytes = float64(total) / float64(ops)
		part.Records = float64(records) / float64(ops)
		perOp += part.Bytes
		parts = append(parts, part)
	}
	return perOp, parts, rows.Err()
}

// flushWAL makes the server flush its WAL up to now, for the queries read
// it up to the flush LSN: on a server whose commits do not wait for the
// flush (synchronous_commit = off, as the tests' throwaway servers run),
// the flush LSN may still be behind the mark taken before the operations,
// and pg_walinspect refuses a start after it. A transaction that wrote WAL
// and commits with synchronous_commit = on flushes everything inserted
// before its commit record: this one writes a transactional logical
// message, which touches no block, so no query counts it. (Taking an xid
// is not enough: a transaction that wrote nothing else commits without
// waiting for the flush.)
func flushWAL(ctx context.Context, conn *pgxpool.Conn) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return fmt.Errorf("flush the WAL: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = on`); err != nil {
		return fmt.Errorf("flush the WAL: %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT pg_logical_emit_message(true, 'idem-bench', 'flush')`); err != nil {
		return fmt.Errorf("flush the WAL: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("flush the WAL: %w", err)
	}
	return nil
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
SELECT records.kind || coalesce(' ' || c.relname, ''), sum(records.record_length)::bigint, count(*)
FROM records
LEFT JOIN pg_class AS c ON c.relfilenode = records.filenode
GROUP BY 1
ORDER BY 2 DESC`
