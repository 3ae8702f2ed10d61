package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The contract of a flow's code: a step's function is entered only when
// the step is to run, and the flow's function runs only to continue a
// flow that needs it, never for a replay, a mismatch or a duplicate that
// waits.

// entries counts the entries into a flow's function and its steps'
// functions, at their first line, before any statement.
type entries struct {
	flow, reserve, record atomic.Int64
}

// countedFlow is local–call–local whose functions count their entries in
// e; the call charges p.
func countedFlow(e *entries, p *provider, opts ...idem.FlowOption) *idem.Flow[chargeIn, chargeOut] {
	return idem.MustNewFlow(testdb.Name("counted"), func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		e.flow.Add(1)
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			e.reserve.Add(1)
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			id, _, err := p.charge(ctx, providerKey, in.Amount)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		_, err = idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			e.record.Add(1)
			return id, tx.QueryRow(ctx, `UPDATE payment SET amount_cents = amount_cents WHERE id = $1 RETURNING id`, id).Scan(&id)
		})
		if err != nil {
			return chargeOut{}, err
		}
		return chargeOut{PaymentID: id, ChargeID: charge}, nil
	}, opts...)
}

// want fails t unless e counts flow, reserve and record entries.
func (e *entries) want(t *testing.T, what string, flow, reserve, record int64) {
	t.Helper()
	if e.flow.Load() != flow || e.reserve.Load() != reserve || e.record.Load() != record {
		t.Errorf("%s: the flow's function entered %d times, reserve's %d, record's %d; want %d, %d, %d", what,
			e.flow.Load(), e.reserve.Load(), e.record.Load(), flow, reserve, record)
	}
}

func TestFlowFunctionsRunNeitherForReplaysNorForMismatches(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var e entries
	flow := countedFlow(&e, p)
	first, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || first.Replayed {
		t.Fatalf("first run: %+v, %v", first, err)
	}
	e.want(t, "the first run", 1, 1, 1)
	for i := range 3 {
		res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		if err != nil || !res.Replayed || res.Value != first.Value {
			t.Fatalf("replay %d: %+v, %v; want %+v replayed", i, res, err, first.Value)
		}
	}
	e.want(t, "three replays", 1, 1, 1)
	if _, err := flow.Run(ctx, pool, scope, "k", idem.Fingerprint([]byte("other")), chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("another request under the key: %v, want ErrFingerprintMismatch", err)
	}
	other := idem.MustNewFlow(testdb.Name("other"), func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		e.flow.Add(1)
		return chargeOut{}, nil
	})
	if _, err := other.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("another flow under the key: %v, want ErrFingerprintMismatch", err)
	}
	e.want(t, "two mismatches", 1, 1, 1)
}

func TestFlowConcurrentDuplicatesRunNoneOfItsFunctions(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var e entries
	flow := countedFlow(&e, p)
	const n = 10
	results := make(chan ran[chargeOut], n)
	var start sync.WaitGroup
	start.Add(1)
	for range n {
		go func() {
			start.Wait()
			res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
			results <- ran[chargeOut]{res, err}
		}()
	}
	start.Done()
	var answers []chargeOut
	firsts := 0
	for range n {
		r := <-results
		if r.err != nil {
			t.Fatalf("a run: %v", r.err)
		}
		if !r.Replayed {
			firsts++
		}
		answers = append(answers, r.Value)
	}
	for _, a := range answers {
		if a != answers[0] {
			t.Fatalf("answers differ: %+v", answers)
		}
	}
	if firsts != 1 {
		t.Errorf("%d runs were first executions, want 1", firsts)
	}
	e.want(t, fmt.Sprintf("%d concurrent runs of one key", n), 1, 1, 1)
	if charges, _ := p.effects(); charges != 1 {
		t.Errorf("%d charges, want 1", charges)
	}
}

func TestFlowRetryAfterAStepCompletedDoesNotEnterIt(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var e entries
	flow := countedFlow(&e, p)
	p.before = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("provider: 503")
		}
		return nil
	}
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("the run whose call failed: %v, want ErrFlowIncomplete", err)
	}
	e.want(t, "the run whose call failed", 1, 1, 0)
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Replayed {
		t.Fatalf("the retry: %+v, %v; want it to complete the flow", res, err)
	}
	// The retry continues the flow (its function runs again, as it must),
	// but reserve, recorded, is not entered again.
	e.want(t, "the retry", 2, 1, 1)
	if n := countPayments(t, pool, scope); n != 1 {
		t.Errorf("%d payments, want 1", n)
	}
}

