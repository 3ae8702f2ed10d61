package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
)

func runFlows(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "flows", `flows [-state attention|running|ended] [-name FLOW] [-scope SCOPE] [-limit N] [-after CURSOR]

Lists flows, newest first: by default those stopped for a person's
decision (attention), with the step each stopped at and why; running ones
with their lease and runs; or those an operator ended. Keys are printed in
the clear. A full page ends with the command that prints the next one.
"idem inspect -flow SCOPE KEY" shows one flow; "idem flow-resolve" settles
the call a flow stopped at, "idem flow-end" ends it.`)
	state := fs.String("state", "attention", "attention, running or ended")
	name := fs.String("name", "", "only the flows of this name")
	scope := fs.String("scope", "", "only the flows of this scope")
	limit := fs.Int("limit", 50, "the most flows to print (1 to 1000)")
	after := fs.String("after", "", "the cursor a page before printed")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return cli.UsageError{Err: errors.New("takes no operands")}
	}
	if *limit == 0 {
		return cli.UsageError{Err: errors.New("-limit: want 1 to 1000")}
	}
	filter := idem.FlowFilter{State: *state, Name: *name, Scope: *scope, Limit: *limit, After: *after}
	pool, err := connectMigrated(ctx, stdout, "flows")
	if err != nil {
		return err
	}
	defer pool.Close()
	page, err := idem.ListFlows(ctx, pool, filter)
	if errors.Is(err, idem.ErrInvalidOption) || errors.Is(err, idem.ErrInvalidScope) {
		return cli.UsageError{Err: err} // refused before anything was sent
	}
	if err != nil {
		return fmt.Errorf("flows: %w", err)
	}
	if len(page.Flows) == 0 {
		fmt.Fprintf(stdout, "no flows %s\n", *state)
		return nil
	}
	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	switch *state {
	case "running":
		fmt.Fprintln(w, "STARTED\tSCOPE\tKEY\tFLOW\tSTEP\tRUNS\tLEASE\tLAST ERROR")
	case "ended":
		fmt.Fprintln(w, "STARTED\tSCOPE\tKEY\tFLOW\tSTEP\tENDED\tREASON")
	default:
		fmt.Fprintln(w, "STARTED\tSCOPE\tKEY\tFLOW\tSTOPPED AT\tRUNS\tWHY")
	}
	for _, f := range page.Flows {
		started := f.CreatedAt.Format(time.RFC3339)
		switch *state {
		case "running":
			lease := "held until " + f.LeasedUntil.Format(time.RFC3339)
			if !f.Leased {
				lease = "none (ran out " + f.LeasedUntil.Format(time.RFC3339) + ")"
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", started, f.Scope, f.Key, f.Name, orDash(f.Step), f.Runs, lease, oneLine(f.LastError))
		case "ended":
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", started, f.Scope, f.Key, f.Name, orDash(f.Step),
				f.CompletedAt.Format(time.RFC3339), oneLine(f.LastError))
		default:
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d\t%s\n", started, f.Scope, f.Key, f.Name, orDash(f.Step), f.Runs, oneLine(f.LastError))
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if page.Next != "" {
		next := []string{"idem flows", "-state", *state, "-limit", fmt.Sprint(*limit), "-after", page.Next}
		if *name != "" {
			next = append(next, "-name", shellQuote(*name))
		}
		if *scope != "" {
			next = append(next, "-scope", shellQuote(*scope))
		}
		fmt.Fprintf(stdout, "more: %s\n", strings.Join(next, " "))
	}
	return nil
}

// oneLine is s on one line, for a table's cell: "-" when empty.
func oneLine(s string) string {
	return orDash(strings.Join(strings.Fields(s), " "))
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func runFlowResolve(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "flow-resolve", `flow-resolve [-by NAME] -reason TEXT [-result JSON] SCOPE KEY STEP applied|not-applied

Settles the call STEP that the flow of SCOPE and KEY stopped at for a
person (idem flows lists them; idem inspect -flow shows one), with what you
found out at the other system:

  applied      it applied the call: -result is the call's result, as JSON,
               in the form the flow's code gets from the call (what the
               call's function returns, encoded); the flow goes on from the
               step after it
  not-applied  it did not: the call is made again, with the same provider
               key, as if for the first time (once, for an at-most-once
               call)

The flow runs again at its client's next retry, which gets its answer, or
at the flow's next Resume. Your name (-by, your login by default) and
-reason are recorded with the flow and shown by idem inspect -flow. A flow
whose records are sealed by a codec is resolved as applied from the
application (Flow.Resolve), which holds the codec. To end the flow instead,
use idem flow-end.`)
	by := fs.String("by", currentUser(), "who resolves it (recorded)")
	reason := fs.String("reason", "", "what you found out, and where: a ticket, the provider's reference (required)")
	result := fs.String("result", "", "applied: the call's result, as JSON")
	operands, err := cli.ParseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(operands) != 4 {
		return cli.UsageError{Err: errors.New("want SCOPE, KEY, STEP and applied or not-applied")}
	}
	r := idem.Resolution{Step: operands[2], By: *by, Reason: *reason}
	switch operands[3] {
	case "applied":
		r.Outcome = idem.Applied
		if *result == "" {
			return cli.UsageError{Err: errors.New("applied: -result is required (the call's result, as JSON)")}
		}
		if !json.Valid([]byte(*result)) {
			return cli.UsageError{Err: fmt.Errorf("-result %q is not JSON", *result)}
		}
		r.Result = json.RawMessage(*result)
	case "not-applied":
		r.Outcome = idem.NotApplied
		if *result != "" {
			return cli.UsageError{Err: errors.New("not-applied takes no -result")}
		}
	default:
		return cli.UsageError{Err: fmt.Errorf("%q: want applied or not-applied", operands[3])}
	}
	scope, key := operands[0], operands[1]
	pool, err := connectMigrated(ctx, stdout, "flow-resolve")
	if err != nil {
		return err
	}
	defer pool.Close()
	err = idem.ResolveFlow(ctx, pool, scope, key, r)
	switch {
	case errors.Is(err, idem.ErrInvalidOption) || errors.Is(err, idem.ErrInvalidScope) || errors.Is(err, idem.ErrInvalidKey):
		return cli.UsageError{Err: err} // refused before anything was sent
	case err != nil:
		return fmt.Errorf("flow-resolve: %w", err)
	}
	fmt.Fprintf(stdout, "resolved step %q of the flow of scope %q, key %q as %s: its next run (the client's retry, or Resume) continues it\n",
		r.Step, scope, key, operands[3])
	return nil
}

// currentUser is the login of the user running the command, for -by.
func currentUser() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return os.Getenv("USER")
}
