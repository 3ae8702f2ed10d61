package idemgrpc

import (
	"cmp"
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
)

// Default values of the configuration.
const (
	// DefaultMetadata is the metadata key that carries the idempotency key
	// unless [Config.Metadata] says otherwise: the HTTP header field of the
	// IETF draft, as gRPC metadata spells it.
	DefaultMetadata = "idempotency-key"

	// DefaultMaxResponseBytes is the largest response stored unless
	// [Config.MaxResponseBytes] says otherwise.
	DefaultMaxResponseBytes = 1 << 20
)

// ReplayedMetadata is the header metadata key set to "true" on every
// replayed answer, a stored error included. A first answer does not carry
// it.
const ReplayedMetadata = "idempotent-replayed"

// StoreDefinite is the default of [Config.Store]. It stores the handler
// errors whose codes are a definite answer to the request, which a retry
// would only get again: INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
// PERMISSION_DENIED, FAILED_PRECONDITION, OUT_OF_RANGE and UNIMPLEMENTED.
// A declined payment stays declined on retry, rather than being charged
// when the client tries again. It leaves out the codes that say the
// request may succeed if tried again, or that the server failed:
// CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, UNAUTHENTICATED (the caller's
// credentials, not the request), RESOURCE_EXHAUSTED, ABORTED, INTERNAL,
// UNAVAILABLE and DATA_LOSS. Such an error goes to the client and rolls
// back, so that a retry with the same key runs the handler again.
func StoreDefinite(code codes.Code) bool {
	switch code {
	case codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
		codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented:
		return true
	}
	return false
}

