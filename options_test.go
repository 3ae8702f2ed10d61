package idem_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

func TestInvalidOptionsAreRejected(t *testing.T) {
	ctx := context.Background()
	fn := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	for _, opt := range []idem.Option{
		idem.WithRetention(0), idem.WithRetention(500 * time.Nanosecond), idem.WithWait(-time.Second), idem.WithMaxResponseSize(0),
		idem.WithWait(25 * 24 * time.Hour), idem.WithWait(time.Duration(math.MaxInt64)),
	} {
		if _, err := idem.Do(ctx, panicTx{}, "s", "k", nil, fn, opt); !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("err = %v, want ErrInvalidOption", err)
		}
		// CheckOptions tells beforehand what the call would say.
		if err := idem.CheckOptions(idem.WithLookupFirst(), opt); !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("CheckOptions: %v, want ErrInvalidOption", err)
		}
	}
	if err := idem.CheckOptions(idem.WithRetention(time.Microsecond), idem.WithWait(0), idem.WithMaxResponseSize(1)); err != nil {
		t.Errorf("CheckOptions of the smallest values that work: %v", err)
	}
	if err := idem.CheckOptions(); err != nil {
		t.Errorf("CheckOptions of none: %v", err)
	}
}

// A retention that is not a whole number of microseconds is rounded up, as
// every duration idem sends to PostgreSQL is: 1.001µs keeps a record for
// 2µs, never for less than asked.
func TestRetentionIsRoundedUpToTheMicrosecond(t *testing.T) {
	ctx, pool, scope := setup(t)
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		key := "k-" + string(iso)
		_, err := idem.Run(ctx, pool, scope, key, fpA, func(context.Context, pgx.Tx) (int, error) { return 1, nil },
			idem.WithRetention(time.Microsecond+time.Nanosecond), idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso}))
		if err != nil {
			t.Fatalf("%s: %v", iso, err)
		}
		var kept time.Duration
		if err := pool.QueryRow(ctx, `SELECT expires_at - created_at FROM idempotency_key WHERE scope = $1 AND key = $2`,
			scope, key).Scan(&kept); err != nil {
			t.Fatal(err)
		}
		if kept != 2*time.Microsecond {
			t.Errorf("%s: retention of 1.001µs kept the record for %s, want 2µs", iso, kept)
		}
	}
}
