package idem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/guard"
)

// MaxKeyLength is the longest key or scope accepted, in bytes.
const MaxKeyLength = guard.MaxIdentifierLength

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

// Result is what [Do] and [Run] return on success.
type Result[T any] struct {
	// Value is the function's result, or on a replay the stored result
	// decoded again from JSON. Only what survives a JSON round trip is
	// replayed: unexported fields and fields tagged `json:"-"` come back as
	// zero values.
	Value T

	// Replayed is true when the function did not run in this call because
	// the key's operation had already completed.
	Replayed bool
}

// Option changes how [Do] and [Run] treat a key.
type Option interface {
	apply(*options)
}

type optionFunc func(*options)

func (f optionFunc) apply(o *options) { f(o) }

type options struct {
	retention       time.Duration
	wait            time.Duration
	txOptions       pgx.TxOptions
	maxResponseSize int
	lookupFirst     bool
	// noResponse stores no value: the key only records that fn ran.
	noResponse bool
	observer   *Observer
	codec      Codec
	err        error
}

// WithRetention sets how long a completed record blocks its key and answers
// retries with the stored value. After that the record counts as absent and
// the key can be claimed again. Choose it longer than the longest time in
// which a client, or anything that stores and forwards its requests, may
// retry. It must be positive. Defaults to 24h.
func WithRetention(d time.Duration) Option {
	return optionFunc(func(o *options) {
		if d <= 0 {
			o.fail(fmt.Errorf("%w: retention must be positive, got %s", ErrInvalidOption, d))
			return
		}
		o.retention = d
	})
}

// WithWait sets how long a duplicate waits for a concurrent attempt on the
// same key to finish. When that attempt commits in time, the duplicate
// replays its outcome; when it rolls back, the duplicate claims the key and
// runs the function itself; past the budget, the duplicate returns
// [ErrInProgress]. Zero means not at all: PostgreSQL's own lock_timeout of 0
// would wait forever, so zero is sent as the server's smallest budget, one
// millisecond. Negative values, and values beyond lock_timeout's range
// (about 24 days), are rejected. The budget applies to the claim's waits
// for rows and transactions: the function and the rest of the transaction
// keep the caller's own lock_timeout, and so does a wait for a table lock
// (behind a migration, say), which happens before the budget is set. A
// caller's statement_timeout shorter than the budget cuts the wait short
// with the driver's own error. Defaults to 5s.
func WithWait(d time.Duration) Option {
	return optionFunc(func(o *options) {
		if d < 0 || d > maxWait {
			o.fail(fmt.Errorf("%w: wait must be between 0 and %s, got %s", ErrInvalidOption, maxWait, d))
			return
		}
		o.wait = d
	})
}

// WithLookupFirst makes [Run] read the key before it begins a transaction.
// A replay then costs one round trip and no transaction at all, instead of
// two round trips; a first execution costs one round trip more. It pays
// where retries are common: consumers of a queue that redelivers, endpoints
// behind retrying proxies, or a service riding out a retry storm. [Do]
// ignores it, as it does when Run is given a TxBeginner other than
// *pgxpool.Pool, *pgxpool.Conn or *pgx.Conn. Defaults to off.
func WithLookupFirst() Option { return optionFunc(func(o *options) { o.lookupFirst = true }) }

// WithTxOptions sets the options of the transaction that [Run] begins, such
// as its isolation level. [Do] ignores it: the caller owns that transaction.
// Defaults to READ COMMITTED.
func WithTxOptions(txOptions pgx.TxOptions) Option {
	return optionFunc(func(o *options) { o.txOptions = txOptions })
}

