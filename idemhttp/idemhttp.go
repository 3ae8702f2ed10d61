package idemhttp

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
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

// Upper bounds of the configuration, on which [New] panics rather than
// start a server whose every keyed request would fail.
const (
	// maxWait is the largest Config.Wait: PostgreSQL's lock_timeout, which
	// carries the wait, counts milliseconds in an int32, and idem.WithWait
	// rejects anything longer.
	maxWait = math.MaxInt32 * time.Millisecond

	// maxMaxResponseBytes is the largest Config.MaxResponseBytes: the size
	// of the stored response, its body in base64 plus headerAllowance, must
	// still fit in an int.
	maxMaxResponseBytes = (math.MaxInt - headerAllowance) / 4 * 3

	// headerAllowance is what a stored response may take beyond its body
	// in base64: the status and the stored headers, generously.
	headerAllowance = 1 << 20
)

// ReplayedHeader is the header field set to "true" on every replayed
// response, as Stripe names it. A first answer does not carry it.
const ReplayedHeader = "Idempotent-Replayed"

// StoreBelow500 is the default of [Config.Store]: it stores every answer
// below 500. A 4xx is stored on purpose: a declined card stays declined on
// retry, rather than being charged when the client tries again. So is a
// 409 or a 429 that the handler answers itself, for the whole retention;
// [StoreFinal] is the policy that leaves those out.
func StoreBelow500(status int) bool { return status < 500 }

// StoreFinal stores what [StoreBelow500] stores except the answers that ask
// the client to try again: 408 Request Timeout, 409 Conflict, 425 Too Early
// and 429 Too Many Requests. Such an answer goes to the client and rolls
// back, so that the client's retry with the same key runs the handler
// again, rather than getting the same refusal until the key expires. Use
// it with Config{Store: idemhttp.StoreFinal}.
func StoreFinal(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return StoreBelow500(status)
}

