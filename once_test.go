package idem_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// consume is a consumer's handler: apply the message's effect once.
func consume(scope, id string, effects *atomic.Int64) func(context.Context, pgx.Tx) (bool, error) {
	return func(ctx context.Context, tx pgx.Tx) (bool, error) {
		return idem.Once(ctx, tx, scope, id, func(ctx context.Context, tx pgx.Tx) error {
			effects.Add(1)
			_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1)`, scope, id)
			time.Sleep(10 * time.Millisecond)
			return err
		})
	}
}

func TestOnceRedeliveredConcurrentlyHasOneEffect(t *testing.T) {
	ctx, pool, scope := setup(t)
	const deliveries = 50
	var effects, ranCount atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, deliveries)
	for range deliveries {
		wg.Go(func() {
			<-start
			err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
				ran, err := consume(scope, "msg-1", &effects)(ctx, tx)
				if ran {
					ranCount.Add(1)
				}
				return err
			})
			if err != nil {
				errs <- err
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if effects.Load() != 1 || ranCount.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d effects, %d ran, %d payments; want 1 each", effects.Load(), ranCount.Load(), countPayments(t, pool, scope))
	}
}

func TestOnceFailureRecordsNothing(t *testing.T) {
	ctx, pool, scope := setup(t)
	errPoison := errors.New("cannot apply")
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := idem.Once(ctx, tx, scope, "msg", func(context.Context, pgx.Tx) error { return errPoison })
		return err
	})
	if !errors.Is(err, errPoison) {
		t.Fatalf("err = %v, want errPoison", err)
	}
	var effects atomic.Int64
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		ran, err := consume(scope, "msg", &effects)(ctx, tx)
		if !ran {
			t.Error("redelivery after a failure did not run")
		}
		return err
	})
	if err != nil || effects.Load() != 1 {
		t.Fatalf("redelivery: %v, %d effects", err, effects.Load())
	}
	if _, err := idem.Once(ctx, panicTx{}, scope, "", nil); !errors.Is(err, idem.ErrInvalidKey) {
		t.Fatalf("empty id: %v, want ErrInvalidKey", err)
	}
}
