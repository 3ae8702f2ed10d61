package webhook

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/internal/adapter"
	"github.com/pgidem/idem/internal/httpedge"
	"github.com/pgidem/idem/internal/ident"
)

// Codes of the problems the receiver answers for deliveries it refuses,
// besides idemhttp's own that it shares (body-too-large, body-unreadable,
// scope-unknown, key-in-progress, request-failed, database-unavailable).
// A problem's type URI is [Config.ProblemTypeBase] followed by its code;
// the codes are stable.
const (
	// ProblemUnsigned (400): a header the scheme needs (the signature,
	// the event's id, the timestamp) is missing. Nothing was written.
	ProblemUnsigned = "webhook-unsigned"

	// ProblemMalformed (400): a header the scheme needs, or the event id
	// in the body, cannot be read. Nothing was written.
	ProblemMalformed = "webhook-malformed"

	// ProblemSignatureInvalid (400): no signature of the delivery matches
	// the receiver's secrets. Nothing was written.
	ProblemSignatureInvalid = "webhook-signature-invalid"

	// ProblemStale (400): the time the signature covers is older than
	// [Config.Tolerance] on the receiver's clock, or further ahead of it
	// than the scheme allows (see Config.Tolerance). Nothing was written.
	ProblemStale = "webhook-stale"

	// ProblemIDReused (422): the event's id was received before, within
	// [Config.Retention], with another payload: a sender's bug, or an
	// attack. The handler did not run, and nothing was written.
	ProblemIDReused = "webhook-id-reused"
)

// Handler applies one event in tx, the transaction in which the receiver
// records the event's id: its writes and the record commit together, or
// not at all. It returns nil to acknowledge the event (the sender gets
// 204, and no redelivery runs it again), and an error to roll everything
// back (the sender gets 500, and delivers it again). It must not commit or
// roll tx back, and must do nothing that a rollback cannot undo, since
// the receiver runs it again in a new transaction when PostgreSQL aborts
// the first at commit (a serialization failure or a deadlock): to act
// outside the database, enqueue an outbox message in tx (see the package
// documentation). An event it does not care about is acknowledged by
// returning nil.
type Handler func(ctx context.Context, tx pgx.Tx, ev Event) error

// Event is a verified delivery, as the [Handler] gets it.
type Event struct {
	// Scope is the scope that [Config.Scope] gave the delivery.
	Scope string

	// ID is the event's id, as the sender sent it.
	ID string

	// Type is the event's type, when the scheme knows it (see
	// [Delivery.Type]).
	Type string

	// Body is the delivery's body, byte for byte what was signed; an
	// empty body is an empty slice, never nil.
	Body []byte

	// SignedAt is the time the signature covers; zero when the scheme
	// signs none.
	SignedAt time.Time

	// Header is the delivery's header.
	Header http.Header
}

// Receiver is an http.Handler that receives a sender's webhooks and
// applies each event once: see the package documentation. It is safe for
// concurrent use.
type Receiver struct {
	db     idem.TxBeginner
	handle Handler
	settings
}

// NewReceiver checks cfg, applies its defaults, and returns the receiver
// that applies each event with handle, on db. It refuses a nil db or
// handle, and every field of cfg that cannot work, with an error that
// names the field and wraps [idem.ErrInvalidOption].
func NewReceiver(db idem.TxBeginner, handle Handler, cfg Config) (*Receiver, error) {
	if db == nil {
		return nil, invalidField("NewReceiver", "needs a database, got nil")
	}
	if handle == nil {
		return nil, invalidField("NewReceiver", "needs a handler, got nil")
	}
	s, err := newSettings(cfg)
	if err != nil {
		return nil, err
	}
	return &Receiver{db: db, handle: handle, settings: s}, nil
}

// ServeHTTP receives one delivery: it reads the body (bounded), verifies
// it, and applies its event once, answering 204 only after the commit.
func (rc *Receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, ok := rc.readBody(w, r)
	if !ok {
		return
	}
	d, err := rc.scheme.Verify(r, body)
	if err == nil {
		err = rc.check(d)
	}
	if err != nil {
		rc.refuse(w, r, err)
		return
	}
	scope, err := rc.scope(r)
	if err != nil {
		rc.metrics.delivery(r.Context(), outcomeRefused, reasonScopeUnknown, true)
		rc.writeProblem(w, http.StatusBadRequest, idemhttp.ProblemScopeUnknown, "The delivery does not say whose endpoint it is for.")
		return
	}
	fp := d.Fingerprint
	if fp == nil {
		fp = idem.Fingerprint(body)
	}
	ev := Event{Scope: scope, ID: d.ID, Type: d.Type, Body: body, SignedAt: d.SignedAt, Header: r.Header}
	res, err := idem.Run(r.Context(), rc.db, scope, recordKey(d.ID), fp, func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
		return struct{}{}, rc.apply(ctx, tx, ev)
	}, rc.runOptions...)
	switch {
	case err == nil && res.Replayed:
		rc.metrics.delivery(r.Context(), outcomeDuplicate, "", true)
		w.Header().Set(idemhttp.ReplayedHeader, "true")
		w.WriteHeader(http.StatusNoContent)
	case err == nil:
		rc.metrics.delivery(r.Context(), outcomeApplied, "", true)
		w.WriteHeader(http.StatusNoContent)
	default:
		rc.fail(w, r, ev, err)
	}
}

