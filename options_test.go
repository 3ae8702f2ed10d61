package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

func TestInvalidOptionsAreRejected(t *testing.T) {
	ctx := context.Background()
	fn := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	for _, opt := range []idem.Option{
		idem.WithRetention(0), idem.WithRetention(-time.Hour), idem.WithRetention(500 * time.Nanosecond), idem.WithMaxResponseSize(0),
		idem.WithMaxResponseSize(-1), idem.WithWait(25 * 24 * time.Hour), idem.WithWait(time.Duration(math.MaxInt64)),
		idem.WithIdleTimeout(25 * 24 * time.Hour),
	} {
		if _, err := idem.Do(ctx, panicTx{}, "s", "k", nil, fn, opt); !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("err = %v, want ErrInvalidOption", err)
		}
		// CheckOptions tells beforehand what the call would say.
		if err := idem.CheckOptions(idem.WithLookupFirst(), opt); !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("CheckOptions: %v, want ErrInvalidOption", err)
		}
	}
	if err := idem.CheckOptions(idem.WithRetention(time.Microsecond), idem.WithWait(0), idem.WithMaxResponseSize(1)); err != nil {
		t.Errorf("CheckOptions of the smallest values that work: %v", err)
	}
	// A negative wait or idle timeout means none (see
	// TestANegativeWaitDoesNotWait, TestANegativeIdleTimeoutSetsNoBound).
	if err := idem.CheckOptions(idem.WithWait(-time.Nanosecond), idem.WithWait(time.Duration(math.MinInt64)),
		idem.WithIdleTimeout(-time.Second), idem.WithIdleTimeout(0)); err != nil {
		t.Errorf("CheckOptions of a negative wait and idle timeout: %v", err)
	}
	if err := idem.CheckOptions(); err != nil {
		t.Errorf("CheckOptions of none: %v", err)
	}
	// A flow takes the idle timeout too, and refuses it as a call does.
	if err := idem.CheckFlowOptions(idem.WithIdleTimeout(25 * 24 * time.Hour)); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("CheckFlowOptions of an idle timeout of 25 days: %v, want ErrInvalidOption", err)
	}
	if err := idem.CheckFlowOptions(idem.WithIdleTimeout(-time.Second), idem.WithIdleTimeout(0)); err != nil {
		t.Errorf("CheckFlowOptions of a negative and a zero idle timeout: %v", err)
	}
}

// Where an option applies is its type: an option that means nothing to a
// call (a flow's lease) is not an Option, and one that means nothing to a
// flow (WithLookupFirst) is not a FlowOption, so that the compiler refuses
// either where it would be ignored; the options both use are both. Each
// is its own type, so that no type assertion turns one kind into another.
func TestOptionsAreTypedByWhereTheyApply(t *testing.T) {
	callOnly := map[string]any{
		"WithLookupFirst": idem.WithLookupFirst(),
	}
	flowOnly := map[string]any{
		"WithLease":          idem.WithLease(time.Second),
		"WithLease(invalid)": idem.WithLease(0),
		"WithGrace":          idem.WithGrace(time.Second),
		"WithProviderWindow": idem.WithProviderWindow(time.Hour),
		"WithCallTimeout":    idem.WithCallTimeout(time.Second),
	}
	sharedOpts := map[string]any{
		"WithWait":             idem.WithWait(time.Second),
		"WithWait(invalid)":    idem.WithWait(time.Duration(math.MaxInt64)),
		"WithRetention":        idem.WithRetention(time.Hour),
		"WithTxOptions":        idem.WithTxOptions(pgx.TxOptions{}),
		"WithIdleTimeout":      idem.WithIdleTimeout(time.Second),
		"WithIdleTimeout(big)": idem.WithIdleTimeout(25 * 24 * time.Hour),
		"WithMaxResponseSize":  idem.WithMaxResponseSize(1),
		"WithCodec":            idem.WithCodec(nil),
		"WithObserver":         idem.WithObserver(nil),
		"WithTxOptions(bad)":   idem.WithTxOptions(pgx.TxOptions{AccessMode: pgx.ReadOnly}),
		"WithRetention(0)":     idem.WithRetention(0),
		"WithMaxResponseSize0": idem.WithMaxResponseSize(0),
	}
	kinds := []struct {
		opts       map[string]any
		call, flow bool
	}{{callOnly, true, false}, {flowOnly, false, true}, {sharedOpts, true, true}}
	for _, k := range kinds {
		for name, opt := range k.opts {
			_, call := opt.(idem.Option)
			_, flow := opt.(idem.FlowOption)
			if call != k.call || flow != k.flow {
				t.Errorf("%s: an Option %t and a FlowOption %t; want %t and %t", name, call, flow, k.call, k.flow)
			}
		}
	}
}

