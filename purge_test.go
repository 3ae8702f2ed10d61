package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// setupOwnDatabase is setup on a migrated database of the test's own, for
// tests of purging, which deletes every scope's expired records.
func setupOwnDatabase(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	ctx, _, scope := setup(t)
	pool, err := pgxpool.New(ctx, env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, testdb.AppSchema); err != nil {
		t.Fatal(err)
	}
	return ctx, pool, scope
}

func TestPurgerDeletesExpiredInTheBackground(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	var calls atomic.Int64
	for i := range 12 {
		key := fmt.Sprintf("k%d", i)
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
		if i < 10 {
			expire(t, pool, scope, key)
		}
	}
	purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Batch: 3, Pause: time.Millisecond, Interval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// Wait for the purger to have counted what it deleted, not only for
	// the rows to be gone: its count follows each batch's commit.
	deadline := time.Now().Add(30 * time.Second)
	for countRecords(t, pool, scope) != 2 || purger.Deleted() < 10 {
		if time.Now().After(deadline) {
			t.Fatalf("purger left %d records and counted %d deleted, want the 2 live ones and 10", countRecords(t, pool, scope), purger.Deleted())
		}
		time.Sleep(5 * time.Millisecond)
	}
	purger.Stop()
	purger.Stop() // a second Stop is harmless
	if purger.Deleted() != 10 {
		t.Fatalf("Deleted() = %d, want 10", purger.Deleted())
	}
}

// StartPurger refuses every field that cannot work, naming it, before it
// starts anything; each field is either refused for some value below or
// listed as taking every value.
func TestStartPurgerRefusesEveryInvalidField(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	stillThere := expiredRecord(t, ctx, pool, scope)
	aboveInt32 := math.MaxInt32
	aboveInt32++ // a variable: on 32-bit platforms it wraps, and is refused as negative
	cases := []struct {
		field  string
		config idem.PurgerConfig
	}{
		{"Batch", idem.PurgerConfig{Batch: -1}},
		{"Batch", idem.PurgerConfig{Batch: aboveInt32}},
		{"Pause", idem.PurgerConfig{Pause: -time.Nanosecond}},
		{"PauseFactor", idem.PurgerConfig{PauseFactor: math.NaN()}},
		{"PauseFactor", idem.PurgerConfig{PauseFactor: math.Inf(1)}},
		{"PauseFactor", idem.PurgerConfig{PauseFactor: math.Inf(-1)}},
		{"Interval", idem.PurgerConfig{Interval: -time.Second}},
	}
	tested := map[string]bool{}
	for _, c := range cases {
		p, err := idem.StartPurger(ctx, pool, c.config)
		if p != nil {
			p.Stop()
		}
		want := "idem: PurgerConfig." + c.field + ": "
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: err = %v, want idem.ErrInvalidOption naming %q", c.config, err, want)
		}
		tested[c.field] = true
	}
	anyValue := map[string]string{
		"Logger": "nil means slog.Default()",
	}
	for f := range reflect.TypeFor[idem.PurgerConfig]().Fields() {
		if !tested[f.Name] && anyValue[f.Name] == "" {
			t.Errorf("PurgerConfig.%s: no invalid value tested, and not listed as taking every value", f.Name)
		}
	}
	if p, err := idem.StartPurger(ctx, nil, idem.PurgerConfig{}); !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), "db must not be nil") {
		if p != nil {
			p.Stop()
		}
		t.Errorf("nil db: err = %v, want idem.ErrInvalidOption naming it", err)
	}
	stillThere() // no refused purger deleted anything
}

func TestPurgerStopsWithItsContext(t *testing.T) {
	ctx, pool, _ := setupOwnDatabase(t)
	ctx, cancel := context.WithCancel(ctx)
	purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	stopped := make(chan struct{})
	go func() { purger.Stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("purger did not stop after its context was cancelled")
	}
}

func TestPurgeDeletesOnlyExpired(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	var calls atomic.Int64
	for i := range 7 {
		key := fmt.Sprintf("k%d", i)
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
		if i < 5 {
			expire(t, pool, scope, key)
		}
	}
	if n, err := idem.Purge(ctx, pool, 2); err != nil || n != 5 {
		t.Fatalf("Purge deleted %d, %v; want the 5 expired", n, err)
	}
	if n := countRecords(t, pool, scope); n != 2 {
		t.Fatalf("%d records left, want the 2 live ones", n)
	}
	if _, err := idem.Purge(ctx, pool, 0); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("batch 0: %v, want ErrInvalidOption", err)
	}
}

