package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

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
