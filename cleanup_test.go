package idem_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/faultproxy"
	"github.com/pgidem/idem/internal/testdb"
)

// freezer is a TCP proxy in front of the test server that can stop
// forwarding, without closing anything: to the client, a connection whose
// server (or network) stopped answering.
type freezer struct {
	proxy  *faultproxy.Proxy
	frozen chan struct{}
	once   sync.Once
}

// setupFrozen returns a pool whose only connection runs through a freezer,
// and the freezer. Both are closed when the test ends.
func setupFrozen(t *testing.T) (context.Context, *pgxpool.Pool, string, *freezer) {
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
	f := &freezer{frozen: make(chan struct{})}
	network, address := faultproxy.PostgresAddress(cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	f.proxy, err = faultproxy.Start(faultproxy.Config{
		Network: network,
		Address: address,
		Pipes:   func() (faultproxy.Pipe, faultproxy.Pipe) { return f.pipe, f.pipe },
	})
	if err != nil {
		t.Fatal(err)
	}
	addr := f.proxy.Addr()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = addr.IP.String(), uint16(addr.Port)
	cfg.ConnConfig.Fallbacks = nil
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.close()
		pool.Close()
	})
	return ctx, pool, scope, f
}

// pipe forwards from src to dst until frozen, then holds what it reads.
func (f *freezer) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-f.frozen:
			_, _ = io.Copy(io.Discard, src) // swallow, never answer
			return
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (f *freezer) freeze() { f.once.Do(func() { close(f.frozen) }) }

func (f *freezer) close() {
	f.freeze()
	f.proxy.Close()
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
							f.freeze()
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
