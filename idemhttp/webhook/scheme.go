package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/webhooksig"
)

// A Scheme verifies the signature of a sender's deliveries and says which
// event each carries. [StandardWebhooks], [Stripe] and [GitHub] are the
// schemes idem provides; a sender of another kind is served by a Scheme of
// the application's own, which idem then treats like these.
type Scheme interface {
	// Verify checks the signature of the delivery r, whose body, read
	// whole already, is body, and returns the event it carries. An error
	// that wraps [ErrUnsigned], [ErrMalformed], [ErrSignatureInvalid] or
	// [ErrStale] refuses the delivery with the problem of that name (400),
	// and is counted as such; any other error is the receiver's own
	// failure (500), which the sender retries. It is called before
	// anything else is done with the delivery, concurrently, and must not
	// read r.Body.
	Verify(r *http.Request, body []byte) (Delivery, error)
}

// Delivery is what a [Scheme] finds in a delivery it verified.
type Delivery struct {
	// ID is the event's id: the same on every delivery of the event, and
	// distinct from every other event's id of the sender. Required.
	ID string

	// SignedAt is the time that the signature covers, which the
	// receiver's tolerance applies to ([Config.Tolerance]); zero when the
	// scheme signs no time, as GitHub's does not.
	SignedAt time.Time

	// Fingerprint is what makes two deliveries with the same ID the same
	// event. Nil means the body's: its SHA-256, so that the same id with
	// any other body is refused.
	Fingerprint []byte

	// Type is the event's type, when the scheme knows where the sender
	// puts it ("payment_intent.succeeded", "push"); "" otherwise.
	Type string
}

// Errors a [Scheme] returns, and the receiver answers with a problem of
// their own (see [ProblemUnsigned] and the codes after it). Each says
// nothing of the secrets.
var (
	// ErrUnsigned: a header that the scheme needs (the signature, the
	// event's id, the timestamp) is missing or empty.
	ErrUnsigned = errors.New("webhook: delivery is not signed")

	// ErrMalformed: a header that the scheme needs, or the event's id in
	// the body where the scheme keeps it there, cannot be read.
	ErrMalformed = errors.New("webhook: delivery's signature cannot be read")

	// ErrSignatureInvalid: no signature of the delivery was made with any
	// of the secrets: a wrong secret, a body changed on the way, or a
	// forgery.
	ErrSignatureInvalid = errors.New("webhook: no signature matches")

	// ErrStale: the time the signature covers is older than the
	// receiver's tolerance, or further ahead of its clock than the scheme
	// allows (see Config.Tolerance): a delivery replayed long after it was
	// signed, or a clock that is far off.
	ErrStale = errors.New("webhook: delivery's timestamp is outside the tolerance")
)

// header returns the one value of the field name, ErrUnsigned when it is
// missing or empty, and ErrMalformed when it is sent more than once, which
// would leave the receiver to guess which one the sender meant.
func header(r *http.Request, name string) (string, error) {
	values := r.Header.Values(name)
	switch {
	case len(values) > 1:
		return "", fmt.Errorf("%w: %s is sent %d times", ErrMalformed, name, len(values))
	case len(values) == 0 || strings.TrimSpace(values[0]) == "":
		return "", fmt.Errorf("%w: no %s header", ErrUnsigned, name)
	}
	return strings.TrimSpace(values[0]), nil
}

// StandardWebhooks is the scheme of the Standard Webhooks specification
// (https://www.standardwebhooks.com), which the outbox's webhook sender
// also speaks: the event's id in webhook-id, the time of the attempt in
// webhook-timestamp (Unix seconds), and in webhook-signature a
// space-separated list of signatures over "{id}.{timestamp}.{body}", v1
// (HMAC-SHA256) or v1a (ed25519), each "version,base64". A delivery is
// accepted when any signature of the list matches any secret: senders sign
// with the old and the new secret while they rotate it.
type StandardWebhooks struct{ keys webhooksig.Keys }

// NewStandardWebhooks returns the scheme for the secrets, in the forms
// the specification gives them: "whsec_" and the base64 of a symmetric
// secret (verifies v1, and signs it), "whpk_" and the base64 of an ed25519
// public key (verifies v1a), "whsk_" and the base64 of an ed25519 seed
// (verifies v1a with its public key, and signs it). A secret without a
// prefix is taken as symmetric, as the reference libraries take it. List
// several while the sender rotates its secret. It refuses no secrets, and
// a secret that does not parse, with an error that names its index and
// wraps [idem.ErrInvalidOption].
func NewStandardWebhooks(secrets ...string) (*StandardWebhooks, error) {
	keys, err := webhooksig.ParseKeys(secrets)
	if err != nil {
		return nil, &idem.FieldError{Package: "webhook", Field: "NewStandardWebhooks", Problem: err.Error(), Err: err}
	}
	return &StandardWebhooks{keys: keys}, nil
}

