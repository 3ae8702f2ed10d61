/*
Package webhook receives a provider's webhooks and applies each event
exactly once: it verifies the delivery's signature, then records the
event's id with idem in the transaction of the handler's own writes.

A provider (Stripe, GitHub, any sender of Standard Webhooks, the outbox of
another idem service) delivers each event at least once: it retries for
days until it gets a 2xx, sends a twin when the first answer is slow, and
redelivers by hand from its dashboard. A [Receiver] answers 2xx only once
the event's effects have committed, and a redelivery of an event already
applied, sequential or concurrent, does not run the handler again:

	stripe, err := webhook.NewStripe(os.Getenv("STRIPE_WEBHOOK_SECRET"))
	if err != nil {
		return err
	}
	recv, err := webhook.NewReceiver(pool, func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		switch ev.Type {
		case "charge.refunded":
			return recordRefund(ctx, tx, ev.Body) // on tx: commits with the event's id
		}
		return nil // not interested: acknowledged all the same
	}, webhook.Config{
		Scheme: stripe,
		Scope:  func(*http.Request) (string, error) { return "webhook:stripe", nil },
	})
	if err != nil {
		return err
	}
	mux.Handle("POST /webhooks/stripe", recv)

# What each delivery gets

The receiver reads the body whole, up to [Config.MaxBodyBytes] (a larger
one is refused without being read), and verifies it before anything else:
a delivery that is unsigned, whose signature cannot be read, matches none
of the secrets, or was signed longer ago than [Config.Tolerance] or
further ahead than the scheme allows, is refused with a problem (400 [ProblemUnsigned],
[ProblemMalformed], [ProblemSignatureInvalid], [ProblemStale]) and nothing
is written. A verified delivery's event id is then claimed with
[idem.Run], under [Config.Scope], with the event's fingerprint (its body,
by default), and the handler runs in that transaction:

  - the first delivery of an event runs the handler; its writes and the
    event's record commit together, and only then is the answer sent:
    204 No Content;
  - a redelivery after that commit does not run the handler: 204, with
    Idempotent-Replayed: true;
  - a twin that arrives while the first delivery runs waits for it (up to
    [Config.Wait]) and gets 204 once it commits, or runs the handler
    itself if it rolled back; past the wait, 409 key-in-progress with
    Retry-After, and the sender delivers it again;
  - a delivery with an event id received before with another payload is
    refused, 422 [ProblemIDReused], logged as an error and counted: it is
    a sender's bug or an attack, never applied;
  - a handler that returns an error or panics, or any other failure, rolls
    everything back: 500 request-failed, and the sender delivers it again;
    when the database cannot be reached, or the connection reached a
    standby, 503 database-unavailable with Retry-After.

No failure is ever stored: every answer but 204 leaves nothing behind, so
the sender's retries keep coming until one is applied. An event's id is
remembered for [Config.Retention], 7 days by default, longer than any
sender retries; a delivery of the event after that runs the handler again.

The problems are RFC 9457, written as idemhttp writes its own, with the
same type URIs, codes and Link headers; those idemhttp shares are its
codes (idemhttp.ProblemBodyTooLarge and the others).

# Schemes

[NewStandardWebhooks] verifies the Standard Webhooks specification's
signatures, v1 (HMAC-SHA256, whsec_ secrets) and v1a (ed25519, whpk_ public
keys), which the outbox's sender makes (outbox.NewWebhookHandler);
[NewStripe] verifies Stripe's Stripe-Signature, and [NewGitHub] GitHub's
X-Hub-Signature-256. Each takes several secrets at once, for rotation:
a delivery signed with any of them is accepted. Signatures are compared
in constant time. Another sender is served by a [Scheme] of the
application's own: it verifies the delivery and names its event, and the
receiver does the rest as for these.

# Event ids

An event is recorded under the key of its id. An id that idem cannot take
as a key as it is (longer than 255 bytes, not valid UTF-8, holding a NUL)
is recorded as "sha256:" followed by the lower-case hex SHA-256 of its
bytes, and so is an id that starts with "sha256:", so that no two ids
share a record. Event ids share idem's table with idem.Run's keys: choose
a scope for them that no other caller uses.

# Acting later, and events out of order

The handler must do nothing that a rollback cannot undo: the receiver runs
it again in a new transaction when PostgreSQL aborts the first at commit.
Work that calls other systems, or takes long, goes to the outbox in the
same transaction (outbox.Enqueue): the event is acknowledged as soon as it
is recorded, and the outbox's relays act on it at least once, with a key
of their own. An entity's events that may arrive out of order (a
subscription updated, then created) are applied with idem.Advance on the
entity and a version from the payload, in the same transaction, so that an
older event acknowledged after a newer one changes nothing. The
repository's docs/webhooks.md shows both.

# Observing

With [Config.Observer], the receiver counts every delivery once, on the
counter idem.webhook.deliveries, by idem.webhook.outcome: applied,
duplicate, refused (400, 413, 422) or failed (409, 5xx), with
idem.webhook.reason for refused and failed ones (unsigned, malformed,
signature_invalid, stale, body_too_large, body_unreadable, scope_unknown,
id_reused, in_progress, database_unavailable, handler, error) and
idem.webhook.verified, whether it passed verification (a signature that
matches, signed within the tolerance, naming an event). The claim of
each event's id is observed as idem.Run's, on idem.calls and in a span.
*/
package webhook
