/*
Package idemhttp is net/http middleware that turns a handler into an
exactly-once endpoint for clients that send an Idempotency-Key header, as
the IETF draft "The Idempotency-Key HTTP Header Field" and Stripe's API
describe it.

The handler's own database writes share one transaction with the key's claim
and its stored response, so that a request either happens once, with its
answer saved for retries, or leaves no trace at all:

	mw := idemhttp.New(pool, idemhttp.Config{
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
allow-listed headers and the exact body bytes, and commits; only then does
the client get the response. A retry gets the stored response again, byte
for byte. A duplicate that arrives while the first request is still running
waits for it and gets its answer, where Stripe answers 409 at once.

# Answers

	Request                                          Answer
	-----------------------------------------------  ----------------------------------------
	Method not covered (by default, not POST/PATCH)  Handler runs as usual; Tx returns nil
	No key, Config.Required                          400; handler not run
	No key, not required                             Handler runs in a transaction; nothing
	                                                 claimed or stored; commits below 500
	Key invalid                                      400; handler not run
	Config.Scope returns an error                    400; handler not run
	Body over Config.MaxBodyBytes                    413; handler not run
	Handler answers 2xx, 3xx or 4xx                  Its answer; its writes, the claim and
	                                                 the answer commit together
	Handler answers 5xx                              Its answer; all rolled back, so a
	                                                 retry runs the handler again
	Handler panics                                   500; all rolled back, as for a 5xx
	Retry after a commit                             Stored status, allow-listed headers
	                                                 and body, plus Idempotent-Replayed: true
	Same key, different request                      422; handler not run
	Same key while the first request runs            Waits up to Config.Wait, then replays
	                                                 its answer (or runs the handler, if
	                                                 the first rolled back); past the wait,
	                                                 409 with Retry-After
	Database failure, or answer too large to store   500; retrying with the key is safe

A 4xx is stored on purpose: a declined card stays declined on retry, rather
than being charged when the client tries again. The flip side: a 429
answered by the handler is replayed too, so put rate limiting in front of the
middleware. Every answer the middleware
writes itself is an RFC 9457 problem (Content-Type: application/problem+json,
with type, title, status and detail); a 5xx or 4xx the handler writes is sent
as the handler wrote it.

# Keys

The key is an RFC 8941 sf-string, as the draft specifies
(Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"), with the escapes
\" and \\; a bare token of visible ASCII (Idempotency-Key: 8e03978e-40d5)
is accepted too, as Stripe-style clients send it. After unquoting it must be
1 to 255 bytes. A field that appears twice is invalid.

Two requests with the same key are the same request when their fingerprints
match: by default the method, the target URI and the body, a JSON body by
its canonical form (see [DefaultFingerprint]). [Config.Fingerprint] chooses
other fields.

# Replays

A replay carries the stored status and body and only the headers listed in
[Config.ReplayHeaders]. Credentials (Set-Cookie, Authorization,
WWW-Authenticate and their kin) are never stored or replayed, whatever the
configuration says: a first answer carries them, a replay does not. The
first answer carries every header the handler set. Listed header values are
replayed byte for byte, even when they are not UTF-8, and a listed field the
handler set to nil, so that net/http would not add it, as it does a sniffed
Content-Type, is left out of the replay too.

# Writing handlers

The handler finds its transaction with [Tx] and does every write on it; it
must not commit or roll it back. Its response is buffered until the
transaction commits, so flushing and hijacking are not available. A
statement that fails aborts the whole transaction, which then cannot
commit: catch expected failures, such as a unique violation answered with
409, inside a savepoint (tx.Begin). When PostgreSQL aborts the transaction
at commit to resolve a serialization failure or a deadlock, the handler runs
again in a new one, so it must do nothing a rollback cannot undo, such as
calling another service without an idempotency key of its own ([Key] helps
derive one).

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
*/
package idemhttp
