// Package backoff is idem's one home for waiting between attempts: the
// jittered exponential delay, and a sleep that ends with its context.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Jitter is the delay before retrying after the attempt-th failure
// (attempt counts from 1): base doubled attempt-1 times, capped at max,
// then drawn uniformly between half and all of that, so that callers that
// failed together do not retry together. Doubling stops at max, so any
// attempt and any max up to math.MaxInt64 give a delay within [max/2, max]
// without overflowing. A base or max that is not positive gives 0.
func Jitter(attempt int, base, max time.Duration) time.Duration {
	if base <= 0 || max <= 0 {
		return 0
	}
	d := min(base, max)
	for i := 1; i < attempt && d < max; i++ {
		if d > max/2 {
			d = max // doubling would pass the cap, or overflow
			break
		}
		d *= 2
	}
	return d/2 + rand.N(d/2+1)
}

// Sleep waits for d, and returns ctx's error if ctx ends first. A d that
// is not positive returns at once (nil unless ctx has ended).
func Sleep(ctx context.Context, d time.Duration) error {
	return SleepOrWake(ctx, d, nil)
}

// SleepOrWake is [Sleep] that also returns nil, early, as soon as wake
// receives a value. A nil wake never does.
func SleepOrWake(ctx context.Context, d time.Duration, wake <-chan struct{}) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-wake:
		return nil
	case <-timer.C:
		return nil
	}
}
