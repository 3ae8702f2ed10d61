package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// A payment that calls another system: reserve it locally, charge it at a
// payment provider, record the charge locally. Done as an idem flow, and
// done by hand the unsafe way, with one transaction held open across the
// provider's call.

// FlowSchema is the table the flow comparison writes: a payment with the
// provider's charge.
var FlowSchema = []string{
	`CREATE TABLE IF NOT EXISTS bench_flow_payment (
    id           bigserial PRIMARY KEY,
    scope        text   NOT NULL,
    key          text   NOT NULL,
    amount_cents bigint NOT NULL,
    charge_id    text
)`,
}

// CreateFlowSchema creates the flow comparison's table where missing.
func CreateFlowSchema(ctx context.Context, pool *pgxpool.Pool) error {
	for _, stmt := range FlowSchema {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("create the flow benchmark's schema: %w", err)
		}
	}
	return nil
}

// Provider is an in-process payment provider that takes Latency to answer
// and applies a charge once per key.
type Provider struct {
	Latency time.Duration
	mu      sync.Mutex
	charges map[string]string
}

// NewProvider returns a provider that answers after latency.
func NewProvider(latency time.Duration) *Provider {
	return &Provider{Latency: latency, charges: make(map[string]string)}
}

// Charge charges amount under key, once, after the provider's latency.
func (p *Provider) Charge(ctx context.Context, key string, amount int64) (string, error) {
	if p.Latency > 0 {
		t := time.NewTimer(p.Latency)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", ctx.Err()
		case <-t.C:
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	id, ok := p.charges[key]
	if !ok {
		id = numbered("ch_", int64(len(p.charges)+1))
		p.charges[key] = id
	}
	return id, nil
}

// Charged is what the flow answers: the payment and its charge.
type Charged struct {
	PaymentID int64  `json:"payment_id"`
	ChargeID  string `json:"charge_id"`
}

// ChargeFlow is the payment as an idem flow: a local step that reserves
// the payment, a call that charges it (no transaction open, no connection
// held), and a local step that records the charge.
func ChargeFlow(p *Provider) *idem.Flow[int64, Charged] {
	return idem.MustNewFlow("bench-charge", func(ctx context.Context, s *idem.Steps, amount int64) (Charged, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO bench_flow_payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return Charged{}, err
		}
		chargeID, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			return p.Charge(ctx, providerKey, amount)
		})
		if err != nil {
			return Charged{}, err
		}
		_, err = idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
			_, err := tx.Exec(ctx, `UPDATE bench_flow_payment SET charge_id = $2 WHERE id = $1`, id, chargeID)
			return struct{}{}, err
		})
		if err != nil {
			return Charged{}, err
		}
		return Charged{PaymentID: id, ChargeID: chargeID}, nil
	})
}

// HeldAcrossCall is the same payment done by hand the unsafe way: one
// transaction, open across the provider's call, holding its connection
// (and the payment row's lock) for the call's whole latency. A timeout
// after the provider charged rolls the payment back with the charge made,
// and nothing gives the provider a key that a retry would repeat.
func HeldAcrossCall(ctx context.Context, pool *pgxpool.Pool, p *Provider, scope, key string, amount int64) (Charged, error) {
	var c Charged
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `INSERT INTO bench_flow_payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			scope, key, amount).Scan(&c.PaymentID)
		if err != nil {
			return err
		}
		if c.ChargeID, err = p.Charge(ctx, key, amount); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE bench_flow_payment SET charge_id = $2 WHERE id = $1`, c.PaymentID, c.ChargeID)
		return err
	})
	return c, err
}

