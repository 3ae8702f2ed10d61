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

	"github.com/pgidem/idem"
)

// What a flow soak found: the final check of the provider's records, the
// business tables and the stored answers against the answers the clients
// got, and the report it prints.

// flowSoakReport is what a flow soak did and found.
type flowSoakReport struct {
	// Ops is the number of logical operations.
	Ops int
	// AnsweredIn is the time until every client was answered or gave up;
	// SettledIn, until no flow ran any more after that; Elapsed, until
	// the clients that gave up came back and were answered.
	AnsweredIn, SettledIn, Elapsed time.Duration
	// Attempts is the number of requests the clients sent; Executed and
	// Replayed split those answered: the flow ran in the request, or an
	// earlier run had completed it.
	Attempts, Executed, Replayed int64
	// Failures counts failed attempts by kind.
	Failures map[string]int64
	// Twins counts the operations sent by two clients at once. Abandoned
	// counts those whose client gave up after a failure; CompletedAway,
	// those of them that a resumer completed before the client came back.
	Twins, Abandoned, CompletedAway int

	// Kills counts the workers killed, by point; Restarts, the workers
	// started again.
	Kills    map[string]int64
	Restarts int64

	// ProviderCalls counts the calls the provider got; Recalled, the
	// operations whose key it was called with more than once.
	ProviderCalls int64
	Recalled      int
	// The provider's faults, and the calls that reused a key with another
	// amount (Conflicts).
	FailedBefore, TimedOutAfter, CutAfter int64
	Conflicts                             int

	// Effects is the number of charges the provider applied; Declined, how
	// many of them it declined. MissingEffects counts operations the
	// provider never applied; UnknownKeys, charges under a key that is no
	// operation's provider key.
	Effects, Declined, MissingEffects, UnknownKeys int
	// Payments and Ledger are the business rows of the run; MissingRows
	// and DoubledRows count the operations with no row, or more than one,
	// in either table.
	Payments, Ledger         int
	MissingRows, DoubledRows int
	// Answers counts the answers the clients got; WrongAnswers, those that
	// differ from the stored answer, plus the operations whose stored
	// answer, rows and provider charge disagree.
	Answers, WrongAnswers int
	// Unanswered counts the operations no client got an answer for, or
	// that got an error no retry can mend; NotDone, the flows left in
	// another state than done, by state ("missing" for no flow).
	Unanswered int
	NotDone    map[string]int
}

// report gathers what the clients, workers and provider counted.
func (l *flowSoakLoad) report(ops []*flowSoakOp, p *flowSoakProvider, ws *flowSoakWorkers) *flowSoakReport {
	rep := &flowSoakReport{Ops: len(ops), Attempts: l.attempts.Load(), Executed: l.executed.Load(), Replayed: l.replayed.Load(),
		Failures: l.failures, NotDone: make(map[string]int)}
	for _, op := range ops {
		switch {
		case op.twin:
			rep.Twins++
		case op.abandoned:
			rep.Abandoned++
			if op.completedAway {
				rep.CompletedAway++
			}
		}
	}
	rep.Kills, rep.Restarts = ws.counts()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.calls {
		rep.ProviderCalls += int64(n)
		if n > 1 {
			rep.Recalled++
		}
	}
	rep.FailedBefore, rep.TimedOutAfter, rep.CutAfter, rep.Conflicts = p.failedBefore, p.timedOutAfter, p.cutAfter, p.conflicts
	return rep
}

// flowSoakRow is a business row: a payment, or a ledger entry (whose ID is
// its payment's).
type flowSoakRow struct {
	ID       int64
	Status   string
	ChargeID string
}

