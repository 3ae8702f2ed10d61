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
// progress. No answered payment may be lost, run again or answered
// differently from what was stored; none doubled; every receipt delivered
// through the relay and applied once by the consumer's idem.Once.
func TestFailoverSoakSynchronousLosesNoAnsweredPayment(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: database tests are skipped")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()

	cfg := soakConfig{
		Payments:       300,
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
