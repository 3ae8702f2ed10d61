package backoff

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"
)

func TestJitterDoublesUpToCap(t *testing.T) {
	t.Parallel()
	base, ceiling := time.Second, time.Minute
	for attempt := 1; attempt <= 12; attempt++ {
		want := min(base*time.Duration(1<<(attempt-1)), ceiling)
		for range 100 {
			if got := Jitter(attempt, base, ceiling); got < want/2 || got > want {
				t.Fatalf("attempt %d: delay %s, want between %s and %s", attempt, got, want/2, want)
			}
		}
	}
	// Far past the cap, and with a cap near the largest duration, doubling
	// must stop at the cap rather than overflow.
	huge := time.Duration(math.MaxInt64)
	for _, attempt := range []int{64, 1000, math.MaxInt32} {
		if got := Jitter(attempt, time.Nanosecond, huge); got < huge/2 {
			t.Fatalf("attempt %d with the largest cap: delay %s, want at least %s", attempt, got, huge/2)
		}
		if got := Jitter(attempt, base, ceiling); got < ceiling/2 || got > ceiling {
			t.Fatalf("attempt %d: delay %s, want between %s and %s", attempt, got, ceiling/2, ceiling)
		}
	}
	// A base above the cap starts at the cap.
	if got := Jitter(1, time.Hour, time.Minute); got < 30*time.Second || got > time.Minute {
		t.Fatalf("base above cap: delay %s, want between 30s and 1m", got)
	}
}

func TestJitterOfNothingIsZero(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ base, max time.Duration }{{0, time.Second}, {time.Second, 0}, {-time.Second, time.Second}} {
		if got := Jitter(3, c.base, c.max); got != 0 {
			t.Errorf("Jitter(3, %s, %s) = %s, want 0", c.base, c.max, got)
		}
	}
}

func TestSleepEndsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Sleep(ctx, time.Hour); !errors.Is(err, context.Canceled) {
		t.Fatalf("Sleep on an ended context: %v, want context.Canceled", err)
	}
	if err := Sleep(context.Background(), time.Millisecond); err != nil {
		t.Fatalf("Sleep: %v", err)
	}
}

func TestSleepOrWakeReturnsWhenWoken(t *testing.T) {
	t.Parallel()
	wake := make(chan struct{}, 1)
	wake <- struct{}{}
	// An hour's sleep returns at once: only the wake-up can end it.
	if err := SleepOrWake(context.Background(), time.Hour, wake); err != nil {
		t.Fatalf("SleepOrWake: %v", err)
	}
}
