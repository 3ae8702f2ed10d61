package main

import (
	"context"
	"net"
	neturl "net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/cmd/idem/cli"
)

// userTables lists the tables outside PostgreSQL's own schemas.
func userTables(t *testing.T, url string) []string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT schemaname || '.' || tablename FROM pg_tables
		WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return tables
}

func databaseExists(t *testing.T, url, name string) bool {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	return exists
}

var createdDatabase = regexp.MustCompile(`created database "(idem_\w+)"`)

// TestDemoBenchSoakWriteOnlyToADatabaseOfTheirOwn points each command at a
// database with nothing in it, as a user points them at theirs, and checks
// that they ran in a database they created and dropped, leaving the given
// one as it was.
func TestDemoBenchSoakWriteOnlyToADatabaseOfTheirOwn(t *testing.T) {
	url := env.EmptyDatabase(t)
	for _, args := range [][]string{
		{"demo", "-payments", "40", "-clients", "4"},
		{"bench", "-clients", "2", "-rounds", "1", "-ops", "5", "-storm-keys", "2", "-delay", "1ms"},
		// Faults paced by the writes, not by the clock: a busy machine,
		// slow to connect, still gets through.
		{"soak", "-payments", "30", "-clients", "2", "-cut-every", "0", "-terminate-every", "0", "-cut-every-writes", "3", "-terminate-every-writes", "4"},
	} {
		code, out := runCommand(t, url, args...)
		if code != cli.ExitOK {
			t.Fatalf("idem %s: exit %d\n%s", strings.Join(args, " "), code, out)
		}
		m := createdDatabase.FindStringSubmatch(out)
		if m == nil || !strings.Contains(out, `removed database "`+m[1]+`"`) {
			t.Fatalf("idem %s did not say it created and removed a database of its own:\n%s", args[0], out)
		}
		if databaseExists(t, url, m[1]) {
			t.Errorf("idem %s left its database %s behind", args[0], m[1])
		}
		if tables := userTables(t, url); len(tables) != 0 {
			t.Fatalf("idem %s wrote into the database it was given: %v", args[0], tables)
		}
	}
}

// TestDemoKeepsToASchemaOfItsOwnWhereItMayNotCreateDatabases runs the demo
// as a role without CREATEDB: it must make a schema of its own in the given
// database, and remove it.
func TestDemoKeepsToASchemaOfItsOwnWhereItMayNotCreateDatabases(t *testing.T) {
	url := env.EmptyDatabase(t)
	ctx := context.Background()
	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close) // after the role is dropped
	role := "idem_test_role_" + randomHex(4)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range []string{
		"CREATE ROLE " + role + " LOGIN NOCREATEDB PASSWORD 'pw'",
		"GRANT CREATE ON DATABASE " + pgx.Identifier{cfg.Database}.Sanitize() + " TO " + role,
	} {
		if _, err := admin.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, stmt := range []string{"DROP OWNED BY " + role, "DROP ROLE " + role} {
			if _, err := admin.Exec(context.Background(), stmt); err != nil {
				t.Error(err)
			}
		}
	})
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = neturl.UserPassword(role, "pw")
	asRole := u.String()

	code, out := runCommand(t, asRole, "demo", "-payments", "30", "-clients", "4")
	if code != cli.ExitOK {
		t.Fatalf("demo as a role without CREATEDB: exit %d\n%s", code, out)
	}
	m := regexp.MustCompile(`created schema "(idem_demo_\w+)"`).FindStringSubmatch(out)
	if m == nil || !strings.Contains(out, `removed schema "`+m[1]+`"`) {
		t.Fatalf("the demo did not say it made and removed a schema of its own:\n%s", out)
	}
	if tables := userTables(t, url); len(tables) != 0 {
		t.Fatalf("the demo left tables behind: %v", tables)
	}
	var schemas int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, m[1]).Scan(&schemas); err != nil || schemas != 0 {
		t.Fatalf("the demo's schema is still there (%d, %v)", schemas, err)
	}
}

// unsetConnectionVars leaves the command nothing to connect to.
func unsetConnectionVars(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	for _, v := range connVars {
		t.Setenv(v, "")
	}
}

// TestDemoWithNothingConfiguredStartsAThrowawayServer checks the demo's
// fallback: with no DATABASE_URL or PG* variable, a server of its own from
// the local installation (the one this machine's tests may run on), gone
// afterwards.
func TestDemoWithNothingConfiguredStartsAThrowawayServer(t *testing.T) {
	env.Pool(t) // not under -short
	unsetConnectionVars(t)
	var out strings.Builder
	code := run(context.Background(), []string{"demo", "-payments", "30", "-clients", "4"}, &out, &out)
	if code != cli.ExitOK {
		t.Fatalf("exit %d\n%s", code, out.String())
	}
	m := regexp.MustCompile(`removed the throwaway server and its directory (\S+)`).FindStringSubmatch(out.String())
	if !strings.Contains(out.String(), "throwaway PostgreSQL") || m == nil {
		t.Fatalf("the demo did not say it started and removed a throwaway server:\n%s", out.String())
	}
	if _, err := os.Stat(m[1]); !os.IsNotExist(err) {
		t.Fatalf("the throwaway server's directory %s is still there: %v", m[1], err)
	}
}

// TestEmbeddedServerFailsFastWithAClearMessage checks the last fallback on
// a network that answers nothing: embedded-postgres downloads with no
// deadline, so the command bounds it and says why it gave up.
func TestEmbeddedServerFailsFastWithAClearMessage(t *testing.T) {
	// A repository that accepts connections and never answers.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	oldRepo, oldTimeout := embeddedRepository, embeddedTimeout
	embeddedRepository, embeddedTimeout = "http://"+l.Addr().String(), 2*time.Second
	defer func() { embeddedRepository, embeddedTimeout = oldRepo, oldTimeout }()
	t.Setenv("HOME", t.TempDir()) // no cached download
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)

	started := time.Now()
	var out strings.Builder
	_, err = startEmbedded(context.Background(), &out, "demo")
	took := time.Since(started)
	if err == nil {
		t.Fatal("an embedded server started from a repository that never answers")
	}
	want := "within 2s"
	if os.Geteuid() == 0 {
		want = "root" // refused before any download
	}
	if !strings.Contains(err.Error(), want) || took > 10*time.Second {
		t.Fatalf("after %s: %v; want an error saying %q within seconds", took, err, want)
	}
	if left, _ := filepath.Glob(filepath.Join(tmp, "*")); len(left) > 0 {
		t.Fatalf("a failed embedded start left %v behind", left)
	}

	// A repository that cannot be reached at all: at once.
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	embeddedRepository = "http://" + closed.Addr().String()
	closed.Close()
	started = time.Now()
	_, err = startEmbedded(context.Background(), &out, "demo")
	took = time.Since(started)
	want = "cannot reach " + embeddedRepository
	if os.Geteuid() == 0 {
		want = "root"
	}
	if err == nil || !strings.Contains(err.Error(), want) || took > time.Second {
		t.Fatalf("after %s: %v; want an error saying %q at once", took, err, want)
	}
}
