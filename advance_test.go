package idem_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// applyVersion is a consumer of versioned messages: in one transaction it
// asks Advance, and only when the version applies, writes the entity's new
// state (a payment row whose amount is the version, so the tests can read
// back which versions were applied and in what order).
func applyVersion(ctx context.Context, pool *pgxpool.Pool, scope, entity string, version int64, hold time.Duration) (bool, error) {
	var applied bool
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		if applied, err = idem.Advance(ctx, tx, scope, entity, version); err != nil || !applied {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, scope, entity, version); err != nil {
			return err
		}
		time.Sleep(hold) // keep the row locked while others arrive
		return nil
	})
	return applied, err
}

// appliedVersions lists the versions written for entity, in commit order.
func appliedVersions(t *testing.T, pool *pgxpool.Pool, scope, entity string) []int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT amount_cents FROM payment WHERE scope = $1 AND key = $2 ORDER BY id`, scope, entity)
	if err != nil {
		t.Fatal(err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return versions
}

func TestAdvanceSkipsRedeliveredAndReorderedVersions(t *testing.T) {
	ctx, pool, scope := setup(t)
	deliveries := []struct {
		version int64
		applied bool
	}{
		{0, true},  // zero is a valid first version
		{0, false}, // redelivered
		{3, true},
		{2, false}, // reordered: older than the applied 3
		{5, true},  // a gap is fine
		{3, false}, // v3 redelivered after v5
		{4, false}, // late arrival
		{5, false},
		{6, true},
		{math.MaxInt64, true},
		{6, false},
	}
	for _, d := range deliveries {
		applied, err := applyVersion(ctx, pool, scope, "order-1", d.version, 0)
		if err != nil {
			t.Fatalf("version %d: %v", d.version, err)
		}
		if applied != d.applied {
			t.Fatalf("version %d: applied = %v, want %v", d.version, applied, d.applied)
		}
	}
	if got, want := appliedVersions(t, pool, scope, "order-1"), []int64{0, 3, 5, 6, math.MaxInt64}; !slices.Equal(got, want) {
		t.Fatalf("applied versions %v, want %v", got, want)
	}
}

func TestAdvanceConcurrentSameVersionAppliesOnce(t *testing.T) {
	ctx, pool, scope := setup(t)
	// A new entity races on the insert; a known one races on the update.
	if _, err := applyVersion(ctx, pool, scope, "known", 6, 0); err != nil {
		t.Fatal(err)
	}
	for _, entity := range []string{"new", "known"} {
		const deliveries = 50
		var applied atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make(chan error, deliveries)
		for range deliveries {
			wg.Go(func() {
				<-start
				ok, err := applyVersion(ctx, pool, scope, entity, 7, 10*time.Millisecond)
				if err != nil {
					errs <- err
				}
				if ok {
					applied.Add(1)
				}
			})
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("%s entity: %v", entity, err)
		}
		versions := appliedVersions(t, pool, scope, entity)
		if applied.Load() != 1 || versions[len(versions)-1] != 7 || slices.Index(versions, 7) != len(versions)-1 {
			t.Fatalf("%s entity: %d of %d deliveries of version 7 applied, versions written %v; want exactly one",
				entity, applied.Load(), deliveries, versions)
		}
	}
}

func TestAdvanceConcurrentVersionsNeverGoBack(t *testing.T) {
	ctx, pool, scope := setup(t)
	// Versions 1..40 arrive at once in random order; whatever order they
	// commit in, the applied versions only ever increase and end at 40.
	const newest = 40
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, newest)
	for v := range int64(newest) {
		wg.Go(func() {
			<-start
			if _, err := applyVersion(ctx, pool, scope, "e", v+1, time.Millisecond); err != nil {
				errs <- err
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// The entity's row lock orders the writes: each one's id was drawn
	// after the previous applied version committed.
	versions := appliedVersions(t, pool, scope, "e")
	for i := 1; i < len(versions); i++ {
		if versions[i] <= versions[i-1] {
			t.Fatalf("applied versions %v: version %d came after %d", versions, versions[i], versions[i-1])
		}
	}
	if versions[len(versions)-1] != newest {
		t.Fatalf("applied versions %v: want the last to be %d", versions, newest)
	}
}

func TestAdvanceRollbackRecordsNothing(t *testing.T) {
	ctx, pool, scope := setup(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) // on failure; a no-op after the rollback below
	if applied, err := idem.Advance(ctx, tx, scope, "e", 9); err != nil || !applied {
		t.Fatalf("first delivery: %v, %v", applied, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// The consumer failed and rolled back; the broker redelivers.
	applied, err := applyVersion(ctx, pool, scope, "e", 9, 0)
	if err != nil || !applied {
		t.Fatalf("redelivery after rollback: applied = %v, %v; want applied", applied, err)
	}
}

func TestAdvanceScopesAndEntitiesAreIsolated(t *testing.T) {
	ctx, pool, scope := setup(t)
	tenantA, tenantB := scope+"-a", scope+"-b"
	steps := []struct {
		scope, entity string
		version       int64
		applied       bool
	}{
		{tenantA, "order-1", 5, true},
		{tenantB, "order-1", 1, true}, // another tenant's order-1 starts afresh
		{tenantA, "order-2", 1, true}, // another entity of the same tenant too
		{tenantB, "order-1", 2, true},
		{tenantA, "order-1", 2, false},
	}
	for _, s := range steps {
		applied, err := applyVersion(ctx, pool, s.scope, s.entity, s.version, 0)
		if err != nil || applied != s.applied {
			t.Fatalf("%s/%s v%d: applied = %v, %v; want %v", s.scope, s.entity, s.version, applied, err, s.applied)
		}
	}
}

func TestAdvanceUnderRepeatableReadReportsSerialization(t *testing.T) {
	ctx, pool, scope := setup(t)
	if _, err := applyVersion(ctx, pool, scope, "e", 1, 0); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil { // take the snapshot now
		t.Fatal(err)
	}
	if applied, err := applyVersion(ctx, pool, scope, "e", 2, 0); err != nil || !applied {
		t.Fatalf("concurrent v2: %v, %v", applied, err)
	}
	// The snapshot still sees v1, but v2 has committed since.
	_, err = idem.Advance(ctx, tx, scope, "e", 2)
	if !errors.Is(err, idem.ErrSerialization) {
		t.Fatalf("err = %v, want ErrSerialization", err)
	}

	// WithTx retries the whole transaction, which then sees v2 and skips.
	var attempts int
	var applied bool
	err = idem.WithTx(ctx, pool, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(ctx context.Context, tx pgx.Tx) error {
		attempts++
		var err error
		applied, err = idem.Advance(ctx, tx, scope, "e", 2)
		return err
	})
	if err != nil || applied || attempts != 1 {
		t.Fatalf("serializable redelivery: applied = %v, %v after %d attempts; want skipped", applied, err, attempts)
	}
}

func TestAdvanceWaitsWithinCallersLockTimeout(t *testing.T) {
	ctx, pool, scope := setup(t)
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if applied, err := idem.Advance(ctx, holder, scope, "e", 1); err != nil || !applied {
		t.Fatalf("holder: %v, %v", applied, err)
	}
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
			return err
		}
		_, err := idem.Advance(ctx, tx, scope, "e", 1)
		return err
	})
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("err = %v, want ErrInProgress", err)
	}
}

func TestAdvanceInvalidInputNeverReachesTheDatabase(t *testing.T) {
	ctx := context.Background()
	long := strings.Repeat("e", 256)
	cases := []struct {
		scope, entity string
		version       int64
		want          error
	}{
		{"s", "", 1, idem.ErrInvalidKey},
		{"s", long, 1, idem.ErrInvalidKey},
		{"s", "e\xff", 1, idem.ErrInvalidKey},
		{"s", "e\x00", 1, idem.ErrInvalidKey},
		{"", "e", 1, idem.ErrInvalidScope},
		{long, "e", 1, idem.ErrInvalidScope},
		{"s\x00", "e", 1, idem.ErrInvalidScope},
		{"s", "e", -1, idem.ErrInvalidVersion},
		{"s", "e", math.MinInt64, idem.ErrInvalidVersion},
	}
	for _, c := range cases {
		name := fmt.Sprintf("scope %q, entity %.10q, version %d", c.scope, c.entity, c.version)
		// panicTx fails on any use: the call must not reach the database.
		applied, err := idem.Advance(ctx, panicTx{}, c.scope, c.entity, c.version)
		if !errors.Is(err, c.want) || applied {
			t.Errorf("%s: applied = %v, err = %v; want %v", name, applied, err, c.want)
		}
	}
}