// WithMaxResponseSize sets the largest value, in bytes of encoded JSON, that
// is stored for replay. A larger value makes the call fail with
// [ErrResponseTooLarge]. It must be positive. Defaults to 1 MiB.
func WithMaxResponseSize(n int) Option {
	return optionFunc(func(o *options) {
		if n <= 0 {
			o.fail(fmt.Errorf("%w: max response size must be positive, got %d", ErrInvalidOption, n))
			return
		}
		o.maxResponseSize = n
	})
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

// WithCodec stores values sealed by codec, and opens them on replay.
// Defaults to none: values are stored as plain JSON.
func WithCodec(codec Codec) Option {
	return optionFunc(func(o *options) { o.codec = codec })
}

func (o *options) fail(err error) {
	if o.err == nil {
		o.err = err
	}
}

func newOptions(opts []Option) (*options, error) {
	o := &options{
		retention:       DefaultRetention,
		wait:            DefaultWait,
		txOptions:       pgx.TxOptions{IsoLevel: pgx.ReadCommitted},
		maxResponseSize: DefaultMaxResponseSize,
	}
	for _, opt := range opts {
		opt.apply(o)
	}
	return o, o.err
}

// maxWait is the longest wait PostgreSQL's lock_timeout can express: its
// largest value, in milliseconds, is the largest int32.
const maxWait = math.MaxInt32 * time.Millisecond

// lockTimeout spells the wait budget in whole milliseconds, rounded up, and
// never zero, which PostgreSQL would read as "wait forever".
func (o *options) lockTimeout() string {
	ms := int64(o.wait / time.Millisecond)
	if o.wait%time.Millisecond != 0 {
		ms++
	}
	return strconv.FormatInt(max(ms, 1), 10)
}

// checkScopeAndKey validates both identifiers before anything reaches the
// database: out-of-bounds input is rejected, never truncated, because
// truncation turns distinct keys into collisions.
func checkScopeAndKey(scope, key string) error {
	if err := guard.CheckIdentifier(scope); err != nil {
		return fmt.Errorf("%w: %s", ErrInvalidScope, err)
	}
	if err := guard.CheckIdentifier(key); err != nil {
		return fmt.Errorf("%w: %s", ErrInvalidKey, err)
	}
	return nil
}

// Do makes fn's effect happen once per (scope, key), inside the caller's
// transaction tx.
//
// Do claims the key in tx, runs fn with tx, and stores fn's value (as JSON)
// in tx, so that the claim, fn's writes and the stored value commit together
// or not at all. A call for a key whose operation already committed does not
// run fn: it returns the stored value with Replayed set. Scopes are separate
// namespaces: pass the tenant or client identity, so that two tenants using
// the same key never see each other's records.
//
// fp is the request's fingerprint (see [Fingerprint] and [FingerprintJSON]).
// A live key claimed with another fingerprint gives [ErrFingerprintMismatch].
// A nil fp matches only another nil or empty fp.
//
// When fn returns an error, Do releases the claim and returns the error
// wrapped (errors.Is works); the caller should roll back. A duplicate that
// arrives while another transaction holds the key waits for it (see
// [WithWait]) and may get [ErrInProgress], after which tx is unusable.
// Under REPEATABLE READ or SERIALIZABLE, a key completed after tx's snapshot
// gives [ErrSerialization]: retry the whole transaction, or use [Run], which
// does.
//
// Invalid scopes and keys give [ErrInvalidScope] and [ErrInvalidKey] before
// anything is sent to the database.
func Do[T any](ctx context.Context, tx pgx.Tx, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), opts ...Option,
) (_ Result[T], err error) {
	o, err := newOptions(opts)
	ctx, obs := o.observer.observe(ctx, "idem.Do")
	defer func() { obs.end(ctx, scope, key, err) }()
	if err != nil {
		return Result[T]{}, err
	}
	if err := checkScopeAndKey(scope, key); err != nil {
		return Result[T]{}, err
	}
	res, store, err := attempt(ctx, tx, func() pgx.Tx { return tx }, scope, key, fp, fn, o, obs)
	if err != nil || store == nil {
		return res, err
	}
	if err := dbsqlc.New(tx).KeyStoreResponse(ctx, *store); err != nil {
		return Result[T]{}, releaseAfter(ctx, tx, scope, key, translateStore("idem: store response", err), o)
	}
	return res, nil
}

