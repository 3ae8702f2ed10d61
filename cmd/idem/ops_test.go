package main

import (
	"bytes"
	"context"
	"fmt"
	neturl "net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
	"github.com/pgidem/idem/internal/keylock"
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
		{nil, cli.ExitUsage},
		{[]string{"no-such-command"}, cli.ExitUsage},
		{[]string{"help"}, cli.ExitOK},
		{[]string{"stats", "-h"}, cli.ExitOK},
		{[]string{"migrate"}, cli.ExitUsage},
		{[]string{"migrate", "sideways"}, cli.ExitUsage},
		{[]string{"inspect", "only-a-scope"}, cli.ExitUsage},
		{[]string{"purge", "-batch", "0"}, cli.ExitUsage},
		// Above int32: once truncated to LIMIT 0 (nothing purged, exit 0)
		// or to a negative LIMIT.
		{[]string{"purge", "-batch", "4294967296"}, cli.ExitUsage},
		{[]string{"purge", "-batch", "3000000000"}, cli.ExitUsage},
		{[]string{"stats", "-no-such-flag"}, cli.ExitUsage},
	}
	for _, c := range cases {
		if code, out := runCommand(t, url, c.args...); code != c.want {
			t.Errorf("idem %s: exit %d, want %d\n%s", strings.Join(c.args, " "), code, c.want, out)
		}
	}
	if code, out := runCommand(t, "postgres://postgres@127.0.0.1:1/none?sslmode=disable", "stats"); code != cli.ExitDatabase {
		t.Errorf("unreachable database: exit %d, want %d\n%s", code, cli.ExitDatabase, out)
	}
}

