package idemhttp

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
	"github.com/pgidem/idem/internal/backoff"
)

// Transport is an [http.RoundTripper] for the clients of an idemhttp
// server: it gives each request without an idempotency key a fresh one, and
// sends the request again, with the same key and the same body, until it
// gets an answer that another attempt would not change. A request made
// from a flow's call is the exception: see "Flows". Its rules are
// stated here, once; the section "The client: idemhttp.Transport" of
// docs/http.md places it among the other clients and measures it. Put it
// in an [http.Client]:
//
//	client := &http.Client{Transport: &idemhttp.Transport{}}
//
// Its zero value sends over [http.DefaultTransport] with the defaults
// stated on each field. It is safe for concurrent use, keeps no state of
// its own, and does not modify the request it is given: the key goes on a
// copy.
//
// # Which answers are retried
//
//   - An error from Base, such as a refused connection or one cut before
//     the answer arrived, is retried, except a TLS certificate that does
//     not verify and an error after the request's context is done.
//   - 409 with a Retry-After field, as idemhttp answers key-in-progress
//     while the request's first attempt still runs, is retried no sooner
//     than Retry-After says. A 409 without one is the handler's own answer,
//     such as a conflict in the data, and is returned.
//   - A 5xx is retried, also no sooner than its Retry-After, if any,
//     except 501 and 505, which no retry changes.
//   - Every other answer is returned as it is: a 2xx or 3xx, and every
//     other 4xx, 400 and 422 included, which the same request would get
//     again. So is any answer marked Idempotent-Replayed: true, which is
//     the stored answer of an earlier attempt and would come back again.
//
// Before a retry the Transport waits: [Transport.BaseDelay] before the
// first, twice as long before each next one, up to [Transport.MaxDelay],
// each wait a random time between its half and its whole (jitter, so that
// clients that failed together do not come back together), and never less
// than the answer's Retry-After. It stops at [Transport.MaxAttempts]; when
// a wait would end past the deadline of the request's context, or
// Retry-After asks for longer than MaxDelay, it stops at once and returns
// the last answer or error rather than wait in vain. A context cancelled
// while it waits ends the wait at once. So the request's context bounds
// the whole call, every attempt and every wait; give it a deadline
// (context.WithTimeout, or [http.Client.Timeout]).
// [Transport.AttemptTimeout] bounds each attempt (30s by default), so
// that one that hangs is given up and retried rather than waited for.
//
// # The key
//
// A request that already carries the key's field keeps it, as it is: a
// caller that must know the key before the call (to store it with the
// operation, so that a restarted process retries with it) sets it itself.
// The field counts whatever the case of its name: one set in the map
// directly, as req.Header["idempotency-key"], is sent under the canonical
// name, and the same key set twice is sent once, so that the server never
// sees two keys. A request whose field holds two different keys is refused
// before anything is sent, with an error that wraps [idem.ErrInvalidKey].
// Otherwise, unless the request is made from a flow's call, the Transport
// sets one from [Transport.NewKey], as an RFC 8941 sf-string, as the IETF
// draft specifies. GET, HEAD, OPTIONS and TRACE
// requests, safe by definition, get no key; they are retried as they are.
// Each request the Transport is given is one logical operation: an
// [http.Client] that follows a redirect sends a new request, which gets a
// key of its own.
//
// # Flows
//
// A request made from a flow's call ([idem.Call]: the context its function
// gets, or one derived from it, carries the call's provider key,
// [idem.ProviderKeyFromContext]) never gets a key from NewKey: the call's
// next attempt, which the flow makes after a crash or an uncertain
// failure, would send another, so a key of the Transport's own would
// protect only its own retries, and only at a provider that honours keys.
// Such a request, unless its method is safe, is sent:
//
//   - with [Transport.UseProviderKey], under the call's provider key, as
//     it is, unquoted, under Header (say "Cko-Idempotency-Key" or
//     "PayPal-Request-Id" for the provider that expects it), and retried
//     by the rules above: so every attempt of the call, in every process,
//     reaches the provider with the same key, and the call's function need
//     not copy the key into the request, and cannot forget it. A request
//     that already carries the call's key keeps it; one that carries
//     another is refused before anything is sent, with an error that wraps
//     [ErrKeyConflict]. Set it only for a provider that honours keys;
//   - without UseProviderKey, with the key the caller set, if any, and
//     retried by the rules above;
//   - without UseProviderKey and without a key: once, whatever
//     MaxAttempts says, with no key field, so that net/http does not send
//     it again by itself either (see "Go's own re-send"). This is the
//     client for a provider that ignores keys, which applies every
//     request it gets, and for a call that must not be made twice
//     ([idem.AtMostOnce]): whether the call is made again is the flow's
//     decision, and its error wraps [idem.ErrNotSent] when the request
//     surely never left.
//
// A request whose context carries no provider key, and one of a safe
// method, such as a [idem.Reconcile] lookup's GET, are sent as anywhere
// else. One call is one provider key: a call whose function sends two
// requests of side effects through the Transport sends both under its
// key, which a provider answers as a key reused with another request; give
// such requests a call each.
//
// # Errors that prove a request never left
//
// The error the Transport returns wraps [idem.ErrNotSent] when no attempt
// may have reached the server: every attempt failed before net/http had a
// connection to write it on (the host's name did not resolve, the
// connection was refused or timed out, its TLS handshake failed, the
// context ended while it waited for one), and when the Transport refused
// the request before sending anything. A flow's call that returns such an
// error is not counted as one that may have been applied (see
// [idem.ErrNotSent]), so that an [idem.AtMostOnce] call, or one past its
// provider window, is made again rather than stopped for a person. Every
// other error stays uncertain: one after a connection was had (a reset, a
// timeout while waiting for the answer), one of a request that an earlier
// attempt sent, and every error of a Base that is not an [http.Transport]
// and does not report its connections through [net/http/httptrace] (the
// Transport reads GetConn and GotConn: a connection asked for and never
// got).
//
// # The body
//
// Every attempt sends the whole body again. A request with [http.Request.GetBody]
// (which [http.NewRequest] sets for a *bytes.Buffer, *bytes.Reader or
// *strings.Reader) sends its Body first and then what GetBody returns; any
// other body is read whole before the first attempt, up to
// [Transport.MaxBodyBytes]. A larger one is refused, with an error that
// wraps an [*http.MaxBytesError], before anything is sent: set GetBody to
// send it.
//
// # What it reports
//
// [Attempts] returns the key and the number of attempts of the answer the
// Transport returns. When it returns an error instead, the error's text
// names both, and it wraps the last attempt's error, or the context's
// error that ended a wait. The Transport adds no header to the answer,
// which stays the server's.
//
// # Go's own re-send
//
// Base, when it is an [http.Transport], may itself send a request again
// within one attempt: it re-sends one that failed on a kept-alive
// connection before any byte of the answer came back, when the request
// carries an Idempotency-Key or X-Idempotency-Key field and its body can
// be sent again, as the Transport's attempts always can (Request.isReplayable
// and persistConn.shouldRetryRequest in net/http, as of Go 1.26; see "Go's
// net/http retries for you" in docs/http.md). Such a re-send carries the
// same key and body, is safe, and is not counted among the attempts. A
// request of a flow's call sent without a key (see "Flows") carries no
// such field: net/http re-sends it only when it wrote no byte of it.
//
// # Configuration
//
// The zero value of each field means its default, stated on the field; a
// negative value means none where the field says so. Since the Transport is
// a struct without a constructor, a field that cannot work is refused by
// RoundTrip, on every request and before anything is sent, with an error
// that names the field, such as "idemhttp: Transport.MaxDelay: ...", and
// wraps [idem.ErrInvalidOption].
type Transport struct {
	// Base sends each attempt. Defaults, when nil, to
	// [http.DefaultTransport].
	Base http.RoundTripper

	// Header is the name of the header field that carries the key, an HTTP
	// token: the server's [Config.Header], or the field a provider reads
	// keys from (with UseProviderKey, say "PayPal-Request-Id"). Defaults
	// to [DefaultHeader].
	Header string

	// NewKey returns the key of a request that has none; it is called
	// from every goroutine that sends a request. It must return 1
	// to 255 bytes of printable ASCII (space to tilde), which the Transport
	// sends as an sf-string; any other value is refused, with an error
	// that also wraps [idem.ErrInvalidKey], and the request is not sent.
	// Defaults to a random UUID (RFC 9562, version 4: 122 random bits from
	// crypto/rand).
	NewKey func() string

	// MaxAttempts is the most times a request is sent, its first attempt
	// included: 1 sends it once, without retries. Negative means no limit:
	// only the request's context ends the retries. Defaults to 5.
	MaxAttempts int

	// BaseDelay is the wait before the first retry; each next wait doubles,
	// up to MaxDelay, and each is jittered (see "Which answers are
	// retried"). Negative means none: a retry follows at once, unless the
	// answer's Retry-After asks for a wait. Defaults to 100ms.
	BaseDelay time.Duration

	// MaxDelay caps every wait before a retry. An answer whose Retry-After
	// asks for longer is returned rather than retried. When positive, it
	// must not be less than BaseDelay. Negative means no cap: the waits
	// keep doubling, any Retry-After is waited for, and only MaxAttempts
	// and the request's context end the retries. Defaults to 10s, twice
	// the Retry-After that idemhttp answers with its default [Config.Wait].
	MaxDelay time.Duration

	// AttemptTimeout bounds each attempt: from the moment it is handed to
	// Base until its answer's body is read to its end or closed, as
	// [http.Client.Timeout] bounds a whole request. An attempt past it is
	// given up (its connection closed) and counts as failed: it is retried
	// like any other error, within MaxAttempts and the request's context,
	// and the answer returned to the caller must be read within it too; it
	// makes a ResponseHeaderTimeout on the [http.Transport] underneath
	// needless. Negative means none: only the request's context bounds an attempt.
	// Defaults to 30s ([DefaultAttemptTimeout]): room for a slow answer,
	// and half of idem's [idem.DefaultCallTimeout], so that a flow's call
	// whose first attempt hung is tried again before the call's own bound
	// ends it.
	AttemptTimeout time.Duration

	// UseProviderKey makes the Transport send, on a request made from a
	// flow's call (whose context carries the call's provider key,
	// [idem.ProviderKeyFromContext]), that key under Header, and retry it,
	// so that every attempt of the call, in every process, reaches the
	// provider with the same key without the call's function naming it;
	// for a provider that honours keys. See "Flows" above. Defaults to
	// false: such a request that carries no key is sent once, without one.
	UseProviderKey bool

	// MaxBodyBytes is the largest request body read whole to be sent again,
	// for a request without GetBody; a larger one is refused before
	// anything is sent. A request with GetBody is never read ahead.
	// Negative means no limit. Defaults to [DefaultMaxBodyBytes], 1 MiB,
	// the largest body that idemhttp accepts by default.
	MaxBodyBytes int64
}

