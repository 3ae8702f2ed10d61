package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// runCommand runs the command line args against databaseURL and returns
// its exit code and output. It sets DATABASE_URL, so its tests are not
// parallel.
func runCommand(t *testing.T, databaseURL string, args ...string) (int, string) {
	t.Helper()
	t.Setenv("DATABASE_URL", databaseURL)
	t.Setenv("PGCONNECT_TIMEOUT", "5")
	var out bytes.Buffer
	code := run(context.Background(), args, &out, &out)
	return code, out.String()
}

func TestCommandLineExitCodes(t *testing.T) {
	url := env.URL(t)
	cases := []struct {
		args []string
		want int
	}{
		{nil, exitUsage},
		{[]string{"no-such-command"}, exitUsage},
		{[]string{"help"}, exitOK},
		{[]string{"stats", "-h"}, exitOK},
		{[]string{"migrate"}, exitUsage},
		{[]string{"migrate", "sideways"}, exitUsage},
		{[]string{"inspect", "only-a-scope"}, exitUsage},
		{[]string{"purge", "-batch", "0"}, exitUsage},
		{[]string{"stats", "-no-such-flag"}, exitUsage},
	}
	for _, c := range cases {
		if code, out := runCommand(t, url, c.args...); code != c.want {
			t.Errorf("idem %s: exit %d, want %d\n%s", strings.Join(c.args, " "), code, c.want, out)
		}
	}
	if code, out := runCommand(t, "postgres://postgres@127.0.0.1:1/none?sslmode=disable", "stats"); code != exitDatabase {
		t.Errorf("unreachable database: exit %d, want %d\n%s", code, exitDatabase, out)
	}
}

func TestCommandsOnAnUnmigratedDatabase(t *testing.T) {
	url := env.EmptyDatabase(t)
	for _, args := range [][]string{{"stats"}, {"purge"}, {"inspect", "s", "k"}} {
		code, out := runCommand(t, url, args...)
		if code != exitDatabase || !strings.Contains(out, "migrate up") {
			t.Errorf("idem %s on an unmigrated database: exit %d, want %d and a hint\n%s", args[0], code, exitDatabase, out)
		}
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var tables int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE schemaname = 'public'`).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if tables != 0 {
		t.Fatalf("looking at an unmigrated database created %d tables", tables)
	}
}

func TestMigrateStatsInspectPurge(t *testing.T) {
	url := env.EmptyDatabase(t)
	ctx := context.Background()
	mustRun := func(want string, args ...string) string {
		t.Helper()
		code, out := runCommand(t, url, args...)
		if code != exitOK || !strings.Contains(out, want) {
			t.Fatalf("idem %s: exit %d, want 0 and %q in:\n%s", strings.Join(args, " "), code, want, out)
		}
		return out
	}
	mustRun("applied", "migrate", "up")
	mustRun("up to date", "migrate", "up")
	mustRun("applied", "migrate", "status")

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	fn := func(context.Context, pgx.Tx) (map[string]string, error) {
		return map[string]string{"card": "4242"}, nil
	}
	for _, key := range []string{"live", "old"} {
		if _, err := idem.Run(ctx, pool, "tenant", key, nil, fn); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE idempotency_key SET expires_at = now() - interval '1 hour' WHERE key = 'old'`); err != nil {
		t.Fatal(err)
	}

	out := mustRun("records done", "stats")
	if !strings.Contains(out, "past expiry, awaiting purge  1") || !strings.Contains(out, "scopes                               1") {
		t.Errorf("stats:\n%s", out)
	}
	out = mustRun("state", "inspect", "tenant", "live")
	if strings.Contains(out, "4242") || !strings.Contains(out, "redacted") {
		t.Errorf("inspect showed the response without -show-response:\n%s", out)
	}
	mustRun("4242", "inspect", "-show-response", "tenant", "live")
	if code, out := runCommand(t, url, "inspect", "tenant", "absent"); code != exitFailure {
		t.Errorf("inspect of a missing record: exit %d, want %d\n%s", code, exitFailure, out)
	}
	mustRun("purged 1 expired records", "purge")
	mustRun("purged 0 expired records", "purge")
	mustRun("rolled back", "migrate", "down")
}
