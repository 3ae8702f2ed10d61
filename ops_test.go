package idem_test

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

func TestReadStatsCountsRecordsAndRunningOperations(t *testing.T) {
	ctx, pool, scope := setupOwnDatabase(t) // stats count every scope's records
	var calls atomic.Int64
	for _, key := range []string{"live-1", "live-2", "old"} {
		if _, err := idem.Run(ctx, pool, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
	}
	expire(t, pool, scope, "old")
	// An operation running now, at READ COMMITTED: no record yet, a lock.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := idem.Do(ctx, tx, scope, "running", fpA, pay(scope, "running", 1, &calls)); err != nil {
		t.Fatal(err)
	}

	s, err := idem.ReadStats(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	if s.Done != 2 || s.Expired != 1 || s.InProgress != 0 || s.Scopes != 1 || s.Running != 1 || s.Waiting != 0 {
		t.Fatalf("stats %+v; want 2 done, 1 expired, 0 in progress, 1 scope, 1 running, 0 waiting", s)
	}
	if s.OldestLive.IsZero() || s.OldestRunning.IsZero() || s.TableBytes <= 0 || s.IndexBytes <= 0 {
		t.Fatalf("stats %+v; want the oldest live record, the oldest running transaction and the sizes", s)
	}
	if s.OutboxPending != 0 || !s.OldestPending.IsZero() {
		t.Fatalf("stats %+v; want an empty outbox", s)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if s, err := idem.ReadStats(ctx, pool); err != nil || s.Running != 0 || !s.OldestRunning.IsZero() {
		t.Fatalf("after the rollback: %+v, %v; want nothing running", s, err)
	}
}

func TestInspectReadsOneKeysRecordAndLock(t *testing.T) {
	ctx, pool, scope := setup(t)
	info, err := idem.Inspect(ctx, pool, scope, "k")
	if err != nil || info.Found || info.Running {
		t.Fatalf("a key never used: %+v, %v; want nothing found", info, err)
	}
	var calls atomic.Int64
	first, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 700, &calls))
	if err != nil {
		t.Fatal(err)
	}
	info, err = idem.Inspect(ctx, pool, scope, "k")
	if err != nil || !info.Found || info.State != "done" || info.Expired || !bytes.Equal(info.Fingerprint, fpA) || info.Running {
		t.Fatalf("a completed key: %+v, %v", info, err)
	}
	if !bytes.Contains(info.Response, []byte(`"amount_cents": 700`)) && !bytes.Contains(info.Response, []byte(`"amount_cents":700`)) {
		t.Fatalf("stored response %s; want the value of %+v", info.Response, first.Value)
	}
	if !info.CreatedAt.Before(info.ExpiresAt) || info.ExpiresAt.Sub(info.CreatedAt) > idem.DefaultRetention+time.Minute {
		t.Fatalf("created %s, expires %s; want the default retention", info.CreatedAt, info.ExpiresAt)
	}
	expire(t, pool, scope, "k")
	if info, err := idem.Inspect(ctx, pool, scope, "k"); err != nil || !info.Found || !info.Expired {
		t.Fatalf("an expired key: %+v, %v", info, err)
	}

	// Running now: a lock, and no record at READ COMMITTED.
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := idem.Do(ctx, tx, scope, "running", fpA, func(ctx context.Context, _ pgx.Tx) (int, error) {
			info, err := idem.Inspect(ctx, pool, scope, "running")
			if err != nil || info.Found || !info.Running || info.RunningSince.IsZero() || info.Waiting != 0 {
				t.Errorf("a key whose function runs: %+v, %v; want its lock held and no record", info, err)
			}
			return 1, nil
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	if _, err := idem.Inspect(ctx, pool, scope, ""); !errors.Is(err, idem.ErrInvalidKey) {
		t.Fatalf("an empty key: %v, want ErrInvalidKey", err)
	}
	if _, err := idem.Inspect(ctx, pool, "", "k"); !errors.Is(err, idem.ErrInvalidScope) {
		t.Fatalf("an empty scope: %v, want ErrInvalidScope", err)
	}
}