// Config configures the middleware that [New] returns. Only Scope is
// required.
type Config struct {
	// Scope returns who is calling, such as the authenticated principal or
	// tenant: keys are unique per scope, so that two clients who happen to
	// pick the same key never see each other's responses. It is only called
	// for requests that carry a key. When it returns an error the request
	// gets 400 and the handler does not run; the error is not shown to the
	// client. The scope must be 1 to 255 bytes of UTF-8: any other value is
	// a server error (500).
	//
	// It is required, with no default: any default would let two tenants
	// share keys. [New] panics when it is nil.
	Scope func(r *http.Request) (string, error)

	// Required makes a key mandatory: a request of a covered method without
	// one gets 400 and the handler does not run. When false, such a request
	// runs the handler in a transaction of its own, with nothing claimed or
	// stored, so that the handler's code is the same either way. Defaults to
	// false.
	Required bool

	// Methods lists the covered methods. Requests of other methods pass
	// straight to the handler, outside any transaction, and their key is
	// ignored. Defaults, when nil, to POST and PATCH.
	Methods []string

	// Header is the name of the header field that carries the key. Defaults
	// to [DefaultHeader].
	Header string

	// Retention is how long a stored response answers retries of its key
	// (see [idem.WithRetention]). It must be at least a microsecond, the
	// resolution of PostgreSQL's timestamps. Defaults to
	// [idem.DefaultRetention], 24h.
	Retention time.Duration

	// Wait is how long a request waits for a concurrent request with the
	// same key to finish before it gets 409 (see [idem.WithWait]). It
	// bounds only that wait, not the handler. A negative value means not at
	// all. It must not exceed math.MaxInt32 milliseconds (about 596h), the
	// longest wait PostgreSQL's lock_timeout can express. Defaults to
	// [idem.DefaultWait], 5s.
	Wait time.Duration

	// MaxBodyBytes is the largest request body accepted. The middleware
	// reads the body of every covered request whole before the handler
	// runs, to fingerprint it and to hand it again to a handler that runs
	// twice (see [New]); a larger body gets 413 and the handler does not
	// run. math.MaxInt64 sets no limit at all. Defaults to
	// [DefaultMaxBodyBytes], 1 MiB.
	MaxBodyBytes int64

	// MaxResponseBytes is the largest response body stored for replay. An
	// answer with a larger body still commits and goes to the client whole,
	// but only its status and headers are stored, with a mark that its body
	// was not: a retry gets 410 with the problem [ProblemResponseNotStored],
	// which says that the request completed and with which status, and the
	// handler does not run again. The whole response is buffered before it
	// is checked, so this bounds what is stored, not what the handler may
	// write. It must not exceed about three quarters of math.MaxInt (less
	// with a Codec), so that the size of the stored form, the body in
	// base64 plus the headers, fits in an int. Defaults to
	// [DefaultMaxResponseBytes], 1 MiB.
	MaxResponseBytes int

	// ReplayHeaders lists the response header fields stored with the
	// response and replayed. Whatever it lists, the fields needed to read
	// the stored body, Content-Type, Content-Encoding and Content-Range,
	// are always stored and replayed with it, and Content-Length is always
	// the length of the body sent, on the first answer and on every replay.
	// Credentials (Set-Cookie, Authorization, WWW-Authenticate and their
	// kin) and connection-specific fields are never stored, even when
	// listed. An empty list stores only the body's own fields. Defaults,
	// when nil, to Content-Type, Content-Language, Location and ETag.
	ReplayHeaders []string

	// Store decides from the status of the handler's answer whether it is
	// stored for replay. An answer that is not stored is sent to the client
	// as the handler wrote it, but its transaction rolls back, the
	// handler's writes and the key's claim with it, so that a retry with
	// the same key runs the handler again. A handler's panic is never
	// stored. Defaults to [StoreBelow500]: every answer below 500 is stored.
	// [StoreFinal] also leaves out the answers that invite a retry (408,
	// 409, 425 and 429).
	Store func(status int) bool

	// ProblemTypeBase starts the type URI of every problem the middleware
	// answers itself: the type is ProblemTypeBase followed by the problem's
	// code (see [ProblemKeyMissing] and the codes after it), such as
	// https://api.example.com/docs/idempotency#key-missing. The type URI is
	// also sent as the problem's documentation link, in a Link header with
	// rel="describedby", so choose a base that, followed, documents each
	// code. It must be an absolute URI. Defaults to
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

	// TxOptions are the options of the transaction the handler runs in;
	// an empty IsoLevel means READ COMMITTED. Defaults to READ COMMITTED.
	TxOptions pgx.TxOptions

	// Logger receives the failures a client cannot be told about: handler
	// panics and database errors. Defaults to slog.Default().
	Logger *slog.Logger
}

// requestKey is the context key under which the handler finds its
// requestValues.
type requestKey struct{}

type requestValues struct {
	tx  pgx.Tx
	key string
}

// Tx returns the transaction the middleware opened for the request whose
// context is ctx, or nil outside a covered method. The handler does its
// writes on it: they commit together with the key's claim and the stored
// response, or not at all. The handler must not commit or roll it back.
func Tx(ctx context.Context) pgx.Tx {
	v, _ := ctx.Value(requestKey{}).(requestValues)
	return v.tx
}

// Key returns the idempotency key of the request whose context is ctx,
// unquoted, or "" when it has none or its method is not covered. A handler
// that calls another service can derive that call's own idempotency key
// from it, so that a run repeated after a rollback does not repeat the call.
func Key(ctx context.Context) string {
	v, _ := ctx.Value(requestKey{}).(requestValues)
	return v.key
}

// New returns middleware that makes the handler it wraps exactly-once per
// (scope, key) for the covered methods, on db. See the package
// documentation for the answers it gives.
//
// The handler runs in a transaction that it finds with [Tx]. When the
// middleware's own statements in that transaction, such as its COMMIT, fail
// with a serialization failure or a deadlock, it runs the handler again in
// a new transaction (see [idem.Run]), with the same request body: the
// handler must do nothing that a rollback cannot undo.
//
// New panics when db or cfg.Scope is nil, or when cfg holds a value that
// cannot work, such as a retention under a microsecond or a wait longer than
// PostgreSQL's lock_timeout can express: a misconfigured server must not
// start.
func New(db idem.TxBeginner, cfg Config) func(http.Handler) http.Handler {
	m, err := newMiddleware(db, cfg)
	if err != nil {
		panic(err.Error())
	}
	return func(next http.Handler) http.Handler {
		return &handler{middleware: m, next: next}
	}
}

