package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/faultproxy"
	"github.com/pgidem/idem/internal/testdb"
)

// setupFrozen returns a pool whose only connection runs through a freezer,
// and the freezer. Both are closed when the test ends.
func setupFrozen(t *testing.T) (context.Context, *pgxpool.Pool, string, *faultproxy.Freezer) {
	ctx, _, scope := setup(t)
	cfg, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	if testdb.BehindPooler() {
		// The test is about the client's deadline, not the pooler; and a
		// client that vanishes mid-transaction can crash PgBouncer 1.18
		// (see docs/pgbouncer.md, "What to configure").
		cfg = env.DirectPool(t).Config()
	}
	f := testdb.StartFreezer(t, cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	addr := f.Addr()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = addr.IP.String(), uint16(addr.Port)
	cfg.ConnConfig.Fallbacks = nil
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return ctx, pool, scope, f
}

// cleanupBound is how long a call may outlive its context, as WithTx
// documents (one second), with room for a loaded machine.
const cleanupBound = 2500 * time.Millisecond

// TestFailureOnDeadConnectionReturnsSoonAfterDeadline makes fn fail, or
// panic, after the connection stopped answering, before or after the
// call's deadline: whatever cleanup follows
// (a rollback, a claim's release) must not keep the caller more than the
// documented bound past its deadline, at every isolation level.
func TestFailureOnDeadConnectionReturnsSoonAfterDeadline(t *testing.T) {
	errCard := errors.New("card service down")
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		for _, panics := range []bool{false, true} {
			for _, via := range []string{"Run", "WithTx+Do"} {
				for _, late := range []bool{false, true} {
					name := via + "/" + string(iso)
					if panics {
						name += "/panic"
					}
					if late {
						name += "/after-deadline"
					}
					t.Run(name, func(t *testing.T) {
						ctx, pool, scope, f := setupFrozen(t)
						ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
						defer cancel()
						var calls atomic.Int64
						fn := func(ctx context.Context, tx pgx.Tx) (payment, error) {
							if _, err := pay(scope, "k", 1, &calls)(ctx, tx); err != nil {
								return payment{}, err
							}
							f.Freeze()
							if late {
								<-ctx.Done()
							}
							if panics {
								panic(errCard)
							}
							return payment{}, errCard
						}
						done := make(chan struct{})
						go func() {
							defer close(done)
							defer func() { _ = recover() }()
							switch via {
							case "Run":
								_, _ = idem.Run(ctx, pool, scope, "k", fpA, fn, idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso}))
							default:
								_ = idem.WithTx(ctx, pool, pgx.TxOptions{IsoLevel: iso}, func(ctx context.Context, tx pgx.Tx) error {
									_, err := idem.Do(ctx, tx, scope, "k", fpA, fn)
									return err
								})
							}
						}()
						deadline, _ := ctx.Deadline()
						select {
						case <-done:
							t.Logf("returned %s after the deadline", time.Since(deadline).Round(time.Millisecond))
						case <-time.After(time.Until(deadline) + cleanupBound):
							t.Fatalf("still running %s after its deadline; the bound is %s", cleanupBound, cleanupBound)
						}
					})
				}
			}
		}
	}
}