// attempt claims the key through db and runs fn in the transaction that
// txOf returns once the claim is made, or replays. When fn ran, it returns
// the parameters that store the value instead of storing it, so that [Run]
// can send them in the same round trip as COMMIT.
func attempt[T any](ctx context.Context, db dbsqlc.DBTX, txOf func() pgx.Tx, scope, key string, fp []byte,
	fn func(ctx context.Context, tx pgx.Tx) (T, error), o *options, obs *observation,
) (res Result[T], store *dbsqlc.KeyStoreResponseParams, err error) {
	stored, outcome, err := claim(ctx, dbsqlc.New(db), scope, key, fp, o)
	obs.claimDone(outcome)
	if err != nil {
		return res, nil, err
	}
	tx := txOf()
	if outcome == OutcomeReplayed {
		res, err := replayed[T](stored, scope, o)
		return res, nil, err
	}

	// The claim must not survive a panic in fn either: a caller that
	// recovers and commits would leave the key blocked in progress.
	defer func() {
		if p := recover(); p != nil {
			_ = releaseAfter(ctx, tx, scope, key, nil, o)
			panic(p)
		}
	}()

	value, err := fn(ctx, tx)
	if err != nil {
		return Result[T]{}, nil, releaseAfter(ctx, tx, scope, key, fmt.Errorf("idem: %w", err), o)
	}
	// Once stores no response: a SQL NULL, the zero pgtype.Text.
	var response pgtype.Text
	if !o.noResponse {
		encoded, err := encodeResponse(value, scope, o)
		if err != nil {
			return Result[T]{}, nil, releaseAfter(ctx, tx, scope, key, err, o)
		}
		response = pgtype.Text{String: string(encoded), Valid: true}
	}
	res.Value = value
	return res, &dbsqlc.KeyStoreResponseParams{Scope: scope, Key: key, Response: response}, nil
}

// claim runs KeyClaim and interprets the answer: the calling transaction
// now owns the key (OutcomeClaimed, OutcomeReclaimed), or the key's stored
// response is to be replayed (OutcomeReplayed), or an error says why not.
func claim(ctx context.Context, q *dbsqlc.Queries, scope, key string, fp []byte, o *options) (stored []byte, _ Outcome, err error) {
	params := dbsqlc.KeyClaimParams{
		Scope:       scope,
		Key:         key,
		LockTimeout: o.lockTimeout(),
		Fingerprint: fp,
		Retention:   pgtype.Interval{Microseconds: o.retention.Microseconds(), Valid: true},
	}
	if params.Fingerprint == nil {
		params.Fingerprint = []byte{}
	}
	// A record can vanish or change between one statement and the next
	// (purged, or reclaimed once expired); the next round then claims the
	// key or sees the new record. Three rounds are more than that race needs.
	for range 3 {
		row, err := q.KeyClaim(ctx, params)
		if err != nil {
			return nil, OutcomeFailed, translate("idem: claim key", err)
		}
		if row.Claimed {
			return nil, OutcomeClaimed, nil
		}
		if row.State.Valid && row.Expired {
			// An expired record counts as absent: take it over, whatever
			// its fingerprint, unless a concurrent reclaimer got there first.
			got, err := q.KeyReclaim(ctx, dbsqlc.KeyReclaimParams{
				Scope: scope, Key: key, LockTimeout: params.LockTimeout,
				Fingerprint: params.Fingerprint, Retention: params.Retention,
			})
			if err != nil {
				return nil, OutcomeFailed, translate("idem: reclaim expired key", err)
			}
			if got.Claimed {
				return nil, OutcomeReclaimed, nil
			}
			continue
		}
		if row.State.Valid {
			return judge(row.State.String, row.Fingerprint, row.Response, fp)
		}
		// The record was committed while the claim waited for it, so the
		// claim's snapshot cannot see it: read it with a new one.
		got, err := q.KeyGet(ctx, dbsqlc.KeyGetParams{Scope: scope, Key: key})
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			return nil, OutcomeFailed, translate("idem: read key", err)
		}
		return judge(got.State, got.Fingerprint, got.Response, fp)
	}
	return nil, OutcomeInProgress, fmt.Errorf("%w: the record kept changing while it was claimed", ErrInProgress)
}

// lookup reads the key's live record outside any transaction, and reports
// found when it holds a completed operation to replay.
func lookup(ctx context.Context, q *dbsqlc.Queries, scope, key string, fp []byte) (stored []byte, found bool, err error) {
	got, err := q.KeyGet(ctx, dbsqlc.KeyGetParams{Scope: scope, Key: key})
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && got.State != stateDone) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, translate("idem: look up key", err)
	}
	stored, _, err = judge(got.State, got.Fingerprint, got.Response, fp)
	return stored, err == nil, err
}