// A purge walks the expiry index batch by batch, each starting at the
// expiry where the last one stopped. Records that share an expiry across
// a batch's end are all deleted, and a record that another transaction
// holds, passed over by the walk, is deleted by the next purge.
func TestPurgeWalksPastSharedExpiriesAndComesBackForHeldRecords(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	// Three expiries, seven records each: batches of 3 end inside each
	// group. One record, expired before all of them, is held; two are live.
	if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_key (scope, key, fingerprint, state, expires_at)
SELECT $1, 'expired-' || g, '\x00'::bytea, 'done', now() - (g % 3 + 1) * interval '1 hour'
FROM generate_series(1, 21) AS g
UNION ALL SELECT $1, 'held', '\x00'::bytea, 'done', now() - interval '1 day'
UNION ALL SELECT $1, 'live-' || g, '\x00'::bytea, 'done', now() + interval '1 hour' FROM generate_series(1, 2) AS g`, scope); err != nil {
		t.Fatal(err)
	}
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM idempotency_key WHERE scope = $1 AND key = 'held' FOR UPDATE`, scope); err != nil {
		t.Fatal(err)
	}
	if n, err := idem.Purge(ctx, pool, 3); err != nil || n != 21 {
		t.Fatalf("Purge deleted %d, %v; want the 21 expired records that no one holds", n, err)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// A TxBeginner that is neither a pool nor a connection gets a
	// transaction per batch instead of a statement.
	if n, err := idem.Purge(ctx, beginOnly{pool}, 3); err != nil || n != 1 {
		t.Fatalf("the next Purge deleted %d, %v; want the record that was held", n, err)
	}
	if n := countRecords(t, pool, scope); n != 2 {
		t.Fatalf("%d records left, want the 2 live ones", n)
	}
}

// beginOnly is a TxBeginner that only begins transactions.
type beginOnly struct{ idem.TxBeginner }

func TestPurgeDeletesExpiredFlowsAndLeavesTheRestAlone(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	p := newProvider()
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	for _, key := range []string{"done", "ended"} {
		if _, err := flow.Run(ctx, pool, scope, key, fpCharge, chargeIn{Amount: 2500}); err != nil {
			t.Fatal(err)
		}
	}
	abandon(t, ctx, pool, flow, p, scope, "running")
	abandon(t, ctx, pool, flow, p, scope, "attention")
	// Long past any retention, as far as dates go.
	if _, err := pool.Exec(ctx, `UPDATE idem_flow SET created_at = now() - interval '30 days',
		expires_at = CASE WHEN state = 'done' THEN now() - interval '1 day' END WHERE scope = $1`, scope); err != nil {
		t.Fatal(err)
	}
	ageCalls(t, pool, scope, "", 30*24*time.Hour)
	if _, err := flow.Run(ctx, pool, scope, "attention", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("past the window: %v, want ErrFlowStopped", err)
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_flow SET state = 'ended', expires_at = now() - interval '1 day'
		WHERE scope = $1 AND key = 'ended'`, scope); err != nil {
		t.Fatal(err)
	}

	// The steps as rows of their own, as a version before migration 00008
	// wrote them, and as a flow past maxInlineSteps writes them: Purge
	// deletes those of the flows it deletes.
	oldSteps(t, pool, scope)
	var finishedRows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow_step_row WHERE scope = $1 AND key IN ('done', 'ended')`,
		scope).Scan(&finishedRows); err != nil || finishedRows != 6 {
		t.Fatalf("the finished flows' steps as rows: %d, %v; want 6", finishedRows, err)
	}

	deleted, err := idem.Purge(ctx, pool, 1)
	if err != nil || deleted != 2 {
		t.Fatalf("Purge = %d, %v; want the 2 finished flows", deleted, err)
	}
	var left []string
	rows, err := pool.Query(ctx, `SELECT f.key || ':' || (SELECT count(*) FROM jsonb_object_keys(coalesce(f.steps, '{}')))
		+ (SELECT count(*) FROM idem_flow_step_row s WHERE s.scope = f.scope AND s.key = f.key)
		FROM idem_flow f WHERE f.scope = $1 ORDER BY f.key`, scope)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		left = append(left, s)
	}
	if strings.Join(left, " ") != "attention:2 running:2" {
		t.Fatalf("flows left with their steps: %v, want attention:2 running:2", left)
	}
	var orphans, kept int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow_step_row s WHERE NOT EXISTS
		(SELECT FROM idem_flow f WHERE f.scope = s.scope AND f.key = s.key)`).Scan(&orphans); err != nil || orphans != 0 {
		t.Fatalf("%d steps left without their flow, %v", orphans, err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow_step_row WHERE scope = $1`, scope).Scan(&kept); err != nil || kept != 4 {
		t.Fatalf("%d steps' rows left, %v; want the 4 of the flows left", kept, err)
	}
}
