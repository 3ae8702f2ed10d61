package webhook_test

import (
	"bytes"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp/webhook"
)

// request is a delivery of body with header, as a Scheme sees it.
func request(header http.Header, body string) *http.Request {
	r, _ := http.NewRequest(http.MethodPost, "/webhooks", strings.NewReader(body))
	for name, values := range header {
		r.Header[name] = values
	}
	return r
}

// The Standard Webhooks reference libraries' vector (see
// internal/webhooksig): a delivery the specification's own code signed
// verifies, at the HTTP level, and carries its id, time and type.
func TestStandardWebhooksVerifiesTheSpecificationsVector(t *testing.T) {
	t.Parallel()
	s, err := webhook.NewStandardWebhooks("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
	if err != nil {
		t.Fatal(err)
	}
	d, err := s.Verify(request(http.Header{
		"Webhook-Id":        {"msg_p5jXN8AQM9LWM0D4loKWxJek"},
		"Webhook-Timestamp": {"1614265330"},
		"Webhook-Signature": {"v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="},
	}, `{"test": 2432232314}`), []byte(`{"test": 2432232314}`))
	if err != nil {
		t.Fatal(err)
	}
	if d.ID != "msg_p5jXN8AQM9LWM0D4loKWxJek" || !d.SignedAt.Equal(time.Unix(1614265330, 0)) || d.Fingerprint != nil {
		t.Errorf("delivery %+v", d)
	}
}

// Stripe's documented algorithm (the lower-case hex HMAC-SHA256 of
// "{t}.{body}", keyed with the endpoint secret as it is), computed for
// these fixed values by `openssl dgst -sha256 -hmac`, not by idem.
const (
	stripeBody   = `{"id":"evt_1PzW3bIdemVector","object":"event","type":"charge.refunded","pending_webhooks":1}`
	stripeSecret = "whsec_idemStripeVectorSecret0123456789"
	stripeRolled = "whsec_idemStripeRolledSecret9876543210"
	stripeV1     = "4a614f5b457bd63c4b262404cc0222c3dfc9b7c623a1f29fdbc6b908d36d95b6" // stripeSecret, t=1700000000
	stripeV1Next = "c9cbf0530ca7469c989fa4e4a41dee720fee808553c93fc72baabd18241f711b" // stripeRolled, t=1700000000
)

func TestStripeVerifiesTheDocumentedAlgorithm(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, header string
		secrets      []string
	}{
		{"one secret", "t=1700000000,v1=" + stripeV1, []string{stripeSecret}},
		{"v0 and unknown entries are passed over", "t=1700000000,v0=00ff,v1=" + stripeV1 + ",v9=abc", []string{stripeSecret}},
		// While Stripe rolls the secret, it signs with both.
		{"rolling, receiver has the old", "t=1700000000,v1=" + stripeV1Next + ",v1=" + stripeV1, []string{stripeSecret}},
		{"rolling, receiver has the new", "t=1700000000,v1=" + stripeV1Next + ",v1=" + stripeV1, []string{stripeRolled}},
		{"receiver has both", "t=1700000000,v1=" + stripeV1Next, []string{stripeSecret, stripeRolled}},
		{"spaces after commas", "t=1700000000, v1=" + stripeV1, []string{stripeSecret}},
	} {
		s, err := webhook.NewStripe(c.secrets...)
		if err != nil {
			t.Fatal(err)
		}
		d, err := s.Verify(request(http.Header{"Stripe-Signature": {c.header}}, stripeBody), []byte(stripeBody))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if d.ID != "evt_1PzW3bIdemVector" || d.Type != "charge.refunded" || !d.SignedAt.Equal(time.Unix(1700000000, 0)) || d.Fingerprint == nil {
			t.Errorf("%s: delivery %+v", c.name, d)
		}
	}
	// Sign makes the same header, for tests of a receiver.
	s, _ := webhook.NewStripe(stripeSecret, stripeRolled)
	h := http.Header{}
	s.Sign(h, time.Unix(1700000000, 0), []byte(stripeBody))
	if got, want := h.Get("Stripe-Signature"), "t=1700000000,v1="+stripeV1+",v1="+stripeV1Next; got != want {
		t.Errorf("Sign = %s, want %s", got, want)
	}
}