// replayed decodes a stored response into the result of a replay.
func replayed[T any](stored []byte, scope string, o *options) (Result[T], error) {
	res := Result[T]{Replayed: true}
	if stored == nil {
		return res, nil // the key recorded only that its operation ran (Once)
	}
	if o.codec != nil {
		var sealed []byte
		if err := json.Unmarshal(stored, &sealed); err != nil {
			return Result[T]{}, fmt.Errorf("idem: stored response is not sealed by a codec: %w", err)
		}
		opened, err := o.codec.Open(scope, sealed)
		if err != nil {
			return Result[T]{}, fmt.Errorf("idem: open stored response: %w", err)
		}
		stored = opened
	}
	if err := json.Unmarshal(stored, &res.Value); err != nil {
		return Result[T]{}, fmt.Errorf("idem: decode stored response: %w", err)
	}
	return res, nil
}

// judge decides what a duplicate gets from the live record that blocked it.
func judge(state string, storedFP, response, fp []byte) ([]byte, Outcome, error) {
	switch {
	case !bytes.Equal(storedFP, fp):
		return nil, OutcomeMismatch, ErrFingerprintMismatch
	case state != stateDone:
		// Only the calling transaction's own open claim can be seen in
		// progress: another transaction's would have been waited for.
		return nil, OutcomeInProgress, fmt.Errorf("%w: the calling transaction holds the key itself", ErrInProgress)
	}
	return response, OutcomeReplayed, nil
}

// stateDone marks a record whose operation committed with a stored response.
const stateDone = "done"

// encodeResponse encodes v for the jsonb column, refusing what the column
// would reject so that the failure is typed and the transaction stays usable.
// With a codec, the sealed bytes are stored as a JSON string.
func encodeResponse(v any, scope string, o *options) ([]byte, error) {
	encoded, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrResponseNotStorable, err)
	}
	if o.codec != nil {
		sealed, err := o.codec.Seal(scope, encoded)
		if err != nil {
			return nil, fmt.Errorf("%w: seal: %w", ErrResponseNotStorable, err)
		}
		encoded, _ = json.Marshal(sealed) // a []byte always encodes
	}
	if len(encoded) > o.maxResponseSize {
		return nil, fmt.Errorf("%w: %d bytes of JSON, limit %d", ErrResponseTooLarge, len(encoded), o.maxResponseSize)
	}
	switch problems := scanJSON(encoded); {
	case problems&jsonbNUL != 0:
		return nil, fmt.Errorf("%w: a string holds a NUL character, which jsonb cannot store", ErrResponseNotStorable)
	case problems&jsonbLoneSurrogate != 0:
		return nil, fmt.Errorf("%w: a string holds a lone UTF-16 surrogate escape, which jsonb rejects", ErrResponseNotStorable)
	case problems&jsonbNumberRange != 0:
		return nil, fmt.Errorf("%w: a number is beyond the range of jsonb's numeric type", ErrResponseNotStorable)
	}
	return encoded, nil
}

// releaseAfter removes the calling transaction's claim after a failure, with
// a context that is not cancelled, so that a caller who commits anyway never
// commits a record stuck in progress. If the transaction is already aborted
// the release fails harmlessly: nothing in it can commit.
func releaseAfter(ctx context.Context, tx pgx.Tx, scope, key string, cause error, o *options) error {
	err := dbsqlc.New(tx).KeyRelease(context.WithoutCancel(ctx), dbsqlc.KeyReleaseParams{Scope: scope, Key: key})
	// A connection closed by a cancelled context still reports 'T', but its
	// transaction is gone with it: nothing can commit, nothing to report.
	if err != nil && tx.Conn() != nil && !tx.Conn().IsClosed() && tx.Conn().PgConn().TxStatus() == 'T' {
		o.observer.logRelease(ctx, scope, key, err)
		return errors.Join(cause, fmt.Errorf("idem: release claim, roll back: %w", err))
	}
	return cause
}
