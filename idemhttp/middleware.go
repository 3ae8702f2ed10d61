package idemhttp

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// Middleware is a checked [Config] on a database. [Middleware.Wrap] is the
// middleware itself; [Middleware.ParseKey] and [Middleware.WriteError] give
// a handler that calls idem itself the same keys and the same answers.
// It is safe for concurrent use.
type Middleware struct {
	db idem.TxBeginner
	settings
}

// NewMiddleware checks cfg, applies its defaults and returns the middleware
// for db. It refuses a nil db, and every field of cfg that cannot work, such
// as a nil Scope, a retention under a microsecond or a wait longer than
// PostgreSQL's lock_timeout can express, with an error that names the field
// and wraps [idem.ErrInvalidOption]: a misconfigured server must not start.
// Use it where the configuration comes from outside the program (flags,
// files, the environment), and [MustNew] where it is written in the code.
func NewMiddleware(db idem.TxBeginner, cfg Config) (*Middleware, error) {
	if db == nil {
		return nil, invalidField("NewMiddleware", "needs a database, got nil")
	}
	s, err := newSettings(cfg)
	if err != nil {
		return nil, err
	}
	return &Middleware{db: db, settings: s}, nil
}

// MustNew returns middleware that makes the handler it wraps exactly-once per
// (scope, key) for the covered methods, on db: the [Middleware.Wrap] of
// [NewMiddleware](db, cfg). When db or cfg cannot work it panics, with the
// error NewMiddleware returns. Use it where cfg is written in the code, so
// that a mistake in it stops the program at its start, as
// regexp.MustCompile does; use NewMiddleware to handle the error.
func MustNew(db idem.TxBeginner, cfg Config) func(http.Handler) http.Handler {
	m, err := NewMiddleware(db, cfg)
	if err != nil {
		panic(err)
	}
	return m.Wrap
}

// Wrap returns next made exactly-once per (scope, key) for the covered
// methods. See the package documentation for the answers it gives.
//
// The handler runs in a transaction that it finds with [Tx]. When the
// middleware's own statements in that transaction, such as its COMMIT, fail
// with a serialization failure or a deadlock, it runs the handler again in
// a new transaction (see [idem.Run]), with the same request body: the
// handler must do nothing that a rollback cannot undo.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return &handler{Middleware: m, next: next}
}

// requestKey is the context key under which the handler finds its
// requestValues.
type requestKey struct{}

// requestValues are what the middleware tells the handler about its
// request.
type requestValues struct {
	tx         pgx.Tx
	scope, key string
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

// Scope returns the scope that [Config.Scope] gave the request whose
// context is ctx, under which its key is claimed, or "" when it has no key
// or its method is not covered. With [Key] it names the request's
// operation, as an outbox entry needs, without calling Config.Scope again.
func Scope(ctx context.Context) string {
	v, _ := ctx.Value(requestKey{}).(requestValues)
	return v.scope
}
