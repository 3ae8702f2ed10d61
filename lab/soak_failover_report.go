package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// What a failover soak found: per logical payment, its effects, its
// record, the receipt the consumer applied, and whether each answer the
// client got equals the one finally stored.

// failoverReport is what a failover soak did and found. Of the embedded
// soakReport, Lost counts answered payments that a failover lost (before
// the retry after the failovers), and WrongAnswers the answers that differ
// from the one finally stored.
type failoverReport struct {
	soakReport
	// Mode is the replication mode: replicationSync or replicationAsync.
	Mode string
	// Requested is the number of failovers asked for; Failovers, those
	// that happened.
	Requested int
	Failovers []failover
	// FailoverErr is why a failover failed, if one did.
	FailoverErr error

	// The retry of every answered payment after the failovers: it replayed
	// the stored answer, ran again (the payment had been lost), returned
	// something else than what was finally stored, or failed.
	RetryReplayed, ReRun, RetryWrong, RetryFailed int

	// Unanswered counts payments that never got an answer; Mismatched,
	// answered payments without exactly one effect and a record that
	// stores it.
	Unanswered, Mismatched int

	// The receipts: rows applied by the consumer, the consumer's calls,
	// payments whose receipt was delivered more than once, payments with
	// no receipt, with more than one, with a receipt of another payment
	// than the one finally stored (one a failover lost), and with two
	// calls of idem.Once that ran and committed; messages left pending or
	// parked.
	Receipts                                   int64
	Deliveries, Redelivered                    int
	Undelivered, ReceiptsTwice, ReceiptsOfLost int
	// ReceiptsLost counts payments without a receipt whose receipt an
	// acknowledged call of idem.Once applied: a consumer's commit that a
	// failover lost, which asynchronous replication allows.
	ReceiptsLost    int
	AppliedTwice    int
	Pending, Parked int

	// Flows is what the flows run beside the payments found; nil without
	// flows.
	Flows *failoverFlowReport
}

// checkLost counts the answered payments that have no row once the
// failovers are over, and attributes each to the failover whose kill was
// nearest to its answer.
func (f *failoverRun) checkLost(ctx context.Context, answers []soakPayment, errs []error, rep *failoverReport) error {
	paymentsByKey, _, err := readPayments(ctx, f.admin, f.scope)
	if err != nil {
		return err
	}
	for i := range answers {
		if errs[i] != nil || len(paymentsByKey[soakKey(i)]) > 0 {
			continue
		}
		rep.Lost++
		if len(rep.Failovers) == 0 {
			continue
		}
		answered := time.Unix(0, f.answeredAt[i].Load())
		nearest := 0
		for j, ev := range rep.Failovers {
			if ev.Killed.Sub(answered).Abs() < rep.Failovers[nearest].Killed.Sub(answered).Abs() {
				nearest = j
			}
		}
		ev := &rep.Failovers[nearest]
		if d := ev.Killed.Sub(answered); d >= 0 {
			ev.LostBefore++
			ev.LostBeforeMax = max(ev.LostBeforeMax, d)
		} else {
			ev.LostAfter++
			ev.LostAfterMax = max(ev.LostAfterMax, -d)
		}
	}
	return nil
}

// check compares, per logical payment, the effects, the record, the
// receipt and the answers with what is finally stored.
func (f *failoverRun) check(ctx context.Context, answers []soakPayment, errs []error,
	retried []idem.Result[soakPayment], retryErrs []error, rep *failoverReport) error {
	paymentsByKey, rows, err := readPayments(ctx, f.admin, f.scope)
	if err != nil {
		return err
	}
	stored, stranded, err := readStored(ctx, f.admin, f.scope)
	if err != nil {
		return err
	}
	receipts, n, err := readReceipts(ctx, f.admin, f.scope)
	if err != nil {
		return err
	}
	rep.Rows, rep.Stranded, rep.Receipts = rows, stranded, n
	rep.Doubled = countDoubled(paymentsByKey)
	f.mu.Lock()
	for _, n := range f.deliveries {
		rep.Deliveries += n
		if n > 1 {
			rep.Redelivered++
		}
	}
	for _, n := range f.applied {
		if n > 1 {
			rep.AppliedTwice++
		}
	}
	f.mu.Unlock()

	for i := range answers {
		if errs[i] != nil {
			rep.Unanswered++
			continue
		}
		rep.Answered++
		key := soakKey(i)
		payments := paymentsByKey[key]
		if len(payments) != 1 || payments[0] != (soakPayment{ID: payments[0].ID, Key: key, AmountCents: soakAmount(i)}) || stored[key] != payments[0] {
			rep.Mismatched++
			continue
		}
		final := payments[0]
		if answers[i] != final {
			rep.WrongAnswers++
		}
		switch {
		case retryErrs[i] != nil:
			rep.RetryFailed++
		case retried[i].Value != final:
			rep.RetryWrong++
		case retried[i].Replayed:
			rep.RetryReplayed++
		default:
			rep.ReRun++
		}
		switch r := receipts[key]; {
		case len(r) == 0 && f.appliedOnce(key):
			rep.ReceiptsLost++
		case len(r) == 0:
			rep.Undelivered++
		case len(r) > 1:
			rep.ReceiptsTwice++
		case r[0] != final.ID:
			rep.ReceiptsOfLost++
		}
	}
	return nil
}

