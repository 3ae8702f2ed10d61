// Command http is the release rehearsal's application (.ci/release),
// built in a module of its own against a release of idem, as an
// application takes it. On the database DATABASE_URL names it migrates,
// serves a payment through idemhttp's middleware on 127.0.0.1, with an
// outbox message written in the payment's transaction, delivers the
// message with a relay, and runs a flow that calls a provider. Run again
// with -replay, on the same keys, it checks that every answer is the one
// stored, and that nothing ran again.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/outbox"
)

const scope = "rehearsal"

func main() {
	replay := flag.Bool("replay", false, "the keys were used by an earlier run: every answer must be a replay")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
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
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS rehearsal_payment (id bigserial PRIMARY KEY, amount bigint NOT NULL);
		CREATE TABLE IF NOT EXISTS rehearsal_reservation (id bigserial PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	// A payment through the middleware, with its message.
	var handled atomic.Int64
	pay := idemhttp.MustNew(pool, idemhttp.Config{Scope: func(*http.Request) (string, error) { return scope, nil }, Required: true})
	srv := httptest.NewServer(pay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handled.Add(1)
		tx := idemhttp.Tx(r.Context())
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO rehearsal_payment (amount) VALUES (2500) RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := outbox.Enqueue(r.Context(), tx, outbox.Entry{Scope: scope, Key: idemhttp.Key(r.Context()),
			Destination: "ledger", Payload: fmt.Appendf(nil, `{"payment":%d}`, id)}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"payment":%d}`, id)
	})))
	defer srv.Close()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"amount":2500}`))
	if err != nil {
		log.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "payment-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		log.Fatalf("the payment: %d %s, %v", resp.StatusCode, body, err)
	}
	replayed := resp.Header.Get(idemhttp.ReplayedHeader) == "true"
	if replayed != *replay || handled.Load() != map[bool]int64{false: 1, true: 0}[*replay] {
		log.Fatalf("the payment: replayed %t, handler ran %d times; want a replay: %t", replayed, handled.Load(), *replay)
	}
	var payments int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM rehearsal_payment`).Scan(&payments); err != nil || payments != 1 {
		log.Fatalf("%d payments (%v), want 1", payments, err)
	}
	fmt.Printf("http: %s, replayed %t\n", body, replayed)

	// The message, delivered once.
	var delivered atomic.Int64
	relay, err := outbox.StartRelay(ctx, pool, func(ctx context.Context, m outbox.Message) error {
		delivered.Add(1)
		return nil
	}, &outbox.Config{PollInterval: 50 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	if !*replay {
		for delivered.Load() == 0 && ctx.Err() == nil {
			time.Sleep(20 * time.Millisecond)
		}
	} else {
		time.Sleep(300 * time.Millisecond) // nothing is left to deliver
	}
	relay.Stop()
	if want := map[bool]int64{false: 1, true: 0}[*replay]; delivered.Load() != want {
		log.Fatalf("the relay delivered %d messages, want %d", delivered.Load(), want)
	}
	fmt.Printf("outbox: %d delivered\n", delivered.Load())

	// A flow whose call a provider applies once per provider key.
	var charged atomic.Int64
	charge := idem.MustNewFlow("rehearsal-charge", func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		reserved, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO rehearsal_reservation (amount) VALUES ($1) RETURNING id`, amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return "", err
		}
		return idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			charged.Add(1)
			return fmt.Sprintf("charge of reservation %d, key %s", reserved, providerKey), nil
		})
	})
	res, err := charge.Run(ctx, pool, scope, "order-1", idem.Fingerprint([]byte("2500")), 2500)
	if err != nil {
		log.Fatal(err)
	}
	if res.Replayed != *replay || charged.Load() != map[bool]int64{false: 1, true: 0}[*replay] {
		log.Fatalf("the flow: replayed %t, provider called %d times; want a replay: %t", res.Replayed, charged.Load(), *replay)
	}
	fmt.Printf("flow: %s, replayed %t\n", res.Value, res.Replayed)

	stats, err := idem.ReadStats(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	if stats.Done < 1 || stats.FlowsFinished != 1 || stats.FlowsRunning != 0 {
		log.Fatalf("stats: %+v; want a record done, a flow finished, none running", stats)
	}
	fmt.Println("OK")
}
