package outbox

import (
	"log/slog"
	"reflect"
	"testing"
	"time"
)

// Zero means the default, for every field, and a nil config is the zero
// one.
func TestConfigZeroMeansDefault(t *testing.T) {
	t.Parallel()
	want := Config{
		BatchSize:          50,
		Destinations:       []string{},
		LeaseDuration:      time.Minute,
		MaxAttempts:        20,
		RetryDelay:         time.Second,
		MaxRetryDelay:      time.Hour,
		PollInterval:       time.Second,
		DeliveredRetention: 24 * time.Hour,
		Logger:             slog.Default(),
	}
	for name, c := range map[string]*Config{"nil": nil, "zero": {}} {
		got, err := c.withDefaults()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: defaults %+v, want %+v", name, got, want)
		}
	}
}

// Set values are kept, a negative retention among them (never purge), and
// the relay's copy does not change with the caller's config.
func TestConfigKeepsSetValuesInACopy(t *testing.T) {
	t.Parallel()
	logger := slog.New(slog.DiscardHandler)
	c := &Config{BatchSize: 7, Destinations: []string{"a"}, DeliveredRetention: -1, Logger: logger}
	got, err := c.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	c.Destinations[0] = "changed"
	if got.BatchSize != 7 || got.DeliveredRetention != -1 || got.Logger != logger || got.Destinations[0] != "a" {
		t.Errorf("withDefaults kept %+v", got)
	}
}
