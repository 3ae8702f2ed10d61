package outbox_test

import (
	"context"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// Example follows one payment from the edge to the provider: the order,
// its idempotency record and the charge message commit together, a retry
// of the request enqueues nothing more, and a relay hands the message to
// the code that calls the provider, with a key the provider can
// deduplicate on.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// idem's tables, the outbox's among them, then the application's.
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
	    tenant       text   NOT NULL,
	    order_id     text   NOT NULL,
	    amount_cents bigint NOT NULL,
	    PRIMARY KEY (tenant, order_id)
	)`); err != nil {
		log.Fatal(err)
	}
	tenant := fmt.Sprintf("tenant-%d", rand.Int64())
	destination := "payments.charge." + tenant // this run's messages only

	for range 2 { // the client sends the request, then retries it
		res, err := idem.Run(ctx, pool, tenant, "order-42", nil, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			_, err := tx.Exec(ctx, `INSERT INTO orders (tenant, order_id, amount_cents) VALUES ($1, 'order-42', 1200)`, tenant)
			if err != nil {
				return 0, err
			}
			return outbox.Enqueue(ctx, tx, outbox.Entry{
				Scope:       tenant,
				Key:         "order-42",
				Destination: destination,
				Payload:     []byte(`{"amount_cents":1200}`),
			})
		})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println("replayed:", res.Replayed)
	}

	charged := make(chan struct{}, 1)
	relay, err := outbox.StartRelay(ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		// Here the handler would call the provider, passing
		// msg.IdempotencyKey along.
		fmt.Printf("charge %s, attempt %d, key derived from the order: %t\n", msg.Payload, msg.Attempt,
			msg.IdempotencyKey == outbox.IdempotencyKey(tenant, "order-42", destination))
		charged <- struct{}{}
		return nil
	}, &outbox.Config{Destinations: []string{destination}})
	if err != nil {
		fmt.Println(err)
		return
	}
	<-charged
	relay.Stop() // the example has one message; a service's relay runs until it stops

	// Output:
	// replayed: false
	// replayed: true
	// charge {"amount_cents":1200}, attempt 1, key derived from the order: true
}

// EnqueueMany enqueues a batch of messages in one round trip; the same batch
// again, as a retry would send it, adds nothing and gives the same ids.
func ExampleEnqueueMany() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	tenant := fmt.Sprintf("tenant-%d", rand.Int64())
	batch := []outbox.Entry{
		{Scope: tenant, Key: "signup-7", Destination: "mail.send", Payload: []byte(`{"to":"a@example.com"}`)},
		{Scope: tenant, Key: "signup-8", Destination: "mail.send", Payload: []byte(`{"to":"b@example.com"}`)},
		{Scope: tenant, Key: "signup-9", Destination: "mail.send", Payload: []byte(`{"to":"c@example.com"}`)},
	}
	var first, again []int64
	for _, ids := range []*[]int64{&first, &again} {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			*ids, err = outbox.EnqueueMany(ctx, tx, batch)
			return err
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	var stored int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE scope = $1`, tenant).Scan(&stored); err != nil {
		log.Fatal(err)
	}
	fmt.Println("messages:", len(first), "stored:", stored, "same ids again:", fmt.Sprint(first) == fmt.Sprint(again))
	// Output:
	// messages: 3 stored: 3 same ids again: true
}
