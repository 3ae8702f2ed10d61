package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/payments/internal/db"
	"github.com/pgidem/idem/outbox"
)

// startWebhookRelay starts the relay that posts each payment's webhook to
// url, with the message's idempotency key in the Idempotency-Key header:
// at least once, and the receiver recognises the repeats.
func startWebhookRelay(ctx context.Context, pool *pgxpool.Pool, url string, cfg outbox.Config) (*outbox.Relay, error) {
	client := &http.Client{Timeout: 10 * time.Second}
	deliver := func(ctx context.Context, msg outbox.Message) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(msg.Payload))
		if err != nil {
			return outbox.Park(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", msg.IdempotencyKey)
		resp, err := client.Do(req)
		if err != nil {
			return err // retried
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		switch {
		case resp.StatusCode < 300:
			return nil
		case resp.StatusCode == http.StatusBadRequest || resp.StatusCode == http.StatusUnprocessableEntity:
			// No retry makes the receiver take it: park it for a human.
			return outbox.Park(fmt.Errorf("webhook refused: %s", resp.Status))
		default:
			return fmt.Errorf("webhook: %s", resp.Status) // retried
		}
	}
	cfg.Destinations = []string{webhookDestination}
	return outbox.StartRelay(ctx, pool, deliver, &cfg)
}

// receiverScope is the scope of the receiver's records: the sender's
// name. The idempotency keys are the outbox's, unique per message.
const receiverScope = "payments-service"

// newReceiver returns the webhook receiver, POST /webhooks/payments. It
// stands for another system: it applies each webhook once, with idem.Once
// on the Idempotency-Key the relay sends, so that a retry the relay makes
// after a lost answer changes nothing.
func newReceiver(pool *pgxpool.Pool) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /webhooks/payments", func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		var hook Webhook
		if err := json.NewDecoder(r.Body).Decode(&hook); err != nil {
			http.Error(w, "not a payment webhook: "+err.Error(), http.StatusBadRequest)
			return
		}
		err := idem.WithTx(r.Context(), pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.Once(ctx, tx, receiverScope, key, func(ctx context.Context, tx pgx.Tx) error {
				return db.New(tx).LedgerEntryInsert(ctx, db.LedgerEntryInsertParams{
					PaymentID: hook.PaymentID, Merchant: hook.Merchant, OrderID: hook.OrderID,
					AmountCents: hook.AmountCents, Currency: hook.Currency,
				})
			})
			return err
		})
		switch {
		case errors.Is(err, idem.ErrInvalidKey):
			http.Error(w, "Idempotency-Key: "+err.Error(), http.StatusBadRequest)
		case errors.Is(err, idem.ErrInProgress):
			// The same webhook, delivered twice at once: the sender retries.
			w.Header().Set("Retry-After", "1")
			http.Error(w, "already being applied", http.StatusServiceUnavailable)
		case err != nil:
			slog.ErrorContext(r.Context(), "receiver", "error", err)
			http.Error(w, "not applied: retry", http.StatusInternalServerError)
		default:
			// Applied now, or before: the same answer either way.
			w.WriteHeader(http.StatusNoContent)
		}
	})
	return mux
}
