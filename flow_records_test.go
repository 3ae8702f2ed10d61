package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// oldSteps moves the steps that the flows of scope recorded in their rows
// to idem_flow_step_row, as the versions before migration 00008 recorded
// them (in idem_flow_step, which 00008 renamed; the statements are the
// Downs of migrations 00009, which turns the records back into objects,
// and 00008): a flow in flight across the upgrade.
func oldSteps(t *testing.T, pool *pgxpool.Pool, scope string) {
	t.Helper()
	down := migrationDown(t, "00009_flow_step_records_compact.sql")
	down, _, _ = strings.Cut(down, "COMMENT ON")
	scoped := strings.Replace(down, "WHERE f.steps IS NOT NULL;", "WHERE f.steps IS NOT NULL AND f.scope = $1;", 1)
	if scoped == down {
		t.Fatal("00009's Down has changed: its statement for one scope is to be written again")
	}
	if _, err := pool.Exec(t.Context(), scoped, scope); err != nil {
		t.Fatal(err)
	}
	_, err := pool.Exec(t.Context(), `
		WITH moved AS (
		    INSERT INTO idem_flow_step_row (scope, key, seq, name, kind, state, result, attempts, first_called_at, completed_at,
		                                reconciles, last_reconcile)
		    SELECT f.scope, f.key, s.key::int, s.value->>'n',
		           CASE WHEN s.value ? 'a' THEN 'call' ELSE 'local' END,
		           coalesce(s.value->>'s', 'done'), s.value->'r', coalesce((s.value->>'a')::int, 1),
		           timestamptz 'epoch' + (s.value->>'f')::bigint * interval '1 microsecond',
		           timestamptz 'epoch' + (s.value->>'c')::bigint * interval '1 microsecond',
		           coalesce((s.value->>'x')::int, 0), s.value->>'l'
		    FROM idem_flow AS f, jsonb_each(f.steps) AS s
		    WHERE f.scope = $1
		)
		UPDATE idem_flow SET steps = NULL WHERE scope = $1`, scope)
	if err != nil {
		t.Fatal(err)
	}
}

// A flow that an older version left with a local step done and a call
// whose intent it recorded (in idem_flow_step_row) resumes after the upgrade:
// the local step's recorded result is replayed, not run again, and the
// call is made again with the same provider key, its attempts counted on
// from the older version's; InspectFlow shows the steps of both.
func TestFlowRecordedBeforeTheUpgradeResumes(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	abandon(t, ctx, pool, flow, p, scope, "k")
	oldSteps(t, pool, scope)
	before, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || len(before.Steps) != 2 || before.Steps[0].Name != "reserve" || before.Steps[0].State != "done" ||
		before.Steps[1].Name != "charge" || before.Steps[1].State != "calling" || before.Steps[1].Attempts != 1 {
		t.Fatalf("the older version's steps, inspected: %+v, %v", before.Steps, err)
	}
	key := before.Steps[1].ProviderKey
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Replayed || res.Value.ChargeID == "" {
		t.Fatalf("the run after the upgrade: %+v, %v", res, err)
	}
	// reserve ran once (before the upgrade), record once (after).
	if n := steps.Load(); n != 2 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d local steps ran, %d payments; want 2, 1", n, countPayments(t, pool, scope))
	}
	if len(p.keys) != 2 || p.keys[0] != key || p.keys[1] != key || p.applied != 1 {
		t.Fatalf("provider keys %v, %d charges applied; want %s twice, 1", p.keys, p.applied, key)
	}
	after, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || after.State != "done" || len(after.Steps) != 3 {
		t.Fatalf("after: %+v, %v", after, err)
	}
	if s := after.Steps[0]; s.Name != "reserve" || s.Kind != "local" || s.State != "done" || !s.CompletedAt.Equal(before.Steps[0].CompletedAt) {
		t.Fatalf("reserve: %+v; want the older version's record", s)
	}
	if s := after.Steps[1]; s.Name != "charge" || s.Kind != "call" || s.State != "done" || s.Attempts != 2 ||
		!s.FirstCalledAt.Equal(before.Steps[1].FirstCalledAt) || s.ProviderKey != key || s.CompletedAt.IsZero() {
		t.Fatalf("charge: %+v; want done at its second attempt, first called when the older version called it", s)
	}
	if s := after.Steps[2]; s.Name != "record" || s.Kind != "local" || s.State != "done" || s.CompletedAt.IsZero() {
		t.Fatalf("record: %+v", s)
	}
}