// Verify implements [Scheme]. The event's type is the body's "type"
// member, when the body is a JSON object that has one, as the
// specification recommends.
func (s *StandardWebhooks) Verify(r *http.Request, body []byte) (Delivery, error) {
	id, err := header(r, webhooksig.HeaderID)
	if err != nil {
		return Delivery{}, err
	}
	ts, err := header(r, webhooksig.HeaderTimestamp)
	if err != nil {
		return Delivery{}, err
	}
	sigs := strings.Join(r.Header.Values(webhooksig.HeaderSignature), " ")
	if strings.TrimSpace(sigs) == "" {
		return Delivery{}, fmt.Errorf("%w: no %s header", ErrUnsigned, webhooksig.HeaderSignature)
	}
	unix, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return Delivery{}, fmt.Errorf("%w: %s is not Unix seconds", ErrMalformed, webhooksig.HeaderTimestamp)
	}
	switch err := s.keys.Verify(id, unix, body, sigs); {
	case errors.Is(err, webhooksig.ErrMalformed):
		return Delivery{}, fmt.Errorf("%w: %s: %w", ErrMalformed, webhooksig.HeaderSignature, err)
	case err != nil:
		return Delivery{}, fmt.Errorf("%w: %s", ErrSignatureInvalid, webhooksig.HeaderSignature)
	}
	return Delivery{ID: id, SignedAt: time.Unix(unix, 0), Type: jsonType(body)}, nil
}

// Sign sets on h the headers with which a sender holding the scheme's
// signing secrets (its whsec_ and whsk_ ones) delivers body as the event id
// at the time at: for tests of a receiver, and for senders other than the
// outbox's. It fails when the scheme holds only public keys.
func (s *StandardWebhooks) Sign(h http.Header, id string, at time.Time, body []byte) error {
	if !s.keys.CanSign() {
		return errors.New("webhook: StandardWebhooks.Sign: the scheme holds no whsec_ or whsk_ secret to sign with")
	}
	h.Set(webhooksig.HeaderID, id)
	h.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(at.Unix(), 10))
	h.Set(webhooksig.HeaderSignature, s.keys.Sign(id, at.Unix(), body))
	return nil
}

// jsonType is the "type" member of body, when body is a JSON object with a
// string there.
func jsonType(body []byte) string {
	var v struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(body, &v) != nil {
		return ""
	}
	return v.Type
}

// Stripe is the scheme of Stripe's webhooks: the Stripe-Signature header,
// "t=<Unix seconds>,v1=<hex>", with one v1 per signing secret, each the
// lower-case hex HMAC-SHA256 of "{t}.{body}" keyed with the endpoint's
// signing secret ("whsec_..." as it is, its bytes the key). Other entries,
// such as v0, are passed over. The event's id and type are the body's
// "id" and "type".
//
// Two deliveries of one event are the same event when their bodies are
// equal but for the member "pending_webhooks", a count of the endpoints
// that have not yet acknowledged the event, which changes between
// deliveries.
type Stripe struct{ secrets [][]byte }

// NewStripe returns the scheme for the endpoint's signing secrets: list
// the old and the new one while Stripe rolls the secret. It refuses no
// secrets, and an empty one, with an error that wraps
// [idem.ErrInvalidOption].
func NewStripe(secrets ...string) (*Stripe, error) {
	raw, err := rawSecrets("NewStripe", secrets)
	if err != nil {
		return nil, err
	}
	return &Stripe{secrets: raw}, nil
}

// stripeHeader is Stripe's signature header.
const stripeHeader = "Stripe-Signature"

// Verify implements [Scheme].
func (s *Stripe) Verify(r *http.Request, body []byte) (Delivery, error) {
	value, err := header(r, stripeHeader)
	if err != nil {
		return Delivery{}, err
	}
	var ts string
	var sigs [][]byte
	for item := range strings.SplitSeq(value, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(item), "=")
		switch {
		case !ok:
		case k == "t" && ts != "":
			return Delivery{}, fmt.Errorf("%w: %s holds two timestamps", ErrMalformed, stripeHeader)
		case k == "t":
			ts = v
		case k == "v1":
			if sig, err := hex.DecodeString(v); err == nil && len(sig) == sha256.Size {
				sigs = append(sigs, sig)
			}
		}
	}
	unix, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || len(sigs) == 0 {
		return Delivery{}, fmt.Errorf("%w: %s is not t=<Unix seconds>,v1=<hex>", ErrMalformed, stripeHeader)
	}
	content := slices.Concat([]byte(strconv.FormatInt(unix, 10)), []byte("."), body)
	if !anyMAC(s.secrets, content, sigs) {
		return Delivery{}, fmt.Errorf("%w: %s", ErrSignatureInvalid, stripeHeader)
	}
	var event struct {
		ID   string `json:"id"`
		Type string `json:"type"`
	}
	if json.Unmarshal(body, &event) != nil || event.ID == "" {
		return Delivery{}, fmt.Errorf("%w: the body has no event id", ErrMalformed)
	}
	return Delivery{ID: event.ID, SignedAt: time.Unix(unix, 0), Fingerprint: stripeFingerprint(body), Type: event.Type}, nil
}

