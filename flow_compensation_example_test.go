package idem_test

import (
	"context"
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

// stockService stands in for a warehouse's client: it holds and releases
// stock once per idempotency key.
type stockService struct {
	mu   sync.Mutex
	done map[string]bool // idempotency keys applied
	held int
}

func (s *stockService) Hold(ctx context.Context, idempotencyKey, sku string) error {
	return s.apply(idempotencyKey, +1)
}

func (s *stockService) Release(ctx context.Context, idempotencyKey, sku string) error {
	return s.apply(idempotencyKey, -1)
}

func (s *stockService) apply(key string, n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.done[key] {
		s.done[key] = true
		s.held += n
	}
	return nil
}

// decliningCards stands in for a payment provider that declines the card.
type decliningCards struct{ calls int }

type ChargeResult struct {
	ID       string `json:"id,omitempty"`
	Declined bool   `json:"declined,omitempty"`
}

func (c *decliningCards) Charge(ctx context.Context, idempotencyKey string, amountCents int64) (ChargeResult, error) {
	c.calls++
	return ChargeResult{Declined: true}, nil
}

// A checkout that holds stock before it charges the card must release the
// stock when the card is declined. The decline is a definite answer,
// recorded with the call; the release is one more call, with a provider
// key of its own: a crash anywhere, and the retries after it, hold,
// charge and release once each.
func ExampleCall_compensation() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS held_order (
	    id     bigserial PRIMARY KEY,
	    tenant text NOT NULL,
	    sku    text NOT NULL,
	    state  text NOT NULL
	)`); err != nil {
		log.Fatal(err)
	}
	stock := &stockService{done: make(map[string]bool)}
	cards := &decliningCards{}

	type Cart struct {
		SKU         string `json:"sku"`
		AmountCents int64  `json:"amount_cents"`
	}
	type Outcome struct {
		OrderID  int64  `json:"order_id"`
		ChargeID string `json:"charge_id,omitempty"`
		Declined bool   `json:"declined,omitempty"`
	}
	checkout := idem.MustNewFlow("checkout-with-stock", func(ctx context.Context, s *idem.Steps, in Cart) (Outcome, error) {
		orderID, err := idem.Local(s, "order", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO held_order (tenant, sku, state) VALUES ($1, $2, 'holding') RETURNING id`,
				s.Scope(), in.SKU).Scan(&id)
			return id, err
		})
		if err != nil {
			return Outcome{}, err
		}
		if _, err := idem.Call(s, "hold-stock", func(ctx context.Context, key string) (bool, error) {
			return true, stock.Hold(ctx, key, in.SKU)
		}); err != nil {
			return Outcome{}, err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, key string) (ChargeResult, error) {
			return cards.Charge(ctx, key, in.AmountCents)
		})
		if err != nil {
			return Outcome{}, err // uncertain: the retry charges again, with the same key
		}
		if !charge.Declined {
			return Outcome{OrderID: orderID, ChargeID: charge.ID}, nil
		}
		// The compensation: release the stock, once, and record it.
		if _, err := idem.Call(s, "release-stock", func(ctx context.Context, key string) (bool, error) {
			return true, stock.Release(ctx, key, in.SKU)
		}); err != nil {
			return Outcome{}, err
		}
		_, err = idem.Local(s, "cancel", func(ctx context.Context, tx pgx.Tx) (bool, error) {
			_, err := tx.Exec(ctx, `UPDATE held_order SET state = 'cancelled' WHERE id = $1`, orderID)
			return true, err
		})
		return Outcome{OrderID: orderID, Declined: true}, err
	})

	tenant := fmt.Sprintf("tenant-%d", rand.Int64())
	cart := Cart{SKU: "mug", AmountCents: 1500}
	for range 2 { // the client's request and its retry
		res, err := checkout.Run(ctx, pool, tenant, "order-1", nil, cart)
		fmt.Printf("declined %t, replayed %t, error %v\n", res.Value.Declined, res.Replayed, err)
	}
	var state string
	_ = pool.QueryRow(ctx, `SELECT state FROM held_order WHERE tenant = $1`, tenant).Scan(&state)
	fmt.Printf("order %s, stock held %d, card charged %d time(s)\n", state, stock.held, cards.calls)
	// Output:
	// declined true, replayed false, error <nil>
	// declined true, replayed true, error <nil>
	// order cancelled, stock held 0, card charged 1 time(s)
}
