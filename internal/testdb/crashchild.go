package testdb

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A crash test runs its subject in a child process, the test binary run
// again, which kills itself (SIGKILL) at the point under test: nothing of
// it gets to clean up. What the child talked to (a provider, a server) is
// the parent's, so that what it saw outlives the child.

// crashJob is what RunCrashChild passes to the child, as JSON in an
// environment variable.
type crashJob[J any] struct {
	URL string // the database
	Job J
}

// CrashChild makes this test binary a crash child when the variable env is
// set, as RunCrashChild sets it: it runs child on a pool on the parent's
// database, with the parent's job, and exits. Call it from an init
// function, before TestMain would start a database of its own. The child
// is to kill itself (KillSelf); if child returns instead, the process
// exits with code 3 and says so.
func CrashChild[J any](env string, child func(ctx context.Context, pool *pgxpool.Pool, job J) error) {
	raw := os.Getenv(env)
	if raw == "" {
		return
	}
	var j crashJob[J]
	if err := json.Unmarshal([]byte(raw), &j); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, j.URL)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	err = child(ctx, pool, j.Job)
	pool.Close()
	fmt.Fprintf(os.Stderr, "the child returned without a crash: %v\n", err)
	os.Exit(3)
}

// KillSelf sends this process SIGKILL and waits for it.
func KillSelf() {
	self, _ := os.FindProcess(os.Getpid())
	_ = self.Kill()
	select {} // the signal is on its way
}

// RunCrashChild runs this test binary again as a crash child (see
// CrashChild) with job, on the database at url, and fails the test unless
// the child was killed by a signal.
func RunCrashChild[J any](t testing.TB, ctx context.Context, env, url string, job J) {
	t.Helper()
	raw, err := json.Marshal(crashJob[J]{URL: url, Job: job})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env+"="+string(raw))
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != -1 {
		t.Fatalf("the child was not killed: %v\n%s", err, out)
	}
}