// check applies the receiver's own rules to a verified delivery: an id,
// and a signed time no older than the tolerance, and no further ahead
// than the scheme allows.
func (rc *Receiver) check(d Delivery) error {
	if d.ID == "" {
		return fmt.Errorf("%w: the delivery names no event id", ErrMalformed)
	}
	if rc.tolerance < 0 || d.SignedAt.IsZero() {
		return nil
	}
	signed := d.SignedAt.UTC().Format(time.RFC3339)
	switch age := rc.now().Sub(d.SignedAt); {
	case age > rc.tolerance:
		return fmt.Errorf("%w: signed at %s, %s before the receiver's clock, more than the tolerance of %s",
			ErrStale, signed, age.Round(time.Second), rc.tolerance)
	case -age > rc.ahead:
		return fmt.Errorf("%w: signed at %s, %s ahead of the receiver's clock, more than the %s allowed",
			ErrStale, signed, (-age).Round(time.Second), rc.ahead)
	}
	return nil
}

// hashedPrefix starts the key under which an event id is recorded when it
// cannot be recorded as it is (see recordKey).
const hashedPrefix = "sha256:"

// recordKey is the key under which the event id is recorded: the id
// itself, unless idem cannot take it as a key (longer than 255 bytes, not
// UTF-8, a NUL byte), or it starts with "sha256:"; such an id is recorded
// as "sha256:" and the lower-case hex SHA-256 of its bytes. No two ids
// share a key, but for a collision of SHA-256.
func recordKey(id string) string {
	if ident.Check(id) == nil && !strings.HasPrefix(id, hashedPrefix) {
		return id
	}
	sum := sha256.Sum256([]byte(id))
	return hashedPrefix + hex.EncodeToString(sum[:])
}

// handlerFailed is the handler's error or panic, returned to idem.Run so
// that the transaction rolls back.
type handlerFailed struct {
	err   error
	panic any
	stack []byte
}

func (e *handlerFailed) Error() string {
	if e.err != nil {
		return "webhook: handler: " + e.err.Error()
	}
	return fmt.Sprintf("webhook: handler panicked: %v", e.panic)
}

func (e *handlerFailed) Unwrap() error { return e.err }

// apply runs the handler, turning its error or panic into a handlerFailed.
func (rc *Receiver) apply(ctx context.Context, tx pgx.Tx, ev Event) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &handlerFailed{panic: p, stack: debug.Stack()}
		}
	}()
	if err := rc.handle(ctx, tx, ev); err != nil {
		return &handlerFailed{err: err}
	}
	return nil
}

// refuse answers a delivery that did not pass verification: a problem of
// its own for the scheme's errors, nothing written; 500 for any other
// error of a scheme of the application's own.
func (rc *Receiver) refuse(w http.ResponseWriter, r *http.Request, err error) {
	var code, reason string
	level := slog.LevelWarn
	switch {
	case errors.Is(err, ErrUnsigned):
		code, reason, level = ProblemUnsigned, reasonUnsigned, slog.LevelInfo
	case errors.Is(err, ErrMalformed):
		code, reason, level = ProblemMalformed, reasonMalformed, slog.LevelInfo
	case errors.Is(err, ErrSignatureInvalid):
		code, reason = ProblemSignatureInvalid, reasonSignatureInvalid
	case errors.Is(err, ErrStale):
		code, reason = ProblemStale, reasonStale
	default:
		rc.metrics.delivery(r.Context(), outcomeFailed, reasonError, false)
		rc.logger.LogAttrs(r.Context(), slog.LevelError, "webhook: the scheme failed to verify a delivery",
			slog.String("uri", r.URL.RequestURI()), slog.Any("error", err))
		rc.writeProblem(w, http.StatusInternalServerError, idemhttp.ProblemRequestFailed,
			"The delivery could not be verified. Nothing of it was kept: delivering it again is safe.")
		return
	}
	rc.metrics.delivery(r.Context(), outcomeRefused, reason, false)
	rc.logger.LogAttrs(r.Context(), level, "webhook: delivery refused; nothing was written",
		slog.String("uri", r.URL.RequestURI()), slog.String("reason", reason), slog.String("remote_addr", r.RemoteAddr), slog.Any("error", err))
	rc.writeProblem(w, http.StatusBadRequest, code, strings.TrimPrefix(err.Error(), "webhook: ")+".")
}

