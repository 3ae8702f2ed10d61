package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// provider is a fake payment provider that deduplicates on the idempotency
// key, as Stripe does: a repeated key gets the first call's charge back and
// charges nothing. Each new charge emits a webhook event, which the
// provider delivers at least once (here: twice, concurrently).
type provider struct {
	mu      sync.Mutex
	calls   int
	charges map[string]charge // by idempotency key
	events  []event
	webhook func(event)
	sending sync.WaitGroup
	senders chan struct{} // bounds concurrent webhook deliveries
}

type charge struct {
	ID          string
	AmountCents int64
}

type event struct {
	ID     string // the provider's event id, stable across redeliveries
	Charge charge
}

func (p *provider) Charge(idempotencyKey string, amountCents int64) charge {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if c, ok := p.charges[idempotencyKey]; ok {
		return c
	}
	c := charge{ID: fmt.Sprintf("ch_%d", len(p.charges)+1), AmountCents: amountCents}
	p.charges[idempotencyKey] = c
	ev := event{ID: "evt_" + c.ID, Charge: c}
	p.events = append(p.events, ev)
	for range 2 {
		p.sending.Go(func() {
			p.senders <- struct{}{}
			defer func() { <-p.senders }()
			p.webhook(ev)
		})
	}
	return c
}

