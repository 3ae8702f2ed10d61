package idemhttp

import (
	"cmp"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
	"github.com/pgidem/idem/internal/httpedge"
)

// Default values of the configuration.
const (
	// DefaultHeader is the header field that carries the key unless
	// [Config.Header] says otherwise, as the IETF draft names it.
	DefaultHeader = "Idempotency-Key"

	// DefaultMaxBodyBytes is the largest request body accepted unless
	// [Config.MaxBodyBytes] says otherwise.
	DefaultMaxBodyBytes = 1 << 20

	// DefaultMaxResponseBytes is the largest response body stored unless
	// [Config.MaxResponseBytes] says otherwise.
	DefaultMaxResponseBytes = 1 << 20
)

// ReplayedHeader is the header field set to "true" on every replayed
// response, as Stripe names it. A first answer does not carry it.
const ReplayedHeader = "Idempotent-Replayed"

// StoreBelow500 is the default of [Config.Store]: it stores every answer
// below 500. A 4xx is stored on purpose: a declined card stays declined on
// retry, rather than being charged when the client tries again. So is a
// 409 or a 429 that the handler answers itself, for the whole retention;
// [StoreDefinite] is the policy that leaves those out.
func StoreBelow500(status int) bool { return status < 500 }

// StoreDefinite stores what [StoreBelow500] stores except the answers that ask
// the client to try again: 408 Request Timeout, 409 Conflict, 425 Too Early
// and 429 Too Many Requests. Such an answer goes to the client and rolls
// back, so that the client's retry with the same key runs the handler
// again, rather than getting the same refusal until the key expires. Use
// it with Config{Store: idemhttp.StoreDefinite}.
func StoreDefinite(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return StoreBelow500(status)
}

