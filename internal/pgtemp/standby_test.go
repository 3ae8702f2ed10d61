//go:build unix

package pgtemp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// TestAStandbyTakesOverAndIsRebuiltInThePrimarysPlace walks through a
// failover: a standby follows its primary, the primary is killed, the
// standby is promoted with what the primary committed, and a new standby
// of it starts on the dead primary's port, so that a connection string
// naming both ports reaches the new primary and its standby.
func TestAStandbyTakesOverAndIsRebuiltInThePrimarysPlace(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: database tests are skipped")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := func(cfg Config) *Server {
		t.Helper()
		srv, err := Start(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := srv.Stop(); err != nil {
				t.Errorf("stop the server on port %d: %v", srv.Port, err)
			}
		})
		return srv
	}
	connect := func(srv *Server) *pgx.Conn {
		t.Helper()
		conn, err := pgx.Connect(ctx, srv.URL)
		if err != nil {
			t.Fatalf("connect to port %d: %v", srv.Port, err)
		}
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
		return conn
	}

	primary := start(Config{Fast: true})
	standby := start(Config{Fast: true, StandbyOf: primary})
	if standby.Port == primary.Port || standby.Dir == primary.Dir {
		t.Fatalf("the standby shares the primary's port %d or directory", primary.Port)
	}
	p, s := connect(primary), connect(standby)
	if _, err := p.Exec(ctx, `CREATE TABLE t (v text); INSERT INTO t VALUES ('before')`); err != nil {
		t.Fatal(err)
	}
	waitForRow(t, ctx, s, "before")
	if _, err := s.Exec(ctx, `INSERT INTO t VALUES ('on the standby')`); err == nil {
		t.Fatal("the standby accepted a write")
	}

	if err := primary.Kill(syscall.SIGKILL); err != nil {
		t.Fatalf("kill the primary: %v", err)
	}
	if _, err := pgx.Connect(ctx, primary.URL); err == nil {
		t.Fatal("the killed primary still accepts connections")
	}
	if err := primary.Kill(syscall.SIGKILL); err != nil {
		t.Errorf("Kill of a server that is not running: %v", err)
	}
	var promoted bool
	if err := s.QueryRow(ctx, `SELECT pg_promote(true, 60)`).Scan(&promoted); err != nil || !promoted {
		t.Fatalf("promote the standby: %v, %v", promoted, err)
	}
	if _, err := s.Exec(ctx, `INSERT INTO t VALUES ('after')`); err != nil {
		t.Fatalf("write on the promoted standby: %v", err)
	}

	// The old primary's place: its directory goes, a standby of the new
	// primary takes its port.
	port := primary.Port
	if err := primary.Stop(); err != nil {
		t.Fatal(err)
	}
	rebuilt := start(Config{Fast: true, StandbyOf: standby, Port: port})
	if rebuilt.Port != port {
		t.Fatalf("the rebuilt standby listens on %d, want %d", rebuilt.Port, port)
	}
	multi, err := pgx.Connect(ctx, fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		standby.password, port, standby.Port))
	if err != nil {
		t.Fatalf("connect to the read-write server of the two: %v", err)
	}
	defer multi.Close(context.Background())
	if got := multi.PgConn().Conn().RemoteAddr().String(); !strings.HasSuffix(got, fmt.Sprint(":", standby.Port)) {
		t.Errorf("target_session_attrs=read-write reached %s, want the promoted standby's port %d", got, standby.Port)
	}
	waitForRow(t, ctx, connect(rebuilt), "after")
}

// TestStartRefusesABadPortOrAStandbyOfNothing checks the new fields'
// validation, before anything starts.
func TestStartRefusesABadPortOrAStandbyOfNothing(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]Config{
		"Config.Port":      {Port: 70000},
		"Config.StandbyOf": {StandbyOf: &Server{}},
	} {
		srv, err := Start(context.Background(), cfg)
		if srv != nil || !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: %v, %v; want ErrInvalidOption naming the field", field, srv, err)
		}
	}
}

// waitForRow waits until the standby behind conn has replayed the row v.
func waitForRow(t *testing.T, ctx context.Context, conn *pgx.Conn, v string) {
	t.Helper()
	for {
		var n int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM t WHERE v = $1`, v).Scan(&n)
		if err == nil && n == 1 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the standby never showed %q: %v", v, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
