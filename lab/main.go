// Command lab is idem's laboratory: the demo, the soaks and the benchmarks
// that back the README's claims, run from a checkout of the repository.
//
// Usage:
//
//	go run ./lab <command> [flags]
//
// The commands are demo, soak (and soak -failover sync|async), flowsoak and
// bench; "go run ./lab <command> -h" says what each does and its flags.
// The package benchmarks are in lab/bench (go test -bench ... ./lab/bench)
// and the tests against other libraries' clients in lab/interop.
//
// They never write into a database they did not create: with DATABASE_URL
// or the standard PG* variables set, they make a database of their own on
// that server (a schema of their own where they may not create databases)
// and drop it at the end; with neither, they start a throwaway server from
// the machine's PostgreSQL installation, or one fetched by
// embedded-postgres.
//
// The lab is a module of its own, which no application installs: it may
// use the library's internal packages, and moves in lockstep with the
// library in the same commit. The operator's command is cmd/idem.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"syscall"
)

// Exit codes, as the operator's command has them.
const (
	exitOK       = 0
	exitFailure  = 1 // the command ran and failed, or found a violation
	exitUsage    = 2 // bad command line
	exitDatabase = 3 // no database to run on
)

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout io.Writer) error
}

func commands() []command {
	return []command{
		{"demo", "fire a retry storm of payments and show that none is lost or doubled", runDemo},
		{"soak", "inject faults under a payment load and check that nothing is lost or doubled", runSoak},
		{"flowsoak", "kill the processes running flows that call a provider, and check every effect happened once", runFlowSoak},
		{"bench", "compare idem.Run with a bare transaction and other designs, side by side", runBench},
	}
}

func main() {
	// Output piped into a reader that quits (go run ./lab demo | head) must
	// not kill the command before it drops what it created: writes fail
	// instead.
	signal.Ignore(syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmds := commands()
	if len(args) == 0 || slices.Contains([]string{"-h", "-help", "--help", "help"}, args[0]) {
		usage(stderr, cmds)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	}
	i := slices.IndexFunc(cmds, func(c command) bool { return c.name == args[0] })
	if i < 0 {
		fmt.Fprintf(stderr, "lab: unknown command %q\n\n", args[0])
		usage(stderr, cmds)
		return exitUsage
	}
	err := cmds[i].run(ctx, args[1:], stdout)
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	fmt.Fprintf(stderr, "idem %s: %v\n", args[0], err)
	switch {
	case errors.As(err, new(usageError)):
		return exitUsage
	case errors.As(err, new(databaseError)):
		return exitDatabase
	default:
		return exitFailure
	}
}

func usage(w io.Writer, cmds []command) {
	fmt.Fprintln(w, "Usage: go run ./lab <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range cmds {
		fmt.Fprintf(w, "  %-9s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Each makes a database of its own on the server that DATABASE_URL or the PG*")
	fmt.Fprintln(w, "variables name, and drops it at the end (with nothing set, it starts a")
	fmt.Fprintln(w, "throwaway server). Benchmarks: go test -bench . ./lab/bench")
}

// usageError is a bad command line: exit code 2.
type usageError struct{ error }

// databaseError is a database that cannot be reached or used: exit code 3.
type databaseError struct{ error }

// newFlagSet returns a flag set that reports errors instead of exiting,
// and prints its help, asked for with -h, on out.
func newFlagSet(out io.Writer, name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("lab "+name, flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: go run ./lab %s\n\nFlags:\n", synopsis)
		fs.PrintDefaults()
	}
	return fs
}

func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err}
	}
	return nil
}