// Config configures the middleware; [NewMiddleware] and [MustNew] check it.
// The zero value of every field means its default, which the field states;
// a negative value means "none" where that makes sense (no wait, no limit).
// Only Scope is required.
type Config struct {
	// Scope returns who is calling, such as the authenticated principal or
	// tenant: keys are unique per scope, so that two clients who happen to
	// pick the same key never see each other's responses. It is only called
	// for requests that carry a key. When it returns an error the request
	// gets 400 and the handler does not run; the error is not shown to the
	// client. The scope must be 1 to 255 bytes of UTF-8: any other value,
	// "" included, is a bug of the server's, not the client's (return an
	// error for a request that does not say who is calling): the request
	// gets 500 request-failed, which does not invite a retry, and the
	// handler does not run.
	//
	// It is required, with no default: any default would let two tenants
	// share keys.
	Scope func(r *http.Request) (string, error)

	// Required makes a key mandatory: a request of a covered method without
	// one gets 400 and the handler does not run. When false, such a request
	// runs the handler in a transaction of its own, with nothing claimed or
	// stored, so that the handler's code is the same either way. Defaults to
	// false.
	Required bool

	// Methods lists the covered methods, each an HTTP token. Requests of
	// other methods pass straight to the handler, outside any transaction,
	// and their key is ignored. An empty, non-nil list is refused: it would
	// cover nothing. Defaults, when nil, to POST and PATCH.
	Methods []string

	// Header is the name of the header field that carries the key, an HTTP
	// token. Defaults to [DefaultHeader].
	Header string

	// Retention is how long a stored response answers retries of its key
	// (see [idem.WithRetention]). It must be at least a microsecond, the
	// resolution of PostgreSQL's timestamps. Defaults to
	// [idem.DefaultRetention], 24h.
	Retention time.Duration

	// Wait is how long a request waits for a concurrent request with the
	// same key to finish before it gets 409 (see [idem.WithWait]). It
	// bounds only that wait, not the handler. Negative means no wait: a
	// duplicate gets 409 at once. It must not exceed math.MaxInt32
	// milliseconds (about 596h), the longest wait PostgreSQL's lock_timeout
	// can express. Defaults to [idem.DefaultWait], 5s.
	Wait time.Duration

	// MaxBodyBytes is the largest request body accepted. The middleware
	// reads the body of every covered request whole before the handler
	// runs, to fingerprint it and to hand it again to a handler that runs
	// twice (see [Middleware.Wrap]); a larger body gets 413 and the handler does not
	// run. Negative means no limit. Defaults to [DefaultMaxBodyBytes],
	// 1 MiB.
	MaxBodyBytes int64

	// MaxResponseBytes is the largest response body stored for replay. An
	// answer with a larger body still commits and goes to the client whole,
	// but only its status and headers are stored, with a mark that its body
	// was not: a retry gets 410 with the problem [ProblemResponseNotStored],
	// which says that the request completed and with which status, and the
	// handler does not run again. The whole response is buffered before it
	// is checked, so this bounds what is stored, not what the handler may
	// write. Negative means no limit. A positive value must not exceed
	// about three quarters of math.MaxInt (less with a Codec), so that the
	// size of the stored form, the body in base64 plus the headers, fits in
	// an int. Defaults to [DefaultMaxResponseBytes], 1 MiB.
	MaxResponseBytes int

	// ReplayHeaders lists the response header fields stored with the
	// response and replayed, each an HTTP token. Whatever it lists, the
	// fields needed to read the stored body, Content-Type, Content-Encoding
	// and Content-Range, are always stored and replayed with it, and
	// Content-Length is always the length of the body sent, on the first
	// answer and on every replay. Credentials (Set-Cookie, Authorization,
	// WWW-Authenticate and their kin) and connection-specific fields are
	// never stored, even when listed. An empty, non-nil list stores only
	// the body's own fields. Defaults, when nil, to Content-Type,
	// Content-Language, Location and ETag.
	ReplayHeaders []string

	// Store decides from the status of the handler's answer whether it is
	// stored for replay. An answer that is not stored is sent to the client
	// as the handler wrote it, but its transaction rolls back, the
	// handler's writes and the key's claim with it, so that a retry with
	// the same key runs the handler again. A handler's panic is never
	// stored. Defaults to [StoreBelow500]: every answer below 500 is stored.
	// [StoreDefinite] also leaves out the answers that invite a retry (408,
	// 409, 425 and 429).
	Store func(status int) bool

	// ProblemTypeBase starts the type URI of every problem the middleware
	// answers itself: the type is ProblemTypeBase followed by the problem's
	// code (see [ProblemKeyMissing] and the codes after it), such as
	// https://api.example.com/docs/idempotency#key-missing. The type URI is
	// also sent as the problem's documentation link, in a Link header with
	// rel="describedby", so choose a base that, followed, documents each
	// code. It must be an absolute URI that needs no escaping. Defaults to
	// [DefaultProblemTypeBase], this package's own list of the codes.
	ProblemTypeBase string

	// Codec seals each stored answer before it is written and opens it on
	// replay (see [idem.WithCodec]). A stored answer holds the handler's
	// body and headers, which are often personal data; stored without a
	// codec, they are only base64-encoded. Defaults to none.
	Codec idem.Codec

	// Observer records every keyed request's outcome, claim duration and
	// span (see [idem.WithObserver]); an answer that Store refuses counts
	// as failed, since it rolls back. Requests without a key are not
	// observed. Defaults to none.
	Observer *idem.Observer

	// Fingerprint chooses what makes two requests with the same key the
	// same request; a retry whose fingerprint differs from the first
	// request's gets 422. It is given the request and its whole body, and
	// must not read r.Body. When it returns an error the request gets 400
	// and the handler does not run. Defaults to [DefaultFingerprint]: method,
	// target URI and body.
	Fingerprint func(r *http.Request, body []byte) ([]byte, error)

	// LookupFirst reads the key before the handler's transaction begins
	// (see [idem.WithLookupFirst]): the retry of a completed request is then
	// answered in one round trip with no transaction, while a first request
	// costs one round trip more. It pays behind clients and proxies that
	// retry a lot. Defaults to false.
	LookupFirst bool

	// TxOptions are the options of the transaction the handler runs in.
	// IsoLevel, AccessMode and DeferrableMode must each be empty or one of
	// pgx's constants, and AccessMode not pgx.ReadOnly: idem records keys
	// only in read-write transactions. Defaults to READ COMMITTED, read
	// write.
	TxOptions pgx.TxOptions

	// Logger receives the failures a client cannot be told about: handler
	// panics, database errors and answers too large to store, at WARN and
	// ERROR; and, at INFO, the flows that did not complete (503
	// operation-incomplete), which the client's retry continues. Defaults
	// to slog.Default().
	Logger *slog.Logger
}

// settings is a Config checked, with its defaults applied and its lists
// indexed.
type settings struct {
	scope    func(*http.Request) (string, error)
	required bool
	methods  map[string]bool
	header   string
	// maxBodyBytes is math.MaxInt64 when there is no limit.
	maxBodyBytes int64
	// maxResponseBytes is math.MaxInt when there is no limit.
	maxResponseBytes int
	replayHeaders    map[string]bool
	store            func(int) bool
	problemTypeBase  string
	fingerprint      func(*http.Request, []byte) ([]byte, error)
	txOptions        pgx.TxOptions
	logger           *slog.Logger
	// runOptions are what each keyed request hands idem.Run; flowOptions
	// what FlowHandler hands a flow's Run: only the wait, which the 409's
	// Retry-After tells. How a flow stores is the flow's own (NewFlow's
	// options), which its completer uses too.
	runOptions  []idem.Option
	flowOptions []idem.FlowOption
	// retryAfter is the Retry-After of a 409, in seconds: the wait, rounded
	// up, since the first request took at least that long already.
	retryAfter string
}