// DefaultAttemptTimeout is how long an attempt of a [Transport] may take
// unless [Transport.AttemptTimeout] says otherwise.
const DefaultAttemptTimeout = 30 * time.Second

// Defaults of the Transport's fields.
const (
	defaultMaxAttempts = 5
	defaultBaseDelay   = 100 * time.Millisecond
	defaultMaxDelay    = 10 * time.Second

	// drainBytes is how much of an answer that is retried is read, so that
	// its connection can carry the next attempt; the rest is dropped with
	// the connection.
	drainBytes = 64 << 10
)

// transportSettings are a Transport's fields checked, with their defaults
// applied.
type transportSettings struct {
	base   http.RoundTripper
	header string
	newKey func() string
	// maxAttempts is math.MaxInt when there is no limit.
	maxAttempts int
	// baseDelay is 0 when there is none.
	baseDelay time.Duration
	// maxDelay is math.MaxInt64 when there is no cap.
	maxDelay time.Duration
	// maxBodyBytes is math.MaxInt64 when there is no limit.
	maxBodyBytes int64
	// attemptTimeout is 0 when there is none.
	attemptTimeout time.Duration
	useProviderKey bool
}

func (t *Transport) settings() (transportSettings, error) {
	s := transportSettings{
		base:         t.base(),
		header:       http.CanonicalHeaderKey(cmp.Or(t.Header, DefaultHeader)),
		newKey:       t.NewKey,
		maxAttempts:  cmp.Or(t.MaxAttempts, defaultMaxAttempts),
		baseDelay:    cmp.Or(t.BaseDelay, defaultBaseDelay),
		maxDelay:     cmp.Or(t.MaxDelay, defaultMaxDelay),
		maxBodyBytes: cmp.Or(t.MaxBodyBytes, DefaultMaxBodyBytes),

		attemptTimeout: max(cmp.Or(t.AttemptTimeout, DefaultAttemptTimeout), 0),
		useProviderKey: t.UseProviderKey,
	}
	if t.Header != "" && !isToken(t.Header) {
		return s, invalidField("Transport.Header", "%q is not a header field name", t.Header)
	}
	if s.newKey == nil {
		s.newKey = adapter.NewUUID
	}
	if s.maxAttempts < 0 {
		s.maxAttempts = math.MaxInt
	}
	if s.baseDelay < 0 {
		s.baseDelay = 0
	}
	switch {
	case s.maxDelay < 0:
		s.maxDelay = math.MaxInt64
	case s.maxDelay < s.baseDelay && t.MaxDelay == 0:
		return s, invalidField("Transport.BaseDelay", "%s is more than Transport.MaxDelay, which defaults to %s", s.baseDelay, s.maxDelay)
	case s.maxDelay < s.baseDelay:
		return s, invalidField("Transport.MaxDelay", "%s is less than Transport.BaseDelay, %s; negative means no cap", s.maxDelay, s.baseDelay)
	}
	if s.maxBodyBytes < 0 {
		s.maxBodyBytes = math.MaxInt64
	}
	return s, nil
}

