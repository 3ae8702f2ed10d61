package outbox_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// A negative DeliveredRetention means never: the relay purges nothing, even
// a message delivered a century ago, while a relay with the default
// retention purges such a message before it first counts its backlog.
func TestNegativeRetentionNeverPurges(t *testing.T) {
	ctx, pool, scope, _ := setup(t)
	for _, c := range []struct {
		retention time.Duration
		kept      bool
	}{{-1, true}, {0, false}} {
		dest := scope + "-" + c.retention.String()
		ids := enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "old", Destination: dest})
		if _, err := pool.Exec(ctx, `UPDATE outbox_message SET state = 'delivered', delivered_at = now() - interval '100 years'
			WHERE id = $1`, ids[0]); err != nil {
			t.Fatal(err)
		}
		mp := newMeterProvider()
		observer, err := idem.NewObserver(idem.ObserverConfig{MeterProvider: mp})
		if err != nil {
			t.Fatal(err)
		}
		stop := startRelay(t, ctx, pool, func(context.Context, outbox.Message) error { return nil },
			outbox.Config{Destinations: []string{dest}, DeliveredRetention: c.retention, Observer: observer},
			time.Hour, 5*time.Second, time.Minute)
		// Each round of maintenance purges, then counts the backlog: once
		// the backlog is counted, the first purge is over.
		waitFor(t, "the backlog counted", func() bool {
			_, ok := mp.meter.gauge("idem.outbox.backlog",
				attribute.String("idem.outbox.destination", dest), attribute.String("idem.outbox.state", "pending"))
			return ok
		})
		stop()
		if kept := countState(t, pool, dest, "delivered") == 1; kept != c.kept {
			t.Errorf("DeliveredRetention %s: message delivered a century ago kept = %t, want %t", c.retention, kept, c.kept)
		}
	}
}

func TestRelayPurgesDeliveredAfterRetention(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 5)...)
	handler := func(context.Context, outbox.Message) error { return nil }
	config := outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond, DeliveredRetention: time.Hour}
	stop := startRelay(t, ctx, pool, handler, config)
	waitFor(t, "every message delivered", func() bool { return countState(t, pool, dest, "delivered") == len(ids) })
	stop()

	// Three were delivered two hours ago, two just now.
	if _, err := pool.Exec(ctx, `UPDATE outbox_message SET delivered_at = now() - interval '2 hours' WHERE id = ANY($1)`, ids[:3]); err != nil {
		t.Fatal(err)
	}
	startRelay(t, ctx, pool, handler, config) // a relay purges as it starts
	waitFor(t, "old deliveries purged", func() bool { return countState(t, pool, dest, "delivered") < len(ids) })
	var left []int64
	for _, r := range rows(t, pool, dest) {
		left = append(left, r.ID)
	}
	if !slices.Equal(left, ids[3:]) {
		t.Fatalf("messages %v left, want the recent %v", left, ids[3:])
	}
}

// Purging a large delivered backlog must not hold up delivery: the relay
// used to purge to the end before it leased anything.
func TestPurgeDoesNotHoldUpDelivery(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	const backlog = 100_000
	_, err := pool.Exec(ctx, `
		INSERT INTO outbox_message (scope, key, destination, payload, idempotency_key, state, attempts, created_at, delivered_at)
		SELECT $1, 'old' || i, $2, '', $2 || ':old:' || i, 'delivered', 1, now() - interval '2 days', now() - interval '2 days'
		FROM generate_series(1, $3::int) AS i`, scope, dest, backlog)
	if err != nil {
		t.Fatal(err)
	}
	old := func() int {
		var n int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_message
			WHERE destination = $1 AND state = 'delivered' AND delivered_at < now() - interval '1 day'`, dest).Scan(&n)
		if err != nil {
			t.Error(err)
		}
		return n
	}
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "new", Destination: dest})

	leftAtDelivery := make(chan int, 1)
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		select {
		case leftAtDelivery <- old():
		default:
		}
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})

	select {
	case left := <-leftAtDelivery:
		if left == 0 {
			t.Errorf("the message was delivered only once all %d delivered messages were purged", backlog)
		}
		t.Logf("delivered with %d of %d purgeable messages still to purge", left, backlog)
	case <-time.After(time.Minute):
		t.Fatal("the message was not delivered")
	}
	waitFor(t, "the backlog purged", func() bool { return old() == 0 })
	if n := countState(t, pool, dest, "delivered"); n != 1 {
		t.Errorf("%d delivered messages left, want the new one", n)
	}
}
