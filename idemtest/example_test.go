package idemtest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemtest"
)

// A test of an application's exactly-once write, on a database of its own.
// The package's TestMain runs the tests through idemtest.Main:
//
//	func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }
//
// This example is compiled, not run: it is the body of a test.
func Example() {
	testCharge := func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		pool := idemtest.Pool(t) // idem's tables are there already
		// The application's own tables, as its migrations make them.
		if _, err := pool.Exec(ctx, `CREATE TABLE charge (id bigserial PRIMARY KEY, amount_cents bigint NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		charge := func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO charge (amount_cents) VALUES (1200) RETURNING id`).Scan(&id)
			return id, err
		}
		first, err := idem.Run(ctx, pool, "tenant-1", "key-1", nil, charge)
		if err != nil {
			t.Fatal(err)
		}
		retry, err := idem.Run(ctx, pool, "tenant-1", "key-1", nil, charge)
		if err != nil || !retry.Replayed || retry.Value != first.Value {
			t.Fatalf("retry: %+v, %v; want a replay of charge %d", retry, err, first.Value)
		}
	}
	_ = testCharge
}
