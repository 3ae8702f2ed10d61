package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// paymentTable is the application's table that createPayment writes to.
const paymentTable = `
CREATE TABLE IF NOT EXISTS payment (
    id              bigserial PRIMARY KEY,
    tenant          text   NOT NULL,
    idempotency_key text   NOT NULL,
    amount_cents    bigint NOT NULL
)`

// createPayment is an ordinary handler: it writes on the request's
// transaction and answers. The middleware makes it exactly-once.
func createPayment(w http.ResponseWriter, r *http.Request) {
	var req struct {
		AmountCents int64 `json:"amount_cents"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.AmountCents <= 0 {
		http.Error(w, "amount_cents must be a positive integer", http.StatusBadRequest)
		return
	}
	tenant, _, _ := r.BasicAuth()
	_, err := idemhttp.Tx(r.Context()).Exec(r.Context(),
		`INSERT INTO payment (tenant, idempotency_key, amount_cents) VALUES ($1, $2, $3)`,
		tenant, idemhttp.Key(r.Context()), req.AmountCents)
	if err != nil {
		// A 5xx rolls the transaction back: the client's retry runs again.
		http.Error(w, "payment not recorded", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"amount_cents":%d,"status":"paid"}`, req.AmountCents)
}

// A payments endpoint: a retry replays the first answer, byte for byte,
// and charges nothing more.
func ExampleMustNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, paymentTable); err != nil {
		log.Fatal(err)
	}

	mw := idemhttp.MustNew(pool, idemhttp.Config{
		// Keys are per caller. Here the caller is the basic-auth user; a
		// real service checks the password, or a token, first.
		Scope: func(r *http.Request) (string, error) {
			user, _, ok := r.BasicAuth()
			if !ok {
				return "", errors.New("not authenticated")
			}
			return user, nil
		},
		Required: true,
	})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw(http.HandlerFunc(createPayment)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	tenant := fmt.Sprintf("shop-%d", rand.Int64())
	send := func(key, body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(body))
		req.SetBasicAuth(tenant, "secret")
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set(idemhttp.DefaultHeader, key)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer res.Body.Close()
		answer, _ := io.ReadAll(res.Body)
		if res.Header.Get("Content-Type") == "application/problem+json" {
			// A problem: programs act on its code, people follow its link.
			var p struct{ Code, Detail string }
			_ = json.Unmarshal(answer, &p)
			fmt.Printf("%d %s: %s\n    Link: %s\n", res.StatusCode, p.Code, p.Detail, res.Header.Get("Link"))
			return
		}
		fmt.Printf("%d replayed=%q %s\n", res.StatusCode, res.Header.Get(idemhttp.ReplayedHeader), strings.TrimSpace(string(answer)))
	}

	send(`"order-1001"`, `{"amount_cents": 2500}`)
	// The answer was lost; the client retries with the same key.
	send(`"order-1001"`, `{"amount_cents": 2500}`)
	// A client bug: the same key for another payment.
	send(`"order-1001"`, `{"amount_cents": 9900}`)
	// No key at all.
	send("", `{"amount_cents": 2500}`)

	var payments int
	err = pool.QueryRow(ctx, `SELECT count(*) FROM payment WHERE tenant = $1`, tenant).Scan(&payments)
	fmt.Println("payments recorded:", payments, err)
	// Output:
	// 201 replayed="" {"amount_cents":2500,"status":"paid"}
	// 201 replayed="true" {"amount_cents":2500,"status":"paid"}
	// 422 key-reused: This Idempotency-Key was already used for a different request. Use a new key for a new request.
	//     Link: <https://github.com/pgidem/idem/blob/main/idemhttp/PROBLEMS.md#key-reused>; rel="describedby"
	// 400 key-missing: This request needs an Idempotency-Key header.
	//     Link: <https://github.com/pgidem/idem/blob/main/idemhttp/PROBLEMS.md#key-missing>; rel="describedby"
	// payments recorded: 1 <nil>
}

// A refunds endpoint that calls idem.Run itself, with a value of its own
// rather than a stored HTTP answer, reads its keys and answers idem's
// errors as the middleware does.
func ExampleMiddleware_WriteError() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}

	scope := func(r *http.Request) (string, error) {
		user, _, ok := r.BasicAuth()
		if !ok {
			return "", errors.New("not authenticated")
		}
		return user, nil
	}
	m, err := idemhttp.NewMiddleware(pool, idemhttp.Config{Scope: scope})
	if err != nil {
		log.Fatal(err)
	}
	refund := func(w http.ResponseWriter, r *http.Request) {
		key, err := m.ParseKey(r)
		if err != nil {
			m.WriteError(w, r, err) // 400 key-missing or key-invalid
			return
		}
		tenant, err := scope(r)
		if err != nil {
			http.Error(w, "who are you?", http.StatusUnauthorized)
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "body unreadable", http.StatusBadRequest)
			return
		}
		res, err := idem.Run(r.Context(), pool, tenant, key, idemhttp.DefaultFingerprint(r, body),
			func(ctx context.Context, tx pgx.Tx) (string, error) {
				// ... the refund's writes on tx.
				return "refunded " + strings.TrimSpace(string(body)), nil
			})
		if err != nil {
			m.WriteError(w, r, err) // 422, 409, 503 or 500, as the middleware answers
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "%s (replayed: %v)", res.Value, res.Replayed)
	}
	srv := httptest.NewServer(http.HandlerFunc(refund))
	defer srv.Close()

	tenant := fmt.Sprintf("shop-%d", rand.Int64())
	send := func(key, body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/refunds", strings.NewReader(body))
		req.SetBasicAuth(tenant, "secret")
		if key != "" {
			req.Header.Set(idemhttp.DefaultHeader, key)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer res.Body.Close()
		answer, _ := io.ReadAll(res.Body)
		if res.Header.Get("Content-Type") == "application/problem+json" {
			var p struct{ Code string }
			_ = json.Unmarshal(answer, &p)
			fmt.Println(res.StatusCode, p.Code)
			return
		}
		fmt.Println(res.StatusCode, string(answer))
	}

	send(`"refund-7"`, "order 1001")
	send(`"refund-7"`, "order 1001")
	send(`"refund-7"`, "order 1002")
	send(`"refund-7`, "order 1001")
	send("", "order 1001")
	// Output:
	// 201 refunded order 1001 (replayed: false)
	// 201 refunded order 1001 (replayed: true)
	// 422 key-reused
	// 400 key-invalid
	// 400 key-missing
}