// TestFlowDuplicateDuringALocalStepRunsNothing runs a duplicate while the
// first executor is inside its first local step (the flow's row not
// committed yet) and inside its second: it waits, runs none of the
// flow's code, and replays.
func TestFlowDuplicateDuringALocalStepRunsNothing(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	for _, step := range []string{"first", "second"} {
		var flowRuns, entered atomic.Int64
		inStep, release := make(chan struct{}), make(chan struct{})
		flow := idem.MustNewFlow(testdb.Name("dup"), func(ctx context.Context, s *idem.Steps, in chargeIn) (int64, error) {
			flowRuns.Add(1)
			slow := func(name string) (int64, error) {
				return idem.Local(s, name, func(ctx context.Context, tx pgx.Tx) (int64, error) {
					entered.Add(1)
					var v int64
					if err := tx.QueryRow(ctx, `SELECT $1::bigint`, in.Amount).Scan(&v); err != nil {
						return 0, err
					}
					if name == step {
						close(inStep)
						<-release
					}
					return v, nil
				})
			}
			if _, err := slow("first"); err != nil {
				return 0, err
			}
			return slow("second")
		})
		done := make(chan ran[int64], 1)
		go func() {
			res, err := flow.Run(ctx, pool, scope, step, nil, chargeIn{Amount: 7})
			done <- ran[int64]{res, err}
		}()
		<-inStep
		if _, err := flow.Run(ctx, pool, scope, step, nil, chargeIn{Amount: 7}, idem.WithWait(0)); !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("%s step: a duplicate with no wait: %v, want ErrInProgress", step, err)
		}
		dup := make(chan ran[int64], 1)
		go func() {
			res, err := flow.Run(ctx, pool, scope, step, nil, chargeIn{Amount: 7}, idem.WithWait(time.Minute))
			dup <- ran[int64]{res, err}
		}()
		time.Sleep(50 * time.Millisecond) // the duplicate polls meanwhile
		close(release)
		first, second := <-done, <-dup
		if first.err != nil || second.err != nil || !second.Replayed || second.Value != first.Value {
			t.Fatalf("%s step: the run %+v, the duplicate %+v", step, first, second)
		}
		if flowRuns.Load() != 1 || entered.Load() != 2 {
			t.Errorf("%s step: the flow's function ran %d times, its steps' %d; want 1 and 2", step, flowRuns.Load(), entered.Load())
		}
	}
}

// TestFlowStepTxIsClosedOnceItsFunctionReturns keeps a local step's Tx
// past the function's return, in a goroutine the step started: a
// statement it sends while the step's transaction is still open (before
// the flow's next statement commits it), and one it sends after the run,
// each returns pgx.ErrTxClosed, and neither writes. So for a flow's first
// step (which runs in the claim's transaction), its second, and a
// serializable one (which commits as it returns).
func TestFlowStepTxIsClosedOnceItsFunctionReturns(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	for _, c := range []struct {
		name string
		opts []idem.FlowOption
	}{
		{"read committed", nil},
		{"serializable", []idem.FlowOption{idem.WithTxOptions(pgx.TxOptions{IsoLevel: pgx.Serializable})}},
	} {
		for _, kept := range []string{"first", "second"} {
			key := c.name + "/" + kept
			var keptTx pgx.Tx
			late := func(ctx context.Context, what string) error {
				_, err := keptTx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, scope, key+"/"+what, 1)
				return err
			}
			var lateInStep error
			flow := idem.MustNewFlow(testdb.Name("kept"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
				for _, name := range []string{"first", "second"} {
					if _, err := idem.Local(s, name, func(ctx context.Context, tx pgx.Tx) (int, error) {
						if name == kept {
							keptTx = tx
						}
						_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, scope, key+"/"+name, in.Amount)
						return 1, err
					}); err != nil {
						return "", err
					}
					if name == kept {
						// The step returned; its transaction is still open.
						lateInStep = late(ctx, "in-step")
					}
				}
				return "done", nil
			}, c.opts...)
			if _, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 5}); err != nil {
				t.Fatalf("%s: %v", key, err)
			}
			lateAfter := late(ctx, "after")
			for what, err := range map[string]error{"before the commit": lateInStep, "after the run": lateAfter} {
				if !errors.Is(err, pgx.ErrTxClosed) {
					t.Errorf("%s: a statement on the step's Tx %s: %v, want pgx.ErrTxClosed", key, what, err)
				}
			}
			var rows []string
			r, err := pool.Query(ctx, `SELECT key FROM payment WHERE scope = $1 AND key LIKE $2 ORDER BY key`, scope, key+"/%")
			if err == nil {
				rows, err = pgx.CollectRows(r, pgx.RowTo[string])
			}
			if err != nil || strings.Join(rows, ",") != key+"/first,"+key+"/second" {
				t.Errorf("%s: rows %v, %v; want the steps' two only", key, rows, err)
			}
		}
	}
}