// invalidField is a field of Config, or an argument of NewMiddleware, that
// cannot work.
func invalidField(field, format string, args ...any) error {
	return adapter.Invalid("idemhttp", field, format, args...)
}

// newSettings checks every field of cfg and applies the defaults, so that
// a configuration that cannot work stops the program at its start rather
// than fail every request, each answered 500.
func newSettings(cfg Config) (settings, error) {
	s := settings{
		scope:           cfg.Scope,
		required:        cfg.Required,
		methods:         make(map[string]bool),
		header:          http.CanonicalHeaderKey(cmp.Or(cfg.Header, DefaultHeader)),
		replayHeaders:   make(map[string]bool),
		store:           cfg.Store,
		problemTypeBase: cmp.Or(cfg.ProblemTypeBase, DefaultProblemTypeBase),
		fingerprint:     cfg.Fingerprint,
		txOptions:       cfg.TxOptions,
		logger:          cfg.Logger,
	}
	if s.scope == nil {
		return settings{}, invalidField("Config.Scope", "is required, with no default: it keeps one tenant's keys from meeting another's")
	}

	methods := cfg.Methods
	switch {
	case methods == nil:
		methods = []string{http.MethodPost, http.MethodPatch}
	case len(methods) == 0:
		return settings{}, invalidField("Config.Methods", "is empty, which would cover no method; nil means POST and PATCH")
	}
	for _, method := range methods {
		if !isToken(method) {
			return settings{}, invalidField("Config.Methods", "holds %q, which is not a method", method)
		}
		s.methods[method] = true
	}

	if cfg.Header != "" && !isToken(cfg.Header) {
		return settings{}, invalidField("Config.Header", "%q is not a header field name", cfg.Header)
	}

	// What the adapters share: retention, wait, the stored size of an
	// answer (its body in base64 and its headers, sealed by the codec if
	// there is one), the transaction's options, and Run's options.
	common, err := adapter.Check("idemhttp", adapter.Config{Retention: cfg.Retention, Wait: cfg.Wait,
		MaxResponseBytes: cfg.MaxResponseBytes, DefaultMaxResponseBytes: DefaultMaxResponseBytes,
		TxOptions: cfg.TxOptions, LookupFirst: cfg.LookupFirst, Codec: cfg.Codec, Observer: cfg.Observer})
	if err != nil {
		return settings{}, err
	}
	s.maxResponseBytes, s.txOptions = common.MaxResponseBytes, common.TxOptions
	s.runOptions, s.flowOptions = common.RunOptions, common.FlowOptions
	s.retryAfter = strconv.FormatInt(int64(adapter.RetryAfter(common.Wait)/time.Second), 10)

	switch {
	case cfg.MaxBodyBytes < 0:
		s.maxBodyBytes = math.MaxInt64
	default:
		s.maxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	}

	replayHeaders := cfg.ReplayHeaders
	if replayHeaders == nil {
		replayHeaders = []string{"Content-Type", "Content-Language", "Location", "ETag"}
	}
	for _, name := range replayHeaders {
		if !isToken(name) {
			return settings{}, invalidField("Config.ReplayHeaders", "holds %q, which is not a header field name", name)
		}
		s.replayHeaders[http.CanonicalHeaderKey(name)] = true
	}

	if s.store == nil {
		s.store = StoreBelow500
	}
	if cfg.ProblemTypeBase != "" {
		if problem := httpedge.CheckTypeBase(cfg.ProblemTypeBase); problem != "" {
			return settings{}, invalidField("Config.ProblemTypeBase", "%q %s", cfg.ProblemTypeBase, problem)
		}
	}
	if s.fingerprint == nil {
		s.fingerprint = func(r *http.Request, body []byte) ([]byte, error) { return DefaultFingerprint(r, body), nil }
	}
	if s.logger == nil {
		s.logger = slog.Default()
	}
	return s, nil
}

// isToken reports whether s is an RFC 9110 token, as header field names and
// methods are.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := range len(s) {
		c := s[i]
		isAlnum := c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
		if !isAlnum && !strings.ContainsRune("!#$%&'*+-.^_`|~", rune(c)) {
			return false
		}
	}
	return true
}
