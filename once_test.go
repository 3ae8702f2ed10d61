package idem_test

import (
	"context"
	"errors"
	"fmt"
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

// TestOnceLeavesTheCallersOptionsAlone gives Once an option slice with room
// to grow, as a consumer that keeps its options in one place does, from
// several goroutines at once, and gives Do a slice appended to it once at
// start-up, which shares its backing array. Once must write into neither:
// concurrent Once calls would race, and Do would pick up Once's "store no
// response" and replay a zero value.
func TestOnceLeavesTheCallersOptionsAlone(t *testing.T) {
	ctx, pool, scope := setup(t)
	opts := make([]idem.Option, 1, 8)
	opts[0] = idem.WithWait(time.Second)
	doOpts := append(opts, idem.WithRetention(time.Hour))

	var wg sync.WaitGroup
	for i := range 10 {
		wg.Go(func() {
			err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
				_, err := idem.Once(ctx, tx, scope, fmt.Sprintf("msg-%d", i), func(context.Context, pgx.Tx) error { return nil }, opts...)
				return err
			})
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()

	var calls atomic.Int64
	first, err := idem.Run(ctx, pool, scope, "pay", fpA, pay(scope, "pay", 7, &calls), doOpts...)
	if err != nil {
		t.Fatal(err)
	}
	replay, err := idem.Run(ctx, pool, scope, "pay", fpA, pay(scope, "pay", 7, &calls), doOpts...)
	if err != nil || !replay.Replayed || replay.Value != first.Value {
		t.Fatalf("replay: %+v, %v; want %+v", replay, err, first.Value)
	}
}
