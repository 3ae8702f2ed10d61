package idemhttp_test

import (
	"bytes"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

// Middleware given a connection that is in a caller's transaction used to
// run the handler in that transaction and commit it, keyed requests and
// unkeyed ones alike. It now answers 500 without running the handler, and
// leaves the transaction as it was.
func TestMiddlewareRefusesAConnectionInATransaction(t *testing.T) {
	ctx, pool, tenant := setup(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, 'caller', 1)`, tenant); err != nil {
		t.Fatal(err)
	}

	var calls atomic.Int64
	var logs bytes.Buffer
	srv := httptest.NewServer(idemhttp.New(conn, idemhttp.Config{
		Scope:  tenantScope,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})(payHandler(&calls)))
	t.Cleanup(srv.Close)
	for _, key := range []string{`"k1"`, noKey} {
		res := post(t, srv, "/payments", tenant, key, `{"amount_cents": 100}`)
		wantProblem(t, res, http.StatusInternalServerError, idemhttp.DefaultProblemTypeBase, idemhttp.ProblemRequestFailed)
	}
	if n := calls.Load(); n != 0 {
		t.Errorf("the handler ran %d times, want never", n)
	}
	if n := strings.Count(logs.String(), "connection is in a transaction"); n != 2 {
		t.Errorf("%d requests logged the refusal, want 2; logs:\n%s", n, logs.String())
	}
	if status := conn.Conn().PgConn().TxStatus(); status != 'T' {
		t.Fatalf("the caller's transaction has status %q, want T", status)
	}
	if n, r := countPayments(t, pool, tenant), countRecords(t, pool, tenant); n != 0 || r != 0 {
		t.Errorf("%d payments, %d records committed under the caller's open transaction; want none", n, r)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("the caller's commit: %v", err)
	}
	if n, r := countPayments(t, pool, tenant), countRecords(t, pool, tenant); n != 1 || r != 0 {
		t.Errorf("after the caller's commit: %d payments, %d records; want its own 1 and none", n, r)
	}
}