// RoundTrip sends req, with its idempotency key, as many times as the
// Transport's rules say (see [Transport]), and returns the last answer, or
// an error when no attempt got one.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	s, err := t.settings()
	if err != nil {
		closeBody(req)
		return nil, unsent(err)
	}
	out := req.Clone(req.Context())
	if out.Header == nil {
		out.Header = make(http.Header)
	}
	key, once, err := s.setKey(out)
	if err != nil {
		closeBody(req)
		return nil, unsent(err)
	}
	if once {
		s.maxAttempts = 1
	}
	body, err := s.replayable(req, out)
	if err != nil {
		return nil, unsent(err)
	}
	return s.send(out, key, body)
}

// attempt is what [Attempts] reads from the context of the request that
// got an answer.
type attempt struct {
	key string
	n   int
}

// attemptKey is the context key of an attempt.
type attemptKey struct{}

// Attempts returns the idempotency key with which a [Transport] sent the
// request that got resp, and how many times it sent it, the attempt that
// got resp included; "" and 0 for an answer that did not come through a
// Transport. The key is as the server reads it, unquoted (a field that
// holds no valid key is reported as it is); a request of a safe method,
// sent without a key, reports "".
//
// It reads them from the context of resp.Request, which the Transport
// sets to the attempt that got resp: a function rather than a header
// added to the answer, so that the answer's header stays what the server
// sent.
func Attempts(resp *http.Response) (key string, n int) {
	if resp == nil || resp.Request == nil {
		return "", 0
	}
	a, _ := resp.Request.Context().Value(attemptKey{}).(attempt)
	return a.key, a.n
}

