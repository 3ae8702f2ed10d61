package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// countedPool is a pool of one connection whose round trips count counts,
// with cfg changed by change, if not nil.
func countedPool(t *testing.T, ctx context.Context, count *testdb.WireCount, change func(cfg *pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DialFunc = count.Dial
	cfg.MaxConns = 1
	if change != nil {
		change(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestFlowStepsStatementsGoAloneForAQueryTracer counts the round trips of
// local–call–local on one warm connection whose pgx tracer traces
// statements but not batches: a local step's first statement, which would
// go with the batch of its BEGIN and lock, goes alone, where the tracer
// sees it, at the cost of a round trip (6, not 5), and the tracer sees
// every statement of the steps. (TestFlowRoundTripsOnEveryConnection
// counts the rest.)
func TestFlowStepsStatementsGoAloneForAQueryTracer(t *testing.T) {
	ctx, _, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	var count testdb.WireCount
	tracer := &queryTracer{}
	pool := countedPool(t, ctx, &count, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = tracer })
	run := func(key string) int64 {
		t.Helper()
		before := count.Counts()
		if res, err := flow.Run(ctx, pool, scope, key, nil, chargeIn{Amount: 100}); err != nil || res.Replayed {
			t.Fatalf("%s: %+v, %v; want a first execution", key, res, err)
		}
		return count.Counts().RoundTrips - before.RoundTrips
	}
	run("warm") // dialled, statements prepared
	want := int64(6)
	if execMode(t) == pgx.QueryExecModeDescribeExec {
		want = 11 // each batch described first
	}
	if got := run("k"); got != want {
		t.Errorf("local–call–local took %d round trips, want %d", got, want)
	}
	if tracer.payments.Load() != 4 {
		t.Errorf("the tracer saw %d of the steps' statements, want 4", tracer.payments.Load())
	}
}

// queryTracer counts the statements on the payment table it sees.
type queryTracer struct{ payments atomic.Int64 }

func (q *queryTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "INSERT INTO payment") || strings.Contains(data.SQL, "UPDATE payment") {
		q.payments.Add(1)
	}
	return ctx
}

func (q *queryTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// sequenceCalled reports whether nextval was ever called on seq.
func sequenceCalled(t *testing.T, ctx context.Context, pool *pgxpool.Pool, seq string) bool {
	t.Helper()
	var called bool
	if err := pool.QueryRow(ctx, `SELECT is_called FROM `+pgx.Identifier{seq}.Sanitize()).Scan(&called); err != nil {
		t.Fatal(err)
	}
	return called
}

// newSequence creates a sequence of the test's own: nextval is not undone
// by a rollback, so it shows whether a statement ran.
func newSequence(t *testing.T, ctx context.Context, pool *pgxpool.Pool) string {
	t.Helper()
	seq := testdb.Name("step_seq")
	if _, err := pool.Exec(ctx, `CREATE SEQUENCE `+pgx.Identifier{seq}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SEQUENCE `+pgx.Identifier{seq}.Sanitize()) })
	return seq
}

// TestFlowFencedLocalStepsFirstStatementDoesNotRun ends a flow while its
// executor is in a local step, before the step's first statement: the
// statement, sent with the step's BEGIN and the flow's lock, does not run
// (its sequence does not move), and the run, which looks at the flow again,
// finds it stopped (ErrFlowStopped).
func TestFlowFencedLocalStepsFirstStatementDoesNotRun(t *testing.T) {
	ctx, pool, scope := setup(t)
	seq := newSequence(t, ctx, pool)
	inStep, release := make(chan struct{}), make(chan struct{})
	flow := idem.MustNewFlow(testdb.Name("fenced"), func(ctx context.Context, s *idem.Steps, in int) (int64, error) {
		if _, err := idem.Local(s, "first", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
			return 1, err
		}); err != nil {
			return 0, err
		}
		return idem.Local(s, "second", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			close(inStep)
			<-release
			var n int64
			err := tx.QueryRow(ctx, `SELECT nextval($1::regclass)`, seq).Scan(&n)
			return n, err
		})
	})
	done := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, pool, scope, "k", nil, 1)
		done <- err
	}()
	<-inStep
	if ended, err := idem.EndFlow(ctx, pool, scope, "k", "ended by the test"); err != nil || !ended {
		t.Fatalf("EndFlow = %v, %v; want the flow ended", ended, err)
	}
	close(release)
	if err := <-done; !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the fenced executor: %v, want ErrFlowStopped", err)
	}
	if sequenceCalled(t, ctx, pool, seq) {
		t.Error("the fenced step's first statement ran")
	}
}

// TestFlowDuplicatesFirstStatementDoesNotRunWhileAnotherStartsTheFlow runs
// a duplicate while another executor is in the flow's first step (its row
// not committed, its lock held): the duplicate's first statement, sent
// with its BEGIN and the flow's lock, does not run, and the duplicate,
// which may not wait, gets ErrInProgress.
func TestFlowDuplicatesFirstStatementDoesNotRunWhileAnotherStartsTheFlow(t *testing.T) {
	ctx, pool, scope := setup(t)
	seq := newSequence(t, ctx, pool)
	var runs atomic.Int64
	inStep, release := make(chan struct{}), make(chan struct{})
	flow := idem.MustNewFlow(testdb.Name("starting"), func(ctx context.Context, s *idem.Steps, in int) (int64, error) {
		first := runs.Add(1) == 1
		return idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			if first {
				if _, err := tx.Exec(ctx, `SELECT $1::int`, 1); err != nil {
					return 0, err
				}
				close(inStep)
				<-release
				return 0, nil
			}
			var n int64
			err := tx.QueryRow(ctx, `SELECT nextval($1::regclass)`, seq).Scan(&n)
			return n, err
		})
	})
	done := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, pool, scope, "k", nil, 1)
		done <- err
	}()
	<-inStep
	_, err := flow.Run(ctx, pool, scope, "k", nil, 1, idem.WithWait(0))
	close(release)
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("the duplicate: %v, want ErrInProgress", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the first executor: %v", err)
	}
	if sequenceCalled(t, ctx, pool, seq) {
		t.Error("the duplicate's first statement ran")
	}
}

// TestFlowLocalStepsFirstStatementRunsAsPgxRunsIt gives local steps first
// statements of every kind: each returns what pgx would return on a
// transaction of its own, and the step carries on after it.
func TestFlowLocalStepsFirstStatementRunsAsPgxRunsIt(t *testing.T) {
	ctx, pool, scope := setup(t)
	cases := []struct {
		name  string
		first func(ctx context.Context, tx pgx.Tx) (int64, error)
		want  int64
		err   func(error) bool
	}{
		{"rows", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			rows, err := tx.Query(ctx, `SELECT generate_series(1, $1::int)`, 4)
			if err != nil {
				return 0, err
			}
			sum, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			var total int64
			for _, n := range sum {
				total += n
			}
			return total, err
		}, 10, nil},
		{"rows left open", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			rows, err := tx.Query(ctx, `SELECT generate_series(1, $1::int)`, 4)
			if err != nil {
				return 0, err
			}
			rows.Next() // and not closed: the step fails, as its commit would
			var n int64
			return n, rows.Scan(&n)
		}, 0, func(err error) bool { return err != nil && strings.Contains(err.Error(), "conn busy") }},
		{"no row", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var n int64
			return 0, tx.QueryRow(ctx, `SELECT 1 WHERE $1::int = 0`, 1).Scan(&n)
		}, 0, func(err error) bool { return errors.Is(err, pgx.ErrNoRows) }},
		{"no arguments", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			tag, err := tx.Exec(ctx, `SELECT 1; SELECT 2`)
			return tag.RowsAffected(), err
		}, 1, nil},
		{"named arguments", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var n int64
			err := tx.QueryRow(ctx, `SELECT @n::bigint`, pgx.NamedArgs{"n": 7}).Scan(&n)
			return n, err
		}, 7, nil},
		{"a batch", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			b := &pgx.Batch{}
			b.Queue(`SELECT $1::bigint`, 3)
			var n int64
			results := tx.SendBatch(ctx, b)
			err := results.QueryRow().Scan(&n)
			return n, errors.Join(err, results.Close())
		}, 3, nil},
		{"a nil pointer", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var null bool
			err := tx.QueryRow(ctx, `SELECT $1::text IS NULL`, (*string)(nil)).Scan(&null)
			if !null {
				return 0, err
			}
			return 1, err
		}, 1, nil},
		{"a statement while its rows are open", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			rows, err := tx.Query(ctx, `SELECT generate_series(1, $1::int)`, 5)
			if err != nil {
				return 0, err
			}
			defer rows.Close()
			for rows.Next() {
				if _, err := tx.Exec(ctx, `SELECT $1::int`, 1); err != nil {
					return 0, err
				}
			}
			return 0, rows.Err()
		}, 0, func(err error) bool { return err != nil && strings.Contains(err.Error(), "conn busy") }},
		{"a failing statement", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var n int64
			err := tx.QueryRow(ctx, `SELECT 1 / $1::int`, 0).Scan(&n)
			return n, err
		}, 0, func(err error) bool {
			var pgErr *pgconn.PgError
			return errors.As(err, &pgErr) && pgErr.Code == "22012" && !errors.Is(err, idem.ErrLeaseLost)
		}},
	}
	for _, c := range cases {
		for _, position := range []string{"first step", "after a step"} {
			name := fmt.Sprintf("%s, %s", c.name, position)
			flow := idem.MustNewFlow(testdb.Name("first"), func(ctx context.Context, s *idem.Steps, in int) (int64, error) {
				if position == "after a step" {
					if _, err := idem.Local(s, "before", func(ctx context.Context, tx pgx.Tx) (int, error) {
						_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
						return 1, err
					}); err != nil {
						return 0, err
					}
				}
				n, err := idem.Local(s, "step", c.first)
				if err != nil {
					return 0, err
				}
				// The transaction carries on.
				_, err = idem.Local(s, "after", func(ctx context.Context, tx pgx.Tx) (int, error) {
					_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
					return 1, err
				})
				return n, err
			})
			res, err := flow.Run(ctx, pool, scope, name, nil, 1)
			switch {
			case c.err != nil && !c.err(err):
				t.Errorf("%s: %v, want another error", name, err)
			case c.err == nil && (err != nil || res.Value != c.want):
				t.Errorf("%s: %+v, %v; want %d", name, res, err, c.want)
			}
		}
	}
}

// execMode is the exec mode of the tests' connections.
func execMode(t *testing.T) pgx.QueryExecMode {
	t.Helper()
	cfg, err := pgx.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	return cfg.DefaultQueryExecMode
}

// TestFlowLocalStepsStatementOnAChangedTableFailsOnlyItself changes the
// table a step's first statement reads (its result type with it) between
// two runs on one connection: that statement fails once, as pgx's own
// would, and neither it afterwards nor other flows on the connection fail.
func TestFlowLocalStepsStatementOnAChangedTableFailsOnlyItself(t *testing.T) {
	ctx, admin, scope := setup(t)
	var count testdb.WireCount
	pool := countedPool(t, ctx, &count, nil)
	table := pgx.Identifier{testdb.Name("changed")}.Sanitize()
	if _, err := admin.Exec(ctx, `CREATE TABLE `+table+` (a int)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP TABLE `+table) })
	reads := idem.MustNewFlow(testdb.Name("reads"), func(ctx context.Context, s *idem.Steps, in int) (int, error) {
		return idem.Local(s, "read", func(ctx context.Context, tx pgx.Tx) (int, error) {
			rows, err := tx.Query(ctx, `SELECT * FROM `+table+` WHERE $1::int = 1`, 1)
			if err != nil {
				return 0, err
			}
			rows.Close()
			return 1, rows.Err()
		})
	})
	other := idem.MustNewFlow(testdb.Name("other"), func(ctx context.Context, s *idem.Steps, in int) (int, error) {
		return idem.Local(s, "step", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
			return 1, err
		})
	})
	if _, err := reads.Run(ctx, pool, scope, "before", nil, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `ALTER TABLE `+table+` ADD COLUMN b int`); err != nil {
		t.Fatal(err)
	}
	failed := 0
	for i := range 3 {
		if _, err := reads.Run(ctx, pool, scope, fmt.Sprintf("after-%d", i), nil, 1); err != nil {
			failed++
		}
		if _, err := other.Run(ctx, pool, scope, fmt.Sprintf("other-%d", i), nil, 1); err != nil {
			t.Errorf("another flow on the connection, run %d: %v", i, err)
		}
	}
	if failed > 1 {
		t.Errorf("the statement on the changed table failed %d times, want at most once", failed)
	}
}

// TestFlowLocalStepWhoseFirstStatementIsCancelledRollsBack cancels a step's
// context before its first statement, which the connection has not
// prepared yet: the statement fails with the context's error, and the
// step's deferred Rollback, pgx's idiom, returns rather than panics.
func TestFlowLocalStepWhoseFirstStatementIsCancelledRollsBack(t *testing.T) {
	ctx, pool, scope := setup(t)
	flow := idem.MustNewFlow(testdb.Name("cancelled"), func(ctx context.Context, s *idem.Steps, in int) (int, error) {
		return idem.Local(s, "step", func(ctx context.Context, tx pgx.Tx) (int, error) {
			defer tx.Rollback(ctx)
			cancelled, cancel := context.WithCancel(ctx)
			cancel()
			var n int
			err := tx.QueryRow(cancelled, fmt.Sprintf(`SELECT $1::int + %d`, in), 1).Scan(&n)
			return n, err
		})
	})
	if _, err := flow.Run(ctx, pool, scope, "k", nil, int(time.Now().UnixNano()%1000000)); !errors.Is(err, context.Canceled) {
		t.Fatalf("the run: %v, want context.Canceled", err)
	}
}

// TestFlowLocalStepOnAnyExecModeBeginsOnce runs a local step on pools of
// every pgx exec mode but the default, where the step's BEGIN and lock go
// first, alone, through pgx: the step begins its transaction once (a
// BEGIN inside a transaction would draw the server's warning).
func TestFlowLocalStepOnAnyExecModeBeginsOnce(t *testing.T) {
	ctx, _, scope := setup(t)
	flow := idem.MustNewFlow(testdb.Name("modes"), func(ctx context.Context, s *idem.Steps, in int) (int, error) {
		return idem.Local(s, "step", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
			return 1, err
		})
	})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeDescribeExec, pgx.QueryExecModeCacheDescribe} {
		var count testdb.WireCount
		var notices atomic.Int64
		pool := countedPool(t, ctx, &count, func(cfg *pgxpool.Config) {
			cfg.ConnConfig.DefaultQueryExecMode = mode
			cfg.ConnConfig.OnNotice = func(*pgconn.PgConn, *pgconn.Notice) { notices.Add(1) }
		})
		for i := range 2 {
			if _, err := flow.Run(ctx, pool, scope, fmt.Sprintf("%v-%d", mode, i), nil, 1); err != nil {
				t.Fatalf("%v: %v", mode, err)
			}
		}
		if n := notices.Load(); n != 0 {
			t.Errorf("%v: the server sent %d notices, want none", mode, n)
		}
	}
}