// Sign sets on h the Stripe-Signature header with which Stripe, holding
// the scheme's secrets, delivers body at the time at: for tests of a
// receiver.
func (s *Stripe) Sign(h http.Header, at time.Time, body []byte) {
	t := strconv.FormatInt(at.Unix(), 10)
	content := slices.Concat([]byte(t), []byte("."), body)
	value := "t=" + t
	for _, secret := range s.secrets {
		value += ",v1=" + hex.EncodeToString(webhooksig.MAC(secret, content))
	}
	h.Set(stripeHeader, value)
}

// stripeFingerprint is the fingerprint of a Stripe event: its members but
// "pending_webhooks", each by its exact bytes, in the order of their
// names. A body that is not a JSON object, which Stripe never sends, is
// fingerprinted whole.
func stripeFingerprint(body []byte) []byte {
	var members map[string]json.RawMessage
	if json.Unmarshal(body, &members) != nil {
		return idem.Fingerprint([]byte("body"), body)
	}
	delete(members, "pending_webhooks")
	parts := [][]byte{[]byte("members")}
	for _, name := range slices.Sorted(maps.Keys(members)) {
		parts = append(parts, []byte(name), members[name])
	}
	return idem.Fingerprint(parts...)
}

// GitHub is the scheme of GitHub's webhooks: X-Hub-Signature-256,
// "sha256=" and the lower-case hex HMAC-SHA256 of the body keyed with the
// webhook's secret, and the event's id in X-GitHub-Delivery, which a
// redelivery keeps. Its type is X-GitHub-Event.
//
// GitHub signs no time: the receiver's tolerance does not apply, and a
// delivery captured on the way and sent again after the receiver's
// retention has passed would be applied again. Serve the endpoint over
// HTTPS only, and keep the retention long.
type GitHub struct{ secrets [][]byte }

// NewGitHub returns the scheme for the webhook's secrets: list the old and
// the new one while the secret is changed (GitHub signs with one). It
// refuses no secrets, and an empty one, with an error that wraps
// [idem.ErrInvalidOption].
func NewGitHub(secrets ...string) (*GitHub, error) {
	raw, err := rawSecrets("NewGitHub", secrets)
	if err != nil {
		return nil, err
	}
	return &GitHub{secrets: raw}, nil
}

// GitHub's headers.
const (
	githubSignature = "X-Hub-Signature-256"
	githubDelivery  = "X-GitHub-Delivery"
	githubEvent     = "X-GitHub-Event"
)

// Verify implements [Scheme].
func (g *GitHub) Verify(r *http.Request, body []byte) (Delivery, error) {
	value, err := header(r, githubSignature)
	if err != nil {
		return Delivery{}, err
	}
	id, err := header(r, githubDelivery)
	if err != nil {
		return Delivery{}, err
	}
	encoded, ok := strings.CutPrefix(value, "sha256=")
	sig, err := hex.DecodeString(encoded)
	if !ok || err != nil || len(sig) != sha256.Size {
		return Delivery{}, fmt.Errorf("%w: %s is not sha256=<hex>", ErrMalformed, githubSignature)
	}
	if !anyMAC(g.secrets, body, [][]byte{sig}) {
		return Delivery{}, fmt.Errorf("%w: %s", ErrSignatureInvalid, githubSignature)
	}
	return Delivery{ID: id, Type: r.Header.Get(githubEvent)}, nil
}

// Sign sets on h the headers with which GitHub, holding the scheme's first
// secret, delivers body as the delivery id: for tests of a receiver.
func (g *GitHub) Sign(h http.Header, id string, body []byte) {
	h.Set(githubDelivery, id)
	h.Set(githubSignature, "sha256="+hex.EncodeToString(webhooksig.MAC(g.secrets[0], body)))
}

// rawSecrets takes secrets that are keys as they are, refusing none and
// empty ones.
func rawSecrets(fn string, secrets []string) ([][]byte, error) {
	if len(secrets) == 0 {
		return nil, &idem.FieldError{Package: "webhook", Field: fn, Problem: "no secrets"}
	}
	raw := make([][]byte, len(secrets))
	for i, s := range secrets {
		if s == "" {
			return nil, &idem.FieldError{Package: "webhook", Field: fn, Problem: fmt.Sprintf("secret %d is empty", i)}
		}
		raw[i] = []byte(s)
	}
	return raw, nil
}

// anyMAC reports whether any of sigs is the HMAC-SHA256 of content under
// any of secrets, comparing in constant time.
func anyMAC(secrets [][]byte, content []byte, sigs [][]byte) bool {
	for _, secret := range secrets {
		m := webhooksig.MAC(secret, content)
		for _, sig := range sigs {
			if hmac.Equal(m, sig) {
				return true
			}
		}
	}
	return false
}