// TestFlowStepTxRefusesCommitAndRollback: a step's transaction commits
// with the step's record, or not at all.
func TestFlowStepTxRefusesCommitAndRollback(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	var commitErr, rollbackErr error
	flow := idem.MustNewFlow(testdb.Name("commit"), func(ctx context.Context, s *idem.Steps, in chargeIn) (int, error) {
		return idem.Local(s, "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, s.Scope(), s.Key(), in.Amount); err != nil {
				return 0, err
			}
			commitErr, rollbackErr = tx.Commit(ctx), tx.Rollback(ctx)
			return 1, nil
		})
	})
	if _, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1}); err != nil {
		t.Fatal(err)
	}
	if commitErr == nil || rollbackErr == nil {
		t.Fatalf("Commit: %v, Rollback: %v; want both refused", commitErr, rollbackErr)
	}
	if n := countPayments(t, pool, scope); n != 1 {
		t.Fatalf("%d payments, want the step's 1", n)
	}
}

// connKind is a kind of connection applications run: pgx's exec modes,
// and a pool traced as otelpgx traces it (queries and batches).
type connKind struct {
	name   string
	mode   pgx.QueryExecMode
	traced bool
}

// connKinds are the kinds of connection the tests' server carries.
func connKinds(t *testing.T) []connKind {
	var kinds []connKind
	for _, mode := range testdb.ExecModes(t) {
		kinds = append(kinds, connKind{name: mode.String(), mode: mode})
		if mode == pgx.QueryExecModeCacheStatement {
			kinds = append(kinds, connKind{name: "traced", mode: mode, traced: true})
		}
	}
	return kinds
}

// TestFlowRoundTripsOnEveryConnection counts what a flow sends on one
// warm connection of each kind: local–call–local in 5 round trips (the
// claim; the reserve's statement; the flow's row with the reserve's
// record, the call's intent and COMMIT; the record's BEGIN, lock and
// statement; the answer and COMMIT), and a replay in 1, a second replay
// on the same connection too (the claim's failed round trip costs the
// next one nothing), as does the first execution after it. pgx's
// describe_exec mode describes every statement of a batch first, in a
// round trip of its own: it takes twice as many.
func TestFlowRoundTripsOnEveryConnection(t *testing.T) {
	ctx, _, scope, p := setupFlow(t)
	var e entries
	flow := countedFlow(&e, p)
	for _, kind := range connKinds(t) {
		var count testdb.WireCount
		var steps atomic.Int64
		tracer := &statementTracer{see: func(sql string) {
			if strings.Contains(sql, "INTO payment") || strings.Contains(sql, "UPDATE payment") {
				steps.Add(1)
			}
		}}
		pool := countedPool(t, ctx, &count, func(cfg *pgxpool.Config) {
			cfg.ConnConfig.DefaultQueryExecMode = kind.mode
			if kind.traced {
				cfg.ConnConfig.Tracer = tracer
			}
		})
		run := func(key string, replay bool) int64 {
			t.Helper()
			before := count.Counts()
			if res, err := flow.Run(ctx, pool, scope, kind.name+key, fpCharge, chargeIn{Amount: 2500}); err != nil || res.Replayed != replay {
				t.Fatalf("%s %s: %+v, %v; want replayed %v", kind.name, key, res, err, replay)
			}
			return count.Counts().RoundTrips - before.RoundTrips
		}
		run("warm", false) // dialled, statements prepared
		run("warm", true)
		want := [4]int64{5, 1, 1, 5}
		switch kind.mode {
		case pgx.QueryExecModeDescribeExec:
			want = [4]int64{10, 2, 2, 10}
		case pgx.QueryExecModeCacheDescribe:
			// pgx forgets the descriptions of a batch that failed (the
			// claim's, which found the flow there) and describes them
			// again the next time they are sent: a round trip more for a
			// claim after a replay.
			want = [4]int64{6, 1, 2, 6}
		}
		got := [4]int64{run("k", false), run("k", true), run("k", true), run("k2", false)}
		if got != want {
			t.Errorf("%s: local–call–local, two replays, local–call–local took %v round trips, want %v", kind.name, got, want)
		}
		if kind.traced && steps.Load() != 3*2 {
			t.Errorf("traced: the tracer saw %d of the steps' statements, want %d (three runs of two)", steps.Load(), 3*2)
		}
	}
}

