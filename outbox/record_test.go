package outbox_test

import (
	"context"
	"testing"

	"github.com/pgidem/idem/outbox"
)

// Outcomes recorded on their own go through the statement that leases,
// asked for no messages: it must record, and lease nothing.
func TestRecordingAloneLeasesNothing(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 3)...)
	relay, err := outbox.NewRelay(pool, func(context.Context, outbox.Message) error { return nil },
		&outbox.Config{Destinations: []string{dest}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	outbox.RecordDelivered(ctx, relay, ids[0], 1)
	got := rows(t, pool, dest)
	if len(got) != 3 || got[0].State != "delivered" {
		t.Fatalf("rows %+v: want the first of 3 delivered", got)
	}
	for _, r := range got[1:] {
		if r.State != "pending" || r.Leased || r.Attempts != 0 {
			t.Errorf("message %+v: recording an outcome leased it, want it pending, unleased, never attempted", r)
		}
	}
}
