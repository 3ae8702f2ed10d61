package idem_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/testdb"
)

// undecodable is an input that is stored (its JSON is valid) but cannot
// be decoded back, as a flow's function gets it.
type undecodable struct{}

func (undecodable) MarshalJSON() ([]byte, error) { return []byte(`"sealed"`), nil }
func (*undecodable) UnmarshalJSON([]byte) error  { return errors.New("undecodable") }

// TestFlowClaimGivesItsConnectionBackOnEveryPath ends a new flow's run
// while it holds its claim's transaction, every way a run can end there:
// the function panics, or returns an error, or returns without a step;
// the run's context ends before the first step, or in it; the first
// step's function panics, or fails; the input, claimed, cannot be decoded.
// Each time, on a pool of one connection and on a single connection, the
// run gives the connection back idle, and the flow's lock is free: the
// next run on that pool or connection gets it at once.
func TestFlowClaimGivesItsConnectionBackOnEveryPath(t *testing.T) {
	ctx, _, scope := setup(t)
	cfg := env.DirectPool(t).Config()
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	observer := env.DirectPool(t)

	insert := func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
		return 1, err
	}
	cases := []struct {
		name string
		fn   func(ctx context.Context, s *idem.Steps, cancel context.CancelFunc) (int, error)
	}{
		{"the function panics", func(context.Context, *idem.Steps, context.CancelFunc) (int, error) { panic("before any step") }},
		{"the function fails", func(context.Context, *idem.Steps, context.CancelFunc) (int, error) { return 0, errors.New("no") }},
		{"the function takes no step", func(context.Context, *idem.Steps, context.CancelFunc) (int, error) { return 1, nil }},
		{"the context ends before the first step", func(ctx context.Context, s *idem.Steps, cancel context.CancelFunc) (int, error) {
			cancel()
			<-ctx.Done()
			return idem.Local(s, "a", insert)
		}},
		{"the context ends in the first step", func(ctx context.Context, s *idem.Steps, cancel context.CancelFunc) (int, error) {
			return idem.Local(s, "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
				if _, err := insert(ctx, tx); err != nil {
					return 0, err
				}
				cancel()
				return insert(ctx, tx)
			})
		}},
		{"the first step panics", func(ctx context.Context, s *idem.Steps, _ context.CancelFunc) (int, error) {
			return idem.Local(s, "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
				_, _ = insert(ctx, tx)
				panic("in the first step")
			})
		}},
		{"the first step fails", func(ctx context.Context, s *idem.Steps, _ context.CancelFunc) (int, error) {
			return idem.Local(s, "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
				_, _ = insert(ctx, tx)
				return 0, errors.New("no")
			})
		}},
	}
	dbs := []struct {
		name string
		db   idem.TxBeginner
		idle func() error
	}{
		{"pool", pool, func() error {
			if n := pool.Stat().AcquiredConns(); n != 0 {
				return fmt.Errorf("%d connections still acquired", n)
			}
			return nil
		}},
		{"conn", conn, func() error {
			if s := conn.PgConn().TxStatus(); s != 'I' {
				return fmt.Errorf("the connection is in a transaction (%c)", s)
			}
			return nil
		}},
	}
	// free checks that the run gave its connection back idle, and left
	// the flow's lock free.
	free := func(t *testing.T, db int, key string) {
		t.Helper()
		if err := dbs[db].idle(); err != nil {
			t.Fatal(err)
		}
		var free bool
		if err := observer.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1)`, keylock.FlowID(scope, key)).Scan(&free); err != nil || !free {
			t.Fatalf("the flow's lock free: %t, %v", free, err)
		}
	}
	for i, c := range cases {
		for d := range dbs {
			key := fmt.Sprintf("k%d-%s", i, dbs[d].name)
			t.Run(c.name+"/"+dbs[d].name, func(t *testing.T) {
				runCtx, cancel := context.WithCancel(ctx)
				defer cancel()
				flow := idem.MustNewFlow(testdb.Name("claim"), func(ctx context.Context, s *idem.Steps, _ int) (int, error) {
					return c.fn(ctx, s, cancel)
				})
				func() {
					defer func() { _ = recover() }()
					_, _ = flow.Run(runCtx, dbs[d].db, scope, key, nil, 0)
				}()
				free(t, d, key)
			})
		}
	}
	for d := range dbs {
		key := "undecodable-" + dbs[d].name
		t.Run("the input cannot be decoded/"+dbs[d].name, func(t *testing.T) {
			flow := idem.MustNewFlow(testdb.Name("claim"), func(context.Context, *idem.Steps, undecodable) (int, error) {
				t.Error("the function ran with an input it could not decode")
				return 0, nil
			})
			if _, err := flow.Run(ctx, dbs[d].db, scope, key, nil, undecodable{}); err == nil {
				t.Fatal("Run: nil error for an input it could not decode")
			}
			free(t, d, key)
		})
	}
}

// TestFlowClaimThatFindsTheLockTakenLeavesItsConnectionIdle claims a new
// flow whose lock another session holds, on a single connection and on a
// pool of one: the claim finds the lock taken, waits, and runs the flow
// once the lock is free. The connection's first claim, which asks whether
// its database has Citus and takes the lock after BEGIN (as on Citus),
// rolls back what it began; the next claim on it, which knows, takes the
// lock before BEGIN. Either way the connection is left idle, and the pool
// keeps its one connection.
func TestFlowClaimThatFindsTheLockTakenLeavesItsConnectionIdle(t *testing.T) {
	ctx, _, scope := setup(t)
	cfg := env.DirectPool(t).Config()
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	holder, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = holder.Close(context.Background()) })

	var ran int
	flow := idem.MustNewFlow(testdb.Name("locktaken"), func(ctx context.Context, s *idem.Steps, _ int) (int, error) {
		ran++
		return 1, nil
	})
	for _, c := range []struct {
		name string
		db   idem.TxBeginner
	}{{"conn, first claim", conn}, {"conn, next claim", conn}, {"pool, first claim", pool}, {"pool, next claim", pool}} {
		key := c.name
		id := keylock.FlowID(scope, key)
		if _, err := holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, id); err != nil {
			t.Fatal(err)
		}
		var waited atomic.Bool
		released := make(chan error, 1)
		go func() {
			// The lock is let go once the claim has found it taken at
			// least once: the claim's session then waits for it.
			for !waited.Load() {
				var waiting bool
				if err := holder.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND datname = current_database()
					AND query LIKE '%FlowStartLock%'`).Scan(&waiting); err != nil {
					released <- err
					return
				}
				if waiting {
					waited.Store(true)
				}
				time.Sleep(5 * time.Millisecond)
			}
			_, err := holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, id)
			released <- err
		}()
		ran = 0
		res, err := flow.Run(ctx, c.db, scope, key, nil, 0, idem.WithWait(30*time.Second))
		if err := <-released; err != nil {
			t.Fatal(err)
		}
		if err != nil || res.Value != 1 || ran != 1 {
			t.Fatalf("%s: %+v, %v, the function ran %d times; want the flow run once the lock was free", c.name, res, err, ran)
		}
		if s := conn.PgConn().TxStatus(); s != 'I' {
			t.Fatalf("%s: the connection's state is %c, want idle (I)", c.name, s)
		}
		if n := pool.Stat().NewConnsCount(); n > 1 {
			t.Fatalf("%s: the pool opened %d connections, want 1: the claim gave back one in a transaction", c.name, n)
		}
	}
}
