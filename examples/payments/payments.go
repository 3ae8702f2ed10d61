package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/payments/internal/db"
	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/outbox"
)

// PaymentRequest is the body of POST /payments.
type PaymentRequest struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// Payment is a recorded payment, as the API answers it.
type Payment struct {
	ID          int64     `json:"id"`
	OrderID     string    `json:"order_id"`
	AmountCents int64     `json:"amount_cents"`
	Currency    string    `json:"currency"`
	CreatedAt   time.Time `json:"created_at"`
}

// webhookDestination is the outbox destination of the payments' webhooks.
const webhookDestination = "payment-webhook"

// Webhook is the body the relay posts for each payment.
type Webhook struct {
	PaymentID   int64  `json:"payment_id"`
	Merchant    string `json:"merchant"`
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// Repository writes payments, through the sqlc queries of internal/db.
type Repository struct{}

// orderScope is the scope of the orders' keys. It is not the merchant's
// own scope, which holds the clients' Idempotency-Keys: a client's key
// never meets an order's.
func orderScope(merchant string) string { return "orders/" + merchant }

// Create records the payment of an order in tx, the caller's transaction,
// with its webhook in the outbox: the payment, the order's record and the
// message commit together or not at all. An order is paid once: Create
// runs in idem.Do keyed by the order, so a request for an order already
// paid, whatever its Idempotency-Key, gets that payment back (replayed is
// true), and one with another amount or currency gets
// idem.ErrFingerprintMismatch.
func (Repository) Create(ctx context.Context, tx pgx.Tx, merchant string, req PaymentRequest) (p Payment, replayed bool, err error) {
	fp, err := idem.FingerprintJSON(req)
	if err != nil {
		return Payment{}, false, err
	}
	scope := orderScope(merchant)
	res, err := idem.Do(ctx, tx, scope, req.OrderID, fp, func(ctx context.Context, tx pgx.Tx) (Payment, error) {
		row, err := db.New(tx).PaymentInsert(ctx, db.PaymentInsertParams{
			Merchant: merchant, OrderID: req.OrderID, AmountCents: req.AmountCents, Currency: req.Currency,
		})
		if err != nil {
			return Payment{}, err
		}
		payload, err := json.Marshal(Webhook{
			PaymentID: row.ID, Merchant: merchant, OrderID: row.OrderID, AmountCents: row.AmountCents, Currency: row.Currency,
		})
		if err != nil {
			return Payment{}, err
		}
		// The operation that sends it is the order's: its idempotency key
		// is the same on every delivery (outbox.IdempotencyKey).
		if _, err := outbox.Enqueue(ctx, tx, outbox.Entry{
			Scope: scope, Key: req.OrderID, Destination: webhookDestination, Payload: payload,
		}); err != nil {
			return Payment{}, err
		}
		return Payment{ID: row.ID, OrderID: row.OrderID, AmountCents: row.AmountCents, Currency: row.Currency, CreatedAt: row.CreatedAt.Time}, nil
	})
	return res.Value, res.Replayed, err
}

// merchantOf is who calls: the bearer token stands for real
// authentication. It is idemhttp's scope: the handler reads it back with
// idemhttp.Scope.
func merchantOf(r *http.Request) (string, error) {
	merchant, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || merchant == "" || len(merchant) > 200 {
		return "", errors.New("no merchant")
	}
	return merchant, nil
}

// newAPI returns the service's HTTP API: POST /payments, exactly once per
// Idempotency-Key, which it requires.
func newAPI(pool *pgxpool.Pool) http.Handler {
	once := idemhttp.MustNew(pool, idemhttp.Config{Scope: merchantOf, Required: true})
	mux := http.NewServeMux()
	mux.Handle("POST /payments", once(http.HandlerFunc(createPayment)))
	return mux
}

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// createPayment runs in the transaction idemhttp opened for the request's
// key: its writes commit with the key's stored answer.
func createPayment(w http.ResponseWriter, r *http.Request) {
	var req PaymentRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, "the body is not a payment: "+err.Error())
		return
	}
	if req.OrderID == "" || len(req.OrderID) > idem.MaxKeyLength || req.AmountCents <= 0 || !currencyCode.MatchString(req.Currency) {
		writeError(w, http.StatusUnprocessableEntity, "a payment needs an order_id, a positive amount_cents and an ISO 4217 currency")
		return
	}
	// The merchant is the scope idemhttp claimed the request's key under:
	// merchantOf ran once, in the middleware, which turned away a request
	// without a merchant (400) or without a key (Required) before this ran.
	ctx := r.Context()
	merchant := idemhttp.Scope(ctx)
	p, replayed, err := Repository{}.Create(ctx, idemhttp.Tx(ctx), merchant, req)
	switch {
	case errors.Is(err, idem.ErrFingerprintMismatch):
		// A final answer: idemhttp stores it for this key.
		writeError(w, http.StatusConflict, fmt.Sprintf("order %s is paid already, with another amount or currency", req.OrderID))
		return
	case errors.Is(err, idem.ErrInProgress), errors.Is(err, idem.ErrSerialization):
		// Another request for the order is running: a 5xx is not stored
		// and rolls the transaction back, so the client's retry runs again.
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("order %s is being paid by another request: retry", req.OrderID))
		return
	case err != nil:
		slog.ErrorContext(ctx, "payments: create", "merchant", merchant, "idempotency_key", idemhttp.Key(ctx), "error", err)
		writeError(w, http.StatusInternalServerError, "the payment could not be recorded: retry")
		return
	}
	status := http.StatusCreated
	if replayed {
		status = http.StatusOK // the order's payment, made by an earlier request
	}
	w.Header().Set("Location", "/payments/"+strconv.FormatInt(p.ID, 10))
	writeJSON(w, status, p)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, message string) {
	writeJSON(w, status, map[string]string{"error": message})
}
