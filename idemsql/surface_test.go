package idemsql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/idemsql"
	"github.com/pgidem/idem/internal/testdb"
)

// TestAFlowsLocalStepsOnDatabaseSQL runs a flow on Beginner(db): a step
// that fails leaves nothing of its write, the run after it continues, the
// step that committed never runs again, and a duplicate replays.
func TestAFlowsLocalStepsOnDatabaseSQL(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		var payCalls, shipCalls atomic.Int64
		failShip := true
		flow := idem.MustNewFlow(testdb.Name("order"), func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
			p, err := idemsql.Local(s, "pay", pay(scope, "order-1", amount, &payCalls))
			if err != nil {
				return "", err
			}
			_, err = idemsql.Local(s, "ship", func(ctx context.Context, tx *sql.Tx) (int64, error) {
				shipCalls.Add(1)
				if _, err := pay(scope, "shipping", 5, new(atomic.Int64))(ctx, tx); err != nil {
					return 0, err
				}
				if failShip {
					return 0, errors.New("carrier unavailable")
				}
				return 1, nil
			})
			if err != nil {
				return "", err
			}
			return fmt.Sprintf("paid %d as payment %d, shipped", p.AmountCents, p.ID), nil
		})
		beginner := idemsql.Beginner(db)
		_, err := flow.Run(ctx, beginner, scope, "order-1", nil, 100)
		if !errors.Is(err, idem.ErrFlowIncomplete) {
			t.Fatalf("first run: %v, want ErrFlowIncomplete", err)
		}
		if n := testdb.CountPayments(t, pool, scope); n != 1 {
			t.Fatalf("%d payments after the failed step, want 1: the payment, not the failed step's write", n)
		}
		failShip = false
		res, err := flow.Run(ctx, beginner, scope, "order-1", nil, 100)
		if err != nil || res.Replayed {
			t.Fatalf("second run: %+v, %v; want it to complete", res, err)
		}
		again, err := flow.Run(ctx, beginner, scope, "order-1", nil, 100)
		if err != nil || !again.Replayed || again.Value != res.Value {
			t.Fatalf("duplicate: %+v, %v; want the replay of %q", again, err, res.Value)
		}
		if payCalls.Load() != 1 || shipCalls.Load() != 2 {
			t.Errorf("pay ran %d times, ship %d; want 1 and 2", payCalls.Load(), shipCalls.Load())
		}
		if n := testdb.CountPayments(t, pool, scope); n != 2 {
			t.Errorf("%d payments, want 2", n)
		}
	})
}

// TestIdemHTTPWithADatabaseSQLRepository serves a handler whose
// repository writes through database/sql, behind idemhttp built on
// Beginner(db), with 8 concurrent requests of one key: one payment, one
// answer, 7 replays of it.
func TestIdemHTTPWithADatabaseSQLRepository(t *testing.T) {
	forEachDriver(t, func(t *testing.T, ctx context.Context, db *sql.DB, pool *pgxpool.Pool, scope string) {
		repo := sqlRepository{scope: scope}
		var calls atomic.Int64
		handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			tx, ok := idemsql.Unwrap(idemhttp.Tx(r.Context()))
			if !ok {
				http.Error(w, "not a database/sql transaction", http.StatusInternalServerError)
				return
			}
			id, err := repo.createPayment(r.Context(), tx, idemhttp.Key(r.Context()), 1200)
			if err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"id":%d}`, id)
		})
		mw, err := idemhttp.NewMiddleware(idemsql.Beginner(db), idemhttp.Config{
			Scope: func(*http.Request) (string, error) { return scope, nil },
		})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw.Wrap(handler))
		defer srv.Close()

		const n = 8
		type answer struct {
			status   int
			body     string
			replayed bool
		}
		answers := make([]answer, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"amount_cents":1200}`))
				req.Header.Set("Idempotency-Key", "order-7")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				defer resp.Body.Close()
				body, _ := io.ReadAll(resp.Body)
				answers[i] = answer{resp.StatusCode, string(body), resp.Header.Get("Idempotent-Replayed") == "true"}
			})
		}
		wg.Wait()
		replays := 0
		for i, a := range answers {
			if a.status != http.StatusCreated || a.body != answers[0].body {
				t.Errorf("answer %d: %d %q, want 201 %q", i, a.status, a.body, answers[0].body)
			}
			if a.replayed {
				replays++
			}
		}
		if replays != n-1 || calls.Load() != 1 {
			t.Errorf("%d replays, handler ran %d times; want %d and 1", replays, calls.Load(), n-1)
		}
		if got := testdb.CountPayments(t, pool, scope); got != 1 {
			t.Errorf("%d payments, want 1", got)
		}
	})
}

// sqlRepository is an application's repository on database/sql: it
// writes on the *sql.Tx it is given.
type sqlRepository struct{ scope string }

func (r sqlRepository) createPayment(ctx context.Context, tx *sql.Tx, key string, amount int64) (id int64, err error) {
	err = tx.QueryRowContext(ctx,
		`INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
		r.scope, key, amount).Scan(&id)
	return id, err
}
