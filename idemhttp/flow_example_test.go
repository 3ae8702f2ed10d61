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
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// A checkout endpoint whose write charges a card at a provider: a flow
// (idem.MustNewFlow) served by FlowHandler. The provider charges on the first
// request but its answer is lost; the request gets 503
// operation-incomplete, and the client's retry, with the same key,
// continues the flow: the provider, given the same provider key, charges
// once. A later retry replays the answer.
func ExampleFlowHandler() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	err = idem.Migrate(ctx, db)
	db.Close()
	if err != nil {
		log.Fatal(err)
	}

	// The provider: it charges once per provider key, and its first
	// answer is lost on the way.
	var mu sync.Mutex
	charges := map[string]string{}
	lost := false
	charge := func(_ context.Context, providerKey string, cents int64) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		id, ok := charges[providerKey]
		if !ok {
			id = fmt.Sprintf("ch_%d", len(charges)+1)
			charges[providerKey] = id
		}
		if !lost {
			lost = true
			return "", errors.New("provider: timeout") // charged, but the answer is lost
		}
		return id, nil
	}

	type order struct {
		AmountCents int64 `json:"amount_cents"`
	}
	type receipt struct {
		ChargeID string `json:"charge_id"`
	}
	checkout := idem.MustNewFlow("http-checkout", func(ctx context.Context, s *idem.Steps, in order) (receipt, error) {
		id, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			return charge(ctx, providerKey, in.AmountCents)
		})
		return receipt{ChargeID: id}, err
	})

	mw, err := idemhttp.NewMiddleware(pool, idemhttp.Config{
		Scope: func(r *http.Request) (string, error) {
			user, _, ok := r.BasicAuth()
			if !ok {
				return "", errors.New("not authenticated")
			}
			return user, nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /checkout", idemhttp.FlowHandler(mw, checkout,
		func(r *http.Request, body []byte) (order, error) {
			var in order
			if err := json.Unmarshal(body, &in); err != nil || in.AmountCents <= 0 {
				return order{}, errors.New("amount_cents must be a positive integer")
			}
			return in, nil
		},
		func(w http.ResponseWriter, r *http.Request, out receipt) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_ = json.NewEncoder(w).Encode(out)
		}))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	tenant := fmt.Sprintf("shop-%d", rand.Int64())
	send := func(body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/checkout", strings.NewReader(body))
		req.SetBasicAuth(tenant, "secret")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(idemhttp.DefaultHeader, `"cart-7"`)
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
			fmt.Printf("%d %s, Retry-After %s\n", res.StatusCode, p.Code, res.Header.Get("Retry-After"))
			return
		}
		fmt.Printf("%d replayed=%q %s\n", res.StatusCode, res.Header.Get(idemhttp.ReplayedHeader), strings.TrimSpace(string(answer)))
	}

	send(`{"amount_cents": 2500}`)
	send(`{"amount_cents": 2500}`) // the client's retry, with the same key
	send(`{"amount_cents": 2500}`)
	mu.Lock()
	fmt.Println("charges at the provider:", len(charges))
	mu.Unlock()
	// Output:
	// 503 operation-incomplete, Retry-After 1
	// 201 replayed="" {"charge_id":"ch_1"}
	// 201 replayed="true" {"charge_id":"ch_1"}
	// charges at the provider: 1
}
