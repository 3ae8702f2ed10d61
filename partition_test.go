package idem_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestHashPartitionedByScope runs the documented partitioned table
// (docs/partitioned-by-scope.sql) under idem's migrations and puts it
// through the claim's hard cases: concurrent duplicates in many scopes,
// mismatches, an expired key's reclaim, and a purge.
func TestHashPartitionedByScope(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ddl, err := os.ReadFile("docs/partitioned-by-scope.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, string(ddl)); err != nil {
		t.Fatalf("documented DDL: %v", err)
	}
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		t.Fatalf("Migrate over the partitioned table: %v", err)
	}
	if _, err := pool.Exec(ctx, testdb.AppSchema); err != nil {
		t.Fatal(err)
	}

	const scopes, clients = 16, 8
	var calls atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, scopes*clients)
	for s := range scopes {
		scope := fmt.Sprintf("tenant-%d", s)
		for range clients {
			wg.Go(func() {
				res, err := idem.Run(ctx, pool, scope, "same-key", fpA, pay(scope, "same-key", 1, &calls))
				if err == nil && res.Value.ID == 0 {
					err = errors.New("no payment id")
				}
				errs <- err
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if calls.Load() != scopes {
		t.Fatalf("fn ran %d times for %d scopes sharing one key, want once per scope", calls.Load(), scopes)
	}
	var partitionsUsed int
	if err := pool.QueryRow(ctx, `SELECT count(DISTINCT tableoid) FROM idempotency_key`).Scan(&partitionsUsed); err != nil {
		t.Fatal(err)
	}
	if partitionsUsed < 2 {
		t.Fatalf("records landed in %d partition(s); the table is not spreading scopes", partitionsUsed)
	}

	if _, err := idem.Run(ctx, pool, "tenant-0", "same-key", fpB, pay("tenant-0", "same-key", 1, &calls)); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("mismatch on a partition: %v", err)
	}
	expire(t, pool, "tenant-1", "same-key")
	if res, err := idem.Run(ctx, pool, "tenant-1", "same-key", fpB, pay("tenant-1", "same-key", 1, &calls)); err != nil || res.Replayed {
		t.Fatalf("reclaim on a partition: %+v, %v", res, err)
	}
	expire(t, pool, "tenant-2", "same-key")
	if n, err := idem.Purge(ctx, pool, 100); err != nil || n != 1 {
		t.Fatalf("purge on partitions: %d, %v; want 1", n, err)
	}
}
