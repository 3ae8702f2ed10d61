package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
)

// paymentTable is the application's own table, the one its writes go to.
const paymentTable = `
CREATE TABLE IF NOT EXISTS payment (
    id              bigserial PRIMARY KEY,
    tenant          text   NOT NULL,
    idempotency_key text   NOT NULL,
    amount_cents    bigint NOT NULL
)`

// Payment is what Create returns, and what a retry gets back.
type Payment struct {
	ID          int64 `json:"id"`
	AmountCents int64 `json:"amount_cents"`
}

// Payments is ordinary repository code that owns its transactions.
type Payments struct{ pool *pgxpool.Pool }

// Create records a payment once per (tenant, idempotency key), however
// often the client retries. The claim, the insert and the stored response
// commit together. replayed tells a retry from a first execution.
func (p *Payments) Create(ctx context.Context, tenant, idemKey string, amountCents int64) (payment Payment, replayed bool, err error) {
	fp, err := idem.FingerprintJSON(map[string]any{"amount_cents": amountCents})
	if err != nil {
		return Payment{}, false, err
	}
	var res idem.Result[Payment]
	err = idem.WithTx(ctx, p.pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		res, err = idem.Do(ctx, tx, tenant, idemKey, fp, func(ctx context.Context, tx pgx.Tx) (Payment, error) {
			payment := Payment{AmountCents: amountCents}
			err := tx.QueryRow(ctx,
				`INSERT INTO payment (tenant, idempotency_key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				tenant, idemKey, amountCents).Scan(&payment.ID)
			return payment, err
		})
		return err
	})
	return res.Value, res.Replayed, err
}

func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// idem's tables (at start-up; concurrent replicas are fine), then the
	// application's.
	db := stdlib.OpenDBFromPool(pool) // borrows the pool's connections
	err = idem.Migrate(ctx, db)
	db.Close() // returns them; the pool stays open
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, paymentTable); err != nil {
		log.Fatal(err)
	}
	payments := &Payments{pool: pool}
	key := fmt.Sprintf("order-%d", rand.Int64()) // the client's Idempotency-Key

	first, replayed, err := payments.Create(ctx, "acme", key, 2500)
	fmt.Printf("first call: %d cents, replayed %t, error %v\n", first.AmountCents, replayed, err)

	// The response was lost; the client retries with the same key.
	retry, replayed, err := payments.Create(ctx, "acme", key, 2500)
	fmt.Printf("retry:      the same payment %t, replayed %t, error %v\n", retry == first, replayed, err)

	// A client bug: the same key for another amount.
	_, _, err = payments.Create(ctx, "acme", key, 9900)
	fmt.Println("same key, another amount, rejected:", errors.Is(err, idem.ErrFingerprintMismatch))

	var rows int
	err = pool.QueryRow(ctx, `SELECT count(*) FROM payment WHERE tenant = 'acme' AND idempotency_key = $1`, key).Scan(&rows)
	fmt.Println("payment rows for the key:", rows, err)
	// Output:
	// first call: 2500 cents, replayed false, error <nil>
	// retry:      the same payment true, replayed true, error <nil>
	// same key, another amount, rejected: true
	// payment rows for the key: 1 <nil>
}