// fail answers a verified delivery whose event was not applied.
func (rc *Receiver) fail(w http.ResponseWriter, r *http.Request, ev Event, err error) {
	ctx := r.Context()
	attrs := []slog.Attr{slog.String("scope", ev.Scope), slog.String("event_id", ev.ID), slog.String("type", ev.Type)}
	var handler *handlerFailed
	isHandler := errors.As(err, &handler)
	// The handler's own errors are its own, even one that idem gave it
	// (an idem.Do of its own on a key reused): only the database's
	// unavailability is told apart from them.
	switch {
	case !isHandler && errors.Is(err, idem.ErrFingerprintMismatch):
		rc.metrics.delivery(ctx, outcomeRefused, reasonIDReused, true)
		rc.logger.LogAttrs(ctx, slog.LevelError, "webhook: event id reused with another payload (a sender's bug, or an attack); refused, nothing written", attrs...)
		rc.writeProblem(w, http.StatusUnprocessableEntity, ProblemIDReused,
			"This event id was received before with another payload. The delivery was refused and nothing of it was kept.")
	case !isHandler && errors.Is(err, idem.ErrInProgress):
		rc.metrics.delivery(ctx, outcomeFailed, reasonInProgress, true)
		w.Header().Set("Retry-After", rc.retryAfter)
		rc.writeProblem(w, http.StatusConflict, idemhttp.ProblemKeyInProgress,
			"Another delivery of this event is still being applied. Deliver it again later: it will be acknowledged once applied.")
	case isHandler && handler.panic != nil:
		rc.metrics.delivery(ctx, outcomeFailed, reasonHandler, true)
		if handler.panic == http.ErrAbortHandler {
			// The handler asked net/http to cut the connection; do so, now
			// that its transaction has rolled back.
			panic(http.ErrAbortHandler)
		}
		rc.logger.LogAttrs(ctx, slog.LevelError, "webhook: handler panicked; its transaction was rolled back",
			append(attrs, slog.Any("panic", handler.panic), slog.String("stack", string(handler.stack)))...)
		rc.writeProblem(w, http.StatusInternalServerError, idemhttp.ProblemRequestFailed,
			"The event could not be applied. Nothing of it was kept: delivering it again is safe.")
	case adapter.DatabaseUnavailable(err):
		rc.metrics.delivery(ctx, outcomeFailed, reasonDatabaseUnavailable, true)
		if ctx.Err() == nil {
			rc.logger.LogAttrs(ctx, slog.LevelError, "webhook: database unavailable; the sender is asked to deliver again", append(attrs, slog.Any("error", err))...)
		}
		w.Header().Set("Retry-After", httpedge.UnavailableRetryAfter)
		rc.writeProblem(w, http.StatusServiceUnavailable, idemhttp.ProblemDatabaseUnavailable,
			"The event could not be applied: the database is unavailable. Delivering it again later is safe.")
	case !isHandler && errors.Is(err, idem.ErrInvalidScope):
		// Config.Scope gave a scope idem refuses: the server's bug, which
		// every delivery meets until it is fixed; the sender's retries
		// then get through.
		rc.metrics.delivery(ctx, outcomeFailed, reasonError, true)
		rc.logger.LogAttrs(ctx, slog.LevelError, "webhook: Config.Scope gave a scope idem refuses; nothing was written", append(attrs, slog.Any("error", err))...)
		rc.writeProblem(w, http.StatusInternalServerError, idemhttp.ProblemRequestFailed,
			"The event could not be applied because of an error of the receiver's, which its operators are told of. Nothing of it was kept.")
	default:
		reason := reasonError
		if isHandler {
			reason = reasonHandler
		}
		rc.metrics.delivery(ctx, outcomeFailed, reason, true)
		if ctx.Err() == nil {
			rc.logger.LogAttrs(ctx, slog.LevelError, "webhook: event not applied; its transaction was rolled back", append(attrs, slog.Any("error", err))...)
		}
		rc.writeProblem(w, http.StatusInternalServerError, idemhttp.ProblemRequestFailed,
			"The event could not be applied. Nothing of it was kept: delivering it again is safe.")
	}
}

// readBody reads the whole body, up to the limit, or answers the delivery
// itself and reports false.
func (rc *Receiver) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := httpedge.ReadBody(r, rc.maxBodyBytes)
	switch {
	case errors.Is(err, httpedge.ErrBodyTooLarge):
		rc.metrics.delivery(r.Context(), outcomeRefused, reasonBodyTooLarge, false)
		rc.writeProblem(w, http.StatusRequestEntityTooLarge, idemhttp.ProblemBodyTooLarge,
			fmt.Sprintf("The delivery's body is larger than %d bytes.", rc.maxBodyBytes))
		return nil, false
	case err != nil:
		rc.metrics.delivery(r.Context(), outcomeRefused, reasonBodyUnreadable, false)
		rc.writeProblem(w, http.StatusBadRequest, idemhttp.ProblemBodyUnreadable, "The delivery's body could not be read.")
		return nil, false
	}
	return body, true
}

func (rc *Receiver) writeProblem(w http.ResponseWriter, status int, code, detail string) {
	httpedge.Write(w, rc.problemTypeBase, httpedge.Details{Status: status, Code: code, Title: httpedge.Title(code), Detail: detail})
}