// readReceipts reads the payment ids of a run's receipts by payment key,
// and counts them.
func readReceipts(ctx context.Context, admin *pgxpool.Pool, scope string) (map[string][]int64, int64, error) {
	rows, err := admin.Query(ctx, `SELECT key, payment_id FROM idem_soak_receipt WHERE scope = $1`, scope)
	if err != nil {
		return nil, 0, fmt.Errorf("read receipts: %w", err)
	}
	defer rows.Close()
	byKey := make(map[string][]int64)
	var n int64
	for rows.Next() {
		var key string
		var id int64
		if err := rows.Scan(&key, &id); err != nil {
			return nil, 0, fmt.Errorf("read receipts: %w", err)
		}
		byKey[key] = append(byKey[key], id)
		n++
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read receipts: %w", err)
	}
	return byKey, n, nil
}

// violations returns an error listing what broke the mode's guarantees,
// or nil. Both modes promise one effect and one record per key, every
// receipt delivered and applied once, every call back within
// soakLateBound of its deadline; synchronous replication also promises
// that no answer a client got is lost or changes.
func (r *failoverReport) violations() error {
	var v []string
	add := func(cond bool, format string, args ...any) {
		if cond {
			v = append(v, fmt.Sprintf(format, args...))
		}
	}
	add(len(r.Failovers) < r.Requested, "%d of %d failovers done", len(r.Failovers), r.Requested)
	add(r.FailoverErr != nil, "%v", r.FailoverErr)
	add(r.Unanswered > 0, "%d payments got no answer", r.Unanswered)
	add(r.Doubled > 0, "%d payments doubled", r.Doubled)
	add(r.Mismatched > 0, "%d answered payments without exactly one effect and its record", r.Mismatched)
	add(r.Stranded > 0, "%d claims left in progress", r.Stranded)
	add(r.RetryFailed > 0 || r.RetryWrong > 0, "the retry after the failovers failed %d times and answered %d times with something else than what was stored", r.RetryFailed, r.RetryWrong)
	add(r.Undelivered > 0 || r.Pending > 0 || r.Parked > 0, "%d payments without a receipt the consumer acknowledged (%d messages pending, %d parked)", r.Undelivered, r.Pending, r.Parked)
	add(r.ReceiptsTwice > 0, "%d receipts applied twice", r.ReceiptsTwice)
	add(r.LongestLate > soakLateBound, "an attempt returned %s after its deadline", r.LongestLate.Round(time.Millisecond))
	if r.Flows != nil {
		v = append(v, r.Flows.violations(r.Mode)...)
	}
	if r.Mode == replicationSync {
		add(r.Lost > 0, "%d answered payments lost", r.Lost)
		add(r.ReRun > 0, "%d answered payments ran again", r.ReRun)
		add(r.WrongAnswers > 0, "%d answers differ from what was finally stored", r.WrongAnswers)
		add(r.AppliedTwice > 0, "%d receipts applied twice by acknowledged calls of idem.Once", r.AppliedTwice)
		add(r.ReceiptsOfLost > 0, "%d receipts of payments that were lost", r.ReceiptsOfLost)
		// Asynchronously, a receipt the consumer applied and committed on
		// the dying primary, and that the relay then marked delivered on
		// the promoted standby, is lost with the consumer's commit: an
		// acknowledged commit lost, as an answered payment can be.
		add(r.ReceiptsLost > 0, "%d receipts applied by acknowledged calls of idem.Once, then lost", r.ReceiptsLost)
	}
	if len(v) == 0 {
		return nil
	}
	return errors.New("VIOLATION: " + strings.Join(v, "; "))
}

// verdict says what held, for the run's last line.
func (r *failoverReport) verdict() string {
	flows := ""
	if r.Flows != nil {
		flows = fmt.Sprintf(" Flows: %d provider charges for %d answered flows, none charged twice", r.Flows.Charges, r.Flows.Answered)
		if r.Mode == replicationAsync {
			flows += fmt.Sprintf("; %d answered flows lost and run again, their calls reaching the provider with the key it had charged (%d)", r.Flows.Lost, r.Flows.SameKey)
		}
		flows += "."
	}
	if r.Mode == replicationSync {
		return "no answered payment lost or changed, every payment applied exactly once, every receipt delivered and applied once." + flows
	}
	return fmt.Sprintf("%d answered payments lost in the failovers and run again by their retry, with a new answer; every payment applied exactly once, every receipt delivered and applied once.", r.Lost) + flows
}

