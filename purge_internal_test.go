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
	want := PurgerConfig{Batch: DefaultPurgeBatch, Pause: 10 * time.Millisecond, Interval: time.Minute, Logger: slog.Default()}
	if zero != want {
		t.Errorf("zero config became %+v, want %+v", zero, want)
	}
	logger := slog.New(slog.DiscardHandler)
	set := PurgerConfig{Batch: 1, Pause: time.Nanosecond, Interval: time.Hour, Logger: logger}
	kept := set
	if err := kept.check(); err != nil || kept != set {
		t.Errorf("config %+v became %+v (%v), want it kept", set, kept, err)
	}
}
