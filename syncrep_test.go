package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestAReplayWaitsForTheSynchronousStandby closes the gap in what
// synchronous replication promises that docs/failover.md describes. The
// standby is synchronous, and stalls: its WAL receiver is frozen
// (SIGSTOP). A call's COMMIT waits for it until the client gives up, when
// pgx sends a cancel request, and PostgreSQL keeps the commit on the
// primary alone. A retry finds the record there, but does not answer from
// it until the standby has it: through Run, Run with WithLookupFirst, and
// a flow, the retry waits for the standby, returns its context's error
// (never the answer) when its context ends first, and answers once the
// standby is back, when the standby has the record. A replay in the
// caller's transaction (Do, Once, Advance's refusal of a stale version)
// returns at once, and the caller's COMMIT waits. A session that chose
// synchronous_commit = local does not wait. A pool whose context watcher
// sends a cancel request, after which PostgreSQL reports a COMMIT whose
// wait it cut short as a success, gets its context's error too, on a
// first execution as on a replay. statement_timeout does not end the wait.
func TestAReplayWaitsForTheSynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s := startSyncPair(t, ctx)
	pool := s.pool(t, ctx, nil)
	scope := testdb.Name("sync")
	var calls atomic.Int64
	payOnce := func(pool *pgxpool.Pool, key string, opts ...idem.Option) func(ctx context.Context) (idem.Result[payment], error) {
		return func(ctx context.Context) (idem.Result[payment], error) {
			return idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 100, &calls), opts...)
		}
	}
	flow := idem.MustNewFlow(testdb.Name("double"), func(_ context.Context, _ *idem.Steps, in int64) (int64, error) {
		s.freeze(t) // between the flow's start and its answer
		return 2 * in, nil
	})

	// Records whose replays run in the caller's transaction, committed
	// while the standby streams.
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := idem.Do(ctx, tx, scope, "do", fpA, pay(scope, "do", 100, &calls)); err != nil {
			return err
		}
		if _, err := idem.Once(ctx, tx, scope, "once", func(context.Context, pgx.Tx) error { return nil }); err != nil {
			return err
		}
		_, err := idem.Advance(ctx, tx, scope, "entity", 2)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	// Answers committed on the primary alone: each COMMIT waits for the
	// frozen standby until its caller gives up. The flow's function
	// freezes the standby, once the flow's start has committed.
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := flow.Run(ctx, pool, scope, "flow", nil, 1)
		return err
	})
	s.waitForRecord(t, ctx, `SELECT count(*) FROM idem_flow WHERE scope = $1 AND key = 'flow' AND state = 'done'`, scope)
	s.freeze(t)
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := payOnce(pool, "k")(ctx)
		return err
	})
	s.waitForRecord(t, ctx, `SELECT count(*) FROM idempotency_key WHERE scope = $1 AND key = 'k'`, scope)

	// The retries wait for the standby, and end with their context.
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := payOnce(pool, "k")(ctx)
		return err
	})
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := payOnce(pool, "k", idem.WithLookupFirst())(ctx)
		return err
	})
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := flow.Run(ctx, pool, scope, "flow", nil, 1)
		return err
	})
	// In the caller's transaction the replay returns, and the COMMIT
	// waits.
	inTx := func(replay func(ctx context.Context, tx pgx.Tx) (bool, error)) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
			if replayed, err := replay(ctx, tx); err != nil || !replayed {
				t.Errorf("a replay in the caller's transaction: replayed %v, %v", replayed, err)
			}
			return tx.Commit(ctx)
		}
	}
	s.abandonedInItsWait(t, ctx, inTx(func(ctx context.Context, tx pgx.Tx) (bool, error) {
		res, err := idem.Do(ctx, tx, scope, "do", fpA, pay(scope, "do", 100, &calls))
		return res.Replayed, err
	}))
	s.abandonedInItsWait(t, ctx, inTx(func(ctx context.Context, tx pgx.Tx) (bool, error) {
		ran, err := idem.Once(ctx, tx, scope, "once", func(context.Context, pgx.Tx) error { return nil })
		return !ran, err
	}))
	s.abandonedInItsWait(t, ctx, inTx(func(ctx context.Context, tx pgx.Tx) (bool, error) {
		applied, err := idem.Advance(ctx, tx, scope, "entity", 1)
		return !applied, err
	}))

	// A session that does not wait for the standby does not wait for a
	// replay either.
	local := s.pool(t, ctx, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "local" })
	if res, err := payOnce(local, "k")(ctx); err != nil || !res.Replayed {
		t.Errorf("a replay with synchronous_commit = local: %+v, %v; want it at once", res, err)
	}

	// With a context watcher that sends a cancel request and lets the
	// statement finish, PostgreSQL ends the wait with a warning and the
	// COMMIT succeeds: the context, ended, says that the wait was cut
	// short.
	cancelling := s.pool(t, ctx, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: time.Minute}
		}
	})
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := payOnce(cancelling, "cancelled")(ctx)
		return err
	})
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := payOnce(cancelling, "k")(ctx)
		return err
	})
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := payOnce(cancelling, "k", idem.WithLookupFirst())(ctx)
		return err
	})
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := flow.Run(ctx, cancelling, scope, "flow", nil, 1)
		return err
	})

	// statement_timeout does not end a COMMIT's wait: PostgreSQL stops
	// timing a statement before its commit waits.
	timed := s.pool(t, ctx, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["statement_timeout"] = "1s" })
	s.abandonedInItsWait(t, ctx, func(ctx context.Context) error {
		_, err := payOnce(timed, "k")(ctx)
		return err
	}, 3*time.Second)

	// Once the standby is back, each retry answers, when the standby has
	// everything up to the record's commit.
	if n := calls.Load(); n != 3 {
		t.Errorf("fn ran %d times before the standby came back, want 3 (do, k, cancelled)", n)
	}
	answered := func(name string, call func(ctx context.Context) error) {
		s.freeze(t)
		s.answeredOnceThawed(t, ctx, name, call)
	}
	var k idem.Result[payment]
	answered("Run", func(ctx context.Context) (err error) {
		k, err = payOnce(pool, "k")(ctx)
		return err
	})
	if !k.Replayed || k.Value.ID == 0 {
		t.Errorf("Run's retry once the standby is back: %+v, want the replay", k)
	}
	answered("Run with WithLookupFirst", func(ctx context.Context) error {
		res, err := payOnce(pool, "k", idem.WithLookupFirst())(ctx)
		if err == nil && (!res.Replayed || res.Value != k.Value) {
			t.Errorf("the lookup's replay: %+v, want %+v", res, k.Value)
		}
		return err
	})
	answered("a flow", func(ctx context.Context) error {
		res, err := flow.Run(ctx, pool, scope, "flow", nil, 1)
		if err == nil && (!res.Replayed || res.Value != 2) {
			t.Errorf("the flow's replay: %+v, want 2, replayed", res)
		}
		return err
	})
	if n := calls.Load(); n != 3 {
		t.Errorf("fn ran %d times, want 3: every retry of a recorded key was a replay", n)
	}
}

