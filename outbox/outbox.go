package outbox

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
)

// MaxNameLength is the longest scope, key, destination or ordering key
// accepted, in bytes. It is the same as [idem.MaxKeyLength].
const MaxNameLength = idem.MaxKeyLength

// ErrInvalidEntry is returned by [Enqueue] when an entry cannot be stored:
// its destination or ordering key is empty where required, longer than
// [MaxNameLength] bytes, not valid UTF-8, or contains a NUL byte. An invalid
// scope or key also matches [idem.ErrInvalidScope] or [idem.ErrInvalidKey].
// Nothing is sent to the database.
var ErrInvalidEntry = errors.New("outbox: invalid entry")

// ErrEntryMismatch is returned by [Enqueue] when the outbox already holds a
// message with the same idempotency key (the same scope, key and
// destination) but another payload or ordering key. Sending it would make
// the destination either drop it as a duplicate or reject the key's reuse,
// so it is refused here instead. It usually means that one operation
// enqueued two different messages for one destination: give each a key of
// its own, such as the operation's key with a suffix.
var ErrEntryMismatch = errors.New("outbox: another message with the same idempotency key is already enqueued")

// Entry is a message to enqueue.
type Entry struct {
	// Scope and Key identify the operation that sends the message: pass the
	// scope and key given to [idem.Do] or [idem.Once]. With Destination they
	// make the message's idempotency key (see [IdempotencyKey]). Both are
	// required and follow idem's rules for scopes and keys.
	Scope string
	Key   string

	// Destination names where the message goes, for the relay's handler to
	// route on: a topic, a provider, an endpoint. Required.
	Destination string

	// Payload is the message's body, opaque to the outbox. Nil is stored as
	// empty.
	Payload []byte

	// OrderingKey, when set, asks for messages to one destination with the
	// same ordering key to be delivered one at a time, in the order they
	// were enqueued (see the package documentation for the exact promise).
	// Defaults to empty: no ordering.
	OrderingKey string
}

// Message is an enqueued message, as a relay hands it to its [Handler].
type Message struct {
	// ID is the message's row id in the outbox table.
	ID int64

	// Scope, Key, Destination, Payload and OrderingKey are the [Entry]'s.
	Scope       string
	Key         string
	Destination string
	Payload     []byte
	OrderingKey string

	// IdempotencyKey is the key to send to the destination with every
	// attempt, so that it can recognise our retries: the same message
	// always carries the same key. See [IdempotencyKey].
	IdempotencyKey string

	// Attempt is 1 on the first delivery of the message and grows by one
	// with each later attempt.
	Attempt int

	// CreatedAt is when the message was enqueued, by the database's clock.
	CreatedAt time.Time
}

// IdempotencyKey returns the idempotency key of the messages that the
// operation (scope, key) sends to destination: the lower-case hex SHA-256
// of the three, each prefixed with its length ([idem.Fingerprint]). It is
// stable across retries and relays, and a provider's or a consumer's
// records can be matched back to the operation by computing it again.
func IdempotencyKey(scope, key, destination string) string {
	return hex.EncodeToString(idem.Fingerprint([]byte(scope), []byte(key), []byte(destination)))
}