// middleware is a Config with its defaults applied and its lists indexed.
type middleware struct {
	db               idem.TxBeginner
	scope            func(*http.Request) (string, error)
	required         bool
	methods          map[string]bool
	header           string
	maxBodyBytes     int64
	maxResponseBytes int
	replayHeaders    map[string]bool
	store            func(int) bool
	problemTypeBase  string
	fingerprint      func(*http.Request, []byte) ([]byte, error)
	txOptions        pgx.TxOptions
	logger           *slog.Logger
	opts             []idem.Option
	// retryAfter is the Retry-After of a 409, in seconds: the wait budget,
	// since the first request took at least that long already.
	retryAfter string
}

func newMiddleware(db idem.TxBeginner, cfg Config) (*middleware, error) {
	switch {
	case db == nil:
		return nil, errors.New("idemhttp: New needs a database, got nil")
	case cfg.Scope == nil:
		return nil, errors.New("idemhttp: Config.Scope is required: it keeps one tenant's keys from meeting another's")
	case cfg.Wait > maxWait:
		// idem would reject it on every request, each answered 500.
		return nil, fmt.Errorf("idemhttp: Config.Wait must not exceed %s, the longest lock_timeout, got %s", maxWait, cfg.Wait)
	case cfg.MaxBodyBytes < 0:
		return nil, fmt.Errorf("idemhttp: Config.MaxBodyBytes must not be negative, got %d", cfg.MaxBodyBytes)
	case cfg.MaxResponseBytes < 0:
		return nil, fmt.Errorf("idemhttp: Config.MaxResponseBytes must not be negative, got %d", cfg.MaxResponseBytes)
	case cfg.MaxResponseBytes > maxMaxResponseBytes:
		// The size handed to idem would wrap around to a negative one.
		return nil, fmt.Errorf("idemhttp: Config.MaxResponseBytes must not exceed %d, got %d", maxMaxResponseBytes, cfg.MaxResponseBytes)
	case cfg.Header != "" && !isToken(cfg.Header):
		return nil, fmt.Errorf("idemhttp: Config.Header %q is not a valid header field name", cfg.Header)
	}
	if cfg.Retention != 0 {
		// idem's own rule, at least a microsecond: idem would otherwise
		// reject the retention on every keyed request, each answered 500.
		if err := idem.CheckOptions(idem.WithRetention(cfg.Retention)); err != nil {
			return nil, fmt.Errorf("idemhttp: Config.Retention: %w", err)
		}
	}
	if cfg.ProblemTypeBase != "" {
		if err := checkProblemTypeBase(cfg.ProblemTypeBase); err != nil {
			return nil, err
		}
	}
	m := &middleware{
		db:               db,
		scope:            cfg.Scope,
		required:         cfg.Required,
		methods:          make(map[string]bool),
		header:           http.CanonicalHeaderKey(cmp.Or(cfg.Header, DefaultHeader)),
		maxBodyBytes:     cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes),
		maxResponseBytes: cmp.Or(cfg.MaxResponseBytes, DefaultMaxResponseBytes),
		replayHeaders:    make(map[string]bool),
		store:            cfg.Store,
		problemTypeBase:  cmp.Or(cfg.ProblemTypeBase, DefaultProblemTypeBase),
		fingerprint:      cfg.Fingerprint,
		txOptions:        cfg.TxOptions,
		logger:           cfg.Logger,
	}
	if m.txOptions.IsoLevel == "" {
		m.txOptions.IsoLevel = pgx.ReadCommitted
	}
	if m.store == nil {
		m.store = StoreBelow500
	}
	if m.fingerprint == nil {
		m.fingerprint = func(r *http.Request, body []byte) ([]byte, error) { return DefaultFingerprint(r, body), nil }
	}

	methods := cfg.Methods
	if methods == nil {
		methods = []string{http.MethodPost, http.MethodPatch}
	}
	for _, method := range methods {
		if !isToken(method) {
			return nil, fmt.Errorf("idemhttp: Config.Methods holds %q, which is not a method", method)
		}
		m.methods[method] = true
	}
	replayHeaders := cfg.ReplayHeaders
	if replayHeaders == nil {
		replayHeaders = []string{"Content-Type", "Content-Language", "Location", "ETag"}
	}
	for _, name := range replayHeaders {
		m.replayHeaders[http.CanonicalHeaderKey(name)] = true
	}

	wait := cmp.Or(cfg.Wait, idem.DefaultWait)
	wait = max(wait, 0)
	m.retryAfter = strconv.FormatInt(max(int64((wait+time.Second-1)/time.Second), 1), 10)
	storedSize, ok := storedSize(m.maxResponseBytes, cfg.Codec != nil)
	if !ok {
		// Only a Codec gets here: without one, the bound above holds.
		return nil, fmt.Errorf("idemhttp: Config.MaxResponseBytes of %d is too large to store sealed by Config.Codec", m.maxResponseBytes)
	}
	m.opts = []idem.Option{
		idem.WithRetention(cmp.Or(cfg.Retention, idem.DefaultRetention)),
		idem.WithWait(wait),
		idem.WithTxOptions(m.txOptions),
		idem.WithMaxResponseSize(storedSize),
	}
	if cfg.LookupFirst {
		m.opts = append(m.opts, idem.WithLookupFirst())
	}
	if cfg.Codec != nil {
		m.opts = append(m.opts, idem.WithCodec(cfg.Codec))
	}
	if cfg.Observer != nil {
		m.opts = append(m.opts, idem.WithObserver(cfg.Observer))
	}
	// Whatever else idem would reject on every request stops New too.
	if err := idem.CheckOptions(m.opts...); err != nil {
		return nil, fmt.Errorf("idemhttp: Config holds a value that idem rejects: %w", err)
	}
	return m, nil
}