// setKey gives out a fresh key, unless it has one, its method is safe, or
// it is a request of a flow's call, and returns the key as the server
// reads it. A key the caller set under another spelling of the field's
// name is moved to the canonical one, and one set twice is sent once; a
// field that holds two different keys is refused. once reports a request
// of a flow's call that carries no key, to be sent once (see "Flows" at
// [Transport]).
func (s *transportSettings) setKey(out *http.Request) (key string, once bool, err error) {
	values, others := fieldValues(out.Header, s.header)
	for _, name := range others {
		delete(out.Header, name)
	}
	if providerKey, ok := s.providerKey(out); ok {
		return providerKey, false, s.setProviderKey(out, providerKey, values)
	}
	if len(values) > 0 {
		key := callersKey(values[0])
		for _, v := range values[1:] {
			if callersKey(v) != key {
				return "", false, fmt.Errorf("idemhttp: Transport: the request's %s header field holds two different keys (under the names %q): "+
					"a request is one operation, with one key: %w", s.header, append([]string{s.header}, others...), idem.ErrInvalidKey)
			}
		}
		out.Header[s.header] = values[:1]
		return key, false, nil
	}
	if isSafe(out.Method) {
		return "", false, nil
	}
	if inCall(out) {
		return "", true, nil
	}
	key = s.newKey()
	if problem := checkNewKey(key); problem != "" {
		return "", false, &idem.FieldError{Package: "idemhttp", Field: "Transport.NewKey", Problem: problem, Err: idem.ErrInvalidKey}
	}
	out.Header.Set(s.header, sfString(key))
	return key, false, nil
}

// isSafe reports whether method is safe by definition, so that its
// requests get no key.
func isSafe(method string) bool {
	switch method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace: // "" is GET to net/http
		return true
	}
	return false
}

// callersKey is the key that a value of the key's field holds, unquoted,
// or the value as it is when it holds no valid key: the server will say
// what is wrong with it.
func callersKey(value string) string {
	if key, err := parseKey([]string{value}); err == nil {
		return key
	}
	return value
}

// checkNewKey says what is wrong with a key from NewKey, or "".
func checkNewKey(key string) string {
	switch {
	case key == "":
		return "returned an empty key"
	case len(key) > idem.MaxKeyLength:
		return fmt.Sprintf("returned a key of %d bytes, more than %d", len(key), idem.MaxKeyLength)
	}
	for i := range len(key) {
		if key[i] < 0x20 || key[i] > 0x7e {
			return fmt.Sprintf("returned a key with the byte %#02x at offset %d: a key is printable ASCII", key[i], i)
		}
	}
	return ""
}