// Enqueue adds a message to the outbox in the caller's transaction tx and
// returns its id. Put it in the transaction that makes the change the
// message reports, beside idem.Do's claim, so that the change, the claim
// and the message commit together or not at all: a rolled-back transaction
// sends nothing, a committed one is delivered by a [Relay] at least once.
//
// Enqueue is idempotent: when the outbox already holds the same message
// (same scope, key, destination, payload and ordering key), it adds nothing
// and returns that message's id. The same idempotency key with another
// payload or ordering key gives [ErrEntryMismatch]. A message purged after
// delivery is forgotten: enqueuing it again sends it again, and the
// destination, given the same idempotency key, should recognise it.
//
// Relays learn of the message at their next poll; call [Notify] in the same
// transaction to wake the listening ones at commit instead.
//
// When ctx carries an OpenTelemetry span, its W3C trace context
// (traceparent, tracestate) is stored with the message, and the relay
// restores it into the handler's context: the delivery joins the trace of
// the request that caused it. To enqueue many messages, [EnqueueMany] sends
// them in one round trip.
//
// Invalid entries give [ErrInvalidEntry] before anything is sent to the
// database. Under REPEATABLE READ or SERIALIZABLE, the same message
// enqueued by a transaction that committed after tx's snapshot gives
// [idem.ErrSerialization].
func Enqueue(ctx context.Context, tx pgx.Tx, entry Entry) (id int64, err error) {
	if err := entry.check(); err != nil {
		return 0, err
	}
	params := dbsqlc.OutboxInsertParams{
		Scope:          entry.Scope,
		Key:            entry.Key,
		Destination:    entry.Destination,
		Payload:        entry.Payload,
		IdempotencyKey: IdempotencyKey(entry.Scope, entry.Key, entry.Destination),
		OrderingKey:    entry.OrderingKey,
	}
	if params.Payload == nil {
		params.Payload = []byte{} // nil would be sent as NULL
	}
	params.TraceParent, params.TraceState = traceHeaders(ctx)
	q := dbsqlc.New(tx)
	// A message can be purged between the insert that finds it and the read
	// that compares it; the next round then inserts it. Three rounds are
	// more than that race needs.
	for range 3 {
		id, err := q.OutboxInsert(ctx, params)
		if err == nil {
			return id, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, dberr.Translate("outbox: enqueue", err)
		}
		// The statement found the key taken; a message committed while it
		// waited is invisible to its snapshot, so read it with a new one.
		got, err := q.OutboxGetByKey(ctx, params.IdempotencyKey)
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			return 0, dberr.Translate("outbox: enqueue: read the enqueued message", err)
		}
		if !entry.same(got.Scope, got.Key, got.Destination, got.Payload, got.OrderingKey) {
			return 0, fmt.Errorf("%w (message %d)", ErrEntryMismatch, got.ID)
		}
		return got.ID, nil
	}
	return 0, errors.New("outbox: enqueue: the message with this idempotency key kept changing")
}

// EnqueueMany adds entries to the outbox in the caller's transaction tx, in
// one statement and one round trip, and returns their ids in the order of
// entries. It does what as many calls of [Enqueue] would, in that order:
// an entry already in the outbox (or earlier in entries) with the same
// content adds nothing and gets the existing message's id, and the same
// idempotency key with another payload or ordering key gives
// [ErrEntryMismatch], after which tx is to be rolled back. An invalid entry
// gives [ErrInvalidEntry], naming its index, before anything is sent to the
// database. No entries, no statement.
func EnqueueMany(ctx context.Context, tx pgx.Tx, entries []Entry) (ids []int64, err error) {
	if len(entries) == 0 {
		return nil, nil
	}
	keys := make([]string, len(entries))
	first := make(map[string]int, len(entries)) // key -> index of its first entry
	for i := range entries {
		e := &entries[i]
		if err := e.check(); err != nil {
			return nil, fmt.Errorf("entry %d: %w", i, err)
		}
		keys[i] = IdempotencyKey(e.Scope, e.Key, e.Destination)
		if j, ok := first[keys[i]]; !ok {
			first[keys[i]] = i
		} else if f := &entries[j]; !e.same(f.Scope, f.Key, f.Destination, f.Payload, f.OrderingKey) {
			return nil, fmt.Errorf("%w (entries %d and %d)", ErrEntryMismatch, j, i)
		}
	}
	parent, state := traceHeaders(ctx)
	q := dbsqlc.New(tx)
	found := make(map[string]int64, len(first)) // key -> id
	missing := make([]int, 0, len(first))       // indexes of first entries without an id yet
	for i := range entries {
		if first[keys[i]] == i {
			missing = append(missing, i)
		}
	}
	// As in Enqueue: a message found taken can be purged before it is read,
	// and the next round inserts it.
	for range 3 {
		p := dbsqlc.OutboxInsertManyParams{TraceParent: parent, TraceState: state}
		for _, i := range missing {
			e := &entries[i]
			payload := e.Payload
			if payload == nil {
				payload = []byte{}
			}
			p.Scopes = append(p.Scopes, e.Scope)
			p.Keys = append(p.Keys, e.Key)
			p.Destinations = append(p.Destinations, e.Destination)
			p.Payloads = append(p.Payloads, payload)
			p.IdempotencyKeys = append(p.IdempotencyKeys, keys[i])
			p.OrderingKeys = append(p.OrderingKeys, e.OrderingKey)
		}
		inserted, err := q.OutboxInsertMany(ctx, p)
		if err != nil {
			return nil, dberr.Translate("outbox: enqueue many", err)
		}
		for _, row := range inserted {
			found[row.IdempotencyKey] = row.ID
		}
		var taken []string
		for _, i := range missing {
			if _, ok := found[keys[i]]; !ok {
				taken = append(taken, keys[i])
			}
		}
		if len(taken) == 0 {
			missing = nil
			break
		}
		// Read the messages that hold the taken keys with a new snapshot,
		// and compare them with the entries.
		got, err := q.OutboxGetByKeys(ctx, taken)
		if err != nil {
			return nil, dberr.Translate("outbox: enqueue many: read the enqueued messages", err)
		}
		for _, g := range got {
			e := &entries[first[g.IdempotencyKey]]
			if !e.same(g.Scope, g.Key, g.Destination, g.Payload, g.OrderingKey) {
				return nil, fmt.Errorf("%w (entry %d, message %d)", ErrEntryMismatch, first[g.IdempotencyKey], g.ID)
			}
			found[g.IdempotencyKey] = g.ID
		}
		missing = missing[:0]
		for _, key := range taken {
			if _, ok := found[key]; !ok {
				missing = append(missing, first[key])
			}
		}
		if len(missing) == 0 {
			break
		}
	}
	if len(missing) > 0 {
		return nil, errors.New("outbox: enqueue many: the messages with these idempotency keys kept changing")
	}
	ids = make([]int64, len(entries))
	for i, key := range keys {
		ids[i] = found[key]
	}
	return ids, nil
}

