package outbox

import (
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/ident"
)

// Config is how a [Relay] delivers. The zero value of every field means its
// default, so a nil *Config, or an empty one, means every default. A
// negative value means "none" where a field says so (DeliveredRetention);
// every other negative or out-of-range value makes [StartRelay] fail with an
// error that names the field and wraps [idem.ErrInvalidOption].
type Config struct {
	// BatchSize is the most messages one relay leases in one round. It
	// delivers them concurrently, records their outcomes together in one
	// statement (those of handlers that return within a few milliseconds of
	// one another; a slow handler does not hold back the others' outcomes),
	// and leases the next batch once all of them are done.
	//
	// It is also the most handler calls one relay makes at once: each
	// relay calls the handler for up to BatchSize messages concurrently,
	// each in a goroutine of its own, so n relays make up to n*BatchSize
	// concurrent calls to the destinations. Larger batches cost fewer
	// statements and commits per message (with a no-op handler, batches of
	// 10 deliver below the rate at which the same server commits bare
	// one-row inserts, and batches of 50 above it; see docs/outbox.md);
	// smaller ones suit a destination that takes few concurrent calls, and
	// leave fewer messages to wait out their lease after a crash. At most
	// math.MaxInt32. Defaults to 50.
	BatchSize int

	// Destinations limits the relay to messages for these destinations, so
	// that each destination can have relays (and handlers) of its own. Each
	// follows the rules of [Entry.Destination]. Defaults to every
	// destination.
	Destinations []string

	// LeaseDuration is how long a leased message is withheld from other
	// relays. The handler's context ends a tenth of it (at most 5s) before
	// it runs out, so that the relay can record the outcome while the lease
	// still holds, and a relay that crashed leaves its messages to others
	// once it has: choose it longer than most deliveries take, and short
	// enough to wait out after a crash. A handler that needs longer calls
	// [ExtendLease]. Every positive duration is accepted, up to
	// math.MaxInt64 (about 292 years) for a lease that does not run out in
	// practice. Defaults to 1m.
	LeaseDuration time.Duration

	// MaxAttempts is how many attempts a message gets before it is parked.
	// A message is parked after its MaxAttempts-th attempt fails, or once
	// that attempt's lease runs out without an outcome (its relay crashed).
	// Attempts that a stopping relay interrupts are not counted. At most
	// math.MaxInt32. Defaults to 20.
	MaxAttempts int

	// RetryDelay is the delay after a message's first failed attempt. It
	// doubles with each further failure, up to MaxRetryDelay, and each delay
	// is drawn at random between half and all of that, so that messages
	// that failed together do not retry together. It must not exceed
	// MaxRetryDelay. Defaults to 1s.
	RetryDelay time.Duration

	// MaxRetryDelay caps the delay between two attempts of a message. With
	// the defaults, a message that keeps failing is retried for four to
	// eight hours before it is parked. Defaults to 1h.
	MaxRetryDelay time.Duration

	// PollInterval is how long an idle relay waits before it looks for due
	// messages again. It bounds the delivery delay of messages that no
	// notification announces (see [Notify]) and of retries. Defaults to 1s.
	PollInterval time.Duration

	// DeliveredRetention is how long delivered messages stay in the outbox
	// before the relay purges them (only those to its Destinations, when
	// set), once a minute, in batches of 1,000, in a goroutine of its own,
	// so that purging never holds up delivery. Parked messages are never
	// purged. Negative means never: the relay purges nothing, and delivered
	// messages stay until someone deletes them (see docs/outbox.md).
	// math.MaxInt64 keeps them for as long as a time.Duration reaches,
	// about 292 years. Defaults to 24h.
	DeliveredRetention time.Duration

	// ListenConnConfig is where the relay opens its connection to listen
	// for [Notify]: a direct connection to the database, for relays whose
	// db goes through a pooler in transaction mode (PgBouncer's
	// pool_mode=transaction), which does not pass notifications on (and
	// keeps the LISTEN that a relay sends through it on one of its server
	// connections, where later notifications arrive for no client). Each
	// relay opens one such connection while it runs. It must come from
	// pgx.ParseConfig; the relay uses a copy. Defaults to the pool's
	// connection settings when db is a *pgxpool.Pool, and to no listening
	// connection otherwise: the relay then only polls.
	ListenConnConfig *pgx.ConnConfig

	// Observer records the relay's deliveries through the same
	// OpenTelemetry providers as idem's calls: a span per delivery, counts
	// by outcome, latency, backlog, and whether the relay hears
	// notifications (see the package documentation for the names).
	// Defaults to none.
	Observer *idem.Observer

	// Logger receives the relay's failures: failed and parked deliveries,
	// and database errors, after which the relay keeps trying. Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// Defaults of the [Config] fields.
const (
	defaultBatchSize          = 50
	defaultLeaseDuration      = time.Minute
	defaultMaxAttempts        = 20
	defaultRetryDelay         = time.Second
	defaultMaxRetryDelay      = time.Hour
	defaultPollInterval       = time.Second
	defaultDeliveredRetention = 24 * time.Hour
)

// withDefaults returns a copy of c (of the zero Config when c is nil) with
// every zero field set to its default, or an error that names the first
// invalid field. The copy shares nothing with c that c's owner could change
// later: its Destinations are copied, and its ListenConnConfig too.
func (c *Config) withDefaults() (Config, error) {
	var r Config
	if c != nil {
		r = *c
		r.Destinations = append([]string(nil), c.Destinations...)
	}
	// Every non-negative duration fits PostgreSQL's interval, whose
	// microseconds are an int64 too, and keeps now() plus or minus it well
	// within timestamptz's range: there is no upper bound to check.
	for _, f := range []struct {
		name  string
		value *time.Duration
		def   time.Duration
		none  bool // negative means none
	}{
		{"LeaseDuration", &r.LeaseDuration, defaultLeaseDuration, false},
		{"RetryDelay", &r.RetryDelay, defaultRetryDelay, false},
		{"MaxRetryDelay", &r.MaxRetryDelay, defaultMaxRetryDelay, false},
		{"PollInterval", &r.PollInterval, defaultPollInterval, false},
		{"DeliveredRetention", &r.DeliveredRetention, defaultDeliveredRetention, true},
	} {
		switch {
		case *f.value == 0:
			*f.value = f.def
		case *f.value < 0 && !f.none:
			return Config{}, invalidField(f.name, "must not be negative (0 means the default, %s), got %s", f.def, *f.value)
		}
	}
	for _, f := range []struct {
		name  string
		value *int
		def   int
	}{
		{"BatchSize", &r.BatchSize, defaultBatchSize},
		{"MaxAttempts", &r.MaxAttempts, defaultMaxAttempts},
	} {
		switch {
		case *f.value == 0:
			*f.value = f.def
		case *f.value < 0 || *f.value > math.MaxInt32:
			return Config{}, invalidField(f.name, "must be between 1 and %d (0 means the default, %d), got %d", math.MaxInt32, f.def, *f.value)
		}
	}
	if r.RetryDelay > r.MaxRetryDelay {
		return Config{}, invalidField("RetryDelay", "must not exceed Config.MaxRetryDelay (%s), got %s", r.MaxRetryDelay, r.RetryDelay)
	}
	for i, d := range r.Destinations {
		if err := ident.Check(d); err != nil {
			return Config{}, invalidField(fmt.Sprintf("Destinations[%d]", i), "invalid destination %q: %s", d, err)
		}
	}
	if r.Destinations == nil {
		r.Destinations = []string{} // nil would be sent as NULL
	}
	if r.ListenConnConfig != nil {
		r.ListenConnConfig = r.ListenConnConfig.Copy()
	}
	if r.Logger == nil {
		r.Logger = slog.Default()
	}
	return r, nil
}

// invalidField is the error of a Config field with an unusable value.
func invalidField(field, format string, args ...any) error {
	return &idem.FieldError{Package: "outbox", Field: "Config." + field, Problem: fmt.Sprintf(format, args...)}
}