// A flow whose row records a large result, or many steps, records its
// further steps, local steps and calls, as rows of their own (as older
// versions did), and writes its row without its records from then on, so
// that no write of the row copies them again: the flow's row keeps the
// first, small step; the large steps and the call are rows, the call's
// row written again as it is resumed. A resumed run reads both, in
// order, and runs none of the recorded steps again.
func TestFlowOfLargeStepsRecordsTheRestAsRows(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var ran atomic.Int64
	fail := atomic.Bool{}
	fail.Store(true)
	large := strings.Repeat("x", 600)
	flow := idem.MustNewFlow(testdb.Name("large"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		var got []string
		for _, name := range []string{"a", "b", "c"} {
			v, err := idem.Local(s, name, func(ctx context.Context, tx pgx.Tx) (string, error) {
				// The step ran once its statement did: a run's first step
				// may start, up to it, before the run knows its flow.
				if err := tx.QueryRow(ctx, `SELECT $1::text`, name).Scan(new(string)); err != nil {
					return "", err
				}
				ran.Add(1)
				if name == "a" {
					return name, nil
				}
				return name + large, nil
			})
			if err != nil {
				return "", err
			}
			got = append(got, v[:1])
		}
		id, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			if fail.Load() {
				return "", errors.New("connection reset by peer")
			}
			id, _, err := p.charge(ctx, providerKey, in.Amount)
			return id, err
		})
		if err != nil {
			return "", err
		}
		return strings.Join(got, "") + " " + id, nil
	})
	placed := func() (inRow, rows string, steps []byte) {
		t.Helper()
		err := pool.QueryRow(ctx, `SELECT (SELECT coalesce(string_agg(k, ',' ORDER BY k), '') FROM idem_flow f, jsonb_object_keys(f.steps) k
		        WHERE f.scope = $1 AND k <> 'v'),
		    (SELECT coalesce(string_agg(seq::text || ':' || state || ':' || attempts, ',' ORDER BY seq), '')
		        FROM idem_flow_step_row WHERE scope = $1),
		    (SELECT convert_to(steps::text, 'UTF8') FROM idem_flow WHERE scope = $1)`, scope).Scan(&inRow, &rows, &steps)
		if err != nil {
			t.Fatal(err)
		}
		return inRow, rows, steps
	}
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	inRow, rows, before := placed()
	if inRow != "0" || rows != "1:done:1,2:done:1,3:calling:1" {
		t.Fatalf("in the flow's row: steps %q; as rows: %q; want a in the row, b, c and the call's intent as rows", inRow, rows)
	}
	fail.Store(false)
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil || res.Value != "abc ch_1" || ran.Load() != 3 {
		t.Fatalf("the retry: %+v, %v, %d local steps ran; want abc ch_1, 3", res, err, ran.Load())
	}
	inRow, rows, after := placed()
	if inRow != "0" || rows != "1:done:1,2:done:1,3:done:2" || string(after) != string(before) {
		t.Fatalf("after the retry: in the flow's row %q (%s, was %s); as rows %q; want the row's records unchanged, the call done as a row",
			inRow, after, before, rows)
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || len(info.Steps) != 4 {
		t.Fatalf("inspect: %+v, %v", info, err)
	}
	for i, want := range []string{"a", "b", "c", "charge"} {
		if s := info.Steps[i]; s.Name != want || s.State != "done" {
			t.Fatalf("step %d: %+v, want %s done", i, s, want)
		}
	}
	if s := info.Steps[3]; s.Attempts != 2 || s.Kind != "call" || s.FirstCalledAt.IsZero() {
		t.Fatalf("the call: %+v; want 2 attempts", s)
	}
}

