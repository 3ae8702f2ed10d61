package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pressly/goose/v3"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The tests of going back: docs/migrations.md, "Going back".

// errNoCharge is what downFlow's function returns, after its local step,
// for an input of no amount: the flow stays running with no call made.
var errNoCharge = errors.New("nothing to charge")

// downFlow returns the flow name of a local step and a call to p that needs no
// table of the test's own, as a database made only by idem's migrations
// has none.
func downFlow(p *provider, name string, opts ...idem.FlowOption) *idem.Flow[chargeIn, chargeOut] {
	return idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `SELECT $1::bigint`, in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		if in.Amount == 0 {
			return chargeOut{}, errNoCharge
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			id, _, err := p.charge(ctx, providerKey, in.Amount)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		return chargeOut{PaymentID: id, ChargeID: charge}, nil
	}, opts...)
}

// migratedPool returns an empty database with every migration applied, a
// pool on it, and goose over idem's migrations there.
func migratedPool(t *testing.T) (context.Context, *pgxpool.Pool, *goose.Provider, *sql.DB) {
	t.Helper()
	t.Parallel()
	ctx := t.Context()
	url := env.EmptyDatabase(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return ctx, pool, idemGoose(t, db), db
}

// latestMigration is the version of the newest embedded migration.
func latestMigration(t *testing.T) int64 {
	t.Helper()
	files, err := fs.Glob(idem.Migrations(), "*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("no migrations: %v", err)
	}
	var v int64
	if _, err := fmt.Sscanf(slices.Max(files), "%05d_", &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// schemaOf describes what idem's migrations made in db: its tables'
// columns, constraints and indexes, and its functions and sequences.
func schemaOf(t *testing.T, ctx context.Context, db *sql.DB) string {
	t.Helper()
	rows, err := db.QueryContext(ctx, `
		SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '')
		FROM information_schema.columns WHERE table_schema = current_schema() AND table_name <> $1
		UNION ALL
		SELECT 'constraint ' || conrelid::regclass || ' ' || conname || ' ' || pg_get_constraintdef(oid)
		FROM pg_constraint WHERE connamespace = current_schema()::regnamespace AND conrelid <> $1::regclass
		UNION ALL
		SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = current_schema() AND tablename <> $1
		UNION ALL
		SELECT 'function ' || p.oid::regprocedure FROM pg_proc AS p WHERE p.pronamespace = current_schema()::regnamespace
		UNION ALL
		SELECT 'sequence ' || sequence_name FROM information_schema.sequences
		WHERE sequence_schema = current_schema() AND sequence_name NOT LIKE $1 || '%'
		UNION ALL
		SELECT 'comment ' || c.relname || '.' || a.attname || ' ' || d.description
		FROM pg_description AS d JOIN pg_class AS c ON c.oid = d.objoid
		JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum = d.objsubid
		WHERE c.relnamespace = current_schema()::regnamespace
		ORDER BY 1`, idem.MigrationTable)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, line)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}

// TestEveryMigrationGoesDownAndUpWithSettledFlows rolls every migration
// back, one at a time, and applies them again, on a database whose flows
// have settled: one done, one ended by an operator after its call, one
// running that has made no call. A settled flow's answer outlives going
// back past migration 00007 and forward again; the schema made again is
// the one Migrate makes.
func TestEveryMigrationGoesDownAndUpWithSettledFlows(t *testing.T) {
	ctx, pool, provider, db := migratedPool(t)
	fresh := schemaOf(t, ctx, db)
	p := newProvider()
	flow := downFlow(p, testdb.Name("down"))
	scope := "down"
	done, err := flow.Run(ctx, pool, scope, "done", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	abandon(t, ctx, pool, flow, p, scope, "ended")
	if ended, err := idem.EndFlow(ctx, pool, scope, "ended", "refunded by hand"); err != nil || !ended {
		t.Fatalf("EndFlow = %v, %v", ended, err)
	}
	if _, err := flow.Run(ctx, pool, scope, "no-call", fpCharge, chargeIn{}); !errors.Is(err, errNoCharge) {
		t.Fatalf("the flow that makes no call: %v, want %v", err, errNoCharge)
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, "no-call"); err != nil || info.State != "running" || len(info.Steps) != 1 {
		t.Fatalf("the flow that makes no call: %+v, %v; want it running, with its local step recorded", info, err)
	}
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "run", fpCharge, func(ctx context.Context, tx pgx.Tx) (int64, error) {
		return calls.Add(1), nil
	}); err != nil {
		t.Fatal(err)
	}
	latest := latestMigration(t)

	// Back to the version before flows could not charge twice (00006),
	// and forward again: what was stored stays.
	for v := latest; v > 6; v-- {
		if _, err := provider.Down(ctx); err != nil {
			t.Fatalf("going down from version %d: %v", v, err)
		}
	}
	var unnumbered int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_flow WHERE operation IS NULL`).Scan(&unnumbered); err != nil || unnumbered != 0 {
		t.Fatalf("at version 6, %d flows without an operation number (%v)", unnumbered, err)
	}
	if _, err := provider.Up(ctx); err != nil {
		t.Fatalf("up again from version 6: %v", err)
	}
	again, err := flow.Run(ctx, pool, scope, "done", fpCharge, chargeIn{Amount: 2500})
	if err != nil || !again.Replayed || again.Value != done.Value {
		t.Fatalf("the done flow after going back to 6 and up: %+v, %v; want a replay of %+v", again, err, done.Value)
	}
	if charges, _ := p.effects(); charges != 2 {
		t.Fatalf("the provider applied %d charges, want 2 (done's, ended's)", charges)
	}
	// The flow that made no call goes on, and calls once.
	if res, err := flow.Run(ctx, pool, scope, "no-call", fpCharge, chargeIn{}); !errors.Is(err, errNoCharge) {
		t.Fatalf("the flow that made no call, after going back and up: %+v, %v", res, err)
	}

	// Every migration down, and up again.
	for v := latest; v > 0; v-- {
		if _, err := provider.Down(ctx); err != nil {
			t.Fatalf("going down from version %d: %v", v, err)
		}
	}
	if current, err := provider.GetDBVersion(ctx); err != nil || current != 0 {
		t.Fatalf("after every Down: version %d, %v; want 0", current, err)
	}
	if left := schemaOf(t, ctx, db); left != "" {
		t.Fatalf("after every Down, left of idem's schema:\n%s", left)
	}
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatalf("Migrate after every Down: %v", err)
	}
	if got := schemaOf(t, ctx, db); got != fresh {
		t.Fatalf("the schema made again differs from Migrate's on an empty database:\n%s\nwant:\n%s", got, fresh)
	}
	if res, err := flow.Run(ctx, pool, scope, "done", fpCharge, chargeIn{Amount: 2500}); err != nil || res.Replayed {
		t.Fatalf("a flow on the schema made again: %+v, %v", res, err)
	}
}

// TestGoingBackPast00007RefusesAFlowInProgressWithACall: the version
// before 00007 derives a call's provider key from the flow's operation
// number, which a flow started since has none of; numbering it would give
// its call a new key, and the provider a second charge. 00007's Down
// refuses while a running or stopped flow has recorded a call, naming the
// flows, and changes nothing: the flow, resumed, calls with its key. Once
// it is settled (here, ended by an operator), the Down goes through.
func TestGoingBackPast00007RefusesAFlowInProgressWithACall(t *testing.T) {
	ctx, pool, provider, db := migratedPool(t)
	p := newProvider()
	name, stoppedName := testdb.Name("down"), testdb.Name("down-window")
	flow := downFlow(p, name)
	scope := "down"
	abandon(t, ctx, pool, flow, p, scope, "in-progress")
	key := providerKeyOf(t, ctx, pool, scope, "in-progress", "charge")
	stopped := downFlow(p, stoppedName, idem.WithProviderWindow(time.Millisecond))
	abandon(t, ctx, pool, stopped, p, scope, "stopped")
	time.Sleep(5 * time.Millisecond)
	if _, err := stopped.Run(ctx, pool, scope, "stopped", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the flow past its provider window: %v, want ErrFlowStopped", err)
	}
	if _, err := flow.Run(ctx, pool, scope, "done", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}

	latest := latestMigration(t)
	var err error
	for v := latest; v > 6 && err == nil; v-- {
		_, err = provider.Down(ctx)
	}
	if err == nil {
		t.Fatal("going down past 00007 with a flow in progress and a stopped one, each with a recorded call, succeeded")
	}
	for _, want := range []string{"00007", scope + "/in-progress", scope + "/stopped", name, stoppedName, "docs/migrations.md"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal %q does not say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), scope+"/done") {
		t.Errorf("the refusal %q names the done flow", err)
	}
	if current, err := provider.GetDBVersion(ctx); err != nil || current != 7 {
		t.Fatalf("after the refusal: version %d, %v; want 7", current, err)
	}
	var numbered int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_flow WHERE operation IS NOT NULL`).Scan(&numbered); err != nil || numbered != 0 {
		t.Fatalf("after the refusal, %d flows have an operation number (%v); want none", numbered, err)
	}

	// Forward again; the flow in progress calls with the key it had.
	if _, err := provider.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if got := providerKeyOf(t, ctx, pool, scope, "in-progress", "charge"); got != key {
		t.Fatalf("the provider key went from %s to %s", key, got)
	}
	res, err := flow.Run(ctx, pool, scope, "in-progress", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Value.ChargeID == "" {
		t.Fatalf("the flow in progress, resumed: %+v, %v", res, err)
	}
	if charges, keys := p.effects(); charges != 3 || keys[key] != 2 {
		t.Fatalf("the provider applied %d charges, and saw the flow's key %d times; want 3 (in progress, stopped, done), twice", charges, keys[key])
	}

	// Settled, the stopped flow by an operator: the Down goes through.
	if ended, err := idem.EndFlow(ctx, pool, scope, "stopped", "confirmed with the provider"); err != nil || !ended {
		t.Fatalf("EndFlow = %v, %v", ended, err)
	}
	for v := latest; v > 6; v-- {
		if _, err := provider.Down(ctx); err != nil {
			t.Fatalf("going down from version %d once every flow settled: %v", v, err)
		}
	}
}
