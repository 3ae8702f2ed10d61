package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

func TestWithTxRetriesSerializationFailures(t *testing.T) {
	ctx, pool, scope := setup(t)
	attempts := 0
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		attempts++
		if attempts < 3 {
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40001'; END $$`)
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'k', 1)`, scope)
		return err
	})
	if err != nil || attempts != 3 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("err %v after %d attempts; want success on the third", err, attempts)
	}

	errOther := errors.New("not retryable")
	attempts = 0
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		attempts++
		return errOther
	})
	if !errors.Is(err, errOther) || attempts != 1 {
		t.Fatalf("err %v after %d attempts; want errOther after one", err, attempts)
	}
}