// A new flow's first local step, whose transaction stays open, takes the
// flow's lock as it begins and writes the flow's row only as it commits
// (FlowStartHeld). A row that another executor committed meanwhile (here
// written by hand, between the lock's snapshot and the commit) fails that
// write, and the step's writes with it: the run looks at the flow again,
// takes it over once its lease has run out, and runs the step again, so
// that its writes commit once, with the flow's row.
func TestFlowFirstStepWhoseRowWasTakenCommitsNothing(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var ran atomic.Int64
	name := testdb.Name("taken")
	flow := idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		_, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			if ran.Add(1) == 1 {
				// Another executor's row, committed, its lease run out.
				_, err := pool.Exec(ctx, `INSERT INTO idem_flow (scope, key, name, fingerprint, state, input, provider_namespace,
					epoch, leased_until, runs, retention)
					VALUES ($1, 'k', $2, $3, 'running', '{"amount":2500}', (SELECT id FROM idem_installation), 7,
					now() - interval '1 second', 1, interval '1 day')`, s.Scope(), name, fpCharge)
				if err != nil {
					return 0, err
				}
			}
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return "", err
		}
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
	})
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Value != "ch_1" {
		t.Fatalf("%+v, %v", res, err)
	}
	if n := ran.Load(); n != 2 || countPayments(t, pool, scope) != 1 || p.applied != 1 {
		t.Fatalf("the step ran %d times, %d payments, %d charges; want 2, 1, 1", n, countPayments(t, pool, scope), p.applied)
	}
}

// migrationDown is the Down of one of idem's migrations.
func migrationDown(t *testing.T, name string) string {
	t.Helper()
	b, err := fs.ReadFile(idem.Migrations(), name)
	if err != nil {
		t.Fatal(err)
	}
	_, down, ok := strings.Cut(string(b), "-- +goose Down")
	if !ok {
		t.Fatalf("%s has no Down", name)
	}
	return down
}

