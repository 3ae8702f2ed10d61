package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

func TestEnqueueCommitsWithCallersTransaction(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	// The edge's transaction: the claim, the business write and the
	// message.
	attempt := func(commit bool) {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		_, err = idem.Do(ctx, tx, scope, "order-1", nil, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'order-1', 100)`, scope); err != nil {
				return 0, err
			}
			return outbox.Enqueue(ctx, tx, outbox.Entry{Scope: scope, Key: "order-1", Destination: dest, Payload: []byte(`{"amount":100}`)})
		})
		if err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}

	attempt(false)
	if got := rows(t, pool, dest); len(got) != 0 {
		t.Fatalf("after rollback: %d messages, want none", len(got))
	}

	attempt(true)
	got := rows(t, pool, dest)
	if len(got) != 1 {
		t.Fatalf("after commit: %d messages, want 1", len(got))
	}
	m := got[0]
	if m.State != "pending" || m.Attempts != 0 || m.Leased || m.IdempotencyKey != outbox.IdempotencyKey(scope, "order-1", dest) {
		t.Fatalf("enqueued message %+v: want pending, unleased, no attempts, the derived key", m)
	}
}

func TestEnqueueIsIdempotent(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	entry := outbox.Entry{Scope: scope, Key: "k", Destination: dest, Payload: []byte("p"), OrderingKey: "o"}

	// The same message enqueued concurrently, as by consumers handling
	// one redelivered message at once: one row, one id for all.
	const callers = 10
	ids := make([]int64, callers)
	errs := make([]error, callers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range callers {
		wg.Go(func() {
			<-start
			errs[i] = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
				var err error
				ids[i], err = outbox.Enqueue(ctx, tx, entry)
				return err
			})
		})
	}
	close(start)
	wg.Wait()
	for i := range callers {
		if errs[i] != nil || ids[i] != ids[0] {
			t.Fatalf("caller %d: id %d, %v; caller 0 got id %d", i, ids[i], errs[i], ids[0])
		}
	}
	if n := len(rows(t, pool, dest)); n != 1 {
		t.Fatalf("%d messages, want 1", n)
	}

	// The same key with other content is refused, and the caller's
	// transaction stays usable.
	for name, other := range map[string]outbox.Entry{
		"payload":      {Scope: scope, Key: "k", Destination: dest, Payload: []byte("q"), OrderingKey: "o"},
		"ordering key": {Scope: scope, Key: "k", Destination: dest, Payload: []byte("p")},
	} {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := outbox.Enqueue(ctx, tx, other); !errors.Is(err, outbox.ErrEntryMismatch) {
				t.Errorf("other %s: err = %v, want ErrEntryMismatch", name, err)
			}
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		})
		if err != nil {
			t.Fatalf("other %s: transaction unusable afterwards: %v", name, err)
		}
	}

	// Another destination is another message, with another key.
	otherDest := dest + "-2"
	id := enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "k", Destination: otherDest, Payload: []byte("p")})[0]
	if id == ids[0] || rows(t, pool, otherDest)[0].IdempotencyKey == rows(t, pool, dest)[0].IdempotencyKey {
		t.Fatal("another destination shares the message or its idempotency key")
	}
}

func TestEnqueueUnderRepeatableReadReportsSerialization(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	entry := outbox.Entry{Scope: scope, Key: "k", Destination: dest}
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil { // take the snapshot now
		t.Fatal(err)
	}
	enqueue(t, ctx, pool, entry)
	if _, err := outbox.Enqueue(ctx, tx, entry); !errors.Is(err, idem.ErrSerialization) {
		t.Fatalf("err = %v, want idem.ErrSerialization", err)
	}
}

func TestEnqueueInvalidEntryNeverReachesTheDatabase(t *testing.T) {
	long := strings.Repeat("x", outbox.MaxNameLength+1)
	valid := outbox.Entry{Scope: "s", Key: "k", Destination: "d"}
	cases := []struct {
		name   string
		modify func(*outbox.Entry)
		want   error
	}{
		{"empty scope", func(e *outbox.Entry) { e.Scope = "" }, idem.ErrInvalidScope},
		{"long scope", func(e *outbox.Entry) { e.Scope = long }, idem.ErrInvalidScope},
		{"empty key", func(e *outbox.Entry) { e.Key = "" }, idem.ErrInvalidKey},
		{"key not UTF-8", func(e *outbox.Entry) { e.Key = "k\xff" }, idem.ErrInvalidKey},
		{"key with NUL", func(e *outbox.Entry) { e.Key = "k\x00" }, idem.ErrInvalidKey},
		{"empty destination", func(e *outbox.Entry) { e.Destination = "" }, outbox.ErrInvalidEntry},
		{"long destination", func(e *outbox.Entry) { e.Destination = long }, outbox.ErrInvalidEntry},
		{"ordering key with NUL", func(e *outbox.Entry) { e.OrderingKey = "\x00" }, outbox.ErrInvalidEntry},
		{"long ordering key", func(e *outbox.Entry) { e.OrderingKey = long }, outbox.ErrInvalidEntry},
	}
	for _, c := range cases {
		e := valid
		c.modify(&e)
		_, err := outbox.Enqueue(context.Background(), panicTx{}, e)
		if !errors.Is(err, c.want) || !errors.Is(err, outbox.ErrInvalidEntry) {
			t.Errorf("%s: err = %v, want %v and ErrInvalidEntry", c.name, err, c.want)
		}
	}
}

func TestIdempotencyKeyIsStable(t *testing.T) {
	// The derivation is part of the contract with providers that already
	// hold our keys: it must never change.
	const want = "638cc1e768f05fd5fe995d4148ccba02e7a2983fcdb37f080500fb02357bcf04"
	if got := outbox.IdempotencyKey("tenant-1", "order-42", "payments.charge"); got != want {
		t.Fatalf("IdempotencyKey = %s, want %s", got, want)
	}
	// Each part is length-prefixed: moving bytes across a boundary changes
	// the key.
	if outbox.IdempotencyKey("ab", "c", "d") == outbox.IdempotencyKey("a", "bc", "d") {
		t.Fatal("moving a byte from scope to key kept the key")
	}
}

// EnqueueMany sends its entries in one statement and does what as many
// Enqueue calls would.
func TestEnqueueMany(t *testing.T) {
	ctx, _, scope, dest := setup(t)
	config, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	var statements atomic.Int64
	config.ConnConfig.Tracer = countingTracer{&statements}
	pool, err := pgxpool.NewWithConfig(ctx, config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	all := entries(scope, dest, 500)
	existing := enqueue(t, ctx, pool, all[7])
	many := func(batch []outbox.Entry) (ids []int64, sent int64, err error) {
		err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			before := statements.Load()
			var err error
			ids, err = outbox.EnqueueMany(ctx, tx, batch)
			sent = statements.Load() - before
			return err
		})
		return ids, sent, err
	}

	ids, sent, err := many(all[8:])
	if err != nil {
		t.Fatal(err)
	}
	if sent != 1 {
		t.Errorf("EnqueueMany of %d new entries sent %d statements, want 1", len(all[8:]), sent)
	}
	byKey := map[string]int64{}
	for i, id := range ids {
		byKey[all[8+i].Key] = id
	}
	// Again, with new entries, an already enqueued one and a repeat within
	// the call: the same ids, nothing added twice.
	batch := append([]outbox.Entry{all[7], all[100]}, all[:7]...)
	batch = append(batch, all[100])
	ids2, _, err := many(batch)
	if err != nil {
		t.Fatal(err)
	}
	if ids2[0] != existing[0] || ids2[1] != byKey[all[100].Key] || ids2[len(ids2)-1] != ids2[1] {
		t.Errorf("EnqueueMany again: ids %v, want %d and %d for the enqueued entries", ids2, existing[0], byKey[all[100].Key])
	}
	got := rows(t, pool, dest)
	if len(got) != len(all) {
		t.Fatalf("%d messages, want %d", len(got), len(all))
	}
	for _, r := range got {
		if r.IdempotencyKey == "" || r.State != "pending" {
			t.Errorf("message %+v", r)
		}
	}
	for i, id := range ids {
		var key string
		if err := pool.QueryRow(ctx, `SELECT key FROM outbox_message WHERE id = $1`, id).Scan(&key); err != nil || key != all[8+i].Key {
			t.Errorf("id %d of entry %d has key %q (%v), want %q", id, 8+i, key, err, all[8+i].Key)
		}
	}

	changed := all[3]
	changed.Payload = []byte("another payload")
	if _, _, err := many([]outbox.Entry{all[400], changed}); !errors.Is(err, outbox.ErrEntryMismatch) {
		t.Errorf("EnqueueMany with a changed payload: %v, want ErrEntryMismatch", err)
	}
	if _, _, err := many([]outbox.Entry{{Scope: scope, Key: "x", Destination: dest, Payload: []byte("a")}, {Scope: scope, Key: "x", Destination: dest, Payload: []byte("b")}}); !errors.Is(err, outbox.ErrEntryMismatch) {
		t.Errorf("EnqueueMany with one key twice, two payloads: %v, want ErrEntryMismatch", err)
	}
	before := statements.Load()
	if _, err := outbox.EnqueueMany(ctx, panicTx{}, []outbox.Entry{all[0], {Scope: scope, Key: "", Destination: dest}}); !errors.Is(err, outbox.ErrInvalidEntry) {
		t.Errorf("EnqueueMany with an invalid entry: %v, want ErrInvalidEntry", err)
	}
	if ids, err := outbox.EnqueueMany(ctx, panicTx{}, nil); ids != nil || err != nil || statements.Load() != before {
		t.Errorf("EnqueueMany of nothing: %v, %v", ids, err)
	}
}

// countingTracer counts the statements a pool's connections send.
type countingTracer struct{ n *atomic.Int64 }

func (c countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func TestRequeueDeliversAParkedMessage(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "k", Destination: dest})
	var fixed atomic.Bool
	var delivered atomic.Int64
	handler := func(ctx context.Context, msg outbox.Message) error {
		if !fixed.Load() {
			return outbox.Park(errors.New("400 unknown account"))
		}
		delivered.Add(1)
		return nil
	}
	startRelay(t, ctx, pool, handler, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})
	waitFor(t, "the message parked", func() bool { return countState(t, pool, dest, "parked") == 1 })

	requeue := func() bool {
		var requeued bool
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			requeued, err = outbox.Requeue(ctx, tx, ids[0])
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return requeued
	}
	fixed.Store(true)
	if !requeue() {
		t.Fatal("Requeue of a parked message reported false")
	}
	waitFor(t, "the requeued message delivered", func() bool { return countState(t, pool, dest, "delivered") == 1 })
	if delivered.Load() != 1 {
		t.Fatalf("delivered %d times, want once", delivered.Load())
	}
	if requeue() {
		t.Fatal("Requeue of a delivered message reported true")
	}
}
