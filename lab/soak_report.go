package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// What a soak found: the final check of the table against the answers,
// and the report it prints.

// soakFaults counts the faults that actually hit, by kind.
type soakFaults struct {
	// Terminated counts backends killed with pg_terminate_backend while
	// they were in a transaction.
	Terminated int64
	// TimedOut counts attempts that the client abandoned when their short
	// deadline passed.
	TimedOut int64
	// CutBeforeCommit counts connections cut instead of passing a COMMIT
	// to the server.
	CutBeforeCommit int64
	// CutAfterCommit counts connections cut instead of passing the reply
	// to a COMMIT back to the client.
	CutAfterCommit int64
	// CutRandom counts connections cut at a random moment.
	CutRandom int64
	// TerminatedInWrite counts backends terminated inside a business
	// write's transaction (TerminateEveryWrites).
	TerminatedInWrite int64
	// CutInWrite counts connections cut inside a business write's
	// transaction (CutEveryWrites).
	CutInWrite int64
	// Restarts counts runs of the restart command.
	Restarts int64
}

// soakReport is what a soak run did and found.
type soakReport struct {
	// Operations is the number of logical payments started.
	Operations int
	// Answered is the number of payments that got an answer.
	Answered int
	// Attempts is the number of calls to idem.Run, all payments together.
	Attempts int64
	// Executed and Replayed split the answers: the payment ran in the
	// attempt that answered, or an earlier attempt had committed it.
	Executed, Replayed int64
	// Writes is the number of times the business write ran, committed or
	// rolled back by a fault.
	Writes int64
	// Failures counts failed attempts by kind.
	Failures map[string]int64
	// Faults counts the faults injected.
	Faults soakFaults
	// Connections is the number of connections opened through the proxy:
	// the clients' own, each fault costing one, and the driver's cancel
	// requests.
	Connections int64
	// Rows is the number of payments in the table for this run.
	Rows int64
	// Lost counts answered payments with no row; Doubled counts payments
	// with more than one.
	Lost, Doubled int
	// WrongAnswers counts answers that differ from the payment's row or
	// from its stored response.
	WrongAnswers int
	// Stranded counts claims left in progress.
	Stranded int
	// Elapsed is the time from the first payment to the last answer.
	Elapsed time.Duration
	// LongestLate is how long after its deadline the latest attempt
	// returned.
	LongestLate time.Duration
}

// check compares the table and the stored responses with the answers the
// clients got, and fills in the report's verdict.
func (r *soakRun) check(ctx context.Context, admin *pgxpool.Pool, answers []soakPayment, errs []error, rep *soakReport) error {
	paymentsByKey, rows, err := readPayments(ctx, admin, r.scope)
	if err != nil {
		return err
	}
	rep.Rows = rows
	storedByKey, stranded, err := readStored(ctx, admin, r.scope)
	if err != nil {
		return err
	}
	rep.Stranded = stranded
	rep.Doubled = countDoubled(paymentsByKey)
	for i, answer := range answers {
		if errs[i] != nil {
			continue
		}
		rep.Answered++
		key := soakKey(i)
		payments := paymentsByKey[key]
		if len(payments) == 0 {
			rep.Lost++
			continue
		}
		want := soakPayment{ID: payments[0].ID, Key: key, AmountCents: soakAmount(i)}
		if answer != want || payments[0] != want || storedByKey[key] != want {
			rep.WrongAnswers++
		}
	}
	return nil
}

// readPayments reads a run's payment rows by key, and counts them.
func readPayments(ctx context.Context, admin *pgxpool.Pool, scope string) (map[string][]soakPayment, int64, error) {
	rows, err := admin.Query(ctx, `SELECT key, id, amount_cents FROM idem_soak_payment WHERE scope = $1`, scope)
	if err != nil {
		return nil, 0, fmt.Errorf("read payments: %w", err)
	}
	defer rows.Close()
	byKey := make(map[string][]soakPayment)
	var n int64
	for rows.Next() {
		var p soakPayment
		if err := rows.Scan(&p.Key, &p.ID, &p.AmountCents); err != nil {
			return nil, 0, fmt.Errorf("read payments: %w", err)
		}
		byKey[p.Key] = append(byKey[p.Key], p)
		n++
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read payments: %w", err)
	}
	return byKey, n, nil
}

