package webhook

import (
	"cmp"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/adapter"
	"github.com/pgidem/idem/internal/httpedge"
)

// Default values of the configuration.
const (
	// DefaultRetention is how long a received event's id is remembered
	// unless [Config.Retention] says otherwise: longer than any sender
	// retries (Stripe for 3 days, the Standard Webhooks specification's
	// example schedule for 75 hours), so that no redelivery outlives it.
	DefaultRetention = 7 * 24 * time.Hour

	// DefaultTolerance is how old the time a signature covers may be on
	// the receiver's clock unless [Config.Tolerance] says otherwise, as the
	// Standard Webhooks specification's reference libraries and Stripe's
	// take it.
	DefaultTolerance = 5 * time.Minute

	// DefaultMaxBodyBytes is the largest delivery accepted unless
	// [Config.MaxBodyBytes] says otherwise.
	DefaultMaxBodyBytes = 1 << 20
)

// Config configures a [Receiver]; [NewReceiver] checks it. The zero value
// of every field means its default, which the field states; a negative
// value means "none" where the field says so. Scheme and Scope are
// required.
type Config struct {
	// Scheme verifies the sender's signatures: [NewStandardWebhooks],
	// [NewStripe], [NewGitHub], or one of the application's own. Required.
	Scheme Scheme

	// Scope returns the scope under which the delivery's event id is
	// recorded: the sender, or the endpoint, or the tenant whose endpoint
	// this is, within which event ids are unique. It is called once the
	// delivery is verified. When it returns an error, the delivery gets
	// 400 scope-unknown and nothing is written; the error is not shown.
	// The scope must be 1 to 255 bytes of UTF-8: any other value is a
	// server error (500). Event ids share idem's table with the keys of
	// idem.Run, idem.Once and idemhttp: choose scopes that those do not
	// use, such as "webhook:stripe". Required.
	Scope func(r *http.Request) (string, error)

	// Tolerance is how old the time a signature covers may be on the
	// receiver's clock for the delivery to be accepted, and how far ahead
	// of it, as each provider's own library takes it: a Standard Webhooks
	// delivery (and one of a Scheme of the application's own) may be as
	// far ahead as Tolerance, as the specification's reference libraries
	// accept it; a Stripe event as far as Retention less Tolerance, since
	// stripe-go bounds only the age, and only Stripe can sign a time, so
	// that a receiver whose clock runs slow does not refuse every event.
	// A delivery signed earlier or further ahead gets 400 webhook-stale,
	// and nothing is written. It keeps a delivery captured on the way from
	// being applied again once its id is forgotten (see Retention).
	// Negative means no check; schemes that sign no time (GitHub's) are
	// not checked either way. Defaults to [DefaultTolerance], 5m.
	Tolerance time.Duration

	// Now is the receiver's clock, which Tolerance is measured on: tests
	// give it a fixed time. Defaults to time.Now.
	Now func() time.Time

	// Retention is how long an event's id is remembered after its
	// delivery committed: a redelivery within it is answered 204 without
	// running the handler, one after it runs the handler again. Choose it
	// longer than the longest time in which the sender redelivers,
	// including by hand from its dashboard. With a Tolerance, it must be
	// at least twice Tolerance: a signature is accepted from Tolerance
	// before the time it covers (or further, for Stripe's, within the
	// retention) to Tolerance after it, and a delivery captured on the way
	// and sent again within that window, once its id was forgotten, would
	// be applied again. It must be at least a microsecond. Defaults to
	// [DefaultRetention], 7 days.
	Retention time.Duration

	// Wait is how long a delivery waits for a concurrent delivery of the
	// same event (a sender's twin) to finish: when that one commits, this
	// one is answered 204 as a duplicate; when it rolls back, this one
	// runs the handler. Past the wait it gets 409 key-in-progress with
	// Retry-After, and the sender delivers it again later. Negative means
	// no wait. It must not exceed math.MaxInt32 milliseconds, the longest
	// lock_timeout. Defaults to [idem.DefaultWait], 5s.
	Wait time.Duration

	// MaxBodyBytes is the largest delivery accepted: one with a larger
	// Content-Length is refused with 413 body-too-large before its body is
	// read, and one whose body turns out larger is refused once the limit
	// is passed, without reading the rest. GitHub sends up to 25 MB.
	// Negative means no limit. Defaults to [DefaultMaxBodyBytes], 1 MiB.
	MaxBodyBytes int64

	// ProblemTypeBase starts the type URI of every problem the receiver
	// answers, as [idemhttp.Config.ProblemTypeBase] does for idemhttp's.
	// Defaults to [idemhttp.DefaultProblemTypeBase].
	ProblemTypeBase string

	// Observer records every delivery's outcome (see the package
	// documentation), and the claim of its event id as idem.Run's (see
	// [idem.WithObserver]). Defaults to none.
	Observer *idem.Observer

	// Logger receives what deserves a person's attention: deliveries
	// refused for their signature, event ids reused with another payload,
	// handlers that failed or panicked, and database errors. Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// settings is a Config checked, with its defaults applied.
type settings struct {
	scheme    Scheme
	scope     func(*http.Request) (string, error)
	tolerance time.Duration // negative: none
	// ahead is how far ahead of the receiver's clock a signed time may be,
	// when tolerance is not negative.
	ahead           time.Duration
	now             func() time.Time
	maxBodyBytes    int64 // math.MaxInt64: no limit
	problemTypeBase string
	logger          *slog.Logger
	metrics         *metrics // nil without a meter
	runOptions      []idem.Option
	// retryAfter is the Retry-After of a 409, in seconds: the wait,
	// rounded up, as idemhttp gives it.
	retryAfter string
}

// invalidField is a field of Config, or an argument of NewReceiver, that
// cannot work.
func invalidField(field, format string, args ...any) error {
	return adapter.Invalid("webhook", field, format, args...)
}

// newSettings checks every field of cfg and applies the defaults.
func newSettings(cfg Config) (settings, error) {
	s := settings{
		scheme:          cfg.Scheme,
		scope:           cfg.Scope,
		now:             cfg.Now,
		problemTypeBase: cmp.Or(cfg.ProblemTypeBase, idemhttp.DefaultProblemTypeBase),
		logger:          cmp.Or(cfg.Logger, slog.Default()),
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.scheme == nil {
		return settings{}, invalidField("Config.Scheme", "is required: NewStandardWebhooks, NewStripe, NewGitHub, or a Scheme of your own")
	}
	if s.scope == nil {
		return settings{}, invalidField("Config.Scope", "is required, with no default: it keeps one sender's event ids from meeting another's")
	}

	s.tolerance = cmp.Or(cfg.Tolerance, DefaultTolerance)
	retention, err := adapter.Retention("webhook", "Config.Retention", cfg.Retention, DefaultRetention)
	if err != nil {
		return settings{}, err
	}
	if s.tolerance > 0 && retention/2 < s.tolerance {
		// A delivery captured on the way could be sent again, and be
		// accepted, after its id was forgotten.
		return settings{}, invalidField("Config.Retention",
			"must be at least twice Config.Tolerance (2 × %s): a signature is accepted from the tolerance before the time it covers to the tolerance after it, "+
				"and a delivery sent again within that window once its id is forgotten would be applied again; got %s", s.tolerance, retention)
	}
	// A signature is accepted from ahead before the time it covers to
	// tolerance after it: a window that the retention covers.
	s.ahead = s.tolerance
	if _, ok := s.scheme.(*Stripe); ok {
		s.ahead = retention - s.tolerance
	}

	wait, err := adapter.Wait("webhook", "Config.Wait", cfg.Wait)
	if err != nil {
		return settings{}, err
	}
	s.retryAfter = strconv.FormatInt(int64(adapter.RetryAfter(wait)/time.Second), 10)

	s.maxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	if s.maxBodyBytes < 0 {
		s.maxBodyBytes = math.MaxInt64
	}
	if cfg.ProblemTypeBase != "" {
		if problem := httpedge.CheckTypeBase(cfg.ProblemTypeBase); problem != "" {
			return settings{}, invalidField("Config.ProblemTypeBase", "%q %s", cfg.ProblemTypeBase, problem)
		}
	}

	s.runOptions = []idem.Option{idem.WithRetention(retention), idem.WithWait(wait)}
	if cfg.Observer != nil {
		s.runOptions = append(s.runOptions, idem.WithObserver(cfg.Observer))
		var err error
		if s.metrics, err = newMetrics(cfg.Observer); err != nil {
			return settings{}, &idem.FieldError{Package: "webhook", Field: "Config.Observer", Problem: err.Error(), Err: err}
		}
	}
	return s, nil
}
