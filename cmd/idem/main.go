// Command idem runs idem's migrations and maintenance, and demonstrates it.
//
// Usage:
//
//	idem <command> [flags]
//
// The database comes from DATABASE_URL, or else from the standard PG*
// variables (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, ...). Run
// "idem <command> -h" for a command's flags.
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
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
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
		{"demo", "fire a retry storm of payments and show that none is lost or doubled", runDemo},
		{"soak", "inject faults under a payment load and check that nothing is lost or doubled", runSoak},
		{"bench", "compare idem.Run with a bare transaction and other designs, side by side", runBench},
		{"migrate", "apply, roll back or list the embedded migrations: migrate up|down|status", runMigrate},
		{"purge", "delete expired records in batches", runPurge},
		{"stats", "count records by state and show the table's size", runStats},
		{"inspect", "show one record: inspect SCOPE KEY", runInspect},
	}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
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
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "The database comes from DATABASE_URL, or else the standard PG* variables.")
}

// usageError is a bad command line: exit code 2.
type usageError struct{ error }

// databaseError is a database that cannot be reached or used: exit code 3.
type databaseError struct{ error }

// newFlagSet returns a flag set that reports errors instead of exiting.
func newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("idem "+name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: idem %s\n\n", synopsis)
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

// connect opens a pool on DATABASE_URL, or on the PG* variables when it is
// unset, and checks that the server answers.
func connect(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		return nil, databaseError{fmt.Errorf("parse DATABASE_URL: %w", err)}
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, databaseError{err}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		where := cfg.ConnConfig.Host
		if !strings.HasPrefix(where, "/") {
			where = fmt.Sprintf("%s:%d", where, cfg.ConnConfig.Port)
		}
		return nil, databaseError{fmt.Errorf("cannot reach the database at %s (set DATABASE_URL or PG* variables): %w", where, err)}
	}
	return pool, nil
}
