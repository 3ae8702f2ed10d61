package idem_test

import (
	"context"
	"fmt"
	"log"
	"math/rand/v2"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
)

// Run owns the transaction: the usual call when there is none to join.
// Three attempts with one key charge once; the other two get the first
// answer back.
func ExampleRun() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS charge (
	    id           bigserial PRIMARY KEY,
	    tenant       text   NOT NULL,
	    amount_cents bigint NOT NULL
	)`); err != nil {
		log.Fatal(err)
	}

	tenant := fmt.Sprintf("tenant-%d", rand.Int64())
	charge := func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `INSERT INTO charge (tenant, amount_cents) VALUES ($1, 700)`, tenant)
		return "charged 7.00", err
	}
	fp := idem.Fingerprint([]byte("POST /charges"), []byte(`{"amount":700}`))
	for attempt := 1; attempt <= 3; attempt++ {
		res, err := idem.Run(ctx, pool, tenant, "k-42", fp, charge)
		fmt.Printf("attempt %d: %q, replayed %t, error %v\n", attempt, res.Value, res.Replayed, err)
	}
	var rows int
	err = pool.QueryRow(ctx, `SELECT count(*) FROM charge WHERE tenant = $1`, tenant).Scan(&rows)
	fmt.Println("charge rows:", rows, err)
	// Output:
	// attempt 1: "charged 7.00", replayed false, error <nil>
	// attempt 2: "charged 7.00", replayed true, error <nil>
	// attempt 3: "charged 7.00", replayed true, error <nil>
	// charge rows: 1 <nil>
}

// Once deduplicates a message consumer: a redelivered event is a no-op,
// in the same transaction as the consumer's own write.
func ExampleOnce() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS invoice (
	    consumer text NOT NULL,
	    event_id text NOT NULL
	)`); err != nil {
		log.Fatal(err)
	}

	consumer := fmt.Sprintf("billing-%d", rand.Int64())
	handle := func(eventID string) (ran bool, err error) {
		err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			ran, err = idem.Once(ctx, tx, consumer, eventID, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO invoice (consumer, event_id) VALUES ($1, $2)`, consumer, eventID)
				return err
			})
			return err
		})
		return ran, err
	}
	for _, delivery := range []string{"evt-1", "evt-2", "evt-1"} {
		ran, err := handle(delivery)
		fmt.Printf("%s: handled %t, error %v\n", delivery, ran, err)
	}
	var invoices int
	err = pool.QueryRow(ctx, `SELECT count(*) FROM invoice WHERE consumer = $1`, consumer).Scan(&invoices)
	fmt.Println("invoices:", invoices, err)
	// Output:
	// evt-1: handled true, error <nil>
	// evt-2: handled true, error <nil>
	// evt-1: handled false, error <nil>
	// invoices: 2 <nil>
}

// Migrate creates idem's tables at start-up; calling it again, from this
// process or another replica, does nothing.
func ExampleMigrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	for range 2 {
		if err := idem.Migrate(ctx, db); err != nil {
			log.Fatal(err)
		}
	}

	for _, table := range []string{"idempotency_key", "entity_version", "outbox_message", idem.MigrationTable} {
		var exists bool
		err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists)
		fmt.Printf("table %s: %t %v\n", table, exists, err)
	}
	// Output:
	// table idempotency_key: true <nil>
	// table entity_version: true <nil>
	// table outbox_message: true <nil>
	// table idem_goose_version: true <nil>
}