// Stripe counts, in each delivery of an event, the endpoints that have
// not acknowledged it yet: a redelivery may differ there, and only there,
// and is the same event.
func TestStripeFingerprintLeavesOutPendingWebhooks(t *testing.T) {
	t.Parallel()
	s, _ := webhook.NewStripe(stripeSecret)
	fp := func(body string) []byte {
		t.Helper()
		h := http.Header{}
		s.Sign(h, time.Now(), []byte(body))
		d, err := s.Verify(request(h, body), []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return d.Fingerprint
	}
	first := fp(`{"id":"evt_1","type":"charge.refunded","pending_webhooks":2,"data":{"object":{"amount":100}}}`)
	if again := fp(`{"id":"evt_1","type":"charge.refunded","pending_webhooks":1,"data":{"object":{"amount":100}}}`); !bytes.Equal(first, again) {
		t.Error("a redelivery that differs only in pending_webhooks has another fingerprint")
	}
	if other := fp(`{"id":"evt_1","type":"charge.refunded","pending_webhooks":2,"data":{"object":{"amount":999}}}`); bytes.Equal(first, other) {
		t.Error("another amount has the same fingerprint")
	}
}

// GitHub's documentation gives this secret, payload and signature to test
// an implementation against.
func TestGitHubVerifiesTheDocumentedVector(t *testing.T) {
	t.Parallel()
	g, err := webhook.NewGitHub("an old secret", "It's a Secret to Everybody")
	if err != nil {
		t.Fatal(err)
	}
	header := http.Header{
		"X-Hub-Signature-256": {"sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"},
		"X-Github-Delivery":   {"72d3162e-cc78-11e3-81ab-4c9367dc0958"},
		"X-Github-Event":      {"issues"},
	}
	d, err := g.Verify(request(header, "Hello, World!"), []byte("Hello, World!"))
	if err != nil {
		t.Fatal(err)
	}
	if d.ID != "72d3162e-cc78-11e3-81ab-4c9367dc0958" || d.Type != "issues" || !d.SignedAt.IsZero() {
		t.Errorf("delivery %+v", d)
	}
	g, _ = webhook.NewGitHub("It's a Secret to Everybody")
	h := http.Header{}
	g.Sign(h, "72d3162e-cc78-11e3-81ab-4c9367dc0958", []byte("Hello, World!"))
	if got := h.Get("X-Hub-Signature-256"); got != header.Get("X-Hub-Signature-256") {
		t.Errorf("Sign = %s", got)
	}
}

// Every way a delivery can fail verification, for each scheme, gives the
// sentinel that the receiver answers with its problem.
func TestSchemesRefuseWhatTheyCannotVerify(t *testing.T) {
	t.Parallel()
	sw, _ := webhook.NewStandardWebhooks("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
	swBody := `{"test": 2432232314}`
	sw1 := http.Header{
		"Webhook-Id":        {"msg_p5jXN8AQM9LWM0D4loKWxJek"},
		"Webhook-Timestamp": {"1614265330"},
		"Webhook-Signature": {"v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="},
	}
	st, _ := webhook.NewStripe(stripeSecret)
	gh, _ := webhook.NewGitHub("It's a Secret to Everybody")
	gh1 := http.Header{
		"X-Hub-Signature-256": {"sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"},
		"X-Github-Delivery":   {"72d3162e"},
	}
	with := func(h http.Header, name string, values ...string) http.Header {
		h = h.Clone()
		if values == nil {
			h.Del(name)
		} else {
			h[http.CanonicalHeaderKey(name)] = values
		}
		return h
	}
	for _, c := range []struct {
		name   string
		scheme webhook.Scheme
		header http.Header
		body   string
		want   error
	}{
		{"sw: no id", sw, with(sw1, "Webhook-Id"), swBody, webhook.ErrUnsigned},
		{"sw: empty id", sw, with(sw1, "Webhook-Id", ""), swBody, webhook.ErrUnsigned},
		{"sw: no timestamp", sw, with(sw1, "Webhook-Timestamp"), swBody, webhook.ErrUnsigned},
		{"sw: no signature", sw, with(sw1, "Webhook-Signature"), swBody, webhook.ErrUnsigned},
		{"sw: two ids", sw, with(sw1, "Webhook-Id", "a", "b"), swBody, webhook.ErrMalformed},
		{"sw: timestamp not a number", sw, with(sw1, "Webhook-Timestamp", "yesterday"), swBody, webhook.ErrMalformed},
		{"sw: signature not version,base64", sw, with(sw1, "Webhook-Signature", "g0hM9SsE"), swBody, webhook.ErrMalformed},
		{"sw: another body", sw, sw1, `{"test": 1}`, webhook.ErrSignatureInvalid},
		{"sw: another id", sw, with(sw1, "Webhook-Id", "msg_other"), swBody, webhook.ErrSignatureInvalid},
		{"sw: another timestamp", sw, with(sw1, "Webhook-Timestamp", "1614265331"), swBody, webhook.ErrSignatureInvalid},
		{"sw: the signature under v1a", sw, with(sw1, "Webhook-Signature", "v1a,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="), swBody, webhook.ErrSignatureInvalid},
		{"stripe: no header", st, http.Header{}, stripeBody, webhook.ErrUnsigned},
		{"stripe: no t", st, http.Header{"Stripe-Signature": {"v1=" + stripeV1}}, stripeBody, webhook.ErrMalformed},
		{"stripe: two t", st, http.Header{"Stripe-Signature": {"t=1700000000,t=1700000001,v1=" + stripeV1}}, stripeBody, webhook.ErrMalformed},
		{"stripe: no v1", st, http.Header{"Stripe-Signature": {"t=1700000000,v0=" + stripeV1}}, stripeBody, webhook.ErrMalformed},
		{"stripe: v1 not hex", st, http.Header{"Stripe-Signature": {"t=1700000000,v1=zz"}}, stripeBody, webhook.ErrMalformed},
		{"stripe: another t", st, http.Header{"Stripe-Signature": {"t=1700000001,v1=" + stripeV1}}, stripeBody, webhook.ErrSignatureInvalid},
		{"stripe: another body", st, http.Header{"Stripe-Signature": {"t=1700000000,v1=" + stripeV1}}, stripeBody + " ", webhook.ErrSignatureInvalid},
		{"stripe: upper-case hex of another", st, http.Header{"Stripe-Signature": {"t=1700000000,v1=" + strings.ToUpper(stripeV1Next)}}, stripeBody, webhook.ErrSignatureInvalid},
		{"github: no signature", gh, with(gh1, "X-Hub-Signature-256"), "Hello, World!", webhook.ErrUnsigned},
		{"github: no delivery id", gh, with(gh1, "X-Github-Delivery"), "Hello, World!", webhook.ErrUnsigned},
		{"github: sha1", gh, with(gh1, "X-Hub-Signature-256", "sha1=7d38cdd689735b008b3c702edd92eea23791c5f6"), "Hello, World!", webhook.ErrMalformed},
		{"github: another body", gh, gh1, "Hello, World?", webhook.ErrSignatureInvalid},
	} {
		_, err := c.scheme.Verify(request(c.header, c.body), []byte(c.body))
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// A Stripe body that is signed but names no event cannot be recorded.
	h := http.Header{}
	st.Sign(h, time.Now(), []byte(`{"object":"event"}`))
	if _, err := st.Verify(request(h, `{"object":"event"}`), []byte(`{"object":"event"}`)); !errors.Is(err, webhook.ErrMalformed) {
		t.Errorf("stripe: no id in the body: %v, want ErrMalformed", err)
	}
}

func TestSchemeConstructorsRefuseMissingSecrets(t *testing.T) {
	t.Parallel()
	for name, err := range map[string]error{
		"NewStandardWebhooks()":     second(webhook.NewStandardWebhooks()),
		"NewStandardWebhooks(\"\")": second(webhook.NewStandardWebhooks("")),
		"NewStandardWebhooks(bad)":  second(webhook.NewStandardWebhooks("whpk_AAAA")),
		"NewStripe()":               second(webhook.NewStripe()),
		"NewStripe(\"\")":           second(webhook.NewStripe("whsec_x", "")),
		"NewGitHub()":               second(webhook.NewGitHub()),
		"NewGitHub(\"\")":           second(webhook.NewGitHub("")),
	} {
		if !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
	pub, _ := webhook.NewStandardWebhooks("whpk_" + strings.Repeat("A", 43) + "=")
	if err := pub.Sign(http.Header{}, "msg", time.Now(), nil); err == nil {
		t.Error("a scheme with only a public key signed")
	}
}

func second[T any](_ T, err error) error { return err }