// TestMigration00009DownGivesTheRecordsBackAsObjects: going down from
// migration 00009 turns each record of a flow's row into the JSON object
// of the version before, which inspects as the compact record did (times
// to the microsecond), also for a step name and result that hold the
// compact form's separators, a JSON null result and a call still calling;
// and the flow resumes from it.
func TestMigration00009DownGivesTheRecordsBackAsObjects(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var fail atomic.Bool
	fail.Store(true)
	flow := idem.MustNewFlow("compact", func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		odd, err := idem.Local(s, `ü;7,0 "quoted" \ name`, func(ctx context.Context, tx pgx.Tx) (map[string]string, error) {
			return map[string]string{"a": `x;y,z"\`, "b": "日本"}, nil
		})
		if err != nil {
			return "", err
		}
		if _, err := idem.Local(s, "nothing", func(ctx context.Context, tx pgx.Tx) (*int, error) { return nil, nil }); err != nil {
			return "", err
		}
		id, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			if fail.Load() {
				return "", errors.New("connection reset by peer")
			}
			id, _, err := p.charge(ctx, providerKey, in.Amount)
			return id, err
		})
		return odd["a"] + " " + id, err
	})
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	before, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || len(before.Steps) != 3 || before.Steps[2].State != "calling" {
		t.Fatalf("before: %+v, %v", before.Steps, err)
	}
	var compact int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow f, jsonb_each(f.steps) s
		WHERE f.scope = $1 AND jsonb_typeof(s.value) = 'string'`, scope).Scan(&compact); err != nil || compact != 3 {
		t.Fatalf("%d compact records, %v; want 3", compact, err)
	}
	down, _, _ := strings.Cut(migrationDown(t, "00009_flow_step_records_compact.sql"), "COMMENT ON")
	down = strings.Replace(down, "WHERE f.steps IS NOT NULL;", "WHERE f.steps IS NOT NULL AND f.scope = $1;", 1)
	if _, err := pool.Exec(ctx, down, scope); err != nil {
		t.Fatal(err)
	}
	var objects int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow f, jsonb_each(f.steps) s
		WHERE f.scope = $1 AND jsonb_typeof(s.value) = 'object'`, scope).Scan(&objects); err != nil || objects != 3 {
		t.Fatalf("%d records as objects after the Down, %v; want 3", objects, err)
	}
	after, err := idem.InspectFlow(ctx, pool, scope, "k")
	// (Results as JSON: jsonb writes them with spaces of its own.)
	if err != nil || !reflect.DeepEqual(compactResults(t, after.Steps), compactResults(t, before.Steps)) {
		t.Fatalf("after the Down:\n%+v, %v\nwant\n%+v", after.Steps, err, before.Steps)
	}
	fail.Store(false)
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500})
	if err != nil || res.Value != `x;y,z"\ ch_1` || p.applied != 1 {
		t.Fatalf("resumed: %+v, %v, %d charges applied", res, err, p.applied)
	}
	// The call's record, written again with its result, counts its first
	// attempt's time from the flow's created_at, which the executor read
	// with the records: none is a time since 1970 (after an @).
	var calls, since1970 int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE s.value #>> '{}' LIKE '6,%;charge%'),
		    count(*) FILTER (WHERE split_part(s.value #>> '{}', ';', 1) LIKE '%@%')
		FROM idem_flow f, jsonb_each(f.steps) s WHERE f.scope = $1`, scope).Scan(&calls, &since1970); err != nil ||
		calls != 1 || since1970 != 0 {
		t.Fatalf("%d compact records of the call, %d with a time since 1970, %v; want 1, 0", calls, since1970, err)
	}
}

// compactResults is steps with their results without spaces.
func compactResults(t *testing.T, steps []idem.FlowStep) []idem.FlowStep {
	t.Helper()
	out := slices.Clone(steps)
	for i := range out {
		if len(out[i].Result) == 0 {
			out[i].Result = nil
			continue
		}
		var b bytes.Buffer
		if err := json.Compact(&b, out[i].Result); err != nil {
			t.Fatal(err)
		}
		out[i].Result = b.Bytes()
	}
	return out
}

// spilledCallFlow is a flow whose call is recorded as a row of its own:
// the step before it records a result past maxInlineSteps. The call fails
// its first attempt with first's error.
func spilledCallFlow(p *provider, first error, opt idem.CallOption) *idem.Flow[chargeIn, string] {
	var attempts atomic.Int64
	return idem.MustNewFlow(testdb.Name("spilled"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		if _, err := idem.Local(s, "a", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			return "", err
		}
		if _, err := idem.Local(s, "big", func(ctx context.Context, tx pgx.Tx) (string, error) {
			return strings.Repeat("x", 400), nil
		}); err != nil {
			return "", err
		}
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			if attempts.Add(1) == 1 {
				return "", first
			}
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		}, opt)
	}, idem.WithWait(0))
}

// TestCallRecordedAsARowIsNotedUnsent: a call recorded as a row of its
// own whose attempt surely did not leave (ErrNotSent) is noted 'unsent' in
// its row, so that an AtMostOnce call is made by the next run rather than
// stopped for a person.
func TestCallRecordedAsARowIsNotedUnsent(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	flow := spilledCallFlow(p, fmt.Errorf("dial tcp: connection refused: %w", idem.ErrNotSent), idem.AtMostOnce())
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	var rows string
	if err := pool.QueryRow(ctx, `SELECT coalesce(string_agg(seq || ':' || name || ':' || state, ',' ORDER BY seq), '')
		FROM idem_flow_step_row WHERE scope = $1`, scope).Scan(&rows); err != nil || rows != "1:big:done,2:charge:unsent" {
		t.Fatalf("the steps' rows: %q, %v; want 1:big:done,2:charge:unsent", rows, err)
	}
	if res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err != nil || p.applied != 1 {
		t.Fatalf("the second run: %+v, %v, %d charges applied; want the call made", res, err, p.applied)
	}
}

// TestCallRecordedAsARowHasItsLookupNoted: a lookup (Reconcile) that did
// not find a call recorded as a row of its own is noted in its row.
func TestCallRecordedAsARowHasItsLookupNoted(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	flow := spilledCallFlow(p, errors.New("connection reset by peer"),
		idem.Reconcile(func(ctx context.Context, a idem.Attempt) (string, bool, error) { return "", false, nil }))
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	if _, err := pool.Exec(ctx, `UPDATE idem_flow SET leased_until = now() WHERE scope = $1`, scope); err != nil {
		t.Fatal(err)
	}
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || len(info.Steps) != 3 || info.Steps[2].Reconciles != 1 || info.Steps[2].LastReconcile != "not_found" {
		t.Fatalf("%+v, %v; want the call's lookup noted: 1, not_found", info.Steps, err)
	}
}
