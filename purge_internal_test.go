package idem

import (
	"log/slog"
	"testing"
	"time"
)

// The zero PurgerConfig gets every default, a nil Logger slog.Default()
// among them; values that are set are kept.
func TestPurgerConfigDefaults(t *testing.T) {
	t.Parallel()
	var zero PurgerConfig
	if err := zero.check(); err != nil {
		t.Fatal(err)
	}
	want := PurgerConfig{Batch: DefaultPurgeBatch, Pause: defaultPause, PauseFactor: defaultPauseFactor, Interval: time.Minute, Logger: slog.Default()}
	if zero != want {
		t.Errorf("zero config became %+v, want %+v", zero, want)
	}
	logger := slog.New(slog.DiscardHandler)
	set := PurgerConfig{Batch: 1, Pause: time.Nanosecond, PauseFactor: -1, Interval: time.Hour, Logger: logger}
	kept := set
	if err := kept.check(); err != nil || kept != set {
		t.Errorf("config %+v became %+v (%v), want it kept", set, kept, err)
	}
}

// The rest after a batch is Pause, or PauseFactor times the batch's time
// when that is longer, never beyond Interval; a negative factor leaves
// Pause alone.
func TestPurgerRestsInProportionToItsBatches(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	for _, c := range []struct {
		pause, interval time.Duration
		factor          float64
		took, want      time.Duration
	}{
		{10 * ms, time.Minute, 1, 2 * ms, 10 * ms},               // a fast batch: Pause
		{10 * ms, time.Minute, 1, 30 * ms, 30 * ms},              // a slow one: as long as it took
		{10 * ms, time.Minute, 2.5, 30 * ms, 75 * ms},            // or a multiple
		{10 * ms, time.Minute, -1, 30 * ms, 10 * ms},             // negative: Pause alone
		{10 * ms, time.Second, 1e300, 30 * ms, time.Second},      // never beyond Interval, without overflow
		{2 * time.Second, time.Second, 100, ms, 2 * time.Second}, // nor below Pause
	} {
		cfg := PurgerConfig{Pause: c.pause, Interval: c.interval, PauseFactor: c.factor}
		if got := cfg.rest(c.took); got != c.want {
			t.Errorf("%+v after a batch of %s: rests %s, want %s", cfg, c.took, got, c.want)
		}
	}
}
