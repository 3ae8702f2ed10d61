//go:build citus

package main

// The operator's command against a Citus coordinator whose idem tables
// docs/citus.sql distributed (bash .ci/citus; see
// docs/large-deployments.md): migrate, stats, inspect and purge.

import (
	"context"
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/citustemp"
)

func TestCitusCommand(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, err := citustemp.Start(ctx, citustemp.Config{Fast: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Error(err)
		}
	})
	const db = "idem_citus"
	if err := c.CreateDatabase(ctx, db); err != nil {
		t.Fatal(err)
	}
	url := c.URL(db)
	mustRun := mustRunner(t, url)
	mustRun("applied", "migrate", "up")
	script, err := os.ReadFile("../../docs/citus.sql")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, string(script)); err != nil {
		t.Fatalf("docs/citus.sql: %v", err)
	}
	mustRun("up to date", "migrate", "up")

	fn := func(context.Context, pgx.Tx) (map[string]string, error) {
		return map[string]string{"card": "4242"}, nil
	}
	for _, key := range []string{"live", "old"} {
		if _, err := idem.Run(ctx, pool, "tenant", key, nil, fn); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE idempotency_key SET expires_at = now() - interval '1 hour' WHERE scope = 'tenant' AND key = 'old'`); err != nil {
		t.Fatal(err)
	}
	out := mustRun("records done", "stats")
	if !regexp.MustCompile(`past expiry, awaiting purge +1\n`).MatchString(out) {
		t.Errorf("stats:\n%s", out)
	}
	mustRun("4242", "inspect", "-show-response", "tenant", "live")

	// An operation running now holds its key's lock on a worker: stats
	// and inspect count it there, and the duplicate waiting for it.
	checkRunning(t, ctx, pool, url, fn, "no record yet; running now (advisory lock with its id): yes")

	mustRun("purged 1 expired records", "purge", "-batch", "10")
	mustRun("purged 0 expired records", "purge")
}
