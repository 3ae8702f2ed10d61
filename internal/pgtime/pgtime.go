// Package pgtime is idem's one home for spelling Go durations as
// PostgreSQL values.
package pgtime

import (
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// Interval spells d as a PostgreSQL interval of whole microseconds (no
// days or months, so that it means the same length of time whatever the
// calendar), rounding up: a positive duration never becomes a zero
// interval, and 1.5µs is 2µs. It rounds after dividing, because adding
// before would overflow near the largest duration (math.MaxInt64, which
// idem's configs accept as "forever") and give a negative interval;
// every time.Duration therefore fits, since the interval's microseconds
// are an int64 too. A negative d is rounded toward zero (-1.5µs is -1µs);
// idem passes none.
func Interval(d time.Duration) pgtype.Interval {
	us := d / time.Microsecond
	if d%time.Microsecond > 0 {
		us++
	}
	return pgtype.Interval{Microseconds: int64(us), Valid: true}
}
