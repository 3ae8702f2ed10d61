package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// usable reports whether tx still runs statements, and ends it.
func usable(t *testing.T, ctx context.Context, tx pgx.Tx) bool {
	t.Helper()
	defer tx.Rollback(ctx)
	_, err := tx.Exec(ctx, `SELECT 1`)
	var pgErr *pgconn.PgError
	if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == "25P02") {
		t.Fatalf("SELECT 1 failed otherwise than in an aborted transaction: %v", err)
	}
	return err == nil
}

// TestWhichErrorsLeaveTheCallersTransactionUsable pins down what Do's
// documentation and each error's say (see docs/how-it-works.md): after
// which errors from Do the caller's transaction still runs statements, and
// after which it must be rolled back.
func TestWhichErrorsLeaveTheCallersTransactionUsable(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	if _, err := idem.Run(ctx, pool, scope, "done", fpA, pay(scope, "done", 1, &calls)); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("declined")
	cases := []struct {
		name   string
		scope  string
		key    string
		fp     []byte
		fn     func(context.Context, pgx.Tx) (int, error)
		want   error
		usable bool
		opts   []idem.Option
	}{
		{"invalid key", scope, "", fpA, nil, idem.ErrInvalidKey, true, nil},
		{"invalid scope", "", "k", fpA, nil, idem.ErrInvalidScope, true, nil},
		{"fingerprint mismatch", scope, "done", fpB, nil, idem.ErrFingerprintMismatch, true, nil},
		{"fn's own error", scope, "fn-error", fpA,
			func(context.Context, pgx.Tx) (int, error) { return 0, boom }, boom, true, nil},
		{"fn's failed statement", scope, "fn-sql", fpA,
			func(ctx context.Context, tx pgx.Tx) (int, error) {
				_, err := tx.Exec(ctx, `SELECT 1/0`)
				return 0, err
			}, nil, false, nil},
		{"response too large", scope, "too-large", fpA,
			func(context.Context, pgx.Tx) (int, error) { return 123456, nil }, idem.ErrResponseTooLarge, true,
			[]idem.Option{idem.WithMaxResponseSize(3)}},
		{"ErrReadOnly", scope, "read-only", fpA, nil, idem.ErrReadOnly, true, nil},
	}
	for _, c := range cases {
		opts := pgx.TxOptions{}
		if c.want == idem.ErrReadOnly {
			opts.AccessMode = pgx.ReadOnly
		}
		tx, err := pool.BeginTx(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		fn := c.fn
		if fn == nil {
			fn = func(context.Context, pgx.Tx) (int, error) { t.Errorf("%s: fn ran", c.name); return 0, nil }
		}
		_, err = idem.Do(ctx, tx, c.scope, c.key, c.fp, fn, c.opts...)
		if err == nil || (c.want != nil && !errors.Is(err, c.want)) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
		if got := usable(t, ctx, tx); got != c.usable {
			t.Errorf("%s: transaction usable %t, want %t", c.name, got, c.usable)
		}
	}

	// A duplicate that gives up waiting: its lock wait timed out.
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := idem.Do(ctx, holder, scope, "held", fpA, func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = idem.Do(ctx, tx, scope, "held", fpA, func(context.Context, pgx.Tx) (int, error) { return 2, nil },
		idem.WithWait(100*time.Millisecond))
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("duplicate of a held key: %v, want ErrInProgress", err)
	}
	if usable(t, ctx, tx) {
		t.Error("the transaction is usable after ErrInProgress; ErrInProgress's documentation says to roll it back")
	}
}
