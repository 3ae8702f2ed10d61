package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// A relay on a connection in a caller's transaction used to run its
// statements in that transaction: it leased messages and handed them to
// the handler with leases no other relay could see, and recorded outcomes
// that the caller's commit or rollback would keep or undo, whenever it
// came. In a failed transaction every statement failed, and Run logged it
// at every poll. Run now refuses the connection before sending anything.
func TestRelayRefusesAConnectionInATransaction(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"pgx.Conn", "pgxpool.Conn"} {
		for _, state := range []string{"open", "failed"} {
			t.Run(kind+"/"+state, func(t *testing.T) {
				ctx, pool, scope, dest := setup(t)
				enqueue(t, ctx, pool, entries(scope, dest, 1)...)
				conn, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(conn.Release)
				var db idem.TxBeginner = conn
				if kind == "pgx.Conn" {
					db = conn.Conn()
				}
				tx, err := conn.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'caller', 1)`, scope); err != nil {
					t.Fatal(err)
				}
				want := byte('T')
				if state == "failed" {
					want = 'E'
					if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
						t.Fatal("SELECT 1/0 did not fail")
					}
				}

				var handled atomic.Int64
				relay, err := outbox.NewRelay(db, func(context.Context, outbox.Message) error {
					handled.Add(1)
					return nil
				}, &outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond, Logger: testLogger(t)})
				if err != nil {
					t.Fatal(err)
				}
				runCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				err = relay.Run(runCtx)
				if !errors.Is(err, idem.ErrConnInTransaction) {
					t.Errorf("Run: %v, want ErrConnInTransaction", err)
				} else if !strings.Contains(err.Error(), "pass the pool") {
					t.Errorf("Run: %q does not say what to do instead", err)
				}
				if n := handled.Load(); n != 0 {
					t.Errorf("the handler ran %d times, want never", n)
				}
				if status := conn.Conn().PgConn().TxStatus(); status != want {
					t.Fatalf("the caller's transaction has status %q, want %q", status, want)
				}
				if rs := rows(t, pool, dest); len(rs) != 1 || rs[0].State != "pending" || rs[0].Attempts != 0 || rs[0].Leased {
					t.Errorf("message %+v, want pending and untouched", rs)
				}
				if n := countPayments(t, pool, scope); n != 0 {
					t.Errorf("%d payments committed under the caller's open transaction, want none", n)
				}
				if state == "failed" {
					if err := tx.Rollback(ctx); err != nil {
						t.Fatalf("the caller's rollback: %v", err)
					}
					return
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatalf("the caller's commit: %v", err)
				}
				if n := countPayments(t, pool, scope); n != 1 {
					t.Errorf("%d payments after the caller's commit, want its own 1", n)
				}
			})
		}
	}
}