// storedSize is the largest stored value, in bytes of JSON, for a body of n
// bytes, or false when that does not fit in an int. The value is the body
// in base64 plus the status and headers, for which a generous fixed
// allowance is made. Sealed by a codec, it is stored in base64 once more,
// with the same allowance again for what the codec adds.
func storedSize(n int, sealed bool) (int, bool) {
	size, ok := base64Size(n)
	if !ok || size > math.MaxInt-headerAllowance {
		return 0, false
	}
	size += headerAllowance
	if !sealed {
		return size, true
	}
	if size > math.MaxInt-headerAllowance {
		return 0, false
	}
	if size, ok = base64Size(size + headerAllowance); !ok {
		return 0, false
	}
	return size, true
}

// base64Size is the length of n bytes in padded base64, or false when that
// does not fit in an int.
func base64Size(n int) (int, bool) {
	groups := n / 3
	if n%3 != 0 {
		groups++
	}
	if groups > math.MaxInt/4 {
		return 0, false
	}
	return 4 * groups, true
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

// handler is the middleware around one handler.
type handler struct {
	*middleware
	next http.Handler
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.methods[r.Method] {
		h.next.ServeHTTP(w, r)
		return
	}
	values := r.Header.Values(h.header)
	if len(values) == 0 {
		if h.required {
			h.writeProblem(w, http.StatusBadRequest, ProblemKeyMissing, "This request needs an "+h.header+" header.")
			return
		}
		if body, ok := h.readBody(w, r); ok {
			h.serveUnkeyed(w, r, body)
		}
		return
	}
	key, err := parseKey(values)
	if err != nil {
		h.writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "The "+h.header+" header "+err.Error()+".")
		return
	}
	scope, err := h.scope(r)
	if err != nil {
		// The error is the server's view of the caller, which the client
		// has no business reading.
		h.writeProblem(w, http.StatusBadRequest, ProblemScopeUnknown, "The request does not say who is calling, so its "+h.header+" cannot be scoped.")
		return
	}
	body, ok := h.readBody(w, r)
	if !ok {
		return
	}
	fp, err := h.fingerprint(r, body)
	if err != nil {
		h.writeProblem(w, http.StatusBadRequest, ProblemFingerprintFailed, "The request cannot be fingerprinted to check its "+h.header+".")
		return
	}
	h.serveKeyed(w, r, scope, key, fp, body)
}

