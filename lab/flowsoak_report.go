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
	// FailedStarts counts the worker starts that failed and were tried
	// again, LastStartFailure why the last one failed; OverlappingFreezes,
	// the freezes undone at once because another worker was frozen.
	FailedStarts       int64
	LastStartFailure   string
	OverlappingFreezes int64
	// Freezes counts the workers frozen and woken, by point; WokenEarly,
	// those woken before every flow they may have held was taken over or
	// ended (after OpTimeout); LongestFrozen, the longest freeze.
	Freezes       map[string]int64
	WokenEarly    int64
	LongestFrozen time.Duration

	// ProviderCalls counts the calls the provider got; Recalled, the
	// operations whose key it was called with more than once.
	ProviderCalls int64
	Recalled      int
	// The provider's faults, the calls that reused a key with another
	// amount (Conflicts), and those a keyless provider refused as begun
	// too long before (Expired).
	FailedBefore, TimedOutAfter, CutAfter int64
	Conflicts, Expired                    int
	// Lookups counts the lookups at the provider (idem.Reconcile), Found
	// those that found a charge. CallsAfterDone counts the calls that
	// arrived for an operation whose flow was already done: calls of a
	// fenced executor; AppliedAfterDone, those the provider applied as a
	// new charge.
	Lookups, Found                   int
	CallsAfterDone, AppliedAfterDone int
	// FrozenLate counts the calls after their flow was done whose process
	// was frozen while the call was under way (between the moment it
	// entered the call's function, after idem's last look at the lease,
	// and the call's arrival): the residue docs/flows.md names, a
	// process frozen after its last look at the call's context and before
	// its request was written, which sends once it wakes.
	// FrozenLateApplied counts those the provider applied as a new charge.
	FrozenLate, FrozenLateApplied int
	// DoubledFrozen counts the operations charged more than once whose
	// extra charges (ExtraFrozen) were all such calls.
	DoubledFrozen, ExtraFrozen int

	// Effects is the number of charges the provider applied; Declined, how
	// many of them it declined. MissingEffects counts operations whose
	// flow is done that the provider never applied; Doubled, operations
	// it charged more than once, with Extra charges beyond one each;
	// UnknownKeys, charges under a reference that is not their
	// operation's provider key.
	Effects, Declined, MissingEffects, UnknownKeys int
	Doubled, Extra                                 int
	// DoubledWoke counts the charges of operations charged more than once
	// that a worker sent after it froze and woke in the same run, by the
	// point of the freeze.
	DoubledWoke map[string]int
	// Stopped counts the flows stopped for a person's decision (an
	// AtMostOnce call whose outcome was unknown), StoppedCharged those of
	// them that the provider had charged (once: a person settles them
	// with the provider's records), StoppedUncharged those it had not.
	Stopped, StoppedCharged, StoppedUncharged int
	// StoppedNeverEntered counts the stopped flows none of whose call's
	// attempts entered the call's function: stopped for attempts that were
	// never made. Those whose executor was killed or frozen during an
	// attempt (StoppedNeverEnteredFaulted: between the intent's commit and
	// the call, which no one can tell from after it) are expected; the
	// others are not. StoppedNeverSent counts the stopped flows whose call
	// the provider never received.
	StoppedNeverEntered, StoppedNeverEnteredFaulted, StoppedNeverSent int
	// Provider, Reconcile and AtMostOnce are the run's mode.
	Provider              string
	Reconcile, AtMostOnce bool
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
	Unanswered      int
	FirstUnanswered string
	NotDone         map[string]int
}

