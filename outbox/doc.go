// Package outbox sends messages to systems outside the database (a card
// processor, a mail service, a broker, a partner's API) for changes that
// commit in it, without losing one and without the receiver acting on one
// twice, provided the receiver deduplicates on the key it is given.
//
// A transaction cannot cover a call to another system: calling it before
// the commit may act on a change that then rolls back, and calling it after
// may never happen if the process dies in between. The outbox splits the
// call in two. [Enqueue] writes the message in the transaction that makes
// the change, so the two commit together or not at all. A [Relay] then
// delivers committed messages to a [Handler] that makes the call, retrying
// until it succeeds.
//
// # Enqueuing
//
// Enqueue in the transaction of the change, typically inside [idem.Do] or
// [idem.Run] at the edge, with the same scope and key ([EnqueueMany] sends
// many messages in one round trip):
//
//	res, err := idem.Run(ctx, pool, tenant, key, fp, func(ctx context.Context, tx pgx.Tx) (Order, error) {
//		order, err := insertOrder(ctx, tx, req)
//		if err != nil {
//			return Order{}, err
//		}
//		_, err = outbox.Enqueue(ctx, tx, outbox.Entry{
//			Scope: tenant, Key: key, Destination: "payments.charge", Payload: chargeJSON(order),
//		})
//		return order, err
//	})
//
// Each message carries an idempotency key derived from its scope, key and
// destination ([IdempotencyKey]). It is the same on every attempt; the
// handler passes it on (as Stripe's Idempotency-Key header, for example),
// and the receiver uses it to recognise repeats.
//
// # Relaying
//
// Run relays where convenient, as many as needed:
//
//	relay, err := outbox.StartRelay(ctx, pool, func(ctx context.Context, msg outbox.Message) error {
//		return payments.Charge(ctx, msg.IdempotencyKey, msg.Payload)
//	}, &outbox.Config{Destinations: []string{"payments.charge"}})
//	if err != nil {
//		return err
//	}
//	defer relay.Stop() // or let ctx end
//
// A relay leases a batch of due messages in one statement (FOR UPDATE SKIP
// LOCKED, so relays never wait for one another), commits it, calls the
// handler with no transaction open, and records the batch's outcomes
// together, in the statement that leases the next batch; handlers that
// return more than a few milliseconds after their batch-mates do not hold
// back the others' outcomes, which are recorded meanwhile. So a batch
// costs one round trip and one commit, not one per message. A leased
// message is hidden from other relays until its lease runs out
// ([Config.LeaseDuration]); the handler's context ends a little earlier,
// so that its outcome is recorded under the lease. If the relay dies
// before recording the outcome, the message is delivered again after that.
// A handler that needs longer than the lease calls [ExtendLease].
//
// A failed delivery is retried after a delay that doubles with each attempt
// up to a cap ([Config.RetryDelay], [Config.MaxRetryDelay]), and no sooner
// than a handler that wraps its error with [RetryAfter] asks. After
// [Config.MaxAttempts] attempts, or at once when the handler wraps its
// error with [Park], the message is parked: it stays in the table with state
// 'parked' and its last error, and is never delivered or purged without
// someone's decision. To list parked messages:
//
//	SELECT id, destination, attempts, last_error FROM outbox_message WHERE state = 'parked';
//
// and, once the cause is dealt with, [Requeue] sends one again. Which of
// the table's columns and states are a stable interface, and what an
// operator may change by hand, is in docs/outbox.md in idem's repository.
//
// Delivered messages are purged by the relays after
// [Config.DeliveredRetention] (never, when it is negative), once a minute,
// in batches, in a goroutine of their own: a large purge does not delay
// delivery.
//
// Idle relays look for due messages every [Config.PollInterval]. Relays
// given a *pgxpool.Pool (or a [Config.ListenConnConfig]) also listen for
// [Notify], which a transaction calls after Enqueue to have its messages
// delivered as soon as it commits; each listens on one connection of its
// own, outside the pool. When it starts listening, a relay sends itself a
// notification the way Notify's transactions do, through its db; if the
// notification does not arrive (a pooler in transaction mode, such as
// PgBouncer with pool_mode=transaction, never passes one on), the relay
// says so once in its log and its metrics, polls, and tries again every
// minute. Behind such a pooler, give relays a direct connection to listen
// on with [Config.ListenConnConfig].
//
// # Sending webhooks
//
// [NewWebhookHandler] is a ready Handler that POSTs each message to a URL
// as a signed Standard Webhooks delivery (webhook-id, webhook-timestamp,
// webhook-signature), its id the message's idempotency key, and reads the
// answer as the specification describes: 2xx delivered, 410 parked,
// every other answer, timeout and connection error retried (honouring
// Retry-After). The
// receiving end, idem's or anyone's, deduplicates on webhook-id; idem's
// is idemhttp/webhook.
//
// # Database handles
//
// A relay is usually given a *pgxpool.Pool, and runs each statement on it
// as a transaction of its own. Given a *pgx.Conn or a *pgxpool.Conn, it
// runs its statements on that connection one at a time, and must be its
// only user. Given any other [idem.TxBeginner], it runs each statement in
// a transaction of its own, from several goroutines.
//
// # Observing relays
//
// With [Config.Observer], a relay records through the same OpenTelemetry
// providers as idem's calls:
//
//   - idem.outbox.deliveries counts recorded attempts by
//     idem.outbox.outcome (delivered, retried, parked, released: stopped
//     by the relay's shutdown, not counted as an attempt) and
//     idem.outbox.destination. Failed attempts are the retried and parked
//     ones.
//   - idem.outbox.delivery.latency (seconds), by destination: from the
//     start of the transaction that enqueued a message, which is at or
//     before its commit, to its handler's success.
//   - idem.outbox.backlog, a gauge by idem.outbox.state (pending, parked)
//     and destination, counted once a minute by each relay (a scan of the
//     messages that are not delivered).
//   - idem.outbox.relays, the running relays by
//     idem.outbox.notifications: listening (they hear [Notify]) or polling.
//   - A span idem.outbox.deliver (kind consumer) per attempt, with the
//     message's id, destination, attempt and outcome, around the handler
//     call, whose context carries it.
//
// Enqueue stores the W3C trace context (traceparent and tracestate) of its
// context's span with the message, and the relay makes it the parent of
// the delivery's span, or, without a tracer, puts it in the handler's
// context as a remote span context: a delivery joins the trace of the
// request that caused it, even when it happens hours later.
//
// # Guarantees
//
// Every committed message is handed to a handler at least once, until a
// handler succeeds or the message is parked. It may be handed over more
// than once: when a handler succeeds but its relay dies, or loses its
// connection, before recording it; when a handler outlives its lease and
// another relay delivers the message meanwhile; when a handler's call
// succeeds at the receiver but reports a failure (a timeout after the
// receiver acted). The outbox does not deduplicate these; the receiver
// must, on [Message.IdempotencyKey]. A receiver without that facility can
// receive a message twice.
//
// Enqueue itself adds each message once: enqueuing the same scope, key and
// destination again, with the same content, returns the existing message
// as long as it has not been purged.
//
// Messages without an ordering key are delivered in no particular order.
// Messages to one destination with the same [Entry.OrderingKey] are leased
// one at a time, in the order of their ids, each only once the one before
// it has been delivered or parked. That is the order in which they were
// enqueued when their transactions committed one after another; messages
// enqueued by concurrent transactions have no defined order. When a later
// message commits, and is leased, before an earlier one commits, the
// earlier one waits until the later one is done. Only when the earlier one
// commits in the very instant in which two relays lease can the two be
// leased together, since neither relay sees the other's lease until it
// commits. The order holds as long as each delivery finishes within its
// lease: a handler that overruns it may still be calling the receiver when
// the next message goes out. A parked message no longer holds back the
// ones after it. A relay that delivers or parks an ordered message looks
// for the next one at once, without waiting for its next poll.
//
// Every message waiting behind an earlier one with its ordering key is
// still looked at each time a relay leases, and passed over. A long
// backlog on one key thus costs every lease statement an index scan of
// that backlog; keep backlogs on one key short, by delivering them as fast
// as they arrive, or spread the messages over more keys.
package outbox
