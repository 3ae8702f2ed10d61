// Package cli is the skeleton that idem's two command lines share, the
// operator's command (cmd/idem) and the repository's lab: a list of
// commands run by name, exit codes that scripts can rely on, flag sets
// that report errors instead of exiting, and a connection to the server
// that DATABASE_URL or the standard PG* variables name.
//
// It uses only the standard library and pgx, never the library's internal
// packages, so that the operator's command builds against any version of
// the library with the same public API. It is not meant for other
// programs.
package cli

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
	ExitOK       = 0
	ExitFailure  = 1 // the command ran and failed, or found a violation
	ExitUsage    = 2 // bad command line
	ExitDatabase = 3 // the database could not be reached or used
)

// A Command is one of a program's commands: idem migrate, go run ./lab demo.
type Command struct {
	Name    string
	Summary string // one line, in the program's usage
	Run     func(ctx context.Context, args []string, stdout io.Writer) error
}

// A Program is a command line that runs one of its commands by name.
type Program struct {
	Name       string // starts its messages and names its flag sets: "idem"
	Invocation string // how a user runs it, in its usage: "go run ./lab"
	Footer     string // the last lines of its usage
}

// Main runs the command that os.Args names and exits with its code. An
// interrupt or SIGTERM cancels the command's context; output piped into a
// reader that quits (idem stats | head) makes writes fail instead of
// killing the command in the middle of a migration or before it drops what
// it created.
func (p Program) Main(commands []Command) {
	signal.Ignore(syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := p.Run(ctx, commands, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Run runs the command that args name, with the rest of args, and returns
// the exit code: ExitUsage for a UsageError, ExitDatabase for a
// DatabaseError, ExitFailure for any other error. Errors and the usage go
// to stderr.
func (p Program) Run(ctx context.Context, commands []Command, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || slices.Contains([]string{"-h", "-help", "--help", "help"}, args[0]) {
		p.usage(stderr, commands)
		if len(args) == 0 {
			return ExitUsage
		}
		return ExitOK
	}
	i := slices.IndexFunc(commands, func(c Command) bool { return c.Name == args[0] })
	if i < 0 {
		fmt.Fprintf(stderr, "%s: unknown command %q\n\n", p.Name, args[0])
		p.usage(stderr, commands)
		return ExitUsage
	}
	err := commands[i].Run(ctx, args[1:], stdout)
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	fmt.Fprintf(stderr, "%s %s: %v\n", p.Name, args[0], err)
	switch {
	case errors.As(err, new(UsageError)):
		return ExitUsage
	case errors.As(err, new(DatabaseError)):
		return ExitDatabase
	default:
		return ExitFailure
	}
}

func (p Program) usage(w io.Writer, commands []Command) {
	fmt.Fprintf(w, "Usage: %s <command> [flags]\n\nCommands:\n", p.Invocation)
	for _, c := range commands {
		fmt.Fprintf(w, "  %-12s %s\n", c.Name, c.Summary)
	}
	fmt.Fprintf(w, "\n%s\n", p.Footer)
}

// NewFlagSet returns a flag set for the command name that reports errors
// instead of exiting, and prints its help, asked for with -h, on out:
// the synopsis (the command's name, its operands and what it does), then
// its flags.
func (p Program) NewFlagSet(out io.Writer, name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(p.Name+" "+name, flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s %s\n", p.Invocation, synopsis)
		has := false
		fs.VisitAll(func(*flag.Flag) { has = true })
		if has {
			fmt.Fprintf(fs.Output(), "\nFlags:\n")
			fs.PrintDefaults()
		}
	}
	return fs
}

// ParseFlags parses args into fs; a bad flag is a UsageError, and -h is
// flag.ErrHelp, which Run takes for success.
func ParseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return UsageError{Err: err}
	}
	return nil
}

// ParseInterspersed parses flags wherever they appear among the operands,
// which it returns in order; "--" ends the flags.
func ParseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var operands []string
	for {
		if err := ParseFlags(fs, args); err != nil {
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

// UsageError is a bad command line: exit code 2.
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// DatabaseError is a database that cannot be reached or used: exit code 3.
type DatabaseError struct{ Err error }

func (e DatabaseError) Error() string { return e.Err.Error() }
func (e DatabaseError) Unwrap() error { return e.Err }
