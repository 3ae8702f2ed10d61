package outbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/webhooksig"
)

// WebhookConfig is how [NewWebhookHandler] delivers messages. Zero fields
// mean their defaults; a negative Timeout means none. Either URL and
// Secrets, for one receiver, or Endpoint, for a receiver per message, is
// required.
type WebhookConfig struct {
	// URL is where every message is POSTed: an absolute http or https URL.
	// Redirects are not followed (a 3xx is a failed attempt), as the
	// Standard Webhooks specification recommends: update the URL instead.
	URL string

	// Secrets sign every delivery to URL, in the forms of the Standard
	// Webhooks specification: "whsec_" and the base64 of a symmetric
	// secret (a v1 signature, HMAC-SHA256), or "whsk_" and the base64 of an
	// ed25519 seed (a v1a signature). Each makes one signature of the
	// webhook-signature header: while rotating, list the new secret and
	// the old, and the receiver accepts the delivery with either. At least
	// one is required with URL.
	Secrets []string

	// Endpoint returns the URL and secrets of the message's receiver, for
	// a service that notifies many (its customers' endpoints, say, by
	// msg.Destination). An error it returns fails the attempt, which the
	// relay retries; an endpoint whose URL or secrets cannot work parks the
	// message. Set it or URL and Secrets, not both.
	Endpoint func(ctx context.Context, msg Message) (WebhookEndpoint, error)

	// Client sends the requests; its CheckRedirect is replaced by one that
	// follows no redirect. Defaults to a client on http.DefaultTransport.
	Client *http.Client

	// Timeout bounds each attempt, from the request to the end of the
	// answer's headers, within the relay's own bound (the handler's
	// context ends shortly before the message's lease, Config.LeaseDuration,
	// runs out). The specification recommends that receivers get 15 to 30
	// seconds. Negative means none of its own. Defaults to 30s.
	Timeout time.Duration

	// ContentType is the deliveries' Content-Type, a media type. Defaults
	// to application/json.
	ContentType string
}

// WebhookEndpoint is a receiver of webhooks: where a message goes, and the
// secrets that sign it there (see [WebhookConfig]).
type WebhookEndpoint struct {
	URL     string
	Secrets []string
}

// Defaults of the WebhookConfig fields.
const (
	defaultWebhookTimeout     = 30 * time.Second
	defaultWebhookContentType = "application/json"
)

// NewWebhookHandler returns a [Handler] that delivers each message as a
// Standard Webhooks delivery (https://www.standardwebhooks.com): a POST of
// msg.Payload with the headers webhook-id, msg.IdempotencyKey, the same on
// every attempt and from every relay, so that the receiver recognises a
// redelivery; webhook-timestamp, the time of the attempt in Unix seconds;
// and webhook-signature, a signature per secret over
// "{webhook-id}.{webhook-timestamp}.{body}". idem's own receiver
// (idemhttp/webhook) and the specification's reference libraries verify
// them.
//
// It reads the answer as the specification describes:
//
//   - 2xx: delivered;
//   - 410 Gone: the receiver wants no more deliveries: the message is
//     parked at once ([Park]), for someone to look at, and Requeue;
//   - any other answer (3xx, since redirects are not followed, and every
//     other 4xx and 5xx), a timeout, a connection that failed: the
//     attempt failed, and the relay retries it with its backoff
//     (Config.RetryDelay, Config.MaxRetryDelay), no sooner than the
//     answer's Retry-After asks (see [RetryAfter]), until
//     Config.MaxAttempts, and then parks it. So a refusal that time
//     mends, such as idem's receiver's 400 webhook-stale while a clock is
//     off, or a 401 while a secret is being rotated, is delivered once it
//     is mended, without a Requeue.
//
// A failed attempt's error, which the relay logs and stores as the
// message's last_error, names the URL without its userinfo or query
// (wherever it shows it, net/http's own errors included) and the
// answer's status, with the first bytes of its body. NewWebhookHandler checks cfg
// once, and refuses a field that cannot work with an error that names it
// and wraps [idem.ErrInvalidOption].
func NewWebhookHandler(cfg WebhookConfig) (Handler, error) {
	invalid := func(field, format string, args ...any) error {
		return &idem.FieldError{Package: "outbox", Field: "WebhookConfig." + field, Problem: fmt.Sprintf(format, args...)}
	}
	var static *endpoint
	switch {
	case cfg.Endpoint != nil && (cfg.URL != "" || cfg.Secrets != nil):
		return nil, invalid("Endpoint", "is set, and so are URL or Secrets: choose one")
	case cfg.Endpoint == nil && cfg.URL == "":
		return nil, invalid("URL", "is required, unless Endpoint is set")
	case cfg.Endpoint == nil:
		ep, field, err := parseEndpoint(WebhookEndpoint{URL: cfg.URL, Secrets: cfg.Secrets})
		if err != nil {
			return nil, invalid(field, "%v", err)
		}
		static = &ep
	}
	timeout := cfg.Timeout
	if timeout == 0 {
		timeout = defaultWebhookTimeout
	}
	contentType := cfg.ContentType
	if contentType == "" {
		contentType = defaultWebhookContentType
	} else if _, _, err := mime.ParseMediaType(contentType); err != nil {
		return nil, invalid("ContentType", "%q is not a media type", contentType)
	}
	client := &http.Client{}
	if cfg.Client != nil {
		copied := *cfg.Client
		client = &copied
	}
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

	s := &webhookSender{static: static, endpoint: cfg.Endpoint, client: client, timeout: timeout, contentType: contentType}
	return s.deliver, nil
}

