package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// Payment is what the repository below returns to its callers, and what a
// retry gets back.
type Payment struct {
	ID          int64 `json:"id"`
	AmountCents int64 `json:"amount_cents"`
}

// PaymentRepository is ordinary repository code that owns its transaction.
type PaymentRepository struct{ pool *pgxpool.Pool }

// Create records a payment once per (tenant, idempotency key), however often
// the client retries.
func (r *PaymentRepository) Create(ctx context.Context, tenant, idempotencyKey string, amountCents int64) (Payment, bool, error) {
	fp, err := idem.FingerprintJSON(map[string]any{"amount_cents": amountCents})
	if err != nil {
		return Payment{}, false, err
	}
	var res idem.Result[Payment]
	err = idem.WithTx(ctx, r.pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		res, err = idem.Do(ctx, tx, tenant, idempotencyKey, fp, func(ctx context.Context, tx pgx.Tx) (Payment, error) {
			p := Payment{AmountCents: amountCents}
			err := tx.QueryRow(ctx,
				`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				tenant, idempotencyKey, amountCents).Scan(&p.ID)
			return p, err
		})
		return err
	})
	return res.Value, res.Replayed, err
}

// Do inside repository code: the claim, the insert and the stored response
// share the repository's transaction.
func ExampleDo() {
	ctx := context.Background()
	repo := &PaymentRepository{pool: env.ExamplePool()}
	tenant := testdb.Name("tenant")

	first, replayed, err := repo.Create(ctx, tenant, "order-1001", 2500)
	fmt.Println(first.AmountCents, replayed, err)

	// The response was lost; the client retries with the same key.
	retry, replayed, err := repo.Create(ctx, tenant, "order-1001", 2500)
	fmt.Println(retry == first, replayed, err)

	// A client bug: the same key for another amount.
	_, _, err = repo.Create(ctx, tenant, "order-1001", 9900)
	fmt.Println(errors.Is(err, idem.ErrFingerprintMismatch))
	// Output:
	// 2500 false <nil>
	// true true <nil>
	// true
}

// Run owns the transaction: the usual call when there is none to join.
func ExampleRun() {
	ctx := context.Background()
	pool := env.ExamplePool()
	tenant := testdb.Name("tenant")
	charge := func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k-42', 700)`, tenant)
		return "charged 7.00", err
	}
	fp := idem.Fingerprint([]byte("POST /charges"), []byte(`{"amount":700}`))

	for range 3 {
		res, err := idem.Run(ctx, pool, tenant, "k-42", fp, charge)
		fmt.Println(res.Value, res.Replayed, err)
	}
	var rows int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM payment WHERE scope = $1`, tenant).Scan(&rows)
	fmt.Println("payment rows:", rows)
	// Output:
	// charged 7.00 false <nil>
	// charged 7.00 true <nil>
	// charged 7.00 true <nil>
	// payment rows: 1
}

// Once deduplicates a consumer: a redelivered message is a no-op.
func ExampleOnce() {
	ctx := context.Background()
	pool := env.ExamplePool()
	consumer := testdb.Name("billing-consumer")
	handle := func(eventID string, body json.RawMessage) (bool, error) {
		var ran bool
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			ran, err = idem.Once(ctx, tx, consumer, eventID, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, consumer, eventID)
				return err
			})
			return err
		})
		return ran, err
	}
	for _, delivery := range []string{"evt-1", "evt-2", "evt-1"} {
		ran, err := handle(delivery, json.RawMessage(`{}`))
		fmt.Println(delivery, ran, err)
	}
	// Output:
	// evt-1 true <nil>
	// evt-2 true <nil>
	// evt-1 false <nil>
}

// Migrate applies the embedded migrations; a second call does nothing.
func ExampleMigrate() {
	ctx := context.Background()
	db := stdlib.OpenDBFromPool(env.ExamplePool())
	defer db.Close()
	for range 2 {
		fmt.Println(idem.Migrate(ctx, db))
	}
	// Output:
	// <nil>
	// <nil>
}
