package outbox_test

import (
	"context"
	"fmt"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/outbox"
)

// A service notifies its customer's endpoint of an order that shipped: the
// order's change and the notification commit together, and a relay
// delivers it as a signed Standard Webhooks delivery, retried until the
// endpoint acknowledges it, with a webhook-id that stays the same on every
// attempt. Here the customer's endpoint is idem's own receiver.
func ExampleNewWebhookHandler() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	// The endpoint's secret, shared with the customer; a whsk_ key signs
	// too (v1a), for a customer who verifies with the whpk_ public key.
	const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	tenant := fmt.Sprintf("shop-%d", rand.Int64())
	destination := "webhook." + tenant // this run's messages only

	// The customer's endpoint.
	scheme, err := webhook.NewStandardWebhooks(secret)
	if err != nil {
		log.Fatal(err)
	}
	received := make(chan string, 1)
	recv, err := webhook.NewReceiver(pool, func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		received <- fmt.Sprintf("%s, id %t", ev.Type, ev.ID == outbox.IdempotencyKey(tenant, "order-7/shipped", destination))
		return nil
	}, webhook.Config{Scheme: scheme, Scope: func(*http.Request) (string, error) { return "webhook:" + tenant, nil }})
	if err != nil {
		log.Fatal(err)
	}
	endpoint := httptest.NewServer(recv)
	defer endpoint.Close()

	// The service: the change and the notification, in one transaction.
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		// ... UPDATE orders SET shipped_at = now() WHERE ...
		_, err := outbox.Enqueue(ctx, tx, outbox.Entry{
			Scope: tenant, Key: "order-7/shipped", Destination: destination,
			Payload: []byte(`{"type":"order.shipped","data":{"order":"order-7"}}`),
		})
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	deliver, err := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: endpoint.URL, Secrets: []string{secret}})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.StartRelay(ctx, pool, deliver, &outbox.Config{Destinations: []string{destination}})
	if err != nil {
		log.Fatal(err)
	}

	fmt.Println("the endpoint applied:", <-received)
	relay.Stop() // a service's relay runs until it stops
	// Output:
	// the endpoint applied: order.shipped, id true
}