// checkFlowSoak compares, operation by operation, the provider's charges,
// the business rows, the flows' stored answers and the answers the
// clients got, and fills in the report's verdict.
func checkFlowSoak(ctx context.Context, admin *pgxpool.Pool, scope string, ops []*flowSoakOp, p *flowSoakProvider, rep *flowSoakReport) error {
	payments, err := flowSoakRows(ctx, admin, `SELECT key, id, status, coalesce(charge_id, '') FROM idem_flowsoak_payment WHERE scope = $1`, scope)
	if err != nil {
		return fmt.Errorf("read payments: %w", err)
	}
	ledger, err := flowSoakRows(ctx, admin, `SELECT key, payment_id, status, charge_id FROM idem_flowsoak_ledger WHERE scope = $1`, scope)
	if err != nil {
		return fmt.Errorf("read the ledger: %w", err)
	}
	type flowRow struct {
		state     string
		output    []byte
		operation int64
	}
	flows := make(map[string]flowRow)
	rows, err := admin.Query(ctx, `SELECT key, state, output, operation FROM idem_flow WHERE scope = $1`, scope)
	if err != nil {
		return fmt.Errorf("read flows: %w", err)
	}
	for rows.Next() {
		var key string
		var f flowRow
		if err := rows.Scan(&key, &f.state, &f.output, &f.operation); err != nil {
			return fmt.Errorf("read flows: %w", err)
		}
		flows[key] = f
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read flows: %w", err)
	}
	charges, _ := p.snapshot()
	rep.Effects = len(charges)
	for _, c := range charges {
		if c.Status == "declined" {
			rep.Declined++
		}
	}

	ours := make(map[string]bool, len(ops))
	for _, op := range ops {
		// The call's provider key is the operation's (a flow never
		// started has none, and no charge).
		pk := idem.ProviderKey(scope, op.key, "charge", flows[op.key].operation)
		ours[pk] = true
		charge, charged := charges[pk]
		if !charged {
			rep.MissingEffects++
		}
		for _, rs := range []int{len(payments[op.key]), len(ledger[op.key])} {
			switch {
			case rs == 0:
				rep.MissingRows++
			case rs > 1:
				rep.DoubledRows++
			}
		}
		f, ok := flows[op.key]
		switch {
		case !ok:
			rep.NotDone["missing"]++
		case f.state != "done":
			rep.NotDone[f.state]++
		}
		var stored flowSoakAnswer
		if ok && f.output != nil {
			if err := json.Unmarshal(f.output, &stored); err != nil {
				return fmt.Errorf("decode the stored answer of %s: %w", op.key, err)
			}
		}
		// The stored answer is the provider's charge and the rows.
		consistent := charged && len(payments[op.key]) == 1 && len(ledger[op.key]) == 1 && charge.Amount == op.amount
		if consistent {
			payment, entry := payments[op.key][0], ledger[op.key][0]
			want := flowSoakAnswer{PaymentID: payment.ID, ChargeID: charge.ID, Status: charge.Status, Amount: op.amount}
			consistent = stored == want && payment == flowSoakRow{payment.ID, charge.Status, charge.ID} &&
				entry == flowSoakRow{payment.ID, charge.Status, charge.ID}
		}
		if !consistent {
			rep.WrongAnswers++
		}
		op.mu.Lock()
		for _, a := range op.answers {
			rep.Answers++
			if a != stored {
				rep.WrongAnswers++
			}
		}
		if len(op.answers) == 0 || op.err != nil {
			rep.Unanswered++
		}
		op.mu.Unlock()
	}
	for pk := range charges {
		if !ours[pk] {
			rep.UnknownKeys++
		}
	}
	for _, rs := range payments {
		rep.Payments += len(rs)
	}
	for _, rs := range ledger {
		rep.Ledger += len(rs)
	}
	return nil
}

// flowSoakRows reads business rows by key.
func flowSoakRows(ctx context.Context, admin *pgxpool.Pool, sql, scope string) (map[string][]flowSoakRow, error) {
	rows, err := admin.Query(ctx, sql, scope)
	if err != nil {
		return nil, err
	}
	byKey := make(map[string][]flowSoakRow)
	for rows.Next() {
		var key string
		var r flowSoakRow
		if err := rows.Scan(&key, &r.ID, &r.Status, &r.ChargeID); err != nil {
			return nil, err
		}
		byKey[key] = append(byKey[key], r)
	}
	return byKey, rows.Err()
}

// violations says what the soak found wrong, if anything.
func (rep *flowSoakReport) violations() []string {
	var v []string
	add := func(bad bool, format string, args ...any) {
		if bad {
			v = append(v, fmt.Sprintf(format, args...))
		}
	}
	add(rep.Unanswered > 0, "%d operations without an answer", rep.Unanswered)
	add(rep.Effects != rep.Ops || rep.MissingEffects > 0 || rep.UnknownKeys > 0,
		"%d provider effects for %d operations (%d never applied, %d under unknown keys)", rep.Effects, rep.Ops, rep.MissingEffects, rep.UnknownKeys)
	add(rep.Conflicts > 0, "%d provider calls reused a key with another amount", rep.Conflicts)
	add(rep.Payments != rep.Ops || rep.Ledger != rep.Ops || rep.MissingRows > 0 || rep.DoubledRows > 0,
		"%d payments and %d ledger rows for %d operations (%d missing, %d doubled)", rep.Payments, rep.Ledger, rep.Ops, rep.MissingRows, rep.DoubledRows)
	add(rep.WrongAnswers > 0, "%d answers differ from what was stored", rep.WrongAnswers)
	var notDone int
	for _, n := range rep.NotDone {
		notDone += n
	}
	add(notDone > 0, "%d flows not done: %v", notDone, rep.NotDone)
	return v
}