// readBody reads the whole request body, or answers the request itself and
// reports false.
func (h *handler) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	tooLarge := func() {
		h.writeProblem(w, http.StatusRequestEntityTooLarge, ProblemBodyTooLarge,
			fmt.Sprintf("The request body is larger than %d bytes.", h.maxBodyBytes))
	}
	if r.ContentLength > h.maxBodyBytes {
		tooLarge()
		return nil, false
	}
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true
	}
	// One byte past the limit tells a body over it from one at it; at
	// math.MaxInt64 that byte would wrap the limit negative and read nothing,
	// and no body can be longer anyway.
	limit := h.maxBodyBytes
	if limit < math.MaxInt64 {
		limit++
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, limit))
	var maxBytesErr *http.MaxBytesError
	switch {
	case errors.As(err, &maxBytesErr) || int64(len(body)) > h.maxBodyBytes:
		tooLarge()
		return nil, false
	case err != nil:
		h.writeProblem(w, http.StatusBadRequest, ProblemBodyUnreadable, "The request body could not be read.")
		return nil, false
	}
	return body, true
}

// serveKeyed runs the handler under the key's claim, or replays.
func (h *handler) serveKeyed(w http.ResponseWriter, r *http.Request, scope, key string, fp, body []byte) {
	var first *recorder
	res, err := idem.Run(r.Context(), h.db, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (storedResponse, error) {
		rec, err := h.run(ctx, requestValues{tx: tx, key: key}, r, body, h.store)
		if err != nil {
			return storedResponse{}, err
		}
		first = rec
		stored := storedResponse{Status: rec.status, Header: storeHeader(rec.sent, h.replayHeaders)}
		if n := rec.body.Len(); n > h.maxResponseBytes {
			// Rolling back would answer 500 to this request and to every
			// retry of it, forever: the request completes instead, and its
			// retries learn that its body was not kept.
			stored.BodyNotStored = n
		} else {
			stored.Body = rec.body.Bytes()
		}
		return stored, nil
	}, h.opts...)

	switch {
	case err == nil && res.Replayed && res.Value.BodyNotStored > 0:
		h.replayNotStored(w, res.Value)
	case err == nil && res.Replayed:
		stored := res.Value
		header := replayHeader(stored.Header, h.replayHeaders)
		header[ReplayedHeader] = []string{"true"}
		writeResponse(w, header, stored.Status, stored.Body, r.Method == http.MethodHead)
	case err == nil:
		if n := first.body.Len(); n > h.maxResponseBytes {
			h.log().LogAttrs(r.Context(), slog.LevelWarn,
				"idemhttp: answer too large to store; it committed, and its retries get 410 "+ProblemResponseNotStored,
				slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()),
				slog.Int("status", first.status), slog.Int("body_bytes", n), slog.Int("max_response_bytes", h.maxResponseBytes))
		}
		writeResponse(w, first.sent, first.status, first.body.Bytes(), r.Method == http.MethodHead)
	case errors.Is(err, idem.ErrFingerprintMismatch):
		h.writeProblem(w, http.StatusUnprocessableEntity, ProblemKeyReused,
			"This "+h.header+" was already used for a different request. Use a new key for a new request.")
	case errors.Is(err, idem.ErrInProgress):
		w.Header().Set("Retry-After", h.retryAfter)
		h.writeProblem(w, http.StatusConflict, ProblemKeyInProgress,
			"A request with this "+h.header+" is still being processed. Retry it later with the same key.")
	default:
		h.fail(w, r, err, "The request could not be completed. Retrying it with the same "+h.header+" is safe.")
	}
}