// A retention that is not a whole number of microseconds is rounded up, as
// every duration idem sends to PostgreSQL is: 1.001µs keeps a record for
// 2µs, never for less than asked.
func TestRetentionIsRoundedUpToTheMicrosecond(t *testing.T) {
	ctx, pool, scope := setup(t)
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		key := "k-" + string(iso)
		_, err := idem.Run(ctx, pool, scope, key, fpA, func(context.Context, pgx.Tx) (int, error) { return 1, nil },
			idem.WithRetention(time.Microsecond+time.Nanosecond), idem.WithTxOptions(pgx.TxOptions{IsoLevel: iso}))
		if err != nil {
			t.Fatalf("%s: %v", iso, err)
		}
		var kept time.Duration
		if err := pool.QueryRow(ctx, `SELECT expires_at - created_at FROM idempotency_key WHERE scope = $1 AND key = $2`,
			scope, key).Scan(&kept); err != nil {
			t.Fatal(err)
		}
		if kept != 2*time.Microsecond {
			t.Errorf("%s: retention of 1.001µs kept the record for %s, want 2µs", iso, kept)
		}
	}
}

// A negative wait means no wait, as WithWait(0) does: a duplicate of a key
// held by an open transaction gets ErrInProgress at once, without waiting
// the default 5s.
func TestANegativeWaitDoesNotWait(t *testing.T) {
	ctx, pool, scope := setup(t)
	holdKey(t, ctx, pool, scope, "k", time.Hour, false)
	var calls atomic.Int64
	for _, d := range []time.Duration{-time.Second, time.Duration(math.MinInt64)} {
		started := time.Now()
		_, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 1, &calls), idem.WithWait(d))
		if !errors.Is(err, idem.ErrInProgress) {
			t.Fatalf("WithWait(%s): err = %v, want ErrInProgress", d, err)
		}
		if waited := time.Since(started); waited >= idem.DefaultWait {
			t.Errorf("WithWait(%s) waited %s, as long as the default wait", d, waited)
		}
	}
	if calls.Load() != 0 {
		t.Fatal("fn ran while another attempt held the key")
	}
}

// A negative idle timeout means no bound of idem's, as zero does: the
// claim leaves the session's idle_in_transaction_session_timeout as it is,
// where a positive one sets it for the transaction.
func TestANegativeIdleTimeoutSetsNoBound(t *testing.T) {
	ctx, pool, scope := setup(t)
	var session string
	if err := pool.QueryRow(ctx, `SHOW idle_in_transaction_session_timeout`).Scan(&session); err != nil {
		t.Fatal(err)
	}
	for i, c := range []struct {
		opt  idem.Option
		want string
	}{
		{idem.WithIdleTimeout(-time.Second), session},
		{idem.WithIdleTimeout(0), session},
		{idem.WithIdleTimeout(2 * time.Second), "2s"},
	} {
		key := fmt.Sprint("k", i)
		res, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (string, error) {
			var got string
			err := tx.QueryRow(ctx, `SHOW idle_in_transaction_session_timeout`).Scan(&got)
			return got, err
		}, c.opt)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		if res.Value != c.want {
			t.Errorf("case %d: idle_in_transaction_session_timeout in fn is %q, want %q", i, res.Value, c.want)
		}
	}
}

// TestWithTxOptionsRefusesWhatCannotWork checks that WithTxOptions, the one
// place that checks transaction options (idemhttp, idemgrpc and flows use
// it), refuses each mode that pgx would send as it is, and the read-only
// mode, with a FieldError that names the field; the read-only one is
// ErrReadOnly too. Nothing is sent: the check needs no database.
func TestWithTxOptionsRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		opts     pgx.TxOptions
		field    string
		readOnly bool
	}{
		{pgx.TxOptions{IsoLevel: "snapshot"}, "WithTxOptions.IsoLevel", false},
		{pgx.TxOptions{AccessMode: pgx.ReadOnly}, "WithTxOptions.AccessMode", true},
		{pgx.TxOptions{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly, DeferrableMode: pgx.Deferrable}, "WithTxOptions.AccessMode", true},
		{pgx.TxOptions{AccessMode: "read mostly"}, "WithTxOptions.AccessMode", false},
		{pgx.TxOptions{DeferrableMode: "later"}, "WithTxOptions.DeferrableMode", false},
	} {
		err := idem.CheckOptions(idem.WithTxOptions(c.opts))
		fe, ok := errors.AsType[*idem.FieldError](err)
		if !ok || fe.Package != "idem" || fe.Field != c.field || !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("%+v: got %v, want a FieldError of idem's naming %s", c.opts, err, c.field)
			continue
		}
		if errors.Is(err, idem.ErrReadOnly) != c.readOnly {
			t.Errorf("%+v: errors.Is(%v, ErrReadOnly) is %t", c.opts, err, !c.readOnly)
		}
	}
	for _, ok := range []pgx.TxOptions{{}, {IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadWrite, DeferrableMode: pgx.NotDeferrable}} {
		if err := idem.CheckOptions(idem.WithTxOptions(ok)); err != nil {
			t.Errorf("%+v refused: %v", ok, err)
		}
	}
}
