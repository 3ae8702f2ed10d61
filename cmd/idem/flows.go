package main

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
)

// inspectFlow prints the flow of (scope, key): its state, step, runs and
// last error, and each step's state, attempts and provider key; its input
// and answer only with show.
func inspectFlow(ctx context.Context, stdout io.Writer, db idem.TxBeginner, scope, key string, show bool) error {
	f, err := idem.InspectFlow(ctx, db, scope, key)
	if errors.Is(err, idem.ErrInvalidScope) || errors.Is(err, idem.ErrInvalidKey) {
		return cli.UsageError{Err: err}
	}
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	if !f.Found {
		return fmt.Errorf("no flow for scope %q, key %q", scope, key)
	}
	state := f.State
	switch {
	case f.Expired:
		state += " (expired: counts as absent)"
	case f.State == "running" && f.Leased:
		state += fmt.Sprintf(" (an executor holds it until %s)", f.LeasedUntil.Format(time.RFC3339Nano))
	case f.State == "running":
		state += " (no executor holds it: a retry or Flow.Resume continues it)"
	}
	stored := func(b []byte) string {
		switch {
		case b == nil:
			return "(none)"
		case show:
			return string(b)
		}
		return fmt.Sprintf("(%d bytes of JSON, redacted; -show-response prints it)", len(b))
	}
	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "scope\t%s\n", scope)
	fmt.Fprintf(w, "key\t%s\n", key)
	fmt.Fprintf(w, "flow\t%s\n", f.Name)
	fmt.Fprintf(w, "state\t%s\n", state)
	fmt.Fprintf(w, "step\t%s\n", orDash(f.Step))
	fmt.Fprintf(w, "runs\t%d\n", f.Runs)
	fmt.Fprintf(w, "last error\t%s\n", orDash(f.LastError))
	fmt.Fprintf(w, "fingerprint\t%s\n", hex.EncodeToString(f.Fingerprint))
	fmt.Fprintf(w, "created\t%s\n", f.CreatedAt.Format(time.RFC3339Nano))
	if !f.CompletedAt.IsZero() {
		fmt.Fprintf(w, "finished\t%s\n", f.CompletedAt.Format(time.RFC3339Nano))
		fmt.Fprintf(w, "expires\t%s\n", f.ExpiresAt.Format(time.RFC3339Nano))
	}
	fmt.Fprintf(w, "input\t%s\n", stored(f.Input))
	fmt.Fprintf(w, "answer\t%s\n", stored(f.Output))
	for i, s := range f.Steps {
		line := fmt.Sprintf("%s %s, %s", s.Kind, s.Name, s.State)
		if s.Kind == "call" {
			line += fmt.Sprintf(", provider key %s, ", s.ProviderKey)
			if s.Attempts == 0 {
				line += "no attempt may have reached the provider"
			} else {
				line += fmt.Sprintf("%d attempt(s) may have reached the provider, the first %s ago",
					s.Attempts, time.Since(s.FirstCalledAt).Round(time.Second))
			}
		}
		fmt.Fprintf(w, "step %d\t%s\n", i, line)
	}
	for _, r := range f.Resolutions {
		fmt.Fprintf(w, "resolved\t%s: step %s %s by %s: %s\n", r.At.Format(time.RFC3339), r.Step, r.Outcome, r.By, oneLine(r.Reason))
	}
	return w.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func runFlowEnd(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "flow-end", `flow-end SCOPE KEY REASON

Ends the flow of SCOPE and KEY, running or stopped for attention, once you
have settled it by hand (with the provider: refunded, or confirmed, the
call it could not make again safely). Nothing runs it again; an executor
still running it commits nothing more; until its retention has passed,
every retry of the key is answered that the operation was stopped
(ErrFlowStopped, HTTP 409 operation-stopped) with REASON. "idem inspect
-flow SCOPE KEY" shows a flow first.`)
	operands, err := cli.ParseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(operands) != 3 {
		return cli.UsageError{Err: errors.New("want SCOPE, KEY and REASON")}
	}
	pool, err := connectMigrated(ctx, stdout, "flow-end")
	if err != nil {
		return err
	}
	defer pool.Close()
	ended, err := idem.EndFlow(ctx, pool, operands[0], operands[1], operands[2])
	if errors.Is(err, idem.ErrInvalidScope) || errors.Is(err, idem.ErrInvalidKey) {
		return cli.UsageError{Err: err}
	}
	if err != nil {
		return fmt.Errorf("flow-end: %w", err)
	}
	if !ended {
		return fmt.Errorf("no flow running or stopped for scope %q, key %q: nothing ended", operands[0], operands[1])
	}
	fmt.Fprintf(stdout, "ended the flow of scope %q, key %q\n", operands[0], operands[1])
	return nil
}
