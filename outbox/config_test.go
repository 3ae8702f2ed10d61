package outbox_test

import (
	"context"
	"errors"
	"math"
	"reflect"
	"strings"
	"sync/atomic"
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
		"db":      errorOf(outbox.NewRelay(nil, handler, nil)),
		"handler": errorOf(outbox.NewRelay(pool, nil, nil)),
	} {
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), name+" must not be nil") {
			t.Errorf("nil %s: err = %v, want idem.ErrInvalidOption naming it", name, err)
		}
	}
}

// errorOf is the error of a call that returns a value and an error.
func errorOf[T any](_ T, err error) error { return err }

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

// The largest durations mean "forever", not a negative interval.
func TestLargestDurationsMeanForever(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	forever := time.Duration(math.MaxInt64)
	ids := enqueue(t, ctx, pool, entries(scope, dest, 2)...)
	old, fresh := ids[0], ids[1]
	if _, err := pool.Exec(ctx, `UPDATE outbox_message SET state = 'delivered', delivered_at = now() - interval '100 years'
		WHERE id = $1`, old); err != nil {
		t.Fatal(err)
	}

	// A relay purges before it leases: once it has delivered the fresh
	// message, it has purged all it was going to.
	release := make(chan struct{})
	got := newCalls()
	var markerDone atomic.Bool
	handler := func(ctx context.Context, msg outbox.Message) error {
		got.add(msg)
		if msg.ID == fresh {
			// Held until release; a relay stopped before that (a check
			// below failed) ends the call, so that the test fails rather
			// than hang. The test closes release before it stops the
			// relays, so a call that sees its context end after release
			// was closed still succeeds.
			select {
			case <-release:
			case <-ctx.Done():
				select {
				case <-release:
				default:
					return ctx.Err()
				}
			}
		} else {
			markerDone.Store(true)
		}
		return nil
	}
	stopFirst := startRelay(t, ctx, pool, handler, outbox.Config{
		Destinations: []string{dest}, DeliveredRetention: forever, LeaseDuration: forever,
	})
	waitFor(t, "the fresh message handled", func() bool { return got.count(fresh) == 1 })

	// Its lease ends in centuries: a second relay, polling often, must not
	// deliver it meanwhile.
	var leasedForCenturies bool
	if err := pool.QueryRow(ctx, `SELECT leased_until > now() + interval '200 years' FROM outbox_message WHERE id = $1`,
		fresh).Scan(&leasedForCenturies); err != nil {
		t.Fatal(err)
	}
	if !leasedForCenturies {
		t.Error("a lease of the largest duration does not run for centuries")
	}
	stopSecond := startRelay(t, ctx, pool, handler, outbox.Config{
		Destinations: []string{dest}, PollInterval: 2 * time.Millisecond, DeliveredRetention: forever,
	})
	// Wait for the second relay to have leased at least once, through an
	// unrelated message that it delivers.
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "marker", Destination: dest})
	waitFor(t, "the marker handled", markerDone.Load)
	close(release)
	stopSecond()
	stopFirst()
	if n := got.count(fresh); n != 1 {
		t.Errorf("fresh message handled %d times, want once", n)
	}

	byID := map[int64]row{}
	for _, r := range rows(t, pool, dest) {
		byID[r.ID] = r
	}
	if r, ok := byID[old]; !ok || r.State != "delivered" {
		t.Errorf("a message delivered a century ago was purged under a retention of %s", forever)
	}
	if r := byID[fresh]; r.State != "delivered" || r.Attempts != 1 {
		t.Errorf("fresh message %+v: want delivered on its first attempt", r)
	}
}
