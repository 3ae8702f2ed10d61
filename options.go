package idem

import (
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// Default values of the options.
const (
	// DefaultRetention is how long a record blocks its key unless
	// [WithRetention] says otherwise.
	DefaultRetention = 24 * time.Hour

	// DefaultWait is how long a duplicate waits for a concurrent attempt
	// unless [WithWait] says otherwise.
	DefaultWait = 5 * time.Second

	// DefaultMaxResponseSize is the largest stored value, in bytes of JSON,
	// unless [WithMaxResponseSize] says otherwise.
	DefaultMaxResponseSize = 1 << 20
)

// Option changes how [Do], [Run], [Once] and [OnceEach] treat a key. Each
// option checks its value when it is made: an option made from a value
// that cannot work makes every call it is given to fail with
// [ErrInvalidOption], before anything is sent to the database.
//
// An option is an explicit choice, so its zero means zero: WithWait(0) is
// no wait, not the default; leaving the option out gives the default. A
// negative duration means "none" where none makes sense (WithWait,
// WithIdleTimeout), as in the configs of idemhttp and outbox, and is
// refused where it does not (WithRetention).
//
// Where an option applies is its type, so that the compiler refuses one
// given where it would mean nothing: an Option is taken by calls, a
// [FlowOption] by flows ([NewFlow], [Flow.Run]), and a [SharedOption],
// such as [WithWait], by both.
type Option interface {
	apply(*options) error
	callOption()
}

// FlowOption changes how a [Flow] runs: [WithLease], [WithGrace],
// [WithProviderWindow] and [WithCallTimeout], which mean nothing to a
// call of [Do], [Run] or [Once], and every [SharedOption]. Like an
// [Option], it checks its value when it is made.
type FlowOption interface {
	apply(*options) error
	flowOption()
}

// SharedOption is an option that calls and flows both take: an [Option]
// and a [FlowOption]. [WithWait], [WithRetention], [WithTxOptions],
// [WithIdleTimeout], [WithMaxResponseSize], [WithCodec] and [WithObserver]
// are; [WithLookupFirst] is an Option only, since a flow has no use for it.
type SharedOption interface {
	Option
	FlowOption
}

// option sets a field of options, or is refused with err.
type option struct {
	set func(*options)
	err error
}

func (o option) apply(opts *options) error {
	if o.err != nil {
		return o.err
	}
	o.set(opts)
	return nil
}

// The three kinds of option: one for calls and flows alike, one for calls
// only, one for flows only. Each is its own type, so that an option of one
// kind cannot be asserted into another.
type (
	sharedOption   struct{ option }
	callOnlyOption struct{ option }
	flowOnlyOption struct{ option }
)

func (sharedOption) callOption()   {}
func (sharedOption) flowOption()   {}
func (callOnlyOption) callOption() {}
func (flowOnlyOption) flowOption() {}

func shared(set func(*options)) SharedOption { return sharedOption{option{set: set}} }
func callOnly(set func(*options)) Option     { return callOnlyOption{option{set: set}} }
func flowOnly(set func(*options)) FlowOption { return flowOnlyOption{option{set: set}} }
func refused(field, format string, args ...any) option {
	return option{err: &FieldError{Package: "idem", Field: field, Problem: fmt.Sprintf(format, args...)}}
}

// options is what a call's options add up to.
type options struct {
	retention       time.Duration
	wait            time.Duration
	idleTimeout     time.Duration
	txOptions       pgx.TxOptions
	maxResponseSize int
	lookupFirst     bool
	// noResponse stores no value: the key only records that fn ran (Once).
	noResponse bool
	observer   *Observer
	codec      Codec

	// Of flows only (see Flow).
	lease          time.Duration
	grace          time.Duration
	providerWindow time.Duration
	// callTimeout is zero when there is none.
	callTimeout time.Duration
}

// newOptions applies opts over the defaults: a flow's, when opts are
// FlowOptions, which differ from a call's in one, the idle timeout.
func newOptions[O interface{ apply(*options) error }](opts []O) (options, error) {
	o := options{
		retention:       DefaultRetention,
		wait:            DefaultWait,
		txOptions:       pgx.TxOptions{IsoLevel: pgx.ReadCommitted},
		maxResponseSize: DefaultMaxResponseSize,
		lease:           DefaultLease,
		providerWindow:  DefaultProviderWindow,
		callTimeout:     DefaultCallTimeout,
	}
	_, flow := any(opts).([]FlowOption)
	if flow {
		o.idleTimeout = idleTimeoutUnset
	}
	for _, opt := range opts {
		if err := opt.apply(&o); err != nil {
			return o, err
		}
	}
	if o.idleTimeout == idleTimeoutUnset {
		o.idleTimeout = min(o.lease/3, DefaultFlowIdleTimeout)
	}
	return o, nil
}

// idleTimeoutUnset is a flow's idle timeout until the options are
// applied: WithIdleTimeout's, or, unless it is given, a third of the
// lease (see DefaultFlowIdleTimeout).
const idleTimeoutUnset = -1

// CheckOptions reports the first of opts that was made from a value that
// cannot work, with the error that a call given it would return, which
// wraps [ErrInvalidOption]; nil when every one can. It sends nothing
// anywhere. A package that takes idem's settings in a configuration of its
// own checks them with it when it is set up, so that a value that cannot
// work stops a program from starting instead of failing every call.
func CheckOptions(opts ...Option) error {
	_, err := newOptions(opts)
	return err
}

// CheckFlowOptions is [CheckOptions] for a flow's options: it reports the
// first of opts made from a value that cannot work, or what they refuse
// together (a retention shorter than the provider window), with the error
// that [NewFlow] and [Flow.Run] would return; nil when they can
// work.
func CheckFlowOptions(opts ...FlowOption) error {
	o, err := newOptions(opts)
	if err != nil {
		return err
	}
	return checkFlowOptions(&o)
}

// WithRetention sets how long a completed record blocks its key and answers
// retries with the stored value. After that the record counts as absent and
// the key can be claimed again. Choose it longer than the longest time in
// which a client, or anything that stores and forwards its requests, may
// retry. It must be at least a microsecond, the resolution of PostgreSQL's
// timestamps. Defaults to 24h.
func WithRetention(d time.Duration) SharedOption {
	if d < time.Microsecond {
		return sharedOption{refused("WithRetention", "must be at least 1µs, got %s", d)}
	}
	return shared(func(o *options) { o.retention = d })
}

// WithWait sets how long a duplicate waits for a concurrent attempt on the
// same key to finish. When that attempt commits in time, the duplicate
// replays its outcome; when it rolls back, the duplicate runs the function
// itself; past the budget, the duplicate returns [ErrInProgress]. Zero or a
// negative value means not at all: the duplicate returns ErrInProgress at
// once (PostgreSQL's own lock_timeout of 0 would wait forever, so no wait
// is sent as the server's smallest budget, one millisecond). Values beyond
// lock_timeout's range (about 24 days) are rejected. The budget covers
// only the waits for the key, the wait for its lock and, for a key another
// transaction holds by a record in progress, the wait of the statement that
// stores the record, under what the first left (see [Do]): the function
// and the rest of the transaction keep the caller's own lock_timeout. A caller's statement_timeout shorter
// than the budget cuts the wait short with the driver's own error.
// Defaults to 5s.
func WithWait(d time.Duration) SharedOption {
	if d > maxWait {
		return sharedOption{refused("WithWait", "must not exceed %s, got %s", maxWait, d)}
	}
	return shared(func(o *options) { o.wait = max(d, 0) })
}

// maxWait is the longest wait PostgreSQL's lock_timeout can express: its
// largest value, in milliseconds, is the largest int32.
const maxWait = math.MaxInt32 * time.Millisecond

// millis spells a duration for a PostgreSQL timeout setting: in whole
// milliseconds, rounded up, and never zero, which PostgreSQL reads as "no
// timeout".
func millis(d time.Duration) string {
	ms := int64(d / time.Millisecond)
	if d%time.Millisecond != 0 {
		ms++
	}
	return strconv.FormatInt(max(ms, 1), 10)
}

// WithIdleTimeout bounds how long a transaction of idem's may sit idle,
// waiting for its client: a call's ([Do], [Run]), from the claim until it
// ends, and each local step's of a flow ([Local]), from its BEGIN until it
// commits, the wait for the flow's next statement included. It sets
// PostgreSQL's idle_in_transaction_session_timeout for that transaction
// only (SET LOCAL), queued with the claim or the step's BEGIN: no round
// trip more on pgx (database/sql, which has no pipeline, sends it alone).
// A client that stops without closing its connection (a frozen process or
// host, a network partition) otherwise holds the key's lock, or the flow's
// row, which no other executor can then take over, until the server's TCP
// keepalives give up on it: about 2h11m with Linux's defaults, and never
// for a frozen process, whose kernel answers them. With this bound the
// server ends the session, and with it the transaction and its locks,
// after d of silence. The function's own statements are not limited, only
// the gaps between them: choose d longer than the longest pause the
// function makes between two statements. Zero or a negative value means no
// bound of idem's (the server's or role's own setting applies); values
// beyond the setting's range (about 24 days) are rejected. Defaults to
// none for a call, and for a flow to a third of its lease, up to 1m
// ([DefaultFlowIdleTimeout]).
func WithIdleTimeout(d time.Duration) SharedOption {
	if d > maxWait {
		return sharedOption{refused("WithIdleTimeout", "must not exceed %s, got %s", maxWait, d)}
	}
	return shared(func(o *options) { o.idleTimeout = max(d, 0) })
}

// WithLookupFirst makes [Run] read the key before it begins a transaction.
// A replay then costs one round trip and no transaction at all, instead of
// two round trips; a first execution costs one round trip more. It pays
// where retries are common: consumers of a queue that redelivers, endpoints
// behind retrying proxies, or a service riding out a retry storm. [Do]
// ignores it, as it does when Run is given a TxBeginner other than
// *pgxpool.Pool, *pgxpool.Conn or *pgx.Conn. Defaults to off.
func WithLookupFirst() Option { return callOnly(func(o *options) { o.lookupFirst = true }) }

// WithTxOptions sets the options of the transaction that [Run] begins, such
// as its isolation level. [Do] ignores it: the caller owns that transaction.
// IsoLevel, AccessMode and DeferrableMode must each be empty or one of
// pgx's constants, which pgx would otherwise send to the server as they
// are, and AccessMode not pgx.ReadOnly: idem records keys, and a flow its
// steps, only in read-write transactions. A value refused is a
// [*FieldError] naming the field, such as "WithTxOptions.AccessMode"; a
// read-only one wraps [ErrReadOnly] too. Defaults to READ COMMITTED, read
// write.
func WithTxOptions(txOptions pgx.TxOptions) SharedOption {
	if err := checkTxOptions(txOptions); err != nil {
		return sharedOption{option{err: err}}
	}
	return shared(func(o *options) { o.txOptions = txOptions })
}

// checkTxOptions refuses the transaction modes that pgx would send to the
// server as they are, and the read-only mode, in which idem cannot record
// a key: either would fail every call.
func checkTxOptions(o pgx.TxOptions) error {
	refuse := func(field, problem string, cause error) error {
		return &FieldError{Package: "idem", Field: "WithTxOptions." + field, Problem: problem, Err: cause}
	}
	switch o.IsoLevel {
	case "", pgx.Serializable, pgx.RepeatableRead, pgx.ReadCommitted, pgx.ReadUncommitted:
	default:
		return refuse("IsoLevel", fmt.Sprintf("%q is not an isolation level", o.IsoLevel), nil)
	}
	switch o.AccessMode {
	case "", pgx.ReadWrite:
	case pgx.ReadOnly:
		return refuse("AccessMode", "is read only, where idem cannot record a key", ErrReadOnly)
	default:
		return refuse("AccessMode", fmt.Sprintf("%q is not an access mode", o.AccessMode), nil)
	}
	switch o.DeferrableMode {
	case "", pgx.Deferrable, pgx.NotDeferrable:
	default:
		return refuse("DeferrableMode", fmt.Sprintf("%q is not a deferrable mode", o.DeferrableMode), nil)
	}
	return nil
}

// WithMaxResponseSize sets the largest value, in bytes of encoded JSON, that
// is stored for replay. A larger value makes the call fail with
// [ErrResponseTooLarge]. It must be positive. Defaults to 1 MiB.
func WithMaxResponseSize(n int) SharedOption {
	if n <= 0 {
		return sharedOption{refused("WithMaxResponseSize", "must be positive, got %d", n)}
	}
	return shared(func(o *options) { o.maxResponseSize = n })
}

// Codec seals a value's JSON encoding before it is stored and opens it when
// a replay reads it back, so that stored responses, which may hold personal
// data, can be encrypted or redacted. The scope is passed along for
// per-tenant keys. Sealed bytes are stored as a JSON string.
//
// Records sealed with one codec open only with a codec that understands
// them: when changing codecs, keep opening the old form until the
// retention of the records sealed with it has passed.
type Codec interface {
	Seal(scope string, plaintext []byte) ([]byte, error)
	Open(scope string, sealed []byte) ([]byte, error)
}

// FingerprintKeyer is implemented by a [Codec] that also keys the
// fingerprints idem stores, with a secret of its own (an HMAC), so that a
// reader of idem's tables cannot confirm a guess at a request by computing
// its fingerprint, as [Fingerprint]'s plain hash of a request with few
// possible values (an amount) allows. With such a codec, [Do], [Run],
// [Once] and flows store, and compare, KeyFingerprint of each non-empty
// fingerprint. It must give the same bytes for the same scope and
// fingerprint for as long as records live: a new secret makes the retries
// of records keyed with the old one mismatch, so change it only with the
// codec's own rotation, once the retention has passed.
type FingerprintKeyer interface {
	KeyFingerprint(scope string, fingerprint []byte) []byte
}

// storedFingerprint is fp as idem stores it: keyed by the codec when it is
// a FingerprintKeyer.
func (o *options) storedFingerprint(scope string, fp []byte) []byte {
	if keyer, ok := o.codec.(FingerprintKeyer); ok && len(fp) > 0 {
		return keyer.KeyFingerprint(scope, fp)
	}
	return fp
}

// WithCodec stores values sealed by codec, and opens them on replay; a
// codec that is a [FingerprintKeyer] keys the stored fingerprints too.
// Defaults to none: values are stored as plain JSON.
func WithCodec(codec Codec) SharedOption {
	return shared(func(o *options) { o.codec = codec })
}

// WithObserver records the call's outcome, claim duration and span with
// observer (see [NewObserver]). Defaults to none.
func WithObserver(observer *Observer) SharedOption {
	return shared(func(o *options) { o.observer = observer })
}

// Options of flows only (see [Flow]): FlowOptions, which calls of [Do],
// [Run] and [Once] do not take.

// Default values of the flows' options.
const (
	// DefaultLease is how long a flow's executor holds it without renewing
	// its lease, unless [WithLease] says otherwise.
	DefaultLease = 10 * time.Second

	// DefaultProviderWindow is how long after a call's first attempt a
	// flow still calls again, unless [WithProviderWindow] says otherwise:
	// Stripe keeps idempotency keys for 24 hours.
	DefaultProviderWindow = 24 * time.Hour

	// DefaultCallTimeout is how long a flow's call may run, unless
	// [WithCallTimeout] says otherwise.
	DefaultCallTimeout = time.Minute

	// DefaultFlowIdleTimeout is the longest a flow's transaction (its
	// claim's, a local step's) may sit idle, waiting for its executor,
	// before the server ends it, unless [WithIdleTimeout] says otherwise:
	// a third of the flow's lease ([WithLease]), up to this. An executor
	// frozen in a local step holds its flow no longer, so that a
	// duplicate or a completer takes it over once its lease has run out.
	DefaultFlowIdleTimeout = time.Minute
)

// minLease is the shortest lease: the lease is renewed every third of it,
// and a renewal is a round trip.
const minLease = 10 * time.Millisecond

// WithLease sets how long a flow's executor holds the flow without renewing
// its lease. An executor renews it with every step, and every third of it
// while a call runs; one that stops renewing (a process killed, a host cut
// off) loses the flow once the lease has run out: a duplicate, a retry or
// [Flow.Resume] may then take it over, and whatever the old executor tries
// to commit afterwards fails with [ErrLeaseLost]. Shorter leases resume
// sooner after a crash; choose it longer than the longest pause the flow's
// function makes between two steps, and, when the flow runs on a single
// connection rather than a pool (no renewal during a call), longer than
// its longest call. It must be between 10ms and about 24 days (the longest
// wait PostgreSQL expresses). Defaults to 10s.
func WithLease(d time.Duration) FlowOption {
	if d < minLease || d > maxWait {
		return flowOnlyOption{refused("WithLease", "must be between %s and %s, got %s", minLease, maxWait, d)}
	}
	return flowOnly(func(o *options) { o.lease = d })
}

// WithGrace sets how long after a flow's lease has run out [Flow.Resume]
// leaves it to its client, whose retry would take it over and answer the
// client itself, before resuming it. Duplicates and retries take a flow over
// as soon as its lease has run out, whatever the grace. Zero, or a negative
// value, means none. Defaults to none.
func WithGrace(d time.Duration) FlowOption {
	return flowOnly(func(o *options) { o.grace = max(d, 0) })
}

// WithProviderWindow sets how long after a call's first attempt a flow
// still calls the other system again with the same provider key (see
// [Call]): the shortest time for which the providers the flow calls keep
// their idempotency keys (Stripe: 24 hours; docs/flows.md has a table).
// Past it the provider may have forgotten the key, so that a call made
// again could be applied twice: the flow is stopped instead, for a person
// to decide ([ErrFlowStopped]). Zero means that a call is never made
// twice, for a provider that ignores keys. It must not be negative, and a
// flow refuses a [WithRetention] shorter than it: a key used again once
// its flow's retention has passed sends the provider the keys of the
// operation before, and only a provider that has forgotten them since
// takes the new calls for new ones (so choose the retention longer than
// the longest time the provider may keep keys). Defaults to 24h.
func WithProviderWindow(d time.Duration) FlowOption {
	if d < 0 {
		return flowOnlyOption{refused("WithProviderWindow", "must not be negative, got %s", d)}
	}
	return flowOnly(func(o *options) { o.providerWindow = d })
}

// WithCallTimeout bounds how long a flow's call may run ([Call]): its
// context ends once d has passed, and its lease is no longer renewed, so
// that a call that hangs gives the flow up, to a retry or a completer,
// within a lease after that, rather than holding it for ever. Choose it
// longer than the provider's slowest answers (Stripe's libraries wait up
// to 80s). Zero or a negative value means no bound of idem's (the
// context's own, and the lease's on a single connection). Values beyond
// about 24 days are rejected. Defaults to 1m.
func WithCallTimeout(d time.Duration) FlowOption {
	if d > maxWait {
		return flowOnlyOption{refused("WithCallTimeout", "must not exceed %s, got %s", maxWait, d)}
	}
	return flowOnly(func(o *options) { o.callTimeout = max(d, 0) })
}
