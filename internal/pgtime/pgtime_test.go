package pgtime

import (
	"math"
	"testing"
	"time"
)

func TestIntervalRoundsUpWithoutOverflow(t *testing.T) {
	t.Parallel()
	for d, want := range map[time.Duration]int64{
		0:                                  0,
		time.Nanosecond:                    1,
		time.Microsecond:                   1,
		time.Microsecond + 1:               2,
		1500 * time.Nanosecond:             2,
		time.Second:                        1_000_000,
		48 * time.Hour:                     48 * 3600 * 1_000_000,
		-1500 * time.Nanosecond:            -1,
		time.Duration(math.MaxInt64):       math.MaxInt64/1000 + 1,
		time.Duration(math.MaxInt64) - 807: math.MaxInt64 / 1000,
	} {
		if got := Interval(d); !got.Valid || got.Microseconds != want || got.Days != 0 || got.Months != 0 {
			t.Errorf("Interval(%d) = %+v, want %d microseconds", int64(d), got, want)
		}
	}
}