// Config configures the interceptor; [NewServerInterceptor] checks it. The
// zero value of every field means its default, which the field states; a
// negative value means "none" where the field says so. Only Scope is
// required.
type Config struct {
	// Scope returns who is calling, such as the authenticated principal or
	// tenant, from the call's context: keys are unique per scope, so that
	// two clients who happen to pick the same key never see each other's
	// answers. It is only called for calls that carry a key. When it
	// returns an error the call gets UNAUTHENTICATED (reason SCOPE_UNKNOWN)
	// and the handler does not run; the error is not shown to the client.
	// The scope must be 1 to 255 bytes of UTF-8: any other value, ""
	// included, is a bug of the server's, not the caller's (return an
	// error for a call that does not say who is calling): the call gets
	// INTERNAL (reason REQUEST_FAILED), which does not invite a retry, and
	// the handler does not run.
	//
	// It is required, with no default: any default would let two tenants
	// share keys.
	Scope func(ctx context.Context) (string, error)

	// Required makes a key mandatory on the covered methods, but those
	// Optional lists: a call without one gets INVALID_ARGUMENT (reason
	// KEY_MISSING) and the handler does not run. When false, or for a
	// method Optional lists, a call without a key runs the handler in a
	// transaction of its own, with nothing claimed or stored, so that the
	// handler's code is the same either way. Defaults to false.
	Required bool

	// Methods lists the covered unary methods by full name
	// ("/payments.v1.Payments/Create", the generated code's
	// Payments_Create_FullMethodName). Calls of other methods, but those
	// Flows lists, pass straight to the handler, outside any transaction,
	// and their key is ignored.
	// An empty, non-nil list is refused: it would cover nothing, and so is
	// a method without side effects. Defaults, when nil, to every unary
	// method. Streaming methods and methods without side effects (health
	// checks, reflection, channelz, and those declared NO_SIDE_EFFECTS: see
	// "Which calls are covered" in the package documentation) are never
	// covered.
	Methods []string

	// Optional lists covered methods, by full name, on which a key is
	// optional although Required is set, such as an update that is safe to
	// repeat. It must be empty when Required is false, and may name only
	// covered methods. Defaults to none.
	Optional []string

	// Flows lists unary methods, by full name, whose handlers run an
	// [idem.Flow] with [RunFlow]: methods whose write calls another system
	// (charging a card, reserving stock). The interceptor opens no
	// transaction for them and claims nothing: it reads the call's key,
	// scope and fingerprint as for any covered call and hands them to
	// RunFlow, and the flow's own record makes the call exactly-once (see
	// RunFlow). A call of such a method needs a key, whatever Required
	// says. They are covered whatever Methods says, must not be listed in
	// Optional, and may not be methods without side effects. Defaults to
	// none.
	Flows []string

	// Metadata is the metadata key that carries the idempotency key, in
	// lower case (gRPC metadata keys are), not a binary ("-bin") key and
	// not one of gRPC's own ("grpc-"). The value is the key as it is: 1 to
	// 255 bytes; a key sent twice is invalid. Defaults to
	// [DefaultMetadata].
	Metadata string

	// KeyField names a string field of the request messages that carries
	// the key, as AIP-155's request_id does: a request message that has
	// the field, set, takes its key from it; one without the field, or with
	// it empty, takes its key from the metadata. A call whose key is in
	// both, with different values, gets INVALID_ARGUMENT (KEY_INVALID).
	// The field is left out of the fingerprint. A request message whose
	// field of that name is not a singular string is a server error
	// (INTERNAL). Defaults to none: keys come from the metadata only.
	KeyField string

	// Retention is how long a stored answer answers retries of its key
	// (see [idem.WithRetention]). It must be at least a microsecond.
	// Defaults to [idem.DefaultRetention], 24h.
	Retention time.Duration

	// Wait is how long a call waits for a concurrent call with the same key
	// to finish before it gets ABORTED (reason KEY_IN_PROGRESS, with a
	// RetryInfo) (see [idem.WithWait]). It bounds only that wait, not the
	// handler. Negative means no wait: a duplicate gets ABORTED at once. It
	// must not exceed math.MaxInt32 milliseconds (about 596h), the longest
	// wait PostgreSQL's lock_timeout can express. Defaults to
	// [idem.DefaultWait], 5s.
	Wait time.Duration

	// MaxResponseBytes is the largest answer stored for replay: the
	// response message, or the status of a stored error, in bytes of the
	// protobuf wire format. A larger answer still commits and goes to the
	// client, but only its code and metadata are stored: a retry gets
	// ALREADY_EXISTS (reason RESPONSE_NOT_STORED), which says that the call
	// completed and with which code, and the handler does not run again.
	// Negative means no limit. A positive value must not exceed about three
	// quarters of math.MaxInt (less with a Codec). Defaults to
	// [DefaultMaxResponseBytes], 1 MiB.
	MaxResponseBytes int

	// Store decides from the code of the handler's error whether the error
	// is stored for replay; a response is always stored. An error that is
	// not stored goes to the client as the handler returned it, but its
	// transaction rolls back, the handler's writes and the key's claim with
	// it, so that a retry with the same key runs the handler again. A
	// stored error is replayed with its code, message and details.
	// Defaults to [StoreDefinite].
	Store func(code codes.Code) bool

	// Codec seals each stored answer before it is written and opens it on
	// replay (see [idem.WithCodec]). A stored answer holds the response
	// and its metadata, which are often personal data; stored without a
	// codec, they are only base64-encoded. Defaults to none.
	Codec idem.Codec

	// Observer records every keyed call's outcome, claim duration and span
	// (see [idem.WithObserver]); an error that Store refuses counts as
	// failed, since it rolls back. Calls without a key are not observed.
	// Defaults to none.
	Observer *idem.Observer

	// Fingerprint chooses what makes two calls with the same key the same
	// call; a retry whose fingerprint differs from the first call's gets
	// FAILED_PRECONDITION (reason KEY_REUSED). It is given the full method
	// name and the request without its KeyField, and must not change the
	// request. When it returns an error the call gets INVALID_ARGUMENT
	// (reason FINGERPRINT_FAILED) and the handler does not run. Defaults to
	// the SHA-256 digest of the full method name and the request in
	// protobuf's deterministic serialization, so that the order of a map's
	// entries on the wire never makes a retry differ.
	Fingerprint func(fullMethod string, req proto.Message) ([]byte, error)

	// LookupFirst reads the key before the handler's transaction begins
	// (see [idem.WithLookupFirst]): the retry of a completed call is then
	// answered in one round trip with no transaction, while a first call
	// costs one round trip more. Defaults to false.
	LookupFirst bool

	// TxOptions are the options of the transaction the handler runs in.
	// IsoLevel, AccessMode and DeferrableMode must each be empty or one of
	// pgx's constants, and AccessMode not pgx.ReadOnly: idem records keys
	// only in read-write transactions. Defaults to READ COMMITTED, read
	// write.
	TxOptions pgx.TxOptions

	// Logger receives the failures a client cannot be told about: database
	// errors, answers that cannot be stored and answers too large to store,
	// at WARN and ERROR; and, at INFO, the flows that did not complete
	// (UNAVAILABLE operation-incomplete), which the client's retry
	// continues. Defaults to slog.Default().
	Logger *slog.Logger
}

// settings is a Config checked, with its defaults applied and its lists
// indexed.
type settings struct {
	scope    func(context.Context) (string, error)
	required bool
	// methods is nil when every unary method is covered.
	methods  map[string]bool
	optional map[string]bool
	// flows are the methods served by flows (Config.Flows).
	flows    map[string]bool
	metadata string
	keyField protoreflect.Name
	// maxResponseBytes is math.MaxInt when there is no limit.
	maxResponseBytes int
	store            func(codes.Code) bool
	fingerprint      func(string, proto.Message) ([]byte, error)
	txOptions        pgx.TxOptions
	logger           *slog.Logger
	// runOptions are what each keyed call hands idem.Run; flowOptions
	// what RunFlow hands idem.Flow.Run.
	runOptions  []idem.Option
	flowOptions []idem.FlowOption
	// retryDelay is the RetryInfo of an ABORTED KEY_IN_PROGRESS: the wait,
	// rounded up to whole seconds, at least one, since the first call took
	// that long already.
	retryDelay time.Duration
}

// invalidField is a field of Config, or an argument of
// NewServerInterceptor, that cannot work.
func invalidField(field, format string, args ...any) error {
	return adapter.Invalid("idemgrpc", field, format, args...)
}