// FlowPhases returns the two designs as phases of first executions on new
// keys: "flow", on flowPool, and "tx-held", on heldPool. Give each its own
// pool, with a ConnGauge, to count the connections each holds.
func FlowPhases(flowPool, heldPool *pgxpool.Pool, p *Provider, scope string) []Phase {
	flow := ChargeFlow(p)
	fp := idem.Fingerprint([]byte("benchmark charge"))
	var next atomic.Int64
	return []Phase{
		{Name: "flow", Op: func(ctx context.Context, _ int64) error {
			n := next.Add(1)
			res, err := flow.Run(ctx, flowPool, scope, numbered("flow-", n), fp, n)
			if err == nil && (res.Replayed || res.Value.ChargeID == "") {
				err = fmt.Errorf("flow %d: %+v on its first execution", n, res)
			}
			return err
		}},
		{Name: "tx-held", Op: func(ctx context.Context, _ int64) error {
			n := next.Add(1)
			_, err := HeldAcrossCall(ctx, heldPool, p, scope, numbered("held-", n), n)
			return err
		}},
	}
}

// ConnGauge counts the connections a pool's users hold: acquired and not
// yet released. GaugedPool makes it the pool's tracer, and no
// connection's.
type ConnGauge struct {
	mu      sync.Mutex
	held    int
	peak    int
	changed time.Time
	// heldTime is the integral of held over time.
	heldTime time.Duration
}

// TraceAcquireStart implements pgxpool.AcquireTracer.
func (g *ConnGauge) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	return ctx
}

// TraceAcquireEnd implements pgxpool.AcquireTracer.
func (g *ConnGauge) TraceAcquireEnd(_ context.Context, _ *pgxpool.Pool, data pgxpool.TraceAcquireEndData) {
	if data.Err == nil {
		g.add(1)
	}
}

// TraceRelease implements pgxpool.ReleaseTracer.
func (g *ConnGauge) TraceRelease(*pgxpool.Pool, pgxpool.TraceReleaseData) { g.add(-1) }

// TraceQueryStart implements pgx.QueryTracer, as a pool's tracer must.
func (g *ConnGauge) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer.
func (g *ConnGauge) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (g *ConnGauge) add(d int) {
	now := time.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.changed.IsZero() {
		g.heldTime += time.Duration(g.held) * now.Sub(g.changed)
	}
	g.changed = now
	g.held += d
	g.peak = max(g.peak, g.held)
}

// Read returns the most connections held at once, and the integral of the
// connections held over time, since the last Reset.
func (g *ConnGauge) Read() (peak int, heldTime time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.changed.IsZero() {
		now := time.Now()
		g.heldTime += time.Duration(g.held) * now.Sub(g.changed)
		g.changed = now
	}
	return g.peak, g.heldTime
}

// Reset starts counting afresh.
func (g *ConnGauge) Reset() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.peak, g.heldTime, g.changed = g.held, 0, time.Time{}
	if g.held > 0 {
		g.changed = time.Now()
	}
}

// GaugedPool opens a pool on cfg's settings with at most maxConns
// connections and a ConnGauge, which it returns. The gauge traces the
// pool's acquires and releases, not the connections' statements: a
// connection with a tracer is one that idem sends a local step's first
// statement on as pgx would, a round trip of its own (docs/flows.md), and
// the benchmark measures the connections an application without one has.
func GaugedPool(ctx context.Context, cfg *pgxpool.Config, maxConns int32) (*pgxpool.Pool, *ConnGauge, error) {
	cfg = cfg.Copy()
	cfg.MaxConns = maxConns
	gauge := &ConnGauge{}
	cfg.ConnConfig.Tracer = gauge // the pool's tracer, taken as it is made
	beforeConnect := cfg.BeforeConnect
	cfg.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		cc.Tracer = nil // each connection's
		if beforeConnect != nil {
			return beforeConnect(ctx, cc)
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	return pool, gauge, nil
}

// DatabaseWAL runs ops operations of phase one at a time and returns the
// WAL bytes each wrote, broken down as [WAL] breaks them down, read back
// with pg_walinspect as it does, but counting every transaction that wrote
// in this database meanwhile (and the records of no transaction on its
// relations), whatever table it wrote: a flow's steps write several.
// Whatever else writes in the database meanwhile is counted too, so run it
// alone. Full-page images are left out: how many a run writes depends on
// when checkpoints happen, which on a shared server is whenever the
// others' WAL asks for one.
func DatabaseWAL(ctx context.Context, pool *pgxpool.Pool, phase Phase, ops int64) (perOp float64, parts []WALPart, err error) {
	return measureWAL(ctx, pool, phase, ops, databaseWALQuery, func(conn *pgxpool.Conn, _ string) ([]any, error) {
		// The slot keeps the WAL from the last checkpoint on, which holds
		// the database's earlier work too: count from here.
		var start string
		err := conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&start)
		return []any{start}, err
	})
}

