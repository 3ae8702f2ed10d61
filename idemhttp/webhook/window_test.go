package webhook_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp/webhook"
)

// This file holds the tests of how long an event's id is remembered, and
// of the window in which a signature is accepted, which that must cover.

func TestEventIDsAreRememberedForSevenDaysByDefault(t *testing.T) {
	f := newFixture(t, webhook.Config{})
	if a := f.deliver("msg_ret", []byte(`{}`)); a.status != http.StatusNoContent {
		t.Fatalf("%d %s", a.status, a.body)
	}
	var retention time.Duration
	if err := f.pool.QueryRow(f.ctx, `SELECT extract(epoch FROM expires_at - created_at)::float8 * 1e9 FROM idempotency_key WHERE scope = $1`, f.scope).Scan(&retention); err != nil {
		t.Fatal(err)
	}
	if retention < webhook.DefaultRetention || retention > webhook.DefaultRetention+time.Minute || webhook.DefaultRetention != 7*24*time.Hour {
		t.Errorf("retention %s, want %s", retention, webhook.DefaultRetention)
	}
}

// A signature is accepted from Tolerance before the time it covers to
// Tolerance after it: twice the tolerance. A retention shorter than that
// would forget the event's id while a captured delivery of it is still
// accepted.
func TestRetentionShorterThanTwiceTheToleranceIsRefused(t *testing.T) {
	t.Parallel()
	pool := env.Pool(t)
	handle := func(context.Context, pgx.Tx, webhook.Event) error { return nil }
	standard, _ := webhook.NewStandardWebhooks("whsec_" + strings.Repeat("C", 32))
	stripe, _ := webhook.NewStripe(stripeSecret)
	for _, scheme := range []webhook.Scheme{standard, stripe} {
		for _, c := range []struct {
			tolerance, retention time.Duration
			ok                   bool
		}{
			{3 * time.Second, 3 * time.Second, false}, // the issue's
			{3 * time.Second, 6*time.Second - time.Microsecond, false},
			{3 * time.Second, 6 * time.Second, true},
			{0, 10*time.Minute - time.Second, false}, // the default tolerance, 5m
			{0, 10 * time.Minute, true},
			{-1, time.Second, true}, // no tolerance: nothing to cover
		} {
			name := fmt.Sprintf("%T, Tolerance %s, Retention %s", scheme, c.tolerance, c.retention)
			_, err := webhook.NewReceiver(pool, handle, webhook.Config{
				Scheme: scheme, Scope: func(*http.Request) (string, error) { return "s", nil },
				Tolerance: c.tolerance, Retention: c.retention,
			})
			switch {
			case c.ok && err != nil:
				t.Errorf("%s: %v; want it accepted", name, err)
			case !c.ok && (!errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(fmt.Sprint(err), "Config.Retention") ||
				!strings.Contains(fmt.Sprint(err), "twice Config.Tolerance")):
				t.Errorf("%s: %v; want Config.Retention refused, saying it must be twice Config.Tolerance", name, err)
			}
		}
	}
}

// With the shortest retention NewReceiver accepts, twice the tolerance (a
// shorter one is refused: the test above), a delivery sent again and
// again while its signature is accepted, signed as far ahead of the
// receiver's clock as the tolerance (a sender whose clock runs fast, or a
// receiver whose clock runs slow), is applied once: its id is remembered
// for as long as its signature is accepted.
func TestADeliveryIsAppliedOnceForAsLongAsItsSignatureIsAccepted(t *testing.T) {
	const tolerance = time.Second
	for _, retention := range []time.Duration{2 * tolerance} {
		for _, kind := range []string{"StandardWebhooks", "Stripe"} {
			t.Run(fmt.Sprintf("%s, Retention %s", kind, retention), func(t *testing.T) {
				stripe, _ := webhook.NewStripe(stripeSecret)
				cfg := webhook.Config{Tolerance: tolerance, Retention: retention}
				if kind == "Stripe" {
					cfg.Scheme = stripe
				}
				if _, err := webhook.NewReceiver(env.Pool(t), func(context.Context, pgx.Tx, webhook.Event) error { return nil }, withScope(cfg)); err != nil {
					t.Fatalf("refused: %v", err)
				}
				f := newFixture(t, cfg)
				id := "evt_window"
				body := []byte(`{"id":"evt_window","amount":1}`)
				// Signed times are whole seconds: sign just after one
				// begins, a tolerance ahead.
				time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second + 10*time.Millisecond)))
				at := time.Now().Add(tolerance)
				h := http.Header{}
				if kind == "Stripe" {
					stripe.Sign(h, at, body)
				} else if err := f.scheme.Sign(h, id, at, body); err != nil {
					t.Fatal(err)
				}
				var answers []int
				for deadline := at.Truncate(time.Second).Add(tolerance + time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
					answers = append(answers, f.post(h, body).status)
				}
				if f.runs.Load() != 1 || f.payments(id) != 1 {
					t.Errorf("the delivery was applied %d times, %d payment rows, answered %v; want once", f.runs.Load(), f.payments(id), answers)
				}
			})
		}
	}
}

// withScope gives cfg a scheme and a scope, where it has none, so that
// NewReceiver checks the rest.
func withScope(cfg webhook.Config) webhook.Config {
	if cfg.Scheme == nil {
		cfg.Scheme, _ = webhook.NewStandardWebhooks("whsec_" + strings.Repeat("C", 32))
	}
	cfg.Scope = func(*http.Request) (string, error) { return "s", nil }
	return cfg
}

// Stripe's own library, stripe-go's ConstructEvent, refuses an event
// signed longer ago than its tolerance, and accepts one signed ahead of
// the receiver's clock, which only Stripe can sign: a receiver whose clock
// runs slow must not refuse every event. Ahead, the receiver accepts up to
// Retention less Tolerance, so that the id outlives the signature.
func TestStripeEventsSignedAheadOfTheReceiversClockAreAccepted(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	stripe, _ := webhook.NewStripe(stripeSecret)
	f := newFixture(t, webhook.Config{Scheme: stripe, Now: func() time.Time { return now }})
	for i, c := range []struct {
		at   time.Time
		want int
	}{
		{now.Add(5*time.Minute + time.Second), http.StatusNoContent},
		{now.Add(3 * 24 * time.Hour), http.StatusNoContent},
		{now.Add(webhook.DefaultRetention - webhook.DefaultTolerance), http.StatusNoContent},
		{now.Add(webhook.DefaultRetention - webhook.DefaultTolerance + time.Second), http.StatusBadRequest},
		{now.Add(-webhook.DefaultTolerance), http.StatusNoContent},
		{now.Add(-webhook.DefaultTolerance - time.Second), http.StatusBadRequest},
	} {
		body := []byte(fmt.Sprintf(`{"id":"evt_ahead_%d","type":"charge.refunded","amount":1}`, i))
		h := http.Header{}
		stripe.Sign(h, c.at, body)
		if a := f.post(h, body); a.status != c.want || (c.want != http.StatusNoContent && a.code() != webhook.ProblemStale) {
			t.Errorf("signed %s from the receiver's clock: %d %s; want %d", c.at.Sub(now), a.status, a.body, c.want)
		}
	}
}