// TestAReplayWritesAMarkerOnlyForASynchronousStandby measures what a
// replay costs, with and then without a synchronous standby, on one
// connection opened before the standby was named: the same round trips and
// statements (Run's replay two round trips, a lookup's one; a flow's one
// more with the standby, whose claim reads the flow again, alone, to
// commit the marker), and WAL only
// under synchronous replication: the marker that makes the replay's COMMIT
// wait for the standby, a logical message and the commit record of its
// transaction. Without a synchronous standby, or with synchronous_commit
// = local, a replay writes nothing.
func TestAReplayWritesAMarkerOnlyForASynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pair := testdb.StartPair(t, ctx)
	admin := pair.PrimaryPool
	if _, err := admin.Exec(ctx, `CREATE EXTENSION pg_walinspect`); err != nil {
		t.Fatal(err)
	}
	var count testdb.WireCount
	cfg, err := pgx.ParseConfig(pair.Primary.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["synchronous_commit"] = "on"
	cfg.DialFunc = count.Dial
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))

	scope := testdb.Name("cost")
	var calls atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("double"), func(_ context.Context, _ *idem.Steps, in int64) (int64, error) { return 2 * in, nil })
	local := idem.MustNewFlow(testdb.Name("local"), func(_ context.Context, s *idem.Steps, in int64) (int64, error) {
		return idem.Local(s, "read", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var v int64
			err := tx.QueryRow(ctx, `SELECT $1::bigint`, 2*in).Scan(&v)
			return v, err
		})
	})
	replays := []struct {
		name string
		call func(ctx context.Context) (replayed bool, err error)
		// claimed is set for a flow, whose claim reads the flow in a round
		// trip that rolls back when it finds the flow there
		// (flow_claim.go): with a synchronous standby, the claim reads it
		// again, alone, in a second round trip, which writes the marker
		// and commits it.
		claimed bool
	}{
		{"Run", func(ctx context.Context) (bool, error) {
			res, err := idem.Run(ctx, conn, scope, "k", fpA, pay(scope, "k", 100, &calls))
			return res.Replayed, err
		}, false},
		{"Run with WithLookupFirst", func(ctx context.Context) (bool, error) {
			res, err := idem.Run(ctx, conn, scope, "k", fpA, pay(scope, "k", 100, &calls), idem.WithLookupFirst())
			return res.Replayed, err
		}, false},
		{"Do in WithTx", func(ctx context.Context) (replayed bool, err error) {
			err = idem.WithTx(ctx, conn, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
				res, err := idem.Do(ctx, tx, scope, "k", fpA, pay(scope, "k", 100, &calls))
				replayed = res.Replayed
				return err
			})
			return replayed, err
		}, false},
		{"a flow", func(ctx context.Context) (bool, error) {
			res, err := flow.Run(ctx, conn, scope, "flow", nil, 1)
			return res.Replayed, err
		}, true},
		{"a flow of a local step", func(ctx context.Context) (bool, error) {
			res, err := local.Run(ctx, conn, scope, "local", nil, 1)
			return res.Replayed, err
		}, true},
	}
	type cost struct{ roundTrips, statements, markers, walBytes int64 }
	measure := func(call func(ctx context.Context) (bool, error)) cost {
		t.Helper()
		var start string
		if err := admin.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&start); err != nil {
			t.Fatal(err)
		}
		before := count.Counts()
		if replayed, err := call(ctx); err != nil || !replayed {
			t.Fatalf("replayed %v, %v; want a replay", replayed, err)
		}
		after := count.Counts()
		c := cost{roundTrips: after.RoundTrips - before.RoundTrips, statements: after.Statements - before.Statements}
		var flushed bool
		if err := admin.QueryRow(ctx, `SELECT pg_current_wal_flush_lsn() > $1::text::pg_lsn`, start).Scan(&flushed); err != nil || !flushed {
			return c // nothing written since start
		}
		// The marker's records: its logical message, and the records of
		// the transactions that wrote one (their commits).
		err := admin.QueryRow(ctx, `
			WITH w AS (
			    SELECT * FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn())
			)
			SELECT count(*) FILTER (WHERE resource_manager = 'LogicalMessage'),
			       coalesce(sum(record_length) FILTER (WHERE xid IN (
			           SELECT xid FROM w WHERE resource_manager = 'LogicalMessage')), 0)
			FROM w`, start).Scan(&c.markers, &c.walBytes)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	costs := func() map[string]cost {
		out := make(map[string]cost)
		for _, r := range replays {
			out[r.name] = measure(r.call)
		}
		return out
	}
	// The records, then a replay of each, which prepares its statements.
	for _, r := range replays {
		if _, err := r.call(ctx); err != nil {
			t.Fatalf("%s: %v", r.name, err)
		}
	}
	costs()

	without := costs()
	if _, err := admin.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = '*'`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		t.Fatal(err)
	}
	waitForSync(t, ctx, admin)
	// The connection, opened before, sees the new setting at its next
	// statement, once the server's reload has reached its session.
	for {
		var names string
		if err := conn.QueryRow(ctx, `SHOW synchronous_standby_names`).Scan(&names); err != nil {
			t.Fatal(err)
		}
		if names != "" {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	with := costs()
	for _, r := range replays {
		w, s := without[r.name], with[r.name]
		t.Logf("%s replay: %d round trips, %d statements, WAL: none without a synchronous standby (%d markers, %d bytes); with one, %d marker, %d bytes",
			r.name, s.roundTrips, s.statements, w.markers, w.walBytes, s.markers, s.walBytes)
		extra := int64(0)
		if r.claimed {
			extra = 1 // the read again, alone
		}
		if w.roundTrips+extra != s.roundTrips || w.statements+extra != s.statements {
			t.Errorf("%s replay: %d round trips and %d statements without a synchronous standby, %d and %d with one; want %d more",
				r.name, w.roundTrips, w.statements, s.roundTrips, s.statements, extra)
		}
		if w.markers != 0 || w.walBytes != 0 {
			t.Errorf("%s replay without a synchronous standby: %d markers, %d bytes of WAL; want none", r.name, w.markers, w.walBytes)
		}
		if s.markers != 1 || s.walBytes == 0 {
			t.Errorf("%s replay with a synchronous standby: %d markers, %d bytes; want 1", r.name, s.markers, s.walBytes)
		}
	}
	if c := with["Run"]; c.roundTrips != 2 {
		t.Errorf("Run's replay: %d round trips, want 2 (docs/how-it-works.md)", c.roundTrips)
	}
	if c := with["Run with WithLookupFirst"]; c.roundTrips != 1 {
		t.Errorf("a lookup's replay: %d round trips, want 1 (docs/how-it-works.md)", c.roundTrips)
	}

	// A session that does not wait for the standby writes no marker.
	if _, err := conn.Exec(ctx, `SET synchronous_commit = local`); err != nil {
		t.Fatal(err)
	}
	for _, r := range replays {
		if c := measure(r.call); c.markers != 0 {
			t.Errorf("%s replay with synchronous_commit = local: %d markers, want none", r.name, c.markers)
		}
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("fn ran %d times, want 1", n)
	}
}

// syncPair is a primary with a synchronous standby.
type syncPair struct {
	*testdb.Pair
	// receiver is the pid of the standby's WAL receiver, frozen while it
	// is stopped (SIGSTOP).
	receiver int
	frozen   atomic.Bool
}

// startSyncPair starts a primary and a standby that it names synchronous.
func startSyncPair(t *testing.T, ctx context.Context) *syncPair {
	t.Helper()
	s := &syncPair{Pair: testdb.StartPair(t, ctx)}
	// The primary keeps waiting for a frozen standby however long the
	// test takes, instead of ending its replication connection after
	// wal_sender_timeout.
	for _, stmt := range []string{
		`ALTER SYSTEM SET synchronous_standby_names = '*'`,
		`ALTER SYSTEM SET wal_sender_timeout = 0`,
		`SELECT pg_reload_conf()`,
	} {
		if _, err := s.PrimaryPool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	waitForSync(t, ctx, s.PrimaryPool)
	t.Cleanup(func() { s.thaw(t) })
	return s
}

func waitForSync(t *testing.T, ctx context.Context, primary *pgxpool.Pool) {
	t.Helper()
	for {
		var sync bool
		if err := primary.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_stat_replication WHERE sync_state = 'sync'`).Scan(&sync); err != nil {
			t.Fatal(err)
		}
		if sync {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pool returns a pool on the primary whose sessions wait for the
// standby at COMMIT (the pair's servers, Fast, do not by default),
// changed by edit when not nil.
func (s *syncPair) pool(t *testing.T, ctx context.Context, edit func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(s.Primary.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
	if edit != nil {
		edit(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// freeze stops the standby's WAL receiver: the standby stalls, and the
// primary's COMMITs wait for it. It may run on a goroutine of its own.
func (s *syncPair) freeze(t *testing.T) {
	t.Helper()
	if s.frozen.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := s.StandbyPool.QueryRow(ctx, `SELECT pid FROM pg_stat_wal_receiver`).Scan(&s.receiver); err != nil {
		t.Errorf("the standby's WAL receiver: %v", err)
		return
	}
	if err := syscall.Kill(s.receiver, syscall.SIGSTOP); err != nil {
		t.Errorf("freeze the standby's WAL receiver: %v", err)
		return
	}
	s.frozen.Store(true)
}

func (s *syncPair) thaw(t *testing.T) {
	t.Helper()
	if !s.frozen.Load() {
		return
	}
	if err := syscall.Kill(s.receiver, syscall.SIGCONT); err != nil {
		t.Errorf("thaw the standby's WAL receiver: %v", err)
	}
	s.frozen.Store(false)
}

// waitForWaiters waits until n sessions of the primary wait for the
// synchronous standby. A call that returns on done meanwhile fails the
// test: it did not wait.
func (s *syncPair) waitForWaiters(t *testing.T, ctx context.Context, n int, done <-chan error) {
	t.Helper()
	for {
		select {
		case err := <-done:
			t.Fatalf("the call returned (%v) without waiting for the standby", err)
		default:
		}
		var waiting int
		if err := s.PrimaryPool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting == n {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d sessions wait for the synchronous standby, want %d", waiting, n)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// abandonedInItsWait runs call, whose COMMIT is to wait for the frozen
// standby, until its session waits for the standby and at least as long
// as hold, then ends call's context, and checks that call returns the
// context's error: it did not return before, and did not answer. The
// standby is frozen already, or by call itself (freeze) before the COMMIT
// meant: a COMMIT before that one may wait a moment for the standby too.
func (s *syncPair) abandonedInItsWait(t *testing.T, ctx context.Context, call func(ctx context.Context) error, hold ...time.Duration) {
	t.Helper()
	callCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- call(callCtx) }()
	for !s.frozen.Load() {
		select {
		case err := <-done:
			cancel()
			t.Fatalf("the call returned (%v) before it froze the standby", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	s.waitForWaiters(t, ctx, 1, done)
	for _, d := range hold {
		time.Sleep(d)
	}
	select {
	case err := <-done:
		cancel()
		t.Fatalf("the call returned %v while its session waited for the standby", err)
	default:
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("a call whose context ended while it waited for the standby got %v, want context.Canceled", err)
	}
	s.waitForWaiters(t, ctx, 0, nil)
}

// answeredOnceThawed runs call until its session waits for the standby,
// thaws the standby, and checks that call then returns, once the standby
// has everything the primary had written before the call.
func (s *syncPair) answeredOnceThawed(t *testing.T, ctx context.Context, name string, call func(ctx context.Context) error) {
	t.Helper()
	var written string
	if err := s.PrimaryPool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&written); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- call(ctx) }()
	s.waitForWaiters(t, ctx, 1, done)
	s.thaw(t)
	if err := <-done; err != nil {
		t.Fatalf("%s once the standby is back: %v", name, err)
	}
	var has bool
	if err := s.StandbyPool.QueryRow(ctx, `SELECT pg_last_wal_receive_lsn() >= $1::text::pg_lsn`, written).Scan(&has); err != nil || !has {
		t.Errorf("%s answered before the standby had the WAL up to %s: %v, %v", name, written, has, err)
	}
}

// waitForRecord waits until query, given scope, counts a row: the commit
// of a call whose wait was cut short is visible once the server has
// handled the cancel request.
func (s *syncPair) waitForRecord(t *testing.T, ctx context.Context, query, scope string) {
	t.Helper()
	for {
		var n int
		if err := s.PrimaryPool.QueryRow(ctx, query, scope).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}
