/*
Package idemhttp is net/http middleware that turns a handler into an
exactly-once endpoint for clients that send an Idempotency-Key header, as
the IETF draft "The Idempotency-Key HTTP Header Field" and Stripe's API
describe it.

The handler's own database writes share one transaction with the key's claim
and its stored response, so that a request either happens once, with its
answer saved for retries, or leaves no trace at all:

	mw := idemhttp.MustNew(pool, idemhttp.Config{
		Scope: func(r *http.Request) (string, error) {
			return tenantID(r) // the authenticated caller
		},
		Required: true,
	})
	mux.Handle("POST /payments", mw(http.HandlerFunc(createPayment)))

	func createPayment(w http.ResponseWriter, r *http.Request) {
		tx := idemhttp.Tx(r.Context())
		// ... INSERT on tx, then write the response as usual.
	}

For each covered request with a key, the middleware claims (scope, key),
runs the handler with a response recorder, stores the status, the
allow-listed headers, the headers needed to read the body and the exact body
bytes, and commits; only then does the client get the response. A retry gets
the stored response again, byte for byte, marked Idempotent-Replayed: true.
A duplicate that arrives while the first request is still running waits for
it, up to [Config.Wait], and gets its answer, where Stripe answers 409 at
once.

The answer to every kind of request, the headers read and written, which
answers are stored, the problems, what a client should retry (and what Go's
own http.Transport retries for it), and where idemhttp departs from the
draft and from Stripe, on purpose, are in the reference page
https://github.com/pgidem/idem/blob/main/docs/http.md.

A call of the gRPC or gRPC-Web protocol to a covered method is refused in
its own protocol, with UNIMPLEMENTED in a trailers-only answer, and the
handler does not run: its status travels in HTTP trailers, which the
middleware does not store, so a replay would be half an answer. The
interceptor of github.com/pgidem/idem/idemgrpc serves gRPC. Connect's unary
calls are plain POSTs and work (see
https://github.com/pgidem/idem/blob/main/docs/grpc.md).

# Configuration

[NewMiddleware] checks a [Config] once, applies its defaults, and refuses a
field that cannot work with an error that names it and wraps
[idem.ErrInvalidOption]; [MustNew] is the same middleware and panics with that
error instead. In a Config, zero means the default, which each field
states, and a negative value means none where that makes sense: no wait
([Config.Wait]), no limit ([Config.MaxBodyBytes],
[Config.MaxResponseBytes]). A nil Logger is slog.Default().

# Answers

An answer of the handler's whose status [Config.Store] keeps (by default,
any below 500) commits with the handler's writes and the key's claim, and is
stored; one it refuses (by default, any 5xx) goes to the client as the
handler wrote it and rolls back, so that a retry runs the handler again; a
panic rolls back and is answered 500. An answer whose body is over
[Config.MaxResponseBytes] commits, but only its status and headers are
stored: its retries get 410 and the handler does not run again.

Every answer the middleware writes itself is an RFC 9457 problem with a
stable type URI, [Config.ProblemTypeBase] followed by its code, a "code"
member with the code on its own, for programs to switch on, and the draft's
documentation link, Link: <type>; rel="describedby". The codes are
[ProblemKeyMissing] and the constants after it; each is explained at
[DefaultProblemTypeBase].

# Keys

The key is an RFC 8941 sf-string, as the draft specifies
(Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"), with the escapes
\" and \\; a bare token of visible ASCII (Idempotency-Key: 8e03978e-40d5)
is accepted too, as Stripe-style clients send it, and means the same key.
After unquoting it must be 1 to 255 bytes. A field that appears twice is
invalid. Keys are kept per scope ([Config.Scope]); two requests with the
same key are the same request when their fingerprints match
([DefaultFingerprint], [Config.Fingerprint]).

# Writing handlers

The handler finds its transaction with [Tx] and does every write on it; it
must not commit or roll it back. [Key] and [Scope] name the request's
operation. Its response is buffered until the transaction commits, so
flushing and hijacking are not available. A statement that fails aborts the
whole transaction, which then cannot commit: catch expected failures, such
as a unique violation answered with 409, inside a savepoint (tx.Begin).
When PostgreSQL aborts the transaction at commit to resolve a serialization
failure or a deadlock, the handler runs again in a new one, so it must do
nothing a rollback cannot undo, such as calling another service without an
idempotency key of its own ([Key] helps derive one).

Only the middleware's own statements are retried that way. A serialization
failure or a deadlock in one of the handler's own statements is the
handler's error: it typically answers 5xx, the client gets that answer, and
everything rolls back. The middleware does not run the handler again; the
client's retry with the same key does.

The response is buffered whole, and only then checked against
[Config.MaxResponseBytes]: the limit bounds what is stored, not the memory
a handler may use. Trailers are not stored or replayed. A handler must not
write to the response, or use its transaction, from a goroutine after it
returns: what it wrote by then is the whole response.

When the client goes away mid-request, the request's context is cancelled,
the transaction rolls back, and the client's retry runs the handler again.

# Endpoints that call idem themselves

An endpoint that calls [idem.Run] or [idem.Do] itself, rather than sit
behind the middleware, reads its key with [Middleware.ParseKey] and answers
idem's errors with [Middleware.WriteError], so that its clients see the
same keys and the same problems as the middleware's.

# Endpoints that call other systems

An endpoint whose write calls another system in the middle (charging a
card, reserving stock) is served by an [idem.Flow] through [FlowHandler]:
the middleware holds no transaction while the flow runs, with the same
keys, scopes, fingerprints and problems; a flow that did not complete is
503 operation-incomplete, not stored, and its retry continues it.

# Clients

[Transport] is the client side, an [http.RoundTripper] for an
[http.Client]: it gives each request without a key a fresh one and retries
the request with that key and the same body (network errors, 409 with
Retry-After, 5xx; never another 4xx) within the deadline of the request's
context; a request of a flow's call that carries no key is sent once,
without one. Its documentation states its rules; [Attempts] reports the
key and the attempts of an answer.

# Privacy and observability

A stored answer holds the handler's body and headers, often personal data;
without a codec they are only base64 in the table. [Config.Codec] seals them
(see [idem.Codec]) and [Config.Observer] records each keyed request's
outcome, claim duration and span (see [idem.Observer]), as they do for
[idem.Run]. Requests without a key are not observed.
*/
package idemhttp
