package idem_test

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestRunsTransactionDoesWhatPgxsDoes uses, inside Run's fn, everything a
// pgx.Tx offers: Run begins its transaction in the claim's round trip, so
// fn's transaction is one of idem's, and it must behave as pgx's would.
func TestRunsTransactionDoesWhatPgxsDoes(t *testing.T) {
	ctx, pool, scope := setup(t)
	table := pgx.Identifier{"runtx_" + scope}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table.Sanitize()+` (v int)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP TABLE `+table.Sanitize()) })
	count := func(ctx context.Context, q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}) int {
		var n int
		if err := q.QueryRow(ctx, `SELECT count(*) FROM `+table.Sanitize()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	var oid uint32
	res, err := idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (int, error) {
		if tx.Conn() == nil {
			return 0, errors.New("no connection")
		}
		// A savepoint rolled back keeps nothing; one released keeps its row.
		sp, err := tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if _, err := sp.Exec(ctx, `INSERT INTO `+table.Sanitize()+` VALUES (1)`); err != nil {
			return 0, err
		}
		if err := sp.Rollback(ctx); err != nil {
			return 0, err
		}
		sp, err = tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		inner, err := sp.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if _, err := inner.Exec(ctx, `INSERT INTO `+table.Sanitize()+` VALUES (2)`); err != nil {
			return 0, err
		}
		if err := inner.Commit(ctx); err != nil {
			return 0, err
		}
		if err := sp.Commit(ctx); err != nil {
			return 0, err
		}
		if err := sp.Commit(ctx); !errors.Is(err, pgx.ErrTxClosed) {
			return 0, errors.New("a savepoint committed twice")
		}
		// CopyFrom, SendBatch, Prepare.
		if _, err := tx.CopyFrom(ctx, table, []string{"v"}, pgx.CopyFromRows([][]any{{3}, {4}})); err != nil {
			return 0, err
		}
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO ` + table.Sanitize() + ` VALUES (5)`)
		b.Queue(`INSERT INTO ` + table.Sanitize() + ` VALUES (6)`)
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return 0, err
		}
		if _, err := tx.Prepare(ctx, "runtx_insert", `INSERT INTO `+table.Sanitize()+` VALUES ($1)`); err != nil {
			return 0, err
		}
		if _, err := tx.Exec(ctx, "runtx_insert", 7); err != nil {
			return 0, err
		}
		rows, err := tx.Query(ctx, `SELECT v FROM `+table.Sanitize()+` ORDER BY v`)
		if err != nil {
			return 0, err
		}
		vs, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			return 0, err
		}
		if len(vs) != 6 || vs[0] != 2 {
			return 0, errors.New("fn's own writes are not what it wrote")
		}
		// Large objects, which pgx builds only on a transaction of its own.
		lo := tx.LargeObjects()
		oid, err = lo.Create(ctx, 0)
		if err != nil {
			return 0, err
		}
		obj, err := lo.Open(ctx, oid, pgx.LargeObjectModeWrite)
		if err != nil {
			return 0, err
		}
		if _, err := obj.Write([]byte("receipt")); err != nil {
			return 0, err
		}
		return count(ctx, tx), obj.Close()
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Value != 6 || count(ctx, pool) != 6 {
		t.Errorf("fn counted %d rows, %d committed; want 6 and 6", res.Value, count(ctx, pool))
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		lo := tx.LargeObjects()
		obj, err := lo.Open(ctx, oid, pgx.LargeObjectModeRead)
		if err != nil {
			return err
		}
		buf := make([]byte, 16)
		n, _ := obj.Read(buf)
		if string(buf[:n]) != "receipt" {
			t.Errorf("the large object holds %q, want %q", buf[:n], "receipt")
		}
		return lo.Unlink(ctx, oid)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestFnThatEndsRunsTransactionCommitsNothingOfIdems commits Run's
// transaction inside fn: the record cannot be stored afterwards, and Run
// says so instead of claiming the key was recorded.
func TestFnThatEndsRunsTransactionCommitsNothingOfIdems(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	_, err := idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, "k", 1, &calls)(ctx, tx)
		if err != nil {
			return p, err
		}
		return p, tx.Rollback(ctx)
	})
	if err == nil {
		t.Fatal("Run succeeded although fn ended its transaction")
	}
	if n := countRecords(t, pool, scope); n != 0 {
		t.Errorf("%d records, want 0", n)
	}
}

// TestStatementsPreparedAwayArePreparedAgain deallocates the connection's
// prepared statements behind pgx's back between calls (as DISCARD ALL or a
// pooler's reset does): each of Run's round trips (the claim, the record
// with COMMIT) fails once at most, with the driver's error and nothing
// committed, as pgx's own statements do, and the calls after them
// succeed.
func TestStatementsPreparedAwayArePreparedAgain(t *testing.T) {
	ctx, pool, scope := setup(t)
	// A connection of the test's own: DEALLOCATE ALL also spoils pgx's
	// statement cache, which would fail the next statements of whichever
	// test got the connection from the pool.
	conn, err := pgx.Connect(ctx, env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var calls atomic.Int64
	if _, err := idem.Run(ctx, conn, scope, "k0", fpA, pay(scope, "k0", 1, &calls)); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `DEALLOCATE ALL`); err != nil {
		t.Fatal(err)
	}
	// fn sends nothing: only idem's statements are spoilt.
	nothing := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	var failed []string
	keys := []string{"k1", "k2", "k3", "k4"}
	for _, key := range keys {
		if _, err := idem.Run(ctx, conn, scope, key, fpA, nothing); err != nil {
			failed = append(failed, key)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) {
				t.Errorf("%s: %v, want the driver's error", key, err)
			}
		}
	}
	if len(failed) > 2 || slices.Contains(failed, "k4") {
		t.Errorf("calls %v failed after DEALLOCATE ALL, want at most the first two", failed)
	}
	if n := countRecords(t, pool, scope); n != 1+len(keys)-len(failed) {
		t.Errorf("%d records, want %d", n, 1+len(keys)-len(failed))
	}
}

// TestATracedPoolSeesIdemsStatements gives Run a pool with a pgx tracer:
// idem's statements then go through pgx, where the tracer sees them.
func TestATracedPoolSeesIdemsStatements(t *testing.T) {
	ctx, _, scope := setup(t)
	cfg, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	tr := &countingTracer{}
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls)); err != nil {
		t.Fatal(err)
	}
	if n := tr.batches.Load(); n < 2 {
		t.Errorf("the tracer saw %d batches, want the claim's and the record's", n)
	}
}

type countingTracer struct{ batches atomic.Int64 }

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *countingTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.batches.Add(1)
	return ctx
}

func (c *countingTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *countingTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TestFnThatEndsTheCallersTransactionRecordsNothing commits the caller's
// transaction inside Do's fn: Do must not record the key afterwards, in
// no transaction, as if fn's effect were still to commit with it.
func TestFnThatEndsTheCallersTransactionRecordsNothing(t *testing.T) {
	ctx, pool, scope := setup(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var calls atomic.Int64
	_, err = idem.Do(ctx, tx, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		if _, err := pay(scope, "k", 1, &calls)(ctx, tx); err != nil {
			return payment{}, err
		}
		return payment{}, tx.Rollback(ctx)
	})
	if !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Do after fn ended its transaction: %v, want pgx.ErrTxClosed", err)
	}
	if n := countRecords(t, pool, scope); n != 0 {
		t.Errorf("%d records, want 0", n)
	}
}

// TestAStaleStatementOfIdemsNameIsReplaced leaves a statement of the name
// a flow's claim prepares its statement under on a connection that pgx
// does not know it on (as a pooler's earlier client would): the claim
// replaces it, and the flows run.
func TestAStaleStatementOfIdemsNameIsReplaced(t *testing.T) {
	ctx, _, scope := setup(t)
	conn, err := pgx.Connect(ctx, env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		if _, err := conn.PgConn().Prepare(ctx, idem.ClaimStatementName(), "SELECT 1", nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, key := range []string{"k1", "k2"} {
		if _, err := callOnly.Run(ctx, conn, scope, key, nil, 0); err != nil {
			t.Fatalf("%s: %v", key, err)
		}
	}
}

// TestRunsTransactionIsClosedOnceFnReturns keeps Run's Tx past fn's
// return: a statement sent on it after Run (by a goroutine fn started, or
// on a Tx kept in a struct), on it or on a transaction nested in it,
// returns pgx.ErrTxClosed and writes nothing, rather than running on a
// connection back in its pool.
func TestRunsTransactionIsClosedOnceFnReturns(t *testing.T) {
	ctx, pool, scope := setup(t)
	var kept, nested pgx.Tx
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		kept = tx
		var err error
		if nested, err = tx.Begin(ctx); err != nil {
			return payment{}, err
		}
		if err := nested.Commit(ctx); err != nil {
			return payment{}, err
		}
		return pay(scope, "k", 1, &calls)(ctx, tx)
	}); err != nil {
		t.Fatal(err)
	}
	for name, tx := range map[string]pgx.Tx{"Run's": kept, "a nested": nested} {
		_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, scope, "late", 1)
		if !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("a statement on %s transaction after Run: %v, want pgx.ErrTxClosed", name, err)
		}
	}
	if n := testdb.CountPayments(t, pool, scope); n != 1 {
		t.Errorf("%d payments, want fn's 1", n)
	}
}
