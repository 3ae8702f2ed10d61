package idem_test

import (
	"context"
	"os"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

var env *testdb.Env

func TestMain(m *testing.M) {
	if os.Getenv(crashEnv) != "" {
		os.Exit(crashChild()) // a child of the flow crash tests
	}
	os.Exit(testdb.Main(m, &env))
}

// setup marks the test parallel and returns a context, the pool of the
// throwaway database, and a scope no other test uses.
func setup(t *testing.T) (context.Context, *pgxpool.Pool, string) {
	t.Helper()
	return env.Setup(t, "t")
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

// Shared helpers, under the names this package's tests use.
var (
	countPayments = testdb.CountPayments
	countRecords  = testdb.CountRecords
	expire        = testdb.Expire
)

// fpA and fpB are the fingerprints of two different requests.
var fpA, fpB = idem.Fingerprint([]byte("request A")), idem.Fingerprint([]byte("request B"))

// panicTx is a transaction that fails the test on any use: passing it proves
// that a call was rejected before it reached the database.
type panicTx struct{ pgx.Tx }
