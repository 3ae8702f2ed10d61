package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// TestAnEmptyBatchBeginsNoTransaction guards what a local step's round
// trip through pgconn relies on (sendBeginBatch): pgx returns a
// transaction for an empty batch that begins one, and sends nothing, so
// that the transaction is the one the step's own batch began.
func TestAnEmptyBatchBeginsNoTransaction(t *testing.T) {
	ctx, _, _ := setup(t)
	conn, err := pgx.Connect(ctx, env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "begin"); err != nil {
		t.Fatal(err)
	}
	tx := idem.TxOver(ctx, conn, pgx.TxOptions{})
	if tx == nil {
		t.Fatal("pgx made no transaction of an empty batch that begins one: a local step costs a round trip more")
	}
	if _, err := tx.Exec(ctx, "select 1"); err != nil {
		t.Fatalf("the transaction over the one begun: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if s := conn.PgConn().TxStatus(); s != 'I' {
		t.Fatalf("after its commit the connection is in state %q, want idle", s)
	}
	// Outside a transaction, it is closed, and sent nothing.
	if tx := idem.TxOver(ctx, conn, pgx.TxOptions{}); tx != nil {
		if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxClosed) {
			t.Fatalf("over no transaction: commit gives %v, want pgx.ErrTxClosed", err)
		}
	}
	if s := conn.PgConn().TxStatus(); s != 'I' {
		t.Fatalf("an empty batch that begins a transaction left the connection in state %q, want idle: it sent something", s)
	}
}