// replayNotStored answers the retry of a request whose answer was too large
// to store: a problem that says so, with the status the request got and the
// allow-listed headers that describe something other than the body that is
// missing, such as Location.
func (h *handler) replayNotStored(w http.ResponseWriter, stored storedResponse) {
	dst := w.Header()
	for name, values := range replayHeader(stored.Header, h.replayHeaders) {
		if !describesBody(name) {
			dst[name] = values
		}
	}
	dst.Set(ReplayedHeader, "true")
	h.writeProblemOf(w, problem{
		Status: http.StatusGone,
		Code:   ProblemResponseNotStored,
		Detail: fmt.Sprintf("The request with this %s completed with status %d, but its answer of %d bytes was too large to keep, "+
			"so it cannot be sent again. The request will not run again: do not retry it.",
			h.header, stored.Status, stored.BodyNotStored),
		OriginalStatus: stored.Status,
	})
}

// serveUnkeyed runs the handler in a transaction without a claim: what it
// writes commits unless it answers 5xx or panics.
func (h *handler) serveUnkeyed(w http.ResponseWriter, r *http.Request, body []byte) {
	var rec *recorder
	err := idem.WithTx(r.Context(), h.db, h.txOptions, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		rec, err = h.run(ctx, requestValues{tx: tx}, r, body, StoreBelow500)
		return err
	})
	if err != nil {
		h.fail(w, r, err, "The request could not be completed.")
		return
	}
	writeResponse(w, rec.sent, rec.status, rec.body.Bytes(), r.Method == http.MethodHead)
}

// unkept is a handler's answer that is not to be kept, such as a 5xx,
// returned as an error so that its transaction rolls back; the client still
// gets the answer.
type unkept struct{ rec *recorder }

func (e *unkept) Error() string {
	return fmt.Sprintf("idemhttp: handler answered %d, which is not kept", e.rec.status)
}

// handlerPanic is a handler's panic, returned as an error so that its
// transaction rolls back.
type handlerPanic struct {
	value any
	stack []byte
}

func (e *handlerPanic) Error() string { return fmt.Sprintf("idemhttp: handler panicked: %v", e.value) }

// run runs the handler once in the transaction of v, with a fresh copy of
// the body, and records its answer. An answer whose status keep refuses,
// and a panic, come back as errors, for the caller to roll back.
func (h *handler) run(ctx context.Context, v requestValues, r *http.Request, body []byte, keep func(int) bool) (rec *recorder, err error) {
	rec = newRecorder()
	defer func() {
		if p := recover(); p != nil {
			err = &handlerPanic{value: p, stack: debug.Stack()}
		}
	}()
	req := r.WithContext(context.WithValue(ctx, requestKey{}, v))
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	h.next.ServeHTTP(rec, req)
	rec.finish()
	if !keep(rec.status) {
		return rec, &unkept{rec: rec}
	}
	return rec, nil
}

// fail answers a request whose transaction did not commit, or may not have:
// with the handler's own 5xx, or else with a 500 problem saying detail.
func (h *handler) fail(w http.ResponseWriter, r *http.Request, err error, detail string) {
	var failed *unkept
	if errors.As(err, &failed) {
		writeResponse(w, failed.rec.sent, failed.rec.status, failed.rec.body.Bytes(), r.Method == http.MethodHead)
		return
	}
	var panicked *handlerPanic
	switch {
	case errors.As(err, &panicked):
		if panicked.value == http.ErrAbortHandler {
			// The handler asked net/http to cut the connection; do so, now
			// that its transaction has rolled back.
			panic(http.ErrAbortHandler)
		}
		h.log().LogAttrs(r.Context(), slog.LevelError, "idemhttp: handler panicked; its transaction was rolled back",
			slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()),
			slog.Any("panic", panicked.value), slog.String("stack", string(panicked.stack)))
	case r.Context().Err() != nil:
		// The client went away and so cancelled its own request: nothing
		// went wrong that an operator must hear about.
	default:
		h.log().LogAttrs(r.Context(), slog.LevelError, "idemhttp: request failed; its transaction did not commit",
			slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()), slog.Any("error", err))
	}
	h.writeProblem(w, http.StatusInternalServerError, ProblemRequestFailed, detail)
}

func (h *handler) log() *slog.Logger {
	if h.logger != nil {
		return h.logger
	}
	return slog.Default()
}