func (r *failoverReport) print(w io.Writer, verbose bool, samples map[string]string) {
	fmt.Fprintf(w, "\nlogical operations:   %d started, %d answered, in %s\n",
		r.Operations, r.Answered, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(w, "attempts:             %d (%.2f per operation)\n", r.Attempts, float64(r.Attempts)/float64(max(r.Operations, 1)))
	fmt.Fprintf(w, "  answered, executed: %d\n", r.Executed)
	fmt.Fprintf(w, "  answered, replayed: %d (an earlier attempt had committed)\n", r.Replayed)
	printFailures(w, r.Failures, samples, verbose)
	fmt.Fprintf(w, "  longest past its deadline: %s\n", r.LongestLate.Round(time.Millisecond))

	fmt.Fprintf(w, "failovers:            %d of %d, each step timed from the kill:\n", len(r.Failovers), r.Requested)
	fmt.Fprintf(w, "  %-3s %-27s %9s %9s %9s %9s   %s\n", "", "primary stopped by", "promoted", "answers", "standby", "sync", "answered, then lost: before / after the kill")
	for k, ev := range r.Failovers {
		sync := "-"
		if ev.Synchronous > 0 {
			sync = fmt.Sprint(ev.Synchronous.Round(10 * time.Millisecond))
		}
		fmt.Fprintf(w, "  %-3d %-27s %9s %9s %9s %9s   %d / %d%s\n", k+1, ev.Way,
			ev.Promoted.Round(10*time.Millisecond), ev.Answering.Round(10*time.Millisecond), ev.Streaming.Round(10*time.Millisecond), sync,
			ev.LostBefore, ev.LostAfter, ev.lostSpan())
	}
	fmt.Fprintf(w, "answered, then lost in a failover: %d\n", r.Lost)
	fmt.Fprintf(w, "retry of each answered payment after the failovers: %d replayed its answer, %d ran again, %d wrong, %d failed\n",
		r.RetryReplayed, r.ReRun, r.RetryWrong, r.RetryFailed)
	fmt.Fprintf(w, "payments in the table: %d for %d logical operations (doubled %d; without exactly one effect and its record %d)\n",
		r.Rows, r.Operations, r.Doubled, r.Mismatched)
	fmt.Fprintf(w, "answers != stored:     %d (the answer a client got, against the payment finally stored)\n", r.WrongAnswers)
	fmt.Fprintf(w, "claims in progress:    %d\n", r.Stranded)
	fmt.Fprintf(w, "receipts (outbox, relay, consumer with idem.Once): %d applied for %d answered payments, %d calls of the consumer\n",
		r.Receipts, r.Answered, r.Deliveries)
	fmt.Fprintf(w, "  delivered more than once:       %d (the consumer's Once skipped the repeats)\n", r.Redelivered)
	fmt.Fprintf(w, "  not delivered / pending / parked: %d / %d / %d\n", r.Undelivered, r.Pending, r.Parked)
	fmt.Fprintf(w, "  applied, then lost in a failover: %d\n", r.ReceiptsLost)
	fmt.Fprintf(w, "  applied twice:                  %d (by acknowledged calls of Once: %d)\n", r.ReceiptsTwice, r.AppliedTwice)
	fmt.Fprintf(w, "  of a payment a failover lost:   %d\n", r.ReceiptsOfLost)
	if r.Flows != nil {
		r.Flows.print(w)
	}
}

// lostSpan says how far from the kill the lost payments were answered.
func (ev failover) lostSpan() string {
	var parts []string
	if ev.LostBefore > 0 {
		parts = append(parts, fmt.Sprintf("up to %s before", ev.LostBeforeMax.Round(time.Millisecond)))
	}
	if ev.LostAfter > 0 {
		parts = append(parts, fmt.Sprintf("up to %s after", ev.LostAfterMax.Round(time.Millisecond)))
	}
	if len(parts) == 0 {
		return ""
	}
	return " (" + strings.Join(parts, ", ") + ")"
}

// describe says what one failover did and how long each step took.
func (ev failover) describe() string {
	s := fmt.Sprintf("%s on port %d after %d answers; the standby on port %d promoted in %s",
		ev.Way, ev.From, ev.AnsweredBefore, ev.To, ev.Promoted.Round(time.Millisecond))
	if ev.Answering > 0 {
		s += fmt.Sprintf(", clients answered again %s after the kill", ev.Answering.Round(time.Millisecond))
	}
	if ev.Streaming > 0 {
		s += fmt.Sprintf("; the old primary rebuilt as its standby, streaming after %s", ev.Streaming.Round(time.Millisecond))
	}
	if ev.Synchronous > 0 {
		s += fmt.Sprintf(", synchronous after %s", ev.Synchronous.Round(time.Millisecond))
	}
	return s
}

// appliedOnce reports whether a call of idem.Once that ran applied the
// receipt of the payment key and committed.
func (f *failoverRun) appliedOnce(key string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.applied[key] > 0
}