// databaseWALQuery sums the WAL records since $1, full-page images left
// out, of the transactions that wrote a block of this database, and of no
// transaction on its blocks, by resource manager, record type and
// relation.
const databaseWALQuery = `
WITH records AS (
    SELECT w.xid,
           w.resource_manager || ' ' || w.record_type AS kind,
           substring(w.block_ref from 'rel \d+/(\d+)/')::oid AS db,
           substring(w.block_ref from 'rel \d+/\d+/(\d+)')::oid AS filenode,
           w.record_length - w.fpi_length AS bytes
    FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn()) AS w
),
here AS (
    SELECT oid FROM pg_database WHERE datname = current_database()
),
ours AS (
    SELECT DISTINCT xid FROM records WHERE db = (SELECT oid FROM here) AND xid <> '0'::xid
)
SELECT records.kind || coalesce(' ' || c.relname, ''), sum(records.bytes)::bigint, count(*)
FROM records
LEFT JOIN pg_class AS c ON c.relfilenode = records.filenode
WHERE records.xid IN (SELECT xid FROM ours)
   OR (records.xid = '0'::xid AND records.db = (SELECT oid FROM here))
GROUP BY 1
ORDER BY 2 DESC`

// StatementTracer traces what a connection sends as otelpgx does, which
// most production pools run: each statement sent alone, each batch and
// each statement of a batch, and each prepare. It counts the statements.
type StatementTracer struct{ Statements atomic.Int64 }

// TraceQueryStart implements pgx.QueryTracer.
func (s *StatementTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	s.Statements.Add(1)
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer.
func (s *StatementTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart implements pgx.BatchTracer.
func (s *StatementTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

// TraceBatchQuery implements pgx.BatchTracer.
func (s *StatementTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	s.Statements.Add(1)
}

// TraceBatchEnd implements pgx.BatchTracer.
func (s *StatementTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TracePrepareStart implements pgx.PrepareTracer.
func (s *StatementTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

// TracePrepareEnd implements pgx.PrepareTracer.
func (s *StatementTracer) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

// ConnKind is a kind of connection an application runs: pgx's exec mode,
// and whether a tracer traces its statements (StatementTracer).
type ConnKind struct {
	Name   string
	Mode   pgx.QueryExecMode
	Traced bool
}

// ConnKinds are the kinds of connection the flow's cost is measured on:
// pgx's default, traced as otelpgx traces it, and the exec modes behind
// transaction poolers (exec, simple_protocol, cache_describe).
var ConnKinds = []ConnKind{
	{"default", pgx.QueryExecModeCacheStatement, false},
	{"traced", pgx.QueryExecModeCacheStatement, true},
	{"exec", pgx.QueryExecModeExec, false},
	{"simple_protocol", pgx.QueryExecModeSimpleProtocol, false},
	{"cache_describe", pgx.QueryExecModeCacheDescribe, false},
}

// Apply sets cfg's connections to be of kind k.
func (k ConnKind) Apply(cfg *pgxpool.Config) {
	cfg.ConnConfig.DefaultQueryExecMode = k.Mode
	cfg.ConnConfig.Tracer = nil
	if k.Traced {
		cfg.ConnConfig.Tracer = &StatementTracer{}
	}
}