// endpoint is a WebhookEndpoint checked.
type endpoint struct {
	url      string
	shownURL string // without its userinfo or query, for errors
	keys     webhooksig.Keys
}

// parseEndpoint checks a receiver's URL and secrets, and says which of the
// two is wrong.
func parseEndpoint(e WebhookEndpoint) (endpoint, string, error) {
	u, err := url.Parse(e.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return endpoint{}, "URL", errors.New("is not an absolute http or https URL")
	}
	keys, err := webhooksig.ParseKeys(e.Secrets)
	if err != nil {
		return endpoint{}, "Secrets", err
	}
	if !keys.CanSign() {
		return endpoint{}, "Secrets", errors.New("hold no whsec_ or whsk_ secret to sign with")
	}
	return endpoint{url: e.URL, shownURL: u.Scheme + "://" + u.Host + u.Path, keys: keys}, "", nil
}

// webhookSender is a Handler made by NewWebhookHandler.
type webhookSender struct {
	static      *endpoint
	endpoint    func(context.Context, Message) (WebhookEndpoint, error)
	client      *http.Client
	timeout     time.Duration // negative: none
	contentType string
}

// answerExcerpt bounds what of a failed answer's body goes into its error,
// and answerDrain what is read of any answer, so that the connection can
// be used again.
const (
	answerExcerpt = 256
	answerDrain   = 64 << 10
)

func (s *webhookSender) deliver(ctx context.Context, msg Message) error {
	ep := s.static
	if ep == nil {
		e, err := s.endpoint(ctx, msg)
		if err != nil {
			return fmt.Errorf("outbox: webhook endpoint: %w", err)
		}
		checked, field, err := parseEndpoint(e)
		if err != nil {
			return Park(fmt.Errorf("outbox: webhook endpoint: %s %w", field, err))
		}
		ep = &checked
	}
	if s.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep.url, bytes.NewReader(msg.Payload))
	if err != nil {
		return Park(fmt.Errorf("outbox: webhook to %s: %w", ep.shownURL, redactURL(err, ep.shownURL)))
	}
	now := time.Now()
	req.Header.Set(webhooksig.HeaderID, msg.IdempotencyKey)
	req.Header.Set(webhooksig.HeaderTimestamp, strconv.FormatInt(now.Unix(), 10))
	req.Header.Set(webhooksig.HeaderSignature, ep.keys.Sign(msg.IdempotencyKey, now.Unix(), msg.Payload))
	req.Header.Set("Content-Type", s.contentType)
	res, err := s.client.Do(req)
	if err != nil {
		return fmt.Errorf("outbox: webhook to %s: %w", ep.shownURL, redactURL(err, ep.shownURL))
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, answerDrain))
		_ = res.Body.Close()
	}()
	if res.StatusCode >= 200 && res.StatusCode < 300 {
		return nil
	}
	excerpt, _ := io.ReadAll(io.LimitReader(res.Body, answerExcerpt))
	err = fmt.Errorf("outbox: webhook to %s: %s: %s", ep.shownURL, res.Status, strings.TrimSpace(string(excerpt)))
	if res.StatusCode == http.StatusGone {
		return Park(err)
	}
	if d, ok := retryAfter(res.Header.Get("Retry-After"), now); ok {
		return RetryAfter(err, d)
	}
	return err
}

// redactURL replaces the URL of every *url.Error in err's chain, which
// net/http gives whole, its userinfo and query included, with shown, and
// returns err: the error keeps its types, and shows no credential of the
// URL.
func redactURL(err error, shown string) error {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if urlErr, ok := e.(*url.Error); ok {
			urlErr.URL = shown
		}
	}
	return err
}

// retryAfter reads a Retry-After field, delta-seconds or an HTTP-date, as
// the wait from now; false when there is none to honour.
func retryAfter(value string, now time.Time) (time.Duration, bool) {
	value = strings.TrimSpace(value)
	if value == "" {
		return 0, false
	}
	if secs, err := strconv.ParseInt(value, 10, 64); err == nil {
		if secs <= 0 {
			return 0, false
		}
		return time.Duration(min(secs, int64(maxRetryAfter/time.Second))) * time.Second, true
	}
	at, err := http.ParseTime(value)
	if err != nil || !at.After(now) {
		return 0, false
	}
	return min(at.Sub(now), maxRetryAfter), true
}

// maxRetryAfter bounds what a Retry-After is read as, before the relay
// caps it with Config.MaxRetryDelay: far beyond any cap, and far from
// overflowing a duration.
const maxRetryAfter = 100 * 365 * 24 * time.Hour
