package outbox

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

func TestRetryDelayDoublesUpToCap(t *testing.T) {
	base, ceiling := time.Second, time.Minute
	for attempt := 1; attempt <= 12; attempt++ {
		want := min(base*time.Duration(1<<(attempt-1)), ceiling)
		for range 100 {
			if got := retryDelay(attempt, base, ceiling); got < want/2 || got > want {
				t.Fatalf("attempt %d: delay %s, want between %s and %s", attempt, got, want/2, want)
			}
		}
	}
	// Far past the cap, and with a cap near the largest duration, doubling
	// must stop at the cap rather than overflow.
	huge := time.Duration(math.MaxInt64)
	for _, attempt := range []int{64, 1000, math.MaxInt32} {
		if got := retryDelay(attempt, time.Nanosecond, huge); got < huge/2 {
			t.Fatalf("attempt %d with the largest cap: delay %s, want at least %s", attempt, got, huge/2)
		}
		if got := retryDelay(attempt, base, ceiling); got < ceiling/2 || got > ceiling {
			t.Fatalf("attempt %d: delay %s, want between %s and %s", attempt, got, ceiling/2, ceiling)
		}
	}
}

func TestErrorTextIsStorable(t *testing.T) {
	cases := map[string]error{
		"NUL":         errors.New("a\x00b"),
		"invalid":     errors.New("bad \xff byte"),
		"long":        errors.New(strings.Repeat("é", maxErrorText)),
		"long, ascii": errors.New(strings.Repeat("x", 3*maxErrorText)),
	}
	for name, err := range cases {
		got := errorText(err)
		if !utf8.ValidString(got) || strings.ContainsRune(got, 0) || len(got) > maxErrorText+len("…") {
			t.Errorf("%s: %q (%d bytes) is not storable", name, got[:min(len(got), 40)], len(got))
		}
	}
	if got := errorText(errors.New("plain")); got != "plain" {
		t.Errorf("plain error stored as %q", got)
	}
}

func TestIntervalRoundsUpWithoutOverflow(t *testing.T) {
	for d, want := range map[time.Duration]int64{
		0:                                  0,
		time.Nanosecond:                    1,
		time.Microsecond:                   1,
		time.Microsecond + 1:               2,
		time.Second:                        1_000_000,
		time.Duration(math.MaxInt64):       math.MaxInt64/1000 + 1,
		time.Duration(math.MaxInt64) - 807: math.MaxInt64 / 1000,
	} {
		if got := interval(d); !got.Valid || got.Microseconds != want || got.Days != 0 || got.Months != 0 {
			t.Errorf("interval(%d) = %+v, want %d microseconds", int64(d), got, want)
		}
	}
}
