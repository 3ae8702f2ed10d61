//go:build unix

package pgtemp

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestRestartAfterAnImmediateStop stops a server the hard way, with a
// committed row, and starts it again on its data and port: the row is
// there, and the old URL reaches it. A running server's Restart, and a
// removed one's, are refused.
func TestRestartAfterAnImmediateStop(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: database tests are skipped")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, err := Start(ctx, Config{Fast: true, MaxConnections: 20, Settings: map[string]string{
		// Commits are flushed, for the row to outlive the crash.
		"synchronous_commit": "on", "work_mem": "5MB"}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	exec := func(sql string) string {
		t.Helper()
		conn, err := pgx.Connect(ctx, srv.URL)
		if err != nil {
			t.Fatalf("connect to port %d: %v", srv.Port, err)
		}
		defer conn.Close(context.Background())
		rows, _ := conn.Query(ctx, sql)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return strings.Join(out, ",")
	}
	exec(`CREATE TABLE t AS SELECT 'before'::text AS v`)
	if err := srv.Restart(ctx); err == nil {
		t.Fatal("Restart of a running server succeeded")
	}
	port, url := srv.Port, srv.URL
	for _, sig := range []syscall.Signal{syscall.SIGQUIT, syscall.SIGKILL} {
		if err := srv.Kill(sig); err != nil {
			t.Fatalf("kill (%v): %v", sig, err)
		}
		if conn, err := pgx.Connect(ctx, url); err == nil {
			conn.Close(ctx)
			t.Fatalf("the server accepts connections after %v", sig)
		}
		if err := srv.Restart(ctx); err != nil {
			t.Fatalf("restart after %v: %v", sig, err)
		}
		if srv.Port != port || srv.URL != url {
			t.Fatalf("restarted on %s, was %s", srv.URL, url)
		}
		if got := exec(`SELECT string_agg(v, ',') FROM t`); got != "before" {
			t.Fatalf("after %v and Restart, the table holds %q", sig, got)
		}
		if got := exec(`SELECT current_setting('work_mem') || ' ' || current_setting('max_connections')`); got != "5MB 20" {
			t.Fatalf("work_mem and max_connections %s after Restart, want the Config's 5MB 20", got)
		}
	}
	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Restart(ctx); err == nil {
		t.Fatal("Restart of a removed server succeeded")
	}
}
