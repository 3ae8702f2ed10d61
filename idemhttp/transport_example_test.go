package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// A client that pays through the payments endpoint of [MustNew]'s example.
// The network loses the answer to its first attempt after the server
// committed the payment; the Transport sends the request again with the
// same key, and gets the stored answer rather than a second payment.
func ExampleTransport() {
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

	// The network: it loses the first answer on its way back.
	var lostOne atomic.Bool
	network := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		res, err := http.DefaultTransport.RoundTrip(r)
		if err == nil && !lostOne.Swap(true) {
			res.Body.Close()
			return nil, errors.New("connection reset by peer")
		}
		return res, err
	})

	// The client: the zero Transport would send over http.DefaultTransport.
	client := &http.Client{Transport: &idemhttp.Transport{Base: network}}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second) // bounds every attempt and wait
	defer cancel()
	tenant := fmt.Sprintf("shop-%d", rand.Int64())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount_cents": 2500}`))
	if err != nil {
		log.Fatal(err)
	}
	req.SetBasicAuth(tenant, "secret")
	req.Header.Set("Content-Type", "application/json")
	res, err := client.Do(req)
	if err != nil {
		log.Fatal(err) // names the key and the attempts
	}
	defer res.Body.Close()
	answer, _ := io.ReadAll(res.Body)
	key, attempts := idemhttp.Attempts(res)
	fmt.Printf("%d replayed=%q %s\n", res.StatusCode, res.Header.Get(idemhttp.ReplayedHeader), strings.TrimSpace(string(answer)))
	fmt.Printf("attempts: %d, with one key of %d characters\n", attempts, len(key))

	var payments int
	err = pool.QueryRow(ctx, `SELECT count(*) FROM payment WHERE tenant = $1 AND idempotency_key = $2`, tenant, key).Scan(&payments)
	fmt.Println("payments recorded:", payments, err)
	// Output:
	// 201 replayed="true" {"amount_cents":2500,"status":"paid"}
	// attempts: 2, with one key of 36 characters
	// payments recorded: 1 <nil>
}

// A flow's call charges a provider through a Transport that sends the
// call's provider key by itself: the call's function never names it, and
// every attempt, in every process, carries the same key.
func ExampleTransport_providerKey() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}

	// The provider, which reads its keys from Cko-Idempotency-Key.
	var got atomic.Value
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Store(r.Header.Get("Cko-Idempotency-Key"))
		_, _ = io.WriteString(w, "pay_1")
	}))
	defer provider.Close()

	client := &http.Client{Transport: &idemhttp.Transport{UseProviderKey: true, Header: "Cko-Idempotency-Key"}}
	checkout := idem.MustNewFlow("example-checkout", func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		return idem.Call(s, "charge", func(ctx context.Context, _ string) (string, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL+"/payments", strings.NewReader(fmt.Sprint(amount)))
			if err != nil {
				return "", err
			}
			resp, err := client.Do(req)
			if err != nil {
				return "", err // wraps idem.ErrNotSent when it surely never left
			}
			defer resp.Body.Close()
			id, err := io.ReadAll(resp.Body)
			return string(id), err
		})
	})
	key := fmt.Sprint("order-", rand.Int64())
	res, err := checkout.Run(ctx, pool, "tenant-1", key, nil, 2500)
	if err != nil {
		log.Fatal(err)
	}
	info, err := idem.InspectFlow(ctx, pool, "tenant-1", key)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.Value, got.Load() == info.Steps[0].ProviderKey)
	// Output: pay_1 true
}
