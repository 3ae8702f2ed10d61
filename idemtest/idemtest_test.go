package idemtest_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemtest"
	"github.com/pgidem/idem/internal/pgtemp"
)

// noMain, set in a child's environment, runs the tests without Main.
const noMain = "IDEMTEST_TEST_NO_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(noMain) != "" {
		os.Exit(m.Run())
	}
	os.Exit(idemtest.Main(m))
}

// child returns the command that runs this test binary again with run,
// without the connection variables of this one, and with extra set.
// IDEM_PG_BIN, which picks the installation of a matrix run, stays unless
// extra sets TEST_DATABASE_URL, with which it may not be set.
func child(run string, extra ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run", run, "-test.v")
	dropBinDir := slices.ContainsFunc(extra, func(kv string) bool { return strings.HasPrefix(kv, "TEST_DATABASE_URL=") })
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if name != "TEST_DATABASE_URL" && name != noMain && !strings.HasPrefix(name, "PG") &&
			(name != pgtemp.BinDirEnv || !dropBinDir) {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, extra...)
	return cmd
}

func TestPoolGivesEachTestAMigratedDatabaseOfItsOwn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, b := idemtest.Pool(t), idemtest.Pool(t)
	if a.Config().ConnConfig.Database == b.Config().ConnConfig.Database {
		t.Fatalf("two calls gave the same database %q", a.Config().ConnConfig.Database)
	}
	fn := func(context.Context, pgx.Tx) (string, error) { return "charged", nil }
	if _, err := idem.Run(ctx, a, "tenant", "key", nil, fn); err != nil {
		t.Fatalf("idem.Run on Pool's database: %v", err)
	}
	// b is another database: the key is new there.
	res, err := idem.Run(ctx, b, "tenant", "key", nil, fn)
	if err != nil || res.Replayed {
		t.Fatalf("the same key in the other database: %+v, %v; want a first run", res, err)
	}
	replay, err := idem.Run(ctx, a, "tenant", "key", nil, fn)
	if err != nil || !replay.Replayed {
		t.Fatalf("the key again in the first database: %+v, %v; want a replay", replay, err)
	}
}

func TestPoolDropsItsDatabaseWhenTheTestEnds(t *testing.T) {
	t.Parallel()
	var name string
	t.Run("user", func(t *testing.T) {
		name = idemtest.Pool(t).Config().ConnConfig.Database
	})
	var n int
	err := idemtest.Pool(t).QueryRow(context.Background(), `SELECT count(*) FROM pg_database WHERE datname = $1`, name).Scan(&n)
	if err != nil || n != 0 {
		t.Fatalf("database %s after its test ended: %d found, %v; want it dropped", name, n, err)
	}
}

func TestMainFailsLoudlyWhenTheConfiguredServerCannotBeUsed(t *testing.T) {
	t.Parallel()
	out, err := child("^$", "TEST_DATABASE_URL=postgres://postgres@127.0.0.1:1/none?sslmode=disable").CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("exit %v without a usable server, want 1:\n%s", err, out)
	}
	for _, want := range []string{"idemtest: TEST_DATABASE_URL is set, but 127.0.0.1:1 cannot be used", "unset it", "go test -short"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("the failure does not say %q:\n%s", want, out)
		}
	}
}

func TestPoolWithoutMainFailsAndSaysHow(t *testing.T) {
	if os.Getenv(noMain) != "" {
		idemtest.Pool(t)
		return
	}
	t.Parallel()
	out, err := child("^TestPoolWithoutMainFailsAndSaysHow$", noMain+"=1").CombinedOutput()
	if err == nil || !bytes.Contains(out, []byte("Pool needs idemtest.Main")) || bytes.Contains(out, []byte("--- SKIP")) {
		t.Fatalf("Pool without Main: %v; want the test to fail and say what to add:\n%s", err, out)
	}
}