func (l *flowSoakLoad) print(w io.Writer, rep *flowSoakReport) {
	perOp := func(n int64) float64 { return float64(n) / float64(max(rep.Ops, 1)) }
	fmt.Fprintf(w, "\nlogical operations:   %d, answered in %s (%.0f per second); flows settled %s later\n",
		rep.Ops, rep.AnsweredIn.Round(time.Millisecond), float64(rep.Ops)/rep.AnsweredIn.Seconds(), rep.SettledIn.Round(time.Millisecond))
	fmt.Fprintf(w, "  sent by two clients at once: %d\n", rep.Twins)
	fmt.Fprintf(w, "  given up by their client after a failure: %d, of which %d completed by a resumer before the client came back\n",
		rep.Abandoned, rep.CompletedAway)
	fmt.Fprintf(w, "attempts:             %d (%.2f per operation)\n", rep.Attempts, perOp(rep.Attempts))
	fmt.Fprintf(w, "  answered, executed: %d\n", rep.Executed)
	fmt.Fprintf(w, "  answered, replayed: %d\n", rep.Replayed)
	var failed int64
	kinds := make([]string, 0, len(rep.Failures))
	for kind, n := range rep.Failures {
		failed += n
		kinds = append(kinds, kind)
	}
	fmt.Fprintf(w, "  failed, retried:    %d\n", failed)
	slices.SortFunc(kinds, func(a, b string) int {
		return cmp.Or(cmp.Compare(rep.Failures[b], rep.Failures[a]), strings.Compare(a, b))
	})
	for _, kind := range kinds {
		fmt.Fprintf(w, "    %-50s %d\n", kind+":", rep.Failures[kind])
		if l.cfg.Verbose {
			fmt.Fprintf(w, "      e.g. %s\n", l.samples[kind])
		}
	}
	var killed int64
	for _, n := range rep.Kills {
		killed += n
	}
	fmt.Fprintf(w, "workers killed:       %d (SIGKILL), %d restarted\n", killed, rep.Restarts)
	for _, k := range []struct{ point, what string }{
		{killAfterReserve, "after the reserve committed, before the call"},
		{killBeforeApply, "in the call, before the provider applied it"},
		{killAfterApply, "in the call, after the provider applied it"},
		{killInRecord, "in the record's transaction, before COMMIT"},
		{killBeforeAnswer, "after the record, before the answer was stored"},
		{killAnywhere, "at an arbitrary moment"},
	} {
		fmt.Fprintf(w, "  %-48s %d\n", k.what+":", rep.Kills[k.point])
	}
	fmt.Fprintf(w, "provider calls:       %d; %d operations' keys called more than once\n", rep.ProviderCalls, rep.Recalled)
	fmt.Fprintf(w, "  failed before applying (503):                %d\n", rep.FailedBefore)
	fmt.Fprintf(w, "  applied, then left to time out:              %d\n", rep.TimedOutAfter)
	fmt.Fprintf(w, "  applied, then the connection cut:            %d\n", rep.CutAfter)
	fmt.Fprintf(w, "  key reused with another amount:              %d\n", rep.Conflicts)
	fmt.Fprintf(w, "provider effects:     %d for %d operations (%d declined; never applied %d, under unknown keys %d)\n",
		rep.Effects, rep.Ops, rep.Declined, rep.MissingEffects, rep.UnknownKeys)
	fmt.Fprintf(w, "business rows:        %d payments, %d ledger entries for %d operations (missing %d, doubled %d)\n",
		rep.Payments, rep.Ledger, rep.Ops, rep.MissingRows, rep.DoubledRows)
	fmt.Fprintf(w, "answers != stored:    %d of %d answers (checked against the stored answer, the rows and the provider)\n",
		rep.WrongAnswers, rep.Answers)
	var notDone int
	for _, n := range rep.NotDone {
		notDone += n
	}
	fmt.Fprintf(w, "flows not done:       %d %v\n", notDone, rep.NotDone)
	fmt.Fprintf(w, "operations unanswered: %d\n", rep.Unanswered)
}
