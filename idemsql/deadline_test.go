package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testdb"
)

// cleanupBound is how long a call may outlive its context, as idem.WithTx
// documents (one second), with room for a loaded machine.
const cleanupBound = 2500 * time.Millisecond

// TestACallOnAFrozenConnectionReturnsSoonAfterItsDeadline freezes the
// connection (a proxy that stops forwarding, closing nothing) after fn's
// write, and fails fn before or after the call's deadline, or returns, so
// that idem's record is sent to the frozen server: Run returns within the
// documented bound past its deadline, on both drivers.
func TestACallOnAFrozenConnectionReturnsSoonAfterItsDeadline(t *testing.T) {
	t.Parallel()
	for _, d := range drivers {
		for _, c := range []struct{ late, fails bool }{{false, true}, {true, true}, {false, false}} {
			late := c.late
			name := d.name
			if late {
				name += "/after-deadline"
			}
			if !c.fails {
				name += "/record-in-flight"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				u, err := url.Parse(env.URL(t))
				if err != nil {
					t.Fatal(err)
				}
				port, _ := strconv.Atoi(u.Port())
				f := testdb.StartFreezer(t, u.Hostname(), uint16(port))
				u.Host = f.Addr().String()
				db := d.open(t, u.String(), nil)
				db.SetMaxOpenConns(1)
				t.Cleanup(func() { go db.Close() }) // a frozen connection may never close
				scope := testdb.Name("frozen")
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				if err := db.PingContext(ctx); err != nil {
					t.Fatal(err)
				}
				ctx, cancel = context.WithTimeout(ctx, 500*time.Millisecond)
				defer cancel()
				errCard := errors.New("card service down")
				var calls atomic.Int64
				done := make(chan error, 1)
				go func() {
					_, err := idemsql.Run(ctx, db, scope, "k", fpA, func(ctx context.Context, tx *sql.Tx) (payment, error) {
						if _, err := pay(scope, "k", 1, &calls)(ctx, tx); err != nil {
							return payment{}, err
						}
						f.Freeze()
						if late {
							<-ctx.Done()
						}
						if !c.fails {
							return payment{}, nil // idem sends the record to the frozen server
						}
						return payment{}, errCard
					}, idem.WithTxOptions(pgx.TxOptions{IsoLevel: pgx.ReadCommitted}))
					done <- err
				}()
				deadline, _ := ctx.Deadline()
				select {
				case err := <-done:
					t.Logf("returned %s after the deadline: %v", time.Since(deadline).Round(time.Millisecond), err)
				case <-time.After(time.Until(deadline) + cleanupBound):
					t.Fatalf("still running %s after its deadline; the bound is %s", cleanupBound, cleanupBound)
				}
			})
		}
	}
}