// statementTracer calls see with the SQL of every statement a connection
// sends, alone or in a batch, as otelpgx traces them.
type statementTracer struct{ see func(sql string) }

func (s *statementTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	s.see(data.SQL)
	return ctx
}

func (s *statementTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (s *statementTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (s *statementTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	s.see(data.SQL)
}

func (s *statementTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TestFlowStalledExecutorDoesNotEnterItsNextStep stalls an executor
// between two local steps past its lease, while another executor takes
// the flow over (a new epoch, leased): the stalled one does not enter its
// next step's function, whose statement would be refused anyway, and
// waits for the other, as a duplicate.
func TestFlowStalledExecutorDoesNotEnterItsNextStep(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	var entered atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("stalled"), func(ctx context.Context, s *idem.Steps, in chargeIn) (int, error) {
		if _, err := idem.Local(s, "first", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
			return 1, err
		}); err != nil {
			return 0, err
		}
		// Stalled past the lease; meanwhile another executor takes the
		// flow over.
		leaseRanOut(t, ctx, pool, s.Scope(), s.Key())
		if _, err := pool.Exec(ctx, `UPDATE idem_flow SET epoch = epoch + 2, leased_until = now() + interval '1 hour'
			WHERE scope = $1 AND key = $2`, s.Scope(), s.Key()); err != nil {
			return 0, err
		}
		return idem.Local(s, "second", func(ctx context.Context, tx pgx.Tx) (int, error) {
			entered.Add(1)
			_, err := tx.Exec(ctx, `SELECT $1::int`, 2)
			return 2, err
		})
	}, idem.WithLease(100*time.Millisecond), idem.WithIdleTimeout(time.Minute))
	_, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1}, idem.WithWait(50*time.Millisecond))
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("the stalled executor: %v, want ErrInProgress (the other holds the flow)", err)
	}
	if entered.Load() != 0 {
		t.Fatalf("the stalled executor entered its next step's function %d times, want none", entered.Load())
	}
}

// TestFlowWithACommitQueryCommitsThroughIt gives a flow's transactions a
// CommitQuery that records each commit: the claim's transaction commits
// through it, whether a local step runs in it or a call's intent commits
// it, as the steps' own transactions do.
func TestFlowWithACommitQueryCommitsThroughIt(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS flow_commits (scope text, key text)`); err != nil {
		t.Fatal(err)
	}
	opts := func(key string) []idem.FlowOption {
		return []idem.FlowOption{idem.WithTxOptions(pgx.TxOptions{
			CommitQuery: fmt.Sprintf(`INSERT INTO flow_commits VALUES ('%s', '%s'); COMMIT`, scope, key)})}
	}
	var e entries
	callFirst := idem.MustNewFlow(testdb.Name("call-first"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		return idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
	}, opts("call-first")...)
	if _, err := countedFlow(&e, p, opts("local-first")...).Run(ctx, pool, scope, "local-first", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	if _, err := callFirst.Run(ctx, pool, scope, "call-first", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]int{
		"local-first": 2, // the claim's, with the first step and the call's intent; the second step's
		"call-first":  1, // the claim's, which the call's intent commits
	} {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM flow_commits WHERE scope = $1 AND key = $2`, scope, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != want {
			t.Errorf("%s: %d commits went through the CommitQuery, want %d", key, n, want)
		}
	}
}