// TestEndToEndEffectsEqualOperations follows payments through every
// boundary: clients retry at the edge (idem.Run), the edge enqueues the
// charge with the business write, relays that crash mid-delivery and are
// restarted call a provider that deduplicates on the derived key, and the
// provider's webhooks, delivered at least once, reach a consumer that uses
// idem.Once. Each boundary repeats things; the effects still equal the
// logical operations.
func TestEndToEndEffectsEqualOperations(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	const operations = 30
	consumerScope := scope + "-webhooks"

	// The consumer: apply each webhook event once, beside its own write.
	var consumed, webhookDeliveries atomic.Int64
	consumerErrs := make(chan error, 10*operations)
	consume := func(ev event) {
		webhookDeliveries.Add(1)
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			ran, err := idem.Once(ctx, tx, consumerScope, ev.ID, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`,
					consumerScope, ev.Charge.ID, ev.Charge.AmountCents)
				return err
			}, idem.WithWait(30*time.Second))
			if ran {
				consumed.Add(1)
			}
			return err
		})
		if err != nil {
			consumerErrs <- err
		}
	}
	prov := &provider{charges: map[string]charge{}, webhook: consume, senders: make(chan struct{}, 4)}

	// The edge: every operation is sent by three clients at once (a retry
	// storm); the payment and the charge message commit together. A few
	// operations at a time keep the test within its share of connections.
	var firstRuns atomic.Int64
	var edge sync.WaitGroup
	edgeErrs := make(chan error, 3*operations)
	wave := make(chan struct{}, 5)
	for i := range operations {
		key := fmt.Sprintf("payment-%02d", i)
		amount := int64(100 + i)
		wave <- struct{}{}
		var clients sync.WaitGroup
		for range 3 {
			clients.Go(func() {
				res, err := idem.Run(ctx, pool, scope, key, nil, func(ctx context.Context, tx pgx.Tx) (int64, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, scope, key, amount); err != nil {
						return 0, err
					}
					payload, err := json.Marshal(map[string]int64{"amount_cents": amount})
					if err != nil {
						return 0, err
					}
					return outbox.Enqueue(ctx, tx, outbox.Entry{Scope: scope, Key: key, Destination: dest, Payload: payload})
				}, idem.WithWait(30*time.Second))
				if err != nil {
					edgeErrs <- err
					return
				}
				if !res.Replayed {
					firstRuns.Add(1)
				}
			})
		}
		edge.Go(func() {
			clients.Wait()
			<-wave
		})
	}
	edge.Wait()
	close(edgeErrs)
	for err := range edgeErrs {
		t.Fatalf("edge: %v", err)
	}

	// The relays: three at a time. Some deliveries kill their relay after
	// the handler received the message and before the relay records the
	// outcome, either before the provider call or after it (the charge is
	// made, the relay never learns). A killed relay is restarted.
	var deliveries, crashesBefore, crashesAfter atomic.Int64
	const maxCrashes = 12
	handlerFor := func(db *crashable, kill context.CancelFunc) outbox.Handler {
		crash := func() error {
			db.dead.Store(true)
			kill()
			return errCrashed
		}
		return func(ctx context.Context, msg outbox.Message) error {
			n := deliveries.Add(1)
			if n%5 == 2 && crashesBefore.Load()+crashesAfter.Load() < maxCrashes {
				crashesBefore.Add(1)
				return crash()
			}
			var body struct {
				AmountCents int64 `json:"amount_cents"`
			}
			if err := json.Unmarshal(msg.Payload, &body); err != nil {
				return outbox.Park(err)
			}
			prov.Charge(msg.IdempotencyKey, body.AmountCents)
			if n%5 == 4 && crashesBefore.Load()+crashesAfter.Load() < maxCrashes {
				crashesAfter.Add(1)
				return crash()
			}
			return nil
		}
	}
	relayCtx, stopRelays := context.WithCancel(ctx)
	var relays sync.WaitGroup
	var restarts atomic.Int64
	for range 3 {
		relays.Go(func() {
			for relayCtx.Err() == nil {
				db := &crashable{pool: pool}
				runCtx, kill := context.WithCancel(relayCtx)
				relay, err := outbox.NewRelay(db, handlerFor(db, kill), &outbox.Config{
					Destinations:  []string{dest},
					BatchSize:     4,
					LeaseDuration: 300 * time.Millisecond,
					MaxAttempts:   100, // crashes must not park anything here
					RetryDelay:    10 * time.Millisecond,
					MaxRetryDelay: 50 * time.Millisecond,
					PollInterval:  20 * time.Millisecond,
					Logger:        testLogger(t),
				})
				if err != nil {
					t.Error(err)
					kill()
					return
				}
				if err := relay.Run(runCtx); err != nil {
					t.Error(err)
				}
				kill()
				if relayCtx.Err() == nil {
					restarts.Add(1)
				}
			}
		})
	}
	waitFor(t, "every message delivered", func() bool { return countState(t, pool, dest, "delivered") == operations })
	stopRelays()
	relays.Wait()
	prov.sending.Wait()

	// The provider's webhook replay tool sends every event once more.
	for _, ev := range prov.events {
		consume(ev)
	}
	close(consumerErrs)
	for err := range consumerErrs {
		t.Fatalf("consumer: %v", err)
	}

	prov.mu.Lock()
	defer prov.mu.Unlock()
	t.Logf("edge: %d requests for %d operations; relays: %d deliveries, %d crashes before and %d after the provider call, %d restarts; "+
		"provider: %d calls, %d charges; consumer: %d webhook deliveries, %d applied",
		3*operations, operations, deliveries.Load(), crashesBefore.Load(), crashesAfter.Load(), restarts.Load(),
		prov.calls, len(prov.charges), webhookDeliveries.Load(), consumed.Load())

	// Every boundary did see repeats...
	if crashesBefore.Load() == 0 || crashesAfter.Load() == 0 || restarts.Load() == 0 {
		t.Fatal("no relay crashed: the test did not exercise redelivery")
	}
	if prov.calls < operations+int(crashesAfter.Load()) {
		t.Fatalf("provider got %d calls; each of the %d crashes after a call must have caused a repeat", prov.calls, crashesAfter.Load())
	}
	// ...and every boundary's effects equal the logical operations.
	if got := firstRuns.Load(); got != operations {
		t.Errorf("edge ran %d operations, want %d", got, operations)
	}
	if got := countPayments(t, pool, scope); got != operations {
		t.Errorf("edge wrote %d payments, want %d", got, operations)
	}
	if got := len(rows(t, pool, dest)); got != operations {
		t.Errorf("outbox holds %d messages, want %d", got, operations)
	}
	if len(prov.charges) != operations {
		t.Errorf("provider charged %d times (%d distinct keys), want %d", len(prov.charges), len(prov.charges), operations)
	}
	for i := range operations {
		if _, ok := prov.charges[outbox.IdempotencyKey(scope, fmt.Sprintf("payment-%02d", i), dest)]; !ok {
			t.Errorf("payment-%02d was never charged under its derived key", i)
		}
	}
	if got := consumed.Load(); got != operations {
		t.Errorf("consumer applied %d events, want %d", got, operations)
	}
	if got := countPayments(t, pool, consumerScope); got != operations {
		t.Errorf("consumer wrote %d rows, want %d", got, operations)
	}
}
