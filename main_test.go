package idem_test

import (
	"context"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/testdb"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// setup marks the test parallel and returns a context, the pool of the
// throwaway database, and a scope no other test uses.
func setup(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	t.Parallel()
	pool := env.Pool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx, pool, testdb.Name("t")
}

// payment is the value the tests' business write returns and replays.
type payment struct {
	ID          int64  `json:"id"`
	AmountCents int64  `json:"amount_cents"`
	Note        string `json:"note"`
}

// pay returns the business write of the tests: insert one payment row in
// the claim's transaction and count the calls.
func pay(scope, key string, amount int64, calls *atomic.Int64) func(context.Context, pgx.Tx) (payment, error) {
	return func(ctx context.Context, tx pgx.Tx) (payment, error) {
		calls.Add(1)
		p := payment{AmountCents: amount, Note: "paid " + key}
		err := tx.QueryRow(ctx,
			`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			scope, key, amount).Scan(&p.ID)
		return p, err
	}
}

func countPayments(t *testing.T, pool *pgxpool.Pool, scope string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM payment WHERE scope = $1`, scope).Scan(&n); err != nil {
		t.Fatalf("count payments: %v", err)
	}
	return n
}

func countRecords(t *testing.T, pool *pgxpool.Pool, scope string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_key WHERE scope = $1`, scope).Scan(&n); err != nil {
		t.Fatalf("count records: %v", err)
	}
	return n
}

// expire moves a record's expiry into the past, as time would.
func expire(t *testing.T, pool *pgxpool.Pool, scope, key string) {
	t.Helper()
	tag, err := pool.Exec(context.Background(),
		`UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE scope = $1 AND key = $2`, scope, key)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("expire %s/%s: %v (%d rows)", scope, key, err, tag.RowsAffected())
	}
}
