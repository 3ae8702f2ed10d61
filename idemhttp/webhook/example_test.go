package webhook_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/outbox"
)

// A receiver of Standard Webhooks: however often the sender delivers an
// event, and with whatever signature, it is applied once, in the
// transaction that records its id.
func ExampleNewReceiver() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS invoice_paid (
	    endpoint text NOT NULL,
	    event_id text NOT NULL,
	    invoice  text NOT NULL
	)`); err != nil {
		log.Fatal(err)
	}

	// The secret the sender's dashboard shows; during a rotation, list
	// the old one and the new.
	scheme, err := webhook.NewStandardWebhooks("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
	if err != nil {
		log.Fatal(err)
	}
	endpoint := fmt.Sprintf("webhook:billing-%d", rand.Int64()) // this run's events only
	recv, err := webhook.NewReceiver(pool, func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		if ev.Type != "invoice.paid" {
			return nil // acknowledged, and ignored
		}
		var paid struct {
			Data struct{ Invoice string } `json:"data"`
		}
		if err := json.Unmarshal(ev.Body, &paid); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO invoice_paid (endpoint, event_id, invoice) VALUES ($1, $2, $3)`,
			ev.Scope, ev.ID, paid.Data.Invoice)
		return err
	}, webhook.Config{
		Scheme: scheme,
		Scope:  func(*http.Request) (string, error) { return endpoint, nil },
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/billing", recv)
	srv := httptest.NewServer(mux)
	defer srv.Close()

	// The sender: it signs each attempt anew.
	deliver := func(id, body string, sign bool) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/webhooks/billing", strings.NewReader(body))
		if sign {
			_ = scheme.Sign(req.Header, id, time.Now(), []byte(body))
		} else {
			req.Header.Set("webhook-id", id)
			req.Header.Set("webhook-timestamp", fmt.Sprint(time.Now().Unix()))
			req.Header.Set("webhook-signature", "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=")
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer res.Body.Close()
		var problem struct{ Code string }
		answer, _ := io.ReadAll(res.Body)
		_ = json.Unmarshal(answer, &problem)
		fmt.Println(res.StatusCode, problem.Code+replayed(res))
	}
	paid := `{"type":"invoice.paid","data":{"invoice":"in_1"}}`
	deliver("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", paid, true)
	// The sender did not hear the answer in time, and delivers again.
	deliver("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", paid, true)
	// A sender's bug: the same id for another event.
	deliver("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", `{"type":"invoice.paid","data":{"invoice":"in_2"}}`, true)
	// A forgery.
	deliver("msg_forged", paid, false)

	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM invoice_paid WHERE endpoint = $1`, endpoint).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	fmt.Println("invoices recorded:", rows)
	// Output:
	// 204 applied
	// 204 replayed
	// 422 webhook-id-reused
	// 400 webhook-signature-invalid
	// invoices recorded: 1
}

// A receiver of Stripe's webhooks that acknowledges fast and acts later:
// the refund is recorded, and the receipt to mail is enqueued in the
// outbox, in the transaction that records the event, so that a
// redelivery does neither again and a relay sends the mail at least once.
func ExampleNewStripe() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS refund (
	    charge       text   PRIMARY KEY,
	    amount_cents bigint NOT NULL
	)`); err != nil {
		log.Fatal(err)
	}

	// The endpoint's signing secret, from Stripe's dashboard.
	stripe, err := webhook.NewStripe("whsec_idemStripeVectorSecret0123456789")
	if err != nil {
		log.Fatal(err)
	}
	run := rand.Int64() // this run's charge, and its outbox messages
	recv, err := webhook.NewReceiver(pool, func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		switch ev.Type {
		case "charge.refunded":
			var event struct {
				Data struct {
					Object struct {
						ID             string `json:"id"`
						AmountRefunded int64  `json:"amount_refunded"`
					} `json:"object"`
				} `json:"data"`
			}
			if err := json.Unmarshal(ev.Body, &event); err != nil {
				return err
			}
			charge := event.Data.Object
			if _, err := tx.Exec(ctx, `INSERT INTO refund (charge, amount_cents) VALUES ($1, $2)`, charge.ID, charge.AmountRefunded); err != nil {
				return err
			}
			// The mail is slow and outside the database: the outbox sends
			// it once this transaction commits.
			_, err := outbox.Enqueue(ctx, tx, outbox.Entry{
				Scope: ev.Scope, Key: ev.ID, Destination: fmt.Sprintf("mail.refund-receipt-%d", run),
				Payload: []byte(charge.ID),
			})
			return err
		}
		return nil
	}, webhook.Config{
		Scheme: stripe,
		Scope:  func(*http.Request) (string, error) { return "webhook:stripe", nil },
	})
	if err != nil {
		log.Fatal(err)
	}
	srv := httptest.NewServer(recv)
	defer srv.Close()

	// Stripe delivers the event, then again (the first answer was slow);
	// only the count of endpoints yet to acknowledge it differs.
	for pending := 2; pending >= 1; pending-- {
		body := fmt.Sprintf(`{"id":"evt_%d","object":"event","type":"charge.refunded","pending_webhooks":%d,`+
			`"data":{"object":{"id":"ch_%d","amount_refunded":2500}}}`, run, pending, run)
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(body))
		stripe.Sign(req.Header, time.Now(), []byte(body))
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		res.Body.Close()
		fmt.Println(res.StatusCode, replayed(res))
	}

	var refunds, mails int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM refund WHERE charge = $1`, fmt.Sprintf("ch_%d", run)).Scan(&refunds); err != nil {
		log.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE destination = $1`, fmt.Sprintf("mail.refund-receipt-%d", run)).Scan(&mails); err != nil {
		log.Fatal(err)
	}
	fmt.Println("refunds:", refunds, "receipts to mail:", mails)
	// Output:
	// 204 applied
	// 204 replayed
	// refunds: 1 receipts to mail: 1
}

// replayed says how a receiver's 204 answered: "applied" the first time,
// "replayed" for a redelivery; "" for another status.
func replayed(res *http.Response) string {
	switch {
	case res.StatusCode != http.StatusNoContent:
		return ""
	case res.Header.Get("Idempotent-Replayed") == "true":
		return "replayed"
	}
	return "applied"
}
