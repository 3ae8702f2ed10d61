package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// setupOwnDatabase is setup on a migrated database of the test's own, for
// tests of purging, which deletes every scope's expired records.
func setupOwnDatabase(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	ctx, _, scope := setup(t)
	pool, err := pgxpool.New(ctx, env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, testdb.AppSchema); err != nil {
		t.Fatal(err)
	}
	return ctx, pool, scope
}

func TestPurgerDeletesExpiredInTheBackground(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	var calls atomic.Int64
	for i := range 12 {
		key := fmt.Sprintf("k%d", i)
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
		if i < 10 {
			expire(t, pool, scope, key)
		}
	}
	purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Batch: 3, Pause: time.Millisecond, Interval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// Wait for the purger to have counted what it deleted, not only for
	// the rows to be gone: its count follows each batch's commit.
	deadline := time.Now().Add(30 * time.Second)
	for countRecords(t, pool, scope) != 2 || purger.Deleted() < 10 {
		if time.Now().After(deadline) {
			t.Fatalf("purger left %d records and counted %d deleted, want the 2 live ones and 10", countRecords(t, pool, scope), purger.Deleted())
		}
		time.Sleep(5 * time.Millisecond)
	}
	purger.Stop()
	purger.Stop() // a second Stop is harmless
	if purger.Deleted() != 10 {
		t.Fatalf("Deleted() = %d, want 10", purger.Deleted())
	}
}

// StartPurger refuses every field that cannot work, naming it, before it
// starts anything; each field is either refused for some value below or
// listed as taking every value.
func TestStartPurgerRefusesEveryInvalidField(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	stillThere := expiredRecord(t, ctx, pool, scope)
	aboveInt32 := math.MaxInt32
	aboveInt32++ // a variable: on 32-bit platforms it wraps, and is refused as negative
	cases := []struct {
		field  string
		config idem.PurgerConfig
	}{
		{"Batch", idem.PurgerConfig{Batch: -1}},
		{"Batch", idem.PurgerConfig{Batch: aboveInt32}},
		{"Pause", idem.PurgerConfig{Pause: -time.Nanosecond}},
		{"Interval", idem.PurgerConfig{Interval: -time.Second}},
	}
	tested := map[string]bool{}
	for _, c := range cases {
		p, err := idem.StartPurger(ctx, pool, c.config)
		if p != nil {
			p.Stop()
		}
		want := "idem: PurgerConfig." + c.field + ": "
		if !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: err = %v, want idem.ErrInvalidOption naming %q", c.config, err, want)
		}
		tested[c.field] = true
	}
	anyValue := map[string]string{
		"Logger": "nil means slog.Default()",
	}
	for f := range reflect.TypeFor[idem.PurgerConfig]().Fields() {
		if !tested[f.Name] && anyValue[f.Name] == "" {
			t.Errorf("PurgerConfig.%s: no invalid value tested, and not listed as taking every value", f.Name)
		}
	}
	if p, err := idem.StartPurger(ctx, nil, idem.PurgerConfig{}); !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), "db must not be nil") {
		if p != nil {
			p.Stop()
		}
		t.Errorf("nil db: err = %v, want idem.ErrInvalidOption naming it", err)
	}
	stillThere() // no refused purger deleted anything
}

func TestPurgerStopsWithItsContext(t *testing.T) {
	ctx, pool, _ := setupOwnDatabase(t)
	ctx, cancel := context.WithCancel(ctx)
	purger, err := idem.StartPurger(ctx, pool, idem.PurgerConfig{Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	stopped := make(chan struct{})
	go func() { purger.Stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("purger did not stop after its context was cancelled")
	}
}

func TestPurgeDeletesOnlyExpired(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t)
	var calls atomic.Int64
	for i := range 7 {
		key := fmt.Sprintf("k%d", i)
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
		if i < 5 {
			expire(t, pool, scope, key)
		}
	}
	if n, err := idem.Purge(ctx, pool, 2); err != nil || n != 5 {
		t.Fatalf("Purge deleted %d, %v; want the 5 expired", n, err)
	}
	if n := countRecords(t, pool, scope); n != 2 {
		t.Fatalf("%d records left, want the 2 live ones", n)
	}
	if _, err := idem.Purge(ctx, pool, 0); !errors.Is(err, idem.ErrInvalidOption) {
		t.Fatalf("batch 0: %v, want ErrInvalidOption", err)
	}
}
