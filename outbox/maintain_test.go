package outbox_test

import (
	"context"
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
		stop := runRelay(t, ctx, pool, func(context.Context, outbox.Message) error { return nil },
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