func TestCommandsOnAnUnmigratedDatabase(t *testing.T) {
	url := env.EmptyDatabase(t)
	for _, args := range [][]string{{"stats"}, {"purge"}, {"inspect", "s", "k"}} {
		code, out := runCommand(t, url, args...)
		if code != cli.ExitDatabase || !strings.Contains(out, "migrate up") {
			t.Errorf("idem %s on an unmigrated database: exit %d, want %d and a hint\n%s", args[0], code, cli.ExitDatabase, out)
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
	mustRun := mustRunner(t, url)
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
	if !regexp.MustCompile(`past expiry, awaiting purge +1\n`).MatchString(out) || !regexp.MustCompile(`\nscopes +1\n`).MatchString(out) {
		t.Errorf("stats:\n%q", out)
	}
	out = mustRun("state", "inspect", "tenant", "live")
	if strings.Contains(out, "4242") || !strings.Contains(out, "redacted") {
		t.Errorf("inspect showed the response without -show-response:\n%s", out)
	}
	mustRun("4242", "inspect", "-show-response", "tenant", "live")
	// Flags after the operands, as most command lines allow.
	mustRun("4242", "inspect", "tenant", "live", "-show-response")
	if code, out := runCommand(t, url, "inspect", "tenant", "live", "extra"); code != cli.ExitUsage {
		t.Errorf("inspect with three operands: exit %d, want %d\n%s", code, cli.ExitUsage, out)
	}
	if code, out := runCommand(t, url, "inspect", "tenant", "absent"); code != cli.ExitFailure {
		t.Errorf("inspect of a missing record: exit %d, want %d\n%s", code, cli.ExitFailure, out)
	}
	// An operation running now has no record yet at READ COMMITTED: stats
	// and inspect see it, and the duplicate waiting for it, by its lock.
	checkRunning(t, ctx, pool, url, fn, "no record yet; running now (advisory lock with its id): yes, its transaction began")
	if out := mustRun("running now", "inspect", "tenant", "running"); !regexp.MustCompile(`running now \(advisory lock with its id\) +no\n`).MatchString(out) {
		t.Errorf("inspect after the operation committed:\n%s", out)
	}
	if out := mustRun("operations running now", "stats"); !regexp.MustCompile(`operations running now \(advisory locks with idem's tag\) +0\n`).MatchString(out) {
		t.Errorf("stats after the operation committed:\n%s", out)
	}

	mustRun("purged 1 expired records", "purge", "-batch", "2147483647")
	mustRun("purged 0 expired records", "purge")
	mustRun("rolled back", "migrate", "down")
}

// TestStatsAndInspectSayTheyCountLocksByIdemsTag checks that stats and
// inspect say where their running and waiting counts come from: advisory
// locks whose id carries idem's tag, which an application's own lock in
// that range carries too, and is counted with them. Its locks outside the
// range, or of the two-key form, are not.
func TestStatsAndInspectSayTheyCountLocksByIdemsTag(t *testing.T) {
	url := env.EmptyDatabase(t)
	ctx := context.Background()
	if code, out := runCommand(t, url, "migrate", "up"); code != cli.ExitOK {
		t.Fatalf("migrate up: exit %d\n%s", code, out)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	const inRange = int64(keylock.Tag)<<48 | 12345
	for _, lock := range []string{
		fmt.Sprintf("SELECT pg_advisory_xact_lock(%d)", inRange),            // counted
		"SELECT pg_advisory_xact_lock(12345)",                               // outside the tag
		fmt.Sprintf("SELECT pg_advisory_xact_lock(%d, 1)", keylock.Tag<<16), // two keys: objsubid 2
	} {
		if _, err := tx.Exec(ctx, lock); err != nil {
			t.Fatal(err)
		}
	}
	code, out := runCommand(t, url, "stats")
	if code != cli.ExitOK {
		t.Fatalf("stats: exit %d\n%s", code, out)
	}
	if !regexp.MustCompile(`operations running now \(advisory locks with idem's tag\) +1 \(oldest began`).MatchString(out) ||
		!regexp.MustCompile(`duplicates waiting \(advisory lock waits with idem's tag\) +0\n`).MatchString(out) {
		t.Errorf("stats does not say that it counts the locks with idem's tag, or counts other locks:\n%s", out)
	}
	code, out = runCommand(t, url, "inspect", "tenant", "absent")
	if code != cli.ExitFailure || !strings.Contains(out, "no advisory lock with its id") {
		t.Errorf("inspect of a key with no record and no lock: exit %d, want %d and where it looked:\n%s", code, cli.ExitFailure, out)
	}
	for args, want := range map[string][]string{
		"stats -h":   {"advisory locks whose id carries idem's tag", "0x1de0", "an estimate"},
		"inspect -h": {"advisory lock with the key's id", "an estimate"},
	} {
		_, out := runCommand(t, "", strings.Fields(args)...)
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Errorf("idem %s does not say %q:\n%s", args, w, out)
			}
		}
	}
}

// TestOperatorCommandsSayWhereTheyAct checks that migrate, purge, stats
// and inspect print the database and host before anything else.
func TestOperatorCommandsSayWhereTheyAct(t *testing.T) {
	url := env.EmptyDatabase(t)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("database %q on %s:%d", cfg.Database, cfg.Host, cfg.Port)
	for _, args := range [][]string{{"migrate", "up"}, {"migrate", "status"}, {"stats"}, {"inspect", "s", "k"}, {"purge"}, {"migrate", "down"}} {
		_, out := runCommand(t, url, args...)
		first, _, _ := strings.Cut(out, "\n")
		if !strings.HasPrefix(first, "idem "+args[0]+": ") || !strings.Contains(first, want) {
			t.Errorf("idem %s: first line %q, want the target, %s", strings.Join(args, " "), first, want)
		}
	}
	// Also when the database cannot be reached: the operator sees where.
	_, out := runCommand(t, "postgres://postgres@127.0.0.1:1/elsewhere?sslmode=disable", "stats")
	if !strings.HasPrefix(out, `idem stats: database "elsewhere" on 127.0.0.1:1`) {
		t.Errorf("unreachable database: output %q does not start with the target", out)
	}
}

// TestHelpSaysWhatCommandsDo checks the -h texts the issue found silent.
func TestHelpSaysWhatCommandsDo(t *testing.T) {
	for args, want := range map[string][]string{
		"migrate -h": {"down    roll back the most recent migration: one version", "up ", "status "},
		"stats -h":   {"past expiry", "in progress", "oldest live record", "outbox", "only reads"},
		"purge -h":   {"past their expiry", "-batch", "2147483647"},
		"inspect -h": {"-show-response", "before or after SCOPE and KEY"},
	} {
		code, out := runCommand(t, "", strings.Fields(args)...)
		if code != cli.ExitOK {
			t.Errorf("idem %s: exit %d", args, code)
		}
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Errorf("idem %s does not say %q:\n%s", args, w, out)
			}
		}
	}
}