// readStored reads the responses stored for a run's keys, and counts the
// claims left in progress.
func readStored(ctx context.Context, admin *pgxpool.Pool, scope string) (map[string]soakPayment, int, error) {
	rows, err := admin.Query(ctx, `SELECT key, state, response FROM idempotency_key WHERE scope = $1`, scope)
	if err != nil {
		return nil, 0, fmt.Errorf("read stored responses: %w", err)
	}
	defer rows.Close()
	byKey := make(map[string]soakPayment)
	stranded := 0
	for rows.Next() {
		var key, state string
		var response []byte
		if err := rows.Scan(&key, &state, &response); err != nil {
			return nil, 0, fmt.Errorf("read stored responses: %w", err)
		}
		if state != "done" {
			stranded++
			continue
		}
		var stored soakPayment
		if err := json.Unmarshal(response, &stored); err != nil {
			return nil, 0, fmt.Errorf("decode stored response of %s: %w", key, err)
		}
		byKey[key] = stored
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read stored responses: %w", err)
	}
	return byKey, stranded, nil
}

// countDoubled counts the keys with more than one payment row.
func countDoubled(paymentsByKey map[string][]soakPayment) int {
	n := 0
	for _, payments := range paymentsByKey {
		if len(payments) > 1 {
			n++
		}
	}
	return n
}

func (r *soakRun) print(w io.Writer, rep *soakReport) {
	perOp := func(n int64) float64 { return float64(n) / float64(max(rep.Operations, 1)) }
	fmt.Fprintf(w, "\nlogical operations:   %d started, %d answered, in %s (%.0f per second)\n",
		rep.Operations, rep.Answered, rep.Elapsed.Round(time.Millisecond), float64(rep.Answered)/rep.Elapsed.Seconds())
	fmt.Fprintf(w, "attempts:             %d (%.2f per operation)\n", rep.Attempts, perOp(rep.Attempts))
	fmt.Fprintf(w, "  answered, executed: %d\n", rep.Executed)
	fmt.Fprintf(w, "  answered, replayed: %d (an earlier attempt had committed)\n", rep.Replayed)
	printFailures(w, rep.Failures, r.samples, r.cfg.Verbose)
	fmt.Fprintf(w, "  longest past its deadline: %s\n", rep.LongestLate.Round(time.Millisecond))
	fmt.Fprintf(w, "business writes run:  %d (%d rolled back by faults)\n", rep.Writes, rep.Writes-rep.Rows)
	fmt.Fprintf(w, "connections opened:   %d (through the proxy, cancel requests included)\n", rep.Connections)
	f := rep.Faults
	fmt.Fprintf(w, "faults injected:      %d\n", f.Terminated+f.TimedOut+f.CutBeforeCommit+f.CutAfterCommit+f.CutRandom+f.TerminatedInWrite+f.CutInWrite+f.Restarts)
	fmt.Fprintf(w, "  backends terminated in a transaction:         %d\n", f.Terminated)
	fmt.Fprintf(w, "  calls abandoned by a client timeout:          %d\n", f.TimedOut)
	fmt.Fprintf(w, "  connections cut before COMMIT reached server: %d\n", f.CutBeforeCommit)
	fmt.Fprintf(w, "  connections cut after COMMIT, before reply:   %d\n", f.CutAfterCommit)
	fmt.Fprintf(w, "  connections cut at a random moment:           %d\n", f.CutRandom)
	fmt.Fprintf(w, "  backends terminated inside a write:           %d\n", f.TerminatedInWrite)
	fmt.Fprintf(w, "  connections cut inside a write:               %d\n", f.CutInWrite)
	fmt.Fprintf(w, "  PostgreSQL restarts:                          %d\n", f.Restarts)
	fmt.Fprintf(w, "payments in the table: %d for %d logical operations (lost %d, doubled %d)\n",
		rep.Rows, rep.Operations, rep.Lost, rep.Doubled)
	fmt.Fprintf(w, "answers != stored:     %d (checked against the payment row and the stored response)\n", rep.WrongAnswers)
	fmt.Fprintf(w, "claims in progress:    %d\n", rep.Stranded)
}

// printFailures prints the failed attempts, by kind, most frequent first,
// with an example of each when verbose.
func printFailures(w io.Writer, failures map[string]int64, samples map[string]string, verbose bool) {
	var failed int64
	for _, n := range failures {
		failed += n
	}
	fmt.Fprintf(w, "  failed, retried:    %d\n", failed)
	kinds := make([]string, 0, len(failures))
	for kind := range failures {
		kinds = append(kinds, kind)
	}
	slices.SortFunc(kinds, func(a, b string) int {
		return cmp.Or(cmp.Compare(failures[b], failures[a]), strings.Compare(a, b))
	})
	for _, kind := range kinds {
		fmt.Fprintf(w, "    %-50s %d\n", kind+":", failures[kind])
		if verbose {
			fmt.Fprintf(w, "      e.g. %s\n", samples[kind])
		}
	}
}

// countErrors returns how many errs are set, and the first.
func countErrors(errs []error) (int, error) {
	var n int
	var first error
	for _, err := range errs {
		if err != nil {
			if first == nil {
				first = err
			}
			n++
		}
	}
	return n, first
}