// Notify wakes the relays that listen for new messages (those given a
// *pgxpool.Pool or a [Config.ListenConnConfig]) when tx commits, so that they deliver the transaction's
// messages without waiting for their next poll. Call it once per
// transaction, after [Enqueue]; several calls in one transaction send one
// notification.
//
// It has a cost: PostgreSQL commits transactions that notify one at a time,
// under a database-wide lock, so at high commit rates rely on polling
// instead (see [Config.PollInterval]).
//
// Behind a pooler in transaction mode (PgBouncer's pool_mode=transaction)
// the notification is sent, but a relay that listens through the pooler
// never hears it: give relays a direct connection to listen on
// ([Config.ListenConnConfig]). A relay checks that it hears notifications
// when it starts listening, and says so once, in its log and its
// idem.outbox.relays metric, when it does not.
func Notify(ctx context.Context, tx pgx.Tx) error {
	if err := dbsqlc.New(tx).OutboxNotify(ctx); err != nil {
		return dberr.Translate("outbox: notify", err)
	}
	return nil
}

// Requeue sends a parked message again, in the caller's transaction tx:
// once tx commits, relays deliver it as if it were new, from its first
// attempt, with the same idempotency key, so a receiver that did act on an
// earlier attempt still recognises it. It reports false, and changes
// nothing, when the message is not parked. Requeue a message once the cause
// of its parking is dealt with, and while the receiver still remembers its
// key.
func Requeue(ctx context.Context, tx pgx.Tx, id int64) (requeued bool, err error) {
	n, err := dbsqlc.New(tx).OutboxRequeue(ctx, id)
	if err != nil {
		return false, dberr.Translate("outbox: requeue", err)
	}
	return n == 1, nil
}

// same reports whether a stored message has e's content. A nil payload is
// stored as empty.
func (e *Entry) same(scope, key, destination string, payload []byte, orderingKey string) bool {
	return scope == e.Scope && key == e.Key && destination == e.Destination &&
		bytes.Equal(payload, e.Payload) && orderingKey == e.OrderingKey
}

func (e *Entry) check() error {
	if err := ident.Check(e.Scope); err != nil {
		return fmt.Errorf("%w: %w: %s", ErrInvalidEntry, idem.ErrInvalidScope, err)
	}
	if err := ident.Check(e.Key); err != nil {
		return fmt.Errorf("%w: %w: %s", ErrInvalidEntry, idem.ErrInvalidKey, err)
	}
	if err := ident.Check(e.Destination); err != nil {
		return fmt.Errorf("%w: destination: %s", ErrInvalidEntry, err)
	}
	if e.OrderingKey != "" {
		if err := ident.Check(e.OrderingKey); err != nil {
			return fmt.Errorf("%w: ordering key: %s", ErrInvalidEntry, err)
		}
	}
	return nil
}
