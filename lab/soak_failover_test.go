package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestFailoverSoakSynchronousLosesNoAnsweredPayment runs a short failover
// soak with synchronous replication, as CI does: a few hundred payments
// through a primary and a standby of its own, two failovers (a SIGKILL of
// the postmaster, then an immediate shutdown), each paced by the payments'
// progress, with flows (reserve, a call to a provider that honours keys,
// record) beside the payments. No answered payment or flow may be lost, run
// again or answered differently from what was stored; none doubled, no
// flow charged twice; every receipt delivered through the relay and
// applied once by the consumer's idem.Once.
func TestFailoverSoakSynchronousLosesNoAnsweredPayment(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: database tests are skipped")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()

	cfg := soakConfig{
		Payments:       300,
		Flows:          60,
		Clients:        8,
		PaymentTimeout: 2 * time.Minute,
		Failover:       replicationSync,
		Failovers:      2,
		// Saves the disk of a loaded machine, and changes nothing the
		// soak checks (see the field).
		noFsync: true,
	}
	var out bytes.Buffer
	rep, err := failoverSoak(ctx, cfg, &out)
	t.Logf("soak output:\n%s", out.String())
	if err != nil {
		t.Fatalf("failover soak: %v", err)
	}

	if len(rep.Failovers) != 2 || !strings.HasPrefix(rep.Failovers[0].Way, "SIGKILL") || rep.Failovers[1].Way != "immediate shutdown" {
		t.Errorf("failovers %+v, want a SIGKILL of the postmaster, then an immediate shutdown", rep.Failovers)
	}
	if rep.Operations < cfg.Payments || rep.Answered != rep.Operations || rep.Unanswered != 0 {
		t.Errorf("%d payments started, %d answered; want at least %d, all answered", rep.Operations, rep.Answered, cfg.Payments)
	}
	if rep.Lost != 0 || rep.ReRun != 0 || rep.WrongAnswers != 0 || rep.RetryReplayed != rep.Answered {
		t.Errorf("%d answered payments lost, %d run again, %d answers changed, %d of %d replayed by the retry; want 0, 0, 0, all",
			rep.Lost, rep.ReRun, rep.WrongAnswers, rep.RetryReplayed, rep.Answered)
	}
	if rep.Rows != int64(rep.Operations) || rep.Doubled != 0 || rep.Mismatched != 0 || rep.Stranded != 0 {
		t.Errorf("%d payment rows for %d payments, %d doubled, %d without one effect and its record, %d claims in progress",
			rep.Rows, rep.Operations, rep.Doubled, rep.Mismatched, rep.Stranded)
	}
	if rep.Receipts != int64(rep.Answered) || rep.Undelivered != 0 || rep.ReceiptsTwice != 0 || rep.AppliedTwice != 0 {
		t.Errorf("%d receipts for %d payments, %d undelivered, %d applied twice (%d by acknowledged calls of Once)",
			rep.Receipts, rep.Answered, rep.Undelivered, rep.ReceiptsTwice, rep.AppliedTwice)
	}
	checkFailoverFlows(t, rep, cfg)
	// A failover that no client noticed proves nothing about what clients
	// see during one.
	var failed int64
	for _, n := range rep.Failures {
		failed += n
	}
	if failed == 0 {
		t.Error("no attempt failed: the failovers never hit a client")
	}
}

// TestFailoverSoakAsynchronousChargesEachFlowOnce runs a short failover
// soak with asynchronous replication, with flows beside the payments: a
// failover may lose answered payments and flows, whose retries run them
// again; a flow run again must reach the provider with the key its lost
// run sent, so that no flow is charged twice, and every payment applied
// once.
func TestFailoverSoakAsynchronousChargesEachFlowOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	cfg := soakConfig{
		Payments:       300,
		Flows:          60,
		Clients:        8,
		PaymentTimeout: 2 * time.Minute,
		Failover:       replicationAsync,
		Failovers:      2,
		noFsync:        true,
	}
	var out bytes.Buffer
	rep, err := failoverSoak(ctx, cfg, &out)
	t.Logf("soak output:\n%s", out.String())
	if err != nil {
		t.Fatalf("failover soak: %v", err)
	}
	if rep.Doubled != 0 || rep.Mismatched != 0 || rep.Unanswered != 0 {
		t.Errorf("%d payments doubled, %d without one effect and its record, %d unanswered", rep.Doubled, rep.Mismatched, rep.Unanswered)
	}
	t.Logf("async: %d answered payments and %d answered flows lost in the failovers", rep.Lost, rep.Flows.Lost)
	checkFailoverFlows(t, rep, cfg)
}

// checkFailoverFlows checks the flows of a failover soak: at least
// cfg.Flows, all answered, each charged once with one payment and one
// ledger row.
func checkFailoverFlows(t *testing.T, rep *failoverReport, cfg soakConfig) {
	t.Helper()
	f := rep.Flows
	if f == nil {
		t.Fatal("the failover soak ran no flows")
	}
	if f.Started < cfg.Flows || f.Answered != f.Started || f.Unanswered != 0 || f.RetryFailed != 0 {
		t.Errorf("%d flows started, %d answered, %d retries failed; want at least %d, all answered", f.Started, f.Answered, f.RetryFailed, cfg.Flows)
	}
	if f.Doubled != 0 || f.Uncharged != 0 || f.Charges != f.Started || f.BadRows != 0 {
		t.Errorf("%d provider charges for %d flows, %d charged twice, %d never, %d without their rows; want one each",
			f.Charges, f.Started, f.Doubled, f.Uncharged, f.BadRows)
	}
	if cfg.Failover == replicationSync && (f.Lost != 0 || f.ReRun != 0 || f.Wrong != 0) {
		t.Errorf("synchronous replication: %d answered flows lost, %d run again, %d answers changed; want none", f.Lost, f.ReRun, f.Wrong)
	}
}
