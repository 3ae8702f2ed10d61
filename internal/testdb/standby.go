package testdb

import (
	"context"
	"fmt"
	neturl "net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgtemp"
)

// Pair is a throwaway primary and a streaming standby of it, of one test:
// servers of their own, whatever TEST_DATABASE_URL names, since a test of
// a standby or a failover kills and promotes them.
type Pair struct {
	Primary, Standby *pgtemp.Server
	// PrimaryPool and StandbyPool connect to each server's postgres
	// database, which has idem's tables and AppSchema.
	PrimaryPool, StandbyPool *pgxpool.Pool
}

// StartPair starts a Pair (Fast servers), stopped when the test ends. It
// skips the test under -short.
func StartPair(t testing.TB, ctx context.Context) *Pair {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: database tests are skipped")
	}
	p := &Pair{}
	p.Primary, p.PrimaryPool = startServer(t, ctx, pgtemp.Config{Fast: true, MaxConnections: 50})
	sqlDB := stdlib.OpenDBFromPool(p.PrimaryPool)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		t.Fatal(err)
	}
	if _, err := p.PrimaryPool.Exec(ctx, AppSchema); err != nil {
		t.Fatal(err)
	}
	p.Standby, p.StandbyPool = startServer(t, ctx, pgtemp.Config{Fast: true, MaxConnections: 50, StandbyOf: p.Primary})
	var inRecovery bool
	if err := p.StandbyPool.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery); err != nil || !inRecovery {
		t.Fatalf("the standby is not in recovery: %v, %v", inRecovery, err)
	}
	return p
}

func startServer(t testing.TB, ctx context.Context, cfg pgtemp.Config) (*pgtemp.Server, *pgxpool.Pool) {
	t.Helper()
	srv, err := pgtemp.Start(ctx, cfg)
	if err != nil {
		t.Fatalf("this test needs a throwaway primary and standby, started from a local PostgreSQL installation: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Stop(); err != nil {
			t.Errorf("stop the throwaway server: %v", err)
		}
	})
	pool, err := pgxpool.New(ctx, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return srv, pool
}

// URL returns the connection string that the failover docs recommend: both
// servers, the one that accepts writes chosen at each connection
// (target_session_attrs=read-write), each tried for at most two seconds.
func (p *Pair) URL() string {
	u, err := neturl.Parse(p.Primary.URL)
	if err != nil {
		panic(err)
	}
	u.Host = fmt.Sprintf("127.0.0.1:%d,127.0.0.1:%d", p.Primary.Port, p.Standby.Port)
	u.RawQuery = "sslmode=disable&target_session_attrs=read-write&connect_timeout=2"
	return u.String()
}

// WaitForReplay waits until the standby has replayed everything the
// primary has written so far, committed asynchronously too (the servers
// are Fast): up to the WAL's insert position, not its write position.
func (p *Pair) WaitForReplay(t testing.TB, ctx context.Context) {
	t.Helper()
	var lsn string
	if err := p.PrimaryPool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	for {
		var caughtUp bool
		err := p.StandbyPool.QueryRow(ctx, `SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn`, lsn).Scan(&caughtUp)
		if err == nil && caughtUp {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the standby did not replay up to %s: %v", lsn, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Promote promotes the standby and waits until it accepts writes.
func (p *Pair) Promote(t testing.TB, ctx context.Context) {
	t.Helper()
	var ok bool
	if err := p.StandbyPool.QueryRow(ctx, `SELECT pg_promote(true, 60)`).Scan(&ok); err != nil || !ok {
		t.Fatalf("promote the standby: %v, %v", ok, err)
	}
}