// newSettings checks every field of cfg and applies the defaults, so that
// a configuration that cannot work stops the program at its start rather
// than fail every call.
func newSettings(cfg Config) (settings, error) {
	s := settings{
		scope:       cfg.Scope,
		required:    cfg.Required,
		metadata:    strings.ToLower(cmp.Or(cfg.Metadata, DefaultMetadata)),
		keyField:    protoreflect.Name(cfg.KeyField),
		store:       cfg.Store,
		fingerprint: cfg.Fingerprint,
		txOptions:   cfg.TxOptions,
		logger:      cmp.Or(cfg.Logger, slog.Default()),
	}
	if s.store == nil {
		s.store = StoreDefinite
	}
	if s.scope == nil {
		return settings{}, invalidField("Config.Scope", "is required, with no default: it keeps one tenant's keys from meeting another's")
	}

	switch {
	case cfg.Methods == nil:
	case len(cfg.Methods) == 0:
		return settings{}, invalidField("Config.Methods", "is empty, which would cover no method; nil means every unary method")
	default:
		s.methods = make(map[string]bool, len(cfg.Methods))
		for _, m := range cfg.Methods {
			switch {
			case !isFullMethod(m):
				return settings{}, invalidField("Config.Methods", "holds %q, which is not a full method name such as /payments.v1.Payments/Create", m)
			case hasNoSideEffects(m):
				return settings{}, invalidField("Config.Methods", "holds %q, a method without side effects, which is never covered", m)
			}
			s.methods[m] = true
		}
	}
	if len(cfg.Optional) > 0 && !cfg.Required {
		return settings{}, invalidField("Config.Optional", "lists methods, but Config.Required is false: every key is optional already")
	}
	s.optional = make(map[string]bool, len(cfg.Optional))
	for _, m := range cfg.Optional {
		switch {
		case !isFullMethod(m):
			return settings{}, invalidField("Config.Optional", "holds %q, which is not a full method name such as /payments.v1.Payments/Create", m)
		case s.methods != nil && !s.methods[m]:
			return settings{}, invalidField("Config.Optional", "holds %q, which Config.Methods does not cover", m)
		case hasNoSideEffects(m):
			return settings{}, invalidField("Config.Optional", "holds %q, a method without side effects, which is never covered", m)
		}
		s.optional[m] = true
	}

	if err := s.checkFlows(cfg.Flows); err != nil {
		return settings{}, err
	}

	if problem := checkMetadataKey(s.metadata); problem != "" {
		return settings{}, invalidField("Config.Metadata", "%q %s", cfg.Metadata, problem)
	}
	if cfg.KeyField != "" && !s.keyField.IsValid() {
		return settings{}, invalidField("Config.KeyField", "%q is not a protobuf field name", cfg.KeyField)
	}

	// What the adapters share: retention, wait, the stored size of an
	// answer (the message or status in base64 and the metadata, sealed by
	// the codec if there is one), the transaction's options, and Run's
	// options.
	common, err := adapter.Check("idemgrpc", adapter.Config{Retention: cfg.Retention, Wait: cfg.Wait,
		MaxResponseBytes: cfg.MaxResponseBytes, DefaultMaxResponseBytes: DefaultMaxResponseBytes,
		TxOptions: cfg.TxOptions, LookupFirst: cfg.LookupFirst, Codec: cfg.Codec, Observer: cfg.Observer})
	if err != nil {
		return settings{}, err
	}
	s.maxResponseBytes, s.txOptions = common.MaxResponseBytes, common.TxOptions
	s.runOptions, s.flowOptions = common.RunOptions, common.FlowOptions
	s.retryDelay = adapter.RetryAfter(common.Wait)
	return s, nil
}

// covers reports whether calls of the unary method fullMethod go through
// idem, and whether they must carry a key.
func (s *settings) covers(fullMethod string) (covered, required bool) {
	switch {
	case s.flows[fullMethod]:
		return true, true
	case s.methods != nil && !s.methods[fullMethod], hasNoSideEffects(fullMethod):
		return false, false
	}
	return true, s.required && !s.optional[fullMethod]
}

// isFullMethod reports whether m has the form of a gRPC full method name,
// "/service/method".
func isFullMethod(m string) bool {
	service, method, ok := strings.Cut(strings.TrimPrefix(m, "/"), "/")
	return strings.HasPrefix(m, "/") && ok && service != "" && method != "" && !strings.Contains(method, "/")
}

// checkMetadataKey says what is wrong with a metadata key that cannot carry
// an idempotency key; "" when nothing is.
func checkMetadataKey(key string) string {
	if key == "" {
		return "is empty"
	}
	for i := range len(key) {
		c := key[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return "is not a metadata key: only letters, digits, '-', '_' and '.'"
		}
	}
	switch {
	case strings.HasSuffix(key, "-bin"):
		return "is a binary metadata key; an idempotency key is text"
	case strings.HasPrefix(key, "grpc-"):
		return "is reserved for gRPC itself"
	case key == ReplayedMetadata:
		return "is the key that marks replays"
	}
	return ""
}