// TestAuthenticationFailureIsReportedOnceAsSuch checks that a refused login
// says so, once, rather than "cannot reach the database" with the driver's
// error repeated for each attempt.
func TestAuthenticationFailureIsReportedOnceAsSuch(t *testing.T) {
	u, err := neturl.Parse(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.User = neturl.UserPassword("no_such_role_for_idem", "wrong")
	u.RawQuery = "" // sslmode=prefer: the driver tries twice
	code, out := runCommand(t, u.String(), "stats")
	if code != cli.ExitDatabase {
		t.Errorf("exit %d, want %d", code, cli.ExitDatabase)
	}
	if !strings.Contains(out, "refused the credentials") || strings.Contains(out, "cannot reach") {
		t.Errorf("a refused login is not reported as such:\n%s", out)
	}
	if n := strings.Count(out, "no_such_role_for_idem\" does not exist"); n > 1 {
		t.Errorf("the server's answer appears %d times:\n%s", n, out)
	}
	if n := strings.Count(out, "SQLSTATE"); n != 1 {
		t.Errorf("%d SQLSTATEs in the output, want 1:\n%s", n, out)
	}
}

// waitFor polls cond until it holds, or fails the test after ten seconds.
// mustRunner returns mustRun, which runs the command line args against the
// database at url, fails the test unless it succeeds and prints want, and
// returns what it printed.
func mustRunner(t *testing.T, url string) func(want string, args ...string) string {
	return func(want string, args ...string) string {
		t.Helper()
		code, out := runCommand(t, url, args...)
		if code != cli.ExitOK || !strings.Contains(out, want) {
			t.Fatalf("idem %s: exit %d, want 0 and %q in:\n%s", strings.Join(args, " "), code, want, out)
		}
		return out
	}
}

// checkRunning runs fn on the key (tenant, running) in a transaction it
// leaves open, and a duplicate that waits for it; it checks that stats
// counts the operation and its waiting duplicate, and that inspect of the
// key says inspecting; then it commits, and checks that the duplicate
// returned.
func checkRunning(t *testing.T, ctx context.Context, pool *pgxpool.Pool, url string, fn func(context.Context, pgx.Tx) (map[string]string, error), inspecting string) {
	t.Helper()
	mustRun := mustRunner(t, url)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := idem.Do(ctx, tx, "tenant", "running", nil, fn); err != nil {
		t.Fatal(err)
	}
	waiter := make(chan error, 1)
	go func() {
		_, err := idem.Run(ctx, pool, "tenant", "running", nil, fn, idem.WithWait(time.Minute))
		waiter <- err
	}()
	waitFor(t, func() bool {
		_, out := runCommand(t, url, "stats")
		return regexp.MustCompile(`duplicates waiting \(advisory lock waits with idem's tag\) +1\n`).MatchString(out)
	})
	if out := mustRun("operations running now", "stats"); !regexp.MustCompile(`operations running now \(advisory locks with idem's tag\) +1 \(oldest began`).MatchString(out) {
		t.Errorf("stats while one operation runs:\n%s", out)
	}
	mustRun(inspecting, "inspect", "tenant", "running")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-waiter; err != nil {
		t.Fatalf("the waiting duplicate: %v", err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
