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