// sfString returns key as an RFC 8941 sf-string.
func sfString(key string) string {
	var b strings.Builder
	b.Grow(len(key) + 2)
	b.WriteByte('"')
	for i := range len(key) {
		if key[i] == '"' || key[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(key[i])
	}
	b.WriteByte('"')
	return b.String()
}

// send makes the attempts of out.
func (s *transportSettings) send(out *http.Request, key string, body bodySource) (*http.Response, error) {
	ctx := out.Context()
	// unsent stays true while no attempt may have reached the server.
	unsent := true
	for n := 1; ; n++ {
		attemptCtx, cancel := s.attemptContext(context.WithValue(ctx, attemptKey{}, attempt{key: key, n: n}))
		attemptCtx, conns := traceConns(attemptCtx)
		r := out.WithContext(attemptCtx)
		var err error
		if r.Body, err = body(n); err != nil {
			cancel()
			return nil, &attemptError{key: key, n: n, doing: "getting the body of attempt", err: err, unsent: unsent}
		}
		resp, err := s.base.RoundTrip(r)
		if err == nil {
			resp.Request = r
			resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
		} else {
			cancel()
		}
		unsent = unsent && err != nil && conns.neverGot()
		retryAfter, retry := retryable(ctx, resp, err)
		wait := max(backoff.Jitter(n, s.baseDelay, s.maxDelay), retryAfter)
		deadline, hasDeadline := ctx.Deadline()
		if !retry || n >= s.maxAttempts || retryAfter > s.maxDelay || hasDeadline && time.Until(deadline) < wait {
			if err != nil {
				return nil, &attemptError{key: key, n: n, doing: "attempt", err: err, unsent: unsent}
			}
			return resp, nil
		}
		if resp != nil {
			_, _ = io.CopyN(io.Discard, resp.Body, drainBytes)
			_ = resp.Body.Close()
		}
		if err := backoff.Sleep(ctx, wait); err != nil {
			return nil, &attemptError{key: key, n: n, doing: "waiting to retry after attempt", err: err, unsent: unsent}
		}
	}
}

// retryable reports whether an attempt that got resp or err is worth
// another, and the least wait its answer's Retry-After asks for.
func retryable(ctx context.Context, resp *http.Response, err error) (time.Duration, bool) {
	if err != nil {
		var unknownAuthority x509.UnknownAuthorityError
		var hostname x509.HostnameError
		var invalid x509.CertificateInvalidError
		var verification *tls.CertificateVerificationError
		switch {
		case ctx.Err() != nil,
			errors.As(err, &unknownAuthority), errors.As(err, &hostname), errors.As(err, &invalid), errors.As(err, &verification):
			return 0, false
		}
		return 0, true
	}
	if resp.Header.Get(ReplayedHeader) == "true" {
		return 0, false
	}
	switch {
	case resp.StatusCode == http.StatusConflict:
		if len(resp.Header.Values("Retry-After")) == 0 {
			return 0, false
		}
	case resp.StatusCode == http.StatusNotImplemented, resp.StatusCode == http.StatusHTTPVersionNotSupported:
		return 0, false
	case resp.StatusCode < 500 || resp.StatusCode > 599:
		return 0, false
	}
	return parseRetryAfter(resp.Header.Get("Retry-After")), true
}

// parseRetryAfter reads a Retry-After field, delay-seconds or an HTTP-date,
// as a wait; 0 when it is absent, in the past or malformed.
func parseRetryAfter(v string) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs <= 0 {
			return 0
		}
		if secs > int64(math.MaxInt64/time.Second) {
			return math.MaxInt64
		}
		return time.Duration(secs) * time.Second
	}
	if at, err := http.ParseTime(v); err == nil {
		return max(time.Until(at), 0)
	}
	return 0
}

// closeBody closes the body of a request that will not be sent, as a
// RoundTripper must.
func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// CloseIdleConnections closes the idle connections of Base, when it has
// such a method, so that [http.Client.CloseIdleConnections] reaches them
// through the Transport.
func (t *Transport) CloseIdleConnections() {
	type closeIdler interface{ CloseIdleConnections() }
	if c, ok := t.base().(closeIdler); ok {
		c.CloseIdleConnections()
	}
}

// base is Base or its default.
func (t *Transport) base() http.RoundTripper {
	if t.Base == nil {
		return http.DefaultTransport
	}
	return t.Base
}
