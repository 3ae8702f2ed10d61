/*
Package idemhttp is net/http middleware that turns a handler into an
exactly-once endpoint for clients that send an Idempotency-Key header, as
the IETF draft "The Idempotency-Key HTTP Header Field" and Stripe's API
describe it; where it departs from either, on purpose, is listed under
"Departures" below.

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
allow-listed headers, the headers needed to read the body and the exact body
bytes, and commits; only then does the client get the response. A retry gets the stored response again, byte
for byte. A duplicate that arrives while the first request is still running
waits for it and gets its answer, where Stripe answers 409 at once.

# Answers

	Request                                          Answer
	-----------------------------------------------  ----------------------------------------
	Method not covered (by default, not POST/PATCH)  Handler runs as usual; Tx returns nil
	No key, Config.Required                          400 key-missing; handler not run
	No key, not required                             Handler runs in a transaction; nothing
	                                                 claimed or stored; commits below 500
	Key invalid                                      400 key-invalid; handler not run
	Config.Scope returns an error                    400 scope-unknown; handler not run
	Body over Config.MaxBodyBytes                    413 body-too-large; handler not run
	Handler answers a status Config.Store keeps      Its answer; its writes, the claim and
	(by default, any below 500)                      the answer commit together
	Handler answers a status Config.Store refuses    Its answer; all rolled back, so a
	(by default, any 5xx)                            retry runs the handler again
	Handler panics                                   500 request-failed; all rolled back
	Retry after a commit                             Stored status, headers and body, plus
	                                                 Idempotent-Replayed: true
	Same key, different request                      422 key-reused; handler not run
	Same key while the first request runs            Waits up to Config.Wait, then replays
	                                                 its answer (or runs the handler, if
	                                                 the first rolled back); past the wait,
	                                                 409 key-in-progress with Retry-After
	Answer over Config.MaxResponseBytes              Its answer, committed; its status and
	                                                 headers are stored, not its body
	Retry of that answer                             410 response-not-stored; handler not run
	Database failure                                 500 request-failed; retrying is safe

Every answer the middleware writes itself is an RFC 9457 problem (see
Problems); a 4xx or 5xx the handler writes is sent as the handler wrote it.

# Which answers are stored

[Config.Store] decides, from the status of the handler's answer, whether it
is stored; an answer it refuses rolls back, so that the retry runs the
handler again. The default, [StoreBelow500], stores every answer below 500.
A 4xx is stored on purpose: a declined card stays declined on retry, rather
than being charged when the client tries again. The flip side: a 409 or a 429
that the handler answers itself is replayed for the whole retention too. To
leave out the answers that ask the client to retry (408, 409, 425, 429):

	idemhttp.Config{Scope: scope, Store: idemhttp.StoreFinal}

Answers stored before the policy changed are replayed as stored.

# Problems

Each problem the middleware answers has a stable type URI,
[Config.ProblemTypeBase] followed by its code (by default
[DefaultProblemTypeBase], whose page documents every code), a title that
depends only on the code, a detail in English, and a "code" member with the
code on its own, for programs to switch on. The same type URI goes out as
its documentation link, Link: <type>; rel="describedby", as the IETF draft's
"Error Scenarios" ask. The codes:

	Code                 Status  When                                       Retry with the same key?
	-------------------  ------  -----------------------------------------  ------------------------
	key-missing          400     Config.Required and no key                 after adding one
	key-invalid          400     the key's field is malformed               no
	scope-unknown        400     Config.Scope returned an error             after authenticating
	fingerprint-failed   400     Config.Fingerprint returned an error       no
	body-unreadable      400     the request body could not be read         yes
	body-too-large       413     body over Config.MaxBodyBytes              no
	key-reused           422     same key, different request                no: new request, new key
	key-in-progress      409     same key still running past Config.Wait    yes, after Retry-After
	response-not-stored  410     retry of an answer over MaxResponseBytes   no: it ran and committed
	request-failed       500     database failure, panic, bad scope value   yes: nothing was kept

The Go constants are [ProblemKeyMissing] and those after it. The 410 carries
the first answer's status as the member "original_status", and the stored
headers that do not describe the missing body, such as Location.

# Answers too large to store

An answer whose body is over [Config.MaxResponseBytes] is not rolled back:
that would answer 500 to the request and to every retry of it, forever, for
an operation that can never be stored. It commits, the client gets it whole,
and only its status and headers are stored, marked as having lost their body;
the middleware logs a warning. A retry gets 410 response-not-stored, which
says the request completed and with which status, and the handler does not
run again: the client reads the resource it created (its Location) instead.

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

A replay carries the stored status and body, the headers listed in
[Config.ReplayHeaders], and, whatever that list says, the headers needed to
read the body: Content-Type, Content-Encoding (so that a gzipped answer is
replayed gzipped, and says so) and Content-Range. Content-Length is always
the length of the body sent, on the first answer too, whatever the handler
set, so that the replay is framed as its first answer was. Credentials (Set-Cookie, Authorization,
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
a handler may use (see "Answers too large to store"). Trailers are not stored or replayed. A handler must not
write to the response, or use its transaction, from a goroutine after it
returns: what it wrote by then is the whole response.

When the client goes away mid-request, the request's context is cancelled,
the transaction rolls back, and the client's retry runs the handler again.

# Privacy and observability

A stored answer holds the handler's body and headers, often personal data;
without a codec they are only base64 in the table. [Config.Codec] seals them
(see [idem.Codec]) and [Config.Observer] records each keyed request's
outcome, claim duration and span (see [idem.Observer]), as they do for
[idem.Run]. Requests without a key are not observed.

# Departures

idemhttp follows the IETF draft (draft-ietf-httpapi-idempotency-key-header,
revision 07) and Stripe's API v1 where they agree, and departs from them on
purpose here:

  - A duplicate that arrives while the first request runs: the draft answers
    409 and Stripe answers 409, both at once. idemhttp waits for the first
    request, up to Config.Wait, and replays its answer (or runs the handler,
    if the first rolled back), since the client would only retry into the
    same wait; 409 key-in-progress, with Retry-After, comes only past it.
  - 5xx answers: Stripe v1 stores them and replays them to retries.
    idemhttp rolls them back, so that a retry runs the handler again after a
    transient failure; a Config.Store that returns true for a 5xx stores
    them as Stripe does.
  - Error shape: Stripe answers its own error object ({"error": {"type":
    "idempotency_error", ...}}). idemhttp answers RFC 9457 problems, as the
    draft's examples do, with a code member of its own (see Problems), and
    422 for a reused key, as the draft asks.
  - Key syntax: the draft specifies an sf-string ("abc"); idemhttp also
    accepts the bare key (abc) that Stripe's clients send, and reads both
    as the same key.
  - Answers too large to store: neither anchor says; idemhttp commits them
    and answers their retries 410 response-not-stored.
  - Idempotent-Replayed: true marks a replay, as Stripe does; the draft
    defines no such field.

"Stripe-compatible" means exactly this: a client written for Stripe's
idempotency works unchanged as far as the key goes. It sends the same
header (Idempotency-Key) with the same bare values of up to 255 characters
(idemhttp counts bytes), retries with the same key, gets the first answer
with Idempotent-Replayed: true, gets an error for a key reused with other
parameters, and may reuse a key after its retention (24 hours by default,
as Stripe's). What differs is above: the concurrent duplicate, stored 5xx,
and the shape of the errors (and 422 for a reused key), so a client that
parses Stripe's error object does not parse idemhttp's.
*/
package idemhttp
