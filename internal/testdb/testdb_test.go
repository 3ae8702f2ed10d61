package testdb_test

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/pgtemp"
	"github.com/pgidem/idem/internal/testdb"
)

// The tests here run this test binary again as a child, with testdb.Main
// and the environment each case needs; the parent checks what it did.
const childVar = "IDEM_TESTDB_CHILD"

var env *testdb.Env

func TestMain(m *testing.M) {
	if os.Getenv(childVar) != "" {
		os.Exit(testdb.Main(m, &env))
	}
	os.Exit(m.Run())
}

// child returns the command that runs this binary's test run as a child,
// with the connection variables removed and extra set. IDEM_PG_BIN, which
// picks the installation of a matrix run, stays unless extra sets
// TEST_DATABASE_URL, with which it may not be set.
func child(t *testing.T, run string, extra ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run", run, "-test.v")
	dropBinDir := slices.ContainsFunc(extra, func(kv string) bool { return strings.HasPrefix(kv, "TEST_DATABASE_URL=") })
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if name != "TEST_DATABASE_URL" && name != "DATABASE_URL" && name != "CI" && !strings.HasPrefix(name, "PG") &&
			(name != pgtemp.BinDirEnv || !dropBinDir) {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, append([]string{childVar + "=" + run}, extra...)...)
	return cmd
}

func TestFailsLoudlyWhenTheConfiguredServerCannotBeUsed(t *testing.T) {
	t.Parallel()
	out, err := child(t, "^$", "TEST_DATABASE_URL=postgres://postgres@127.0.0.1:1/none?sslmode=disable", "CI=true").CombinedOutput()
	if code := exitCode(err); code == 0 {
		t.Fatalf("exit 0 without a database:\n%s", out)
	}
	for _, want := range []string{"TEST_DATABASE_URL is set, but 127.0.0.1:1 cannot be used", "unset it", "go test -short"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("the failure does not say %q:\n%s", want, out)
		}
	}
	if bytes.Contains(out, []byte("panic")) || bytes.Contains(out, []byte("PASS")) {
		t.Errorf("want one clear failure, got:\n%s", out)
	}
}

// TestRefusesAConfiguredServerAndAnInstallationTogether checks that
// TEST_DATABASE_URL and IDEM_PG_BIN set together fail the run, rather
// than run it on a server of another major version than the one asked for.
func TestRefusesAConfiguredServerAndAnInstallationTogether(t *testing.T) {
	t.Parallel()
	cmd := child(t, "^$", "TEST_DATABASE_URL=postgres://postgres@127.0.0.1:1/none?sslmode=disable", pgtemp.BinDirEnv+"=/nonexistent")
	out, err := cmd.CombinedOutput()
	if code := exitCode(err); code == 0 {
		t.Fatalf("exit 0 with both set:\n%s", out)
	}
	if want := "TEST_DATABASE_URL and IDEM_PG_BIN are both set"; !bytes.Contains(out, []byte(want)) {
		t.Errorf("the failure does not say %q:\n%s", want, out)
	}
}

func TestShortSkipsTheDatabaseTestsAndSaysSo(t *testing.T) {
	t.Parallel()
	cmd := child(t, "^$", "TEST_DATABASE_URL=postgres://postgres@127.0.0.1:1/none?sslmode=disable")
	cmd.Args = append(cmd.Args, "-test.short")
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("-short: the database tests and the examples are skipped")) {
		t.Fatalf("-short: %v\n%s", err, out)
	}
}

var serverLine = regexp.MustCompile(`testdb: the tests run on (a throwaway PostgreSQL .* in (\S+)|a postgres container.*)\n`)

// TestWithNothingConfiguredStartsAServerAndRemovesIt runs a child with no
// TEST_DATABASE_URL: it must start a server of its own (a container where
// Docker runs, else a throwaway one from the local installation) and leave
// nothing behind.
func TestWithNothingConfiguredStartsAServerAndRemovesIt(t *testing.T) {
	t.Parallel()
	out, err := child(t, "^$").CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	m := serverLine.FindSubmatch(out)
	if m == nil {
		t.Fatalf("the child did not say which server it started:\n%s", out)
	}
	if dir := string(m[2]); dir != "" {
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Fatalf("the throwaway server's directory %s is still there: %v", dir, err)
		}
	}
}

// TestInterruptRemovesTheServer interrupts a child while its tests run:
// the server it started must be stopped and its directory removed.
func TestInterruptRemovesTheServer(t *testing.T) {
	if os.Getenv(childVar) != "" {
		// The child: hold the run open until interrupted.
		env.Pool(t)
		os.Stdout.WriteString("child: ready\n")
		time.Sleep(time.Minute)
		t.Fatal("not interrupted")
	}
	t.Parallel()
	cmd := child(t, "^TestInterruptRemovesTheServer$")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan bool, 1)
	go func() {
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			if s.Text() == "child: ready" {
				ready <- true
			}
		}
		ready <- false
	}()
	select {
	case ok := <-ready:
		if !ok {
			err := cmd.Wait()
			t.Fatalf("the child ended (%v) before its test ran:\n%s", err, stderr.String())
		}
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		t.Fatal("the child did not start")
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		t.Fatal("the interrupted child did not exit")
	}
	if exitCode(err) == 0 {
		t.Errorf("an interrupted run exited 0")
	}
	m := serverLine.FindStringSubmatch(stderr.String())
	if !strings.Contains(stderr.String(), "removing the test databases and the server") {
		t.Errorf("the child did not say it cleaned up:\n%s", stderr.String())
	}
	if m == nil {
		t.Fatalf("the child did not say which server it started:\n%s", stderr.String())
	}
	if dir := m[2]; dir != "" {
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Fatalf("the throwaway server's directory %s is still there after the interrupt: %v", dir, err)
		}
		if pids := processesMentioning(dir); len(pids) > 0 {
			t.Fatalf("processes of the throwaway server are still running: %v", pids)
		}
	}
}

// processesMentioning lists the processes whose command line contains s.
func processesMentioning(s string) []string {
	entries, _ := os.ReadDir("/proc")
	var pids []string
	for _, e := range entries {
		cmdline, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err == nil && bytes.Contains(cmdline, []byte(s)) {
			pids = append(pids, e.Name())
		}
	}
	return pids
}

func exitCode(err error) int {
	if err == nil {
		return 0
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	return -1
}
