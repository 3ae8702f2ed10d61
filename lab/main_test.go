package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"

	"github.com/pgidem/idem/cmd/idem/cli"
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

// TestLabCommandLine checks the lab's usage, its exit codes for a bad
// command line, and that each command's -h says what it does.
func TestLabCommandLine(t *testing.T) {
	code, out := runCommand(t, "")
	if code != cli.ExitUsage || !strings.Contains(out, "Usage: go run ./lab <command>") {
		t.Errorf("no command: exit %d, want %d and the usage\n%s", code, cli.ExitUsage, out)
	}
	for _, c := range commands() {
		if !strings.Contains(out, "\n  "+c.Name+" ") {
			t.Errorf("the usage does not list %s:\n%s", c.Name, out)
		}
	}
	if code, out := runCommand(t, "", "migrate"); code != cli.ExitUsage || !strings.Contains(out, `unknown command "migrate"`) {
		t.Errorf("the operator's command: exit %d, want %d\n%s", code, cli.ExitUsage, out)
	}
	if code, out := runCommand(t, "", "demo", "-payments", "0"); code != cli.ExitUsage {
		t.Errorf("demo -payments 0: exit %d, want %d\n%s", code, cli.ExitUsage, out)
	}
	for args, want := range map[string][]string{
		"demo -h":     {"Usage: go run ./lab demo", "database of its own", "dropped at the end"},
		"soak -h":     {"Usage: go run ./lab soak", "-failover"},
		"flowsoak -h": {"Usage: go run ./lab flowsoak", "-ops"},
		"bench -h":    {"Usage: go run ./lab bench", "-delay"},
	} {
		code, out := runCommand(t, "", strings.Fields(args)...)
		if code != cli.ExitOK {
			t.Errorf("%s: exit %d", args, code)
		}
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Errorf("%s does not say %q:\n%s", args, w, out)
			}
		}
	}
}

// run runs the command line args as main does, with the given output.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return program.Run(ctx, commands(), args, stdout, stderr)
}
