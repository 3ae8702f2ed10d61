// Command idem is idem's operator command: it runs idem's migrations and
// maintenance, and shows what its tables hold.
//
// Usage:
//
//	idem <command> [flags]
//
// The server comes from DATABASE_URL, or else from the standard PG*
// variables (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, ...). The
// commands (migrate, purge, stats, inspect, flow-end) act on that database
// and print it before acting; schema prints idem's tables as SQL and
// connects to nothing. Run "idem <command> -h" for what a command does and
// its flags. The demo, the soaks and the benchmarks are not part of it: they
// live in the repository's lab (go run ./lab, from a checkout).
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

// Exit codes that scripts can rely on.
const (
	exitOK       = 0
	exitFailure  = 1 // the command ran and failed, or found a violation
	exitUsage    = 2 // bad command line
	exitDatabase = 3 // the database could not be reached or is not migrated
)

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout io.Writer) error
}

func commands() []command {
	return []command{
		{"migrate", "apply, roll back or list the embedded migrations: migrate up|down|status", runMigrate},
		{"purge", "delete expired records in batches", runPurge},
		{"stats", "show the operations running now, records by state, the table's size, the outbox backlog and the flows", runStats},
		{"inspect", "show one record, or with -flow one flow: inspect [-flow] SCOPE KEY", runInspect},
		{"flow-end", "end a flow that runs or needs attention: flow-end SCOPE KEY REASON", runFlowEnd},
		{"schema", "print idem's tables as SQL, for sqlc and other tools that read a schema", runSchema},
	}
}

func main() {
	// Output piped into a reader that quits (idem stats | head) must not kill
	// the command in the middle of a migration or a purge: writes fail
	// instead.
	signal.Ignore(syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmds := commands()
	if len(args) == 0 || args[0] == "-h" || args[0] == "-help" || args[0] == "--help" || args[0] == "help" {
		usage(stderr, cmds)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	}
	i := slices.IndexFunc(cmds, func(c command) bool { return c.name == args[0] })
	if i < 0 {
		fmt.Fprintf(stderr, "idem: unknown command %q\n\n", args[0])
		usage(stderr, cmds)
		return exitUsage
	}
	err := cmds[i].run(ctx, args[1:], stdout)
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.As(err, new(usageError)):
		fmt.Fprintf(stderr, "idem %s: %v\n", args[0], err)
		return exitUsage
	case errors.As(err, new(databaseError)):
		fmt.Fprintf(stderr, "idem %s: %v\n", args[0], err)
		return exitDatabase
	default:
		fmt.Fprintf(stderr, "idem %s: %v\n", args[0], err)
		return exitFailure
	}
}

func usage(w io.Writer, cmds []command) {
	fmt.Fprintln(w, "Usage: idem <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, c := range cmds {
		fmt.Fprintf(w, "  %-9s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "The server comes from DATABASE_URL, or else the standard PG* variables.")
	fmt.Fprintln(w, "migrate, purge, stats, inspect and flow-end act on that database, and print")
	fmt.Fprintln(w, "it first.")
}

// usageError is a bad command line: exit code 2.
type usageError struct{ error }

// databaseError is a database that cannot be reached or used: exit code 3.
type databaseError struct{ error }

// newFlagSet returns a flag set that reports errors instead of exiting,
// and prints its help, asked for with -h, on out.
func newFlagSet(out io.Writer, name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("idem "+name, flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: idem %s\n", synopsis)
		has := false
		fs.VisitAll(func(*flag.Flag) { has = true })
		if has {
			fmt.Fprintf(fs.Output(), "\nFlags:\n")
			fs.PrintDefaults()
		}
	}
	return fs
}

// parseInterspersed parses flags wherever they appear among the operands,
// which it returns in order; "--" ends the flags.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var operands []string
	for {
		if err := parseFlags(fs, args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return operands, nil
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			return append(operands, rest...), nil
		}
		operands = append(operands, rest[0])
		args = rest[1:]
	}
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
