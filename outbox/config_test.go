package outbox_test

import (
	"context"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// Every invalid field is refused at construction, with an error that names
// the field and wraps idem.ErrInvalidOption.
func TestNewRelayRefusesEveryInvalidField(t *testing.T) {
	t.Parallel()
	pool := env.Pool(t)
	handler := func(context.Context, outbox.Message) error { return nil }
	aboveInt32 := math.MaxInt32
	aboveInt32++ // a variable: on 32-bit platforms it wraps, and is refused as negative
	cases := []struct {
		field  string
		config outbox.Config
	}{
		{"BatchSize", outbox.Config{BatchSize: -1}},
		{"BatchSize", outbox.Config{BatchSize: aboveInt32}},
		{"Destinations[0]", outbox.Config{Destinations: []string{""}}},
		{"Destinations[1]", outbox.Config{Destinations: []string{"ok", "a\x00"}}},
		{"Destinations[0]", outbox.Config{Destinations: []string{strings.Repeat("d", outbox.MaxNameLength+1)}}},
		{"Destinations[0]", outbox.Config{Destinations: []string{"\xff"}}},
		{"LeaseDuration", outbox.Config{LeaseDuration: -time.Nanosecond}},
		{"MaxAttempts", outbox.Config{MaxAttempts: -1}},
		{"MaxAttempts", outbox.Config{MaxAttempts: aboveInt32}},
		{"RetryDelay", outbox.Config{RetryDelay: -time.Second}},
		{"RetryDelay", outbox.Config{RetryDelay: time.Hour, MaxRetryDelay: time.Minute}},
		{"RetryDelay", outbox.Config{RetryDelay: 2 * time.Hour}}, // above the default cap, 1h
		{"MaxRetryDelay", outbox.Config{MaxRetryDelay: -time.Second}},
		{"PollInterval", outbox.Config{PollInterval: -time.Second}},
	}
	tested := map[string]bool{}
	for _, c := range cases {
		_, err := outbox.NewRelay(pool, handler, &c.config)
		want := "outbox: Config." + c.field + ": "
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: err = %v, want idem.ErrInvalidOption naming %q", c.config, err, want)
		}
		tested[strings.Split(c.field, "[")[0]] = true
	}

	// Every field is either refused for some value above, or takes every
	// value: a new field must be placed in one or the other.
	anyValue := map[string]string{
		"DeliveredRetention": "negative means never purge",
		"ListenConnConfig":   "nil means the default; a config not from pgx.ParseConfig is reported by Run",
		"Observer":           "nil means none",
		"Logger":             "nil means slog.Default()",
	}
	for f := range reflect.TypeFor[outbox.Config]().Fields() {
		if !tested[f.Name] && anyValue[f.Name] == "" {
			t.Errorf("Config.%s: no invalid value tested, and not listed as taking every value", f.Name)
		}
	}

	// The arguments too.
	for name, err := range map[string]error{
		"db":      second(outbox.NewRelay(nil, handler, nil)),
		"handler": second(outbox.NewRelay(pool, nil, nil)),
	} {
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), name+" must not be nil") {
			t.Errorf("nil %s: err = %v, want idem.ErrInvalidOption naming it", name, err)
		}
	}
}

func second[T any](_ T, err error) error { return err }

// Zero values, a nil config, and the values at the edges of each range are
// accepted.
func TestNewRelayAcceptsZeroAndEdges(t *testing.T) {
	t.Parallel()
	pool := env.Pool(t)
	handler := func(context.Context, outbox.Message) error { return nil }
	forever := time.Duration(math.MaxInt64)
	for name, c := range map[string]*outbox.Config{
		"nil":                 nil,
		"zero":                {},
		"largest":             {BatchSize: math.MaxInt32, MaxAttempts: math.MaxInt32, LeaseDuration: forever, RetryDelay: forever, MaxRetryDelay: forever, PollInterval: forever, DeliveredRetention: forever},
		"smallest":            {BatchSize: 1, MaxAttempts: 1, LeaseDuration: 1, RetryDelay: 1, MaxRetryDelay: 1, PollInterval: 1, DeliveredRetention: 1},
		"retry delay at cap":  {RetryDelay: time.Hour},
		"never purge":         {DeliveredRetention: -1},
		"listed destinations": {Destinations: []string{"a", "b"}},
	} {
		if _, err := outbox.NewRelay(pool, handler, c); err != nil {
			t.Errorf("%s: %v, want accepted", name, err)
		}
	}
}