// report gathers what the clients, workers and provider counted.
func (l *flowSoakLoad) report(ops []*flowSoakOp, p *flowSoakProvider, ws *flowSoakWorkers) *flowSoakReport {
	rep := &flowSoakReport{Ops: len(ops), Attempts: l.attempts.Load(), Executed: l.executed.Load(), Replayed: l.replayed.Load(),
		Failures: l.failures, NotDone: make(map[string]int),
		Provider: l.cfg.Provider, Reconcile: l.cfg.Reconcile, AtMostOnce: l.cfg.AtMostOnce}
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
	rep.Freezes, rep.WokenEarly, rep.LongestFrozen = ws.freezeCounts()
	rep.FailedStarts, rep.LastStartFailure, rep.OverlappingFreezes = ws.startCounts()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.calls {
		rep.ProviderCalls += int64(n)
		if n > 1 {
			rep.Recalled++
		}
	}
	rep.FailedBefore, rep.TimedOutAfter, rep.CutAfter, rep.Conflicts = p.failedBefore, p.timedOutAfter, p.cutAfter, p.conflicts
	rep.Expired = p.expired
	rep.Lookups, rep.Found = p.lookups, p.found
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
		completed *time.Time
	}
	flows := make(map[string]flowRow)
	rows, err := admin.Query(ctx, `SELECT key, state, output, completed_at FROM idem_flow WHERE scope = $1`, scope)
	if err != nil {
		return fmt.Errorf("read flows: %w", err)
	}
	for rows.Next() {
		var key string
		var f flowRow
		if err := rows.Scan(&key, &f.state, &f.output, &f.completed); err != nil {
			return fmt.Errorf("read flows: %w", err)
		}
		flows[key] = f
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read flows: %w", err)
	}
	charges := p.snapshot()
	// A call that arrived after its flow was done (the server's clock of
	// the transaction that completed it, which began after every call of
	// an executor that held the flow had returned) was made by a fenced
	// executor.
	p.mu.Lock()
	arrivals := slices.Clone(p.arrivals)
	p.mu.Unlock()
	frozenApplied := make(map[string]int) // by operation
	for _, a := range arrivals {
		if f, ok := flows[a.key]; ok && f.completed != nil && a.at.After(*f.completed) {
			rep.CallsAfterDone++
			if a.applied {
				rep.AppliedAfterDone++
			}
			if p.workers.frozenDuring(a.proc, a.started, a.at) {
				rep.FrozenLate++
				if a.applied {
					rep.FrozenLateApplied++
					frozenApplied[a.key]++
				}
			}
		}
	}
	// The charges by operation, as their metadata says, and under which
	// reference.
	byOp := make(map[string][]flowSoakCharged)
	refOf := make(map[string]string)
	for ref, cs := range charges {
		for _, c := range cs {
			rep.Effects++
			if c.Status == "declined" {
				rep.Declined++
			}
			byOp[c.Key] = append(byOp[c.Key], c)
			refOf[c.ID] = ref
		}
	}

	for _, op := range ops {
		// The call's provider key is the operation's (a flow never
		// started has none, and no charge).
		pk, err := flowSoakProviderKey(ctx, admin, scope, op.key)
		if err != nil {
			return err
		}
		opCharges := byOp[op.key]
		for _, c := range opCharges {
			if refOf[c.ID] != pk {
				rep.UnknownKeys++
			}
		}
		if n := len(opCharges); n > 1 {
			rep.Doubled++
			rep.Extra += n - 1
			if frozenApplied[op.key] >= n-1 {
				rep.DoubledFrozen++
				rep.ExtraFrozen += n - 1
			}
			for _, c := range opCharges {
				if c.Woke != "" {
					if rep.DoubledWoke == nil {
						rep.DoubledWoke = make(map[string]int)
					}
					rep.DoubledWoke[c.Woke]++
				}
			}
		}
		f, ok := flows[op.key]
		if ok && f.state == "attention" {
			// Stopped for a person: its reserve is made, its record not,
			// and the provider charged it once or not at all.
			rep.Stopped++
			p.mu.Lock()
			if p.calls[pk] == 0 {
				rep.StoppedNeverSent++
			}
			if p.entered[pk] == 0 {
				rep.StoppedNeverEntered++
				op.mu.Lock()
				if op.faulted {
					rep.StoppedNeverEnteredFaulted++
				}
				op.mu.Unlock()
			}
			p.mu.Unlock()
			if len(opCharges) == 0 {
				rep.StoppedUncharged++
			} else {
				rep.StoppedCharged++
			}
			if len(payments[op.key]) != 1 || len(ledger[op.key]) != 0 {
				rep.DoubledRows++
			}
			op.mu.Lock()
			rep.Answers += len(op.answers)
			rep.WrongAnswers += len(op.answers)
			if !op.stopped {
				rep.Unanswered++
			}
			op.mu.Unlock()
			continue
		}
		if len(opCharges) == 0 {
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
		// The stored answer is one of the provider's charges (the only
		// one, unless a keyless provider charged twice) and the rows.
		consistent := len(payments[op.key]) == 1 && len(ledger[op.key]) == 1
		if consistent {
			consistent = false
			payment, entry := payments[op.key][0], ledger[op.key][0]
			for _, charge := range opCharges {
				want := flowSoakAnswer{PaymentID: payment.ID, ChargeID: charge.ID, Status: charge.Status, Amount: op.amount}
				consistent = consistent || charge.Amount == op.amount && stored == want &&
					payment == flowSoakRow{payment.ID, charge.Status, charge.ID} && entry == flowSoakRow{payment.ID, charge.Status, charge.ID}
			}
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
			if rep.FirstUnanswered == "" {
				rep.FirstUnanswered = fmt.Sprintf("%s, %d answers, error %v", op.key, len(op.answers), op.err)
			}
		}
		op.mu.Unlock()
	}
	for key, cs := range byOp {
		if !strings.HasPrefix(key, "op-") {
			rep.UnknownKeys += len(cs)
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
	add(rep.Unanswered > 0, "%d operations without an answer (first: %s)", rep.Unanswered, rep.FirstUnanswered)
	add(rep.MissingEffects > 0 || rep.UnknownKeys > 0,
		"%d operations done that the provider never applied, %d charges under unknown keys", rep.MissingEffects, rep.UnknownKeys)
	add(rep.Doubled > rep.DoubledFrozen && !rep.doublesExpected(), "%d operations charged more than once (%d extra charges), %d of them by a call whose process was frozen while it was under way",
		rep.Doubled, rep.Extra, rep.DoubledFrozen)
	add(rep.Stopped > 0 && !rep.AtMostOnce, "%d flows stopped for a person, with no call marked AtMostOnce", rep.Stopped)
	add(rep.StoppedNeverEntered > rep.StoppedNeverEnteredFaulted, "%d flows stopped for a person whose call's function was never entered, though no worker died or froze during their attempts",
		rep.StoppedNeverEntered-rep.StoppedNeverEnteredFaulted)
	add(rep.CallsAfterDone > rep.FrozenLate, "%d provider calls arrived after their flow was done (%d applied), %d of them from a process frozen while the call was under way: a fenced executor called",
		rep.CallsAfterDone, rep.AppliedAfterDone, rep.FrozenLate)
	add(rep.WokenEarly > 0, "%d frozen workers woken before their flows were taken over, within %s", rep.WokenEarly, rep.LongestFrozen.Round(time.Millisecond))
	add(rep.Conflicts > 0, "%d provider calls reused a key with another amount", rep.Conflicts)
	add(rep.Payments != rep.Ops || rep.Ledger != rep.Ops-rep.Stopped || rep.MissingRows > 0 || rep.DoubledRows > 0,
		"%d payments and %d ledger rows for %d operations, %d stopped (%d missing, %d doubled)", rep.Payments, rep.Ledger, rep.Ops, rep.Stopped, rep.MissingRows, rep.DoubledRows)
	add(rep.WrongAnswers > 0, "%d answers differ from what was stored", rep.WrongAnswers)
	var notDone int
	for _, n := range rep.NotDone {
		notDone += n
	}
	add(notDone > 0, "%d flows not done: %v", notDone, rep.NotDone)
	return v
}

// doublesExpected reports whether the run's mode lets an operation be
// charged twice: a keyless provider, called again after an attempt of
// unknown outcome with neither a lookup nor AtMostOnce. Such a run counts
// its doubles; it does not fail for them.
func (rep *flowSoakReport) doublesExpected() bool {
	return rep.Provider == providerKeyless && !rep.Reconcile && !rep.AtMostOnce
}

// verdict is the last line of a run that found nothing wrong.
func (rep *flowSoakReport) verdict() string {
	switch {
	case rep.doublesExpected():
		return fmt.Sprintf("DOUBLES, as expected of a keyless provider with neither a lookup nor AtMostOnce: %d of %d operations charged more than once (%d extra charges); "+
			"everything else held (one payment and one ledger row each, every answer the stored one).", rep.Doubled, rep.Ops, rep.Extra)
	case rep.DoubledFrozen > 0:
		return fmt.Sprintf("RESIDUE: %d of %d operations charged twice, each by a call whose process was frozen while it was under way and sent it after another executor "+
			"had completed the flow (the residue docs/flows.md names); no other double; every answer matches what was stored.", rep.DoubledFrozen, rep.Ops)
	case rep.AtMostOnce:
		return fmt.Sprintf("OK: no operation charged twice; %d done with one charge each, %d stopped for a person (%d of them charged once, %d not charged); every answer matches what was stored.",
			rep.Ops-rep.Stopped, rep.Stopped, rep.StoppedCharged, rep.StoppedUncharged)
	}
	return "OK: provider effects == logical operations == business rows, every answer matches what was stored."
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
	fmt.Fprintf(w, "workers killed (SIGKILL) / frozen (SIGSTOP, woken by SIGCONT once their flows were taken over): %d / %d; %d restarted\n",
		killed, sum(rep.Freezes), rep.Restarts)
	for _, k := range []struct{ point, what string }{
		{killAfterReserve, "after the reserve, its commit deferred to the call's intent"},
		{killBeforeSend, "after the call's intent, before it was sent"},
		{killBeforeApply, "in the call, before the provider applied it"},
		{killAfterApply, "after the provider applied it, result not recorded"},
		{killInRecord, "in the record's transaction, before COMMIT"},
		{killAtCommit, "at the record's COMMIT, its answer not received"},
		{killBeforeAnswer, "after the record, before the answer was stored"},
		{killAnywhere, "at an arbitrary moment"},
	} {
		fmt.Fprintf(w, "  %-54s %4d / %d\n", k.what+":", rep.Kills[k.point], rep.Freezes[k.point])
	}
	fmt.Fprintf(w, "  longest freeze: %s; woken before their flows were taken over: %d; freezes undone because another worker was frozen: %d\n",
		rep.LongestFrozen.Round(time.Millisecond), rep.WokenEarly, rep.OverlappingFreezes)
	if rep.FailedStarts > 0 {
		fmt.Fprintf(w, "  worker starts that failed and were tried again: %d; the last: %s\n", rep.FailedStarts, rep.LastStartFailure)
	}
	fmt.Fprintf(w, "provider (%s) calls: %d; %d operations' keys called more than once; %d arrived after their flow was done (%d applied)\n",
		rep.Provider, rep.ProviderCalls, rep.Recalled, rep.CallsAfterDone, rep.AppliedAfterDone)
	if rep.Reconcile {
		fmt.Fprintf(w, "  lookups (idem.Reconcile): %d, %d found the charge\n", rep.Lookups, rep.Found)
	}
	fmt.Fprintf(w, "  failed before applying (503):                %d\n", rep.FailedBefore)
	fmt.Fprintf(w, "  applied, then left to time out:              %d\n", rep.TimedOutAfter)
	fmt.Fprintf(w, "  applied, then the connection cut:            %d\n", rep.CutAfter)
	fmt.Fprintf(w, "  key reused with another amount:              %d\n", rep.Conflicts)
	if rep.Provider == providerKeyless {
		fmt.Fprintf(w, "  refused, begun too long before (503):        %d\n", rep.Expired)
	}
	fmt.Fprintf(w, "provider effects:     %d for %d operations (%d declined; done but never applied %d, under unknown keys %d)\n",
		rep.Effects, rep.Ops, rep.Declined, rep.MissingEffects, rep.UnknownKeys)
	fmt.Fprintf(w, "  operations charged more than once: %d (%d extra charges); their charges sent by a worker woken from a freeze, by point: %v\n",
		rep.Doubled, rep.Extra, rep.DoubledWoke)
	if rep.CallsAfterDone > 0 {
		fmt.Fprintf(w, "  calls after their flow was done from a process frozen while the call was under way (the residue of docs/flows.md): %d (%d applied); operations charged twice by them: %d (%d extra charges)\n",
			rep.FrozenLate, rep.FrozenLateApplied, rep.DoubledFrozen, rep.ExtraFrozen)
	}
	if rep.AtMostOnce || rep.Stopped > 0 {
		fmt.Fprintf(w, "  stopped for a person's decision: %d (charged once %d, not charged %d; whose call's function was never entered %d, all but %d of them with a worker killed or frozen during an attempt; whose call the provider never received %d)\n",
			rep.Stopped, rep.StoppedCharged, rep.StoppedUncharged, rep.StoppedNeverEntered, rep.StoppedNeverEntered-rep.StoppedNeverEnteredFaulted, rep.StoppedNeverSent)
	}
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

// flowSoakProviderKey is the provider key of the operation (scope, key)'s
// call charge, as InspectFlow shows it; "" when it has none.
func flowSoakProviderKey(ctx context.Context, db idem.TxBeginner, scope, key string) (string, error) {
	info, err := idem.InspectFlow(ctx, db, scope, key)
	if err != nil {
		return "", fmt.Errorf("inspect the flow of %s: %w", key, err)
	}
	for _, s := range info.Steps {
		if s.Name == "charge" {
			return s.ProviderKey, nil
		}
	}
	return "", nil
}
