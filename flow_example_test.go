package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
)

// cardProvider stands in for a payment provider's client, such as
// Stripe's: it charges once per idempotency key, and here its first answer
// is lost after the charge went through, as a timeout loses it.
type cardProvider struct {
	mu      sync.Mutex
	charges map[string]string // idempotency key → charge id
	calls   int
}

func (p *cardProvider) Charge(ctx context.Context, idempotencyKey string, amountCents int64) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	id, ok := p.charges[idempotencyKey]
	if !ok {
		id = fmt.Sprintf("ch_%d", len(p.charges)+1)
		p.charges[idempotencyKey] = id
	}
	if p.calls == 1 {
		return "", errors.New("provider timeout") // the charge went through; its answer did not
	}
	return id, nil
}

// Order is what the checkout flow takes; Receipt what it answers.
type Order struct {
	AmountCents int64 `json:"amount_cents"`
}

type Receipt struct {
	OrderID  int64  `json:"order_id"`
	ChargeID string `json:"charge_id"`
	Declined bool   `json:"declined,omitempty"`
}

// A flow records the order, charges the card at the provider with no
// transaction open, and records the charge. The first attempt times out
// after the provider charged; the client's retry continues where the first
// stopped: the order is not recorded again, and the provider, given the
// same key, charges once.
func ExampleNewFlow() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS shop_order (
	    id           bigserial PRIMARY KEY,
	    tenant       text   NOT NULL,
	    amount_cents bigint NOT NULL,
	    charge_id    text
	)`); err != nil {
		log.Fatal(err)
	}
	provider := &cardProvider{charges: make(map[string]string)}

	// Made once, at start-up.
	checkout := idem.MustNewFlow("checkout", func(ctx context.Context, s *idem.Steps, in Order) (Receipt, error) {
		orderID, err := idem.Local(s, "order", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO shop_order (tenant, amount_cents) VALUES ($1, $2) RETURNING id`,
				s.Scope(), in.AmountCents).Scan(&id)
			return id, err
		})
		if err != nil {
			return Receipt{}, err
		}
		chargeID, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			return provider.Charge(ctx, providerKey, in.AmountCents)
		})
		if err != nil {
			return Receipt{}, err // uncertain: not stored; the retry calls again with the same key
		}
		_, err = idem.Local(s, "paid", func(ctx context.Context, tx pgx.Tx) (bool, error) {
			_, err := tx.Exec(ctx, `UPDATE shop_order SET charge_id = $1 WHERE id = $2`, chargeID, orderID)
			return true, err
		})
		return Receipt{OrderID: orderID, ChargeID: chargeID}, err
	})

	tenant := fmt.Sprintf("tenant-%d", rand.Int64())
	fp, _ := idem.FingerprintJSON(Order{AmountCents: 2500})
	_, err = checkout.Run(ctx, pool, tenant, "order-1", fp, Order{AmountCents: 2500})
	fmt.Println("first attempt:", err)

	res, err := checkout.Run(ctx, pool, tenant, "order-1", fp, Order{AmountCents: 2500})
	fmt.Printf("retry:         %s, replayed %t, error %v\n", res.Value.ChargeID, res.Replayed, err)
	res, err = checkout.Run(ctx, pool, tenant, "order-1", fp, Order{AmountCents: 2500})
	fmt.Printf("again:         %s, replayed %t, error %v\n", res.Value.ChargeID, res.Replayed, err)

	var orders int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM shop_order WHERE tenant = $1`, tenant).Scan(&orders)
	fmt.Printf("orders %d, provider calls %d, charges %d\n", orders, provider.calls, len(provider.charges))
	// Output:
	// first attempt: idem: flow "checkout": step "charge": provider timeout
	// retry:         ch_1, replayed false, error <nil>
	// again:         ch_1, replayed true, error <nil>
	// orders 1, provider calls 2, charges 1
}
