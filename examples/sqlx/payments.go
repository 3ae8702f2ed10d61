// Package payments is a complete example of idem with sqlx over lib/pq:
// a payment service whose repository writes with sqlx, made exactly-once
// per client key with idemsql, in a module of its own so that no user of
// idem downloads sqlx or lib/pq.
//
// The one rule: the repository writes on the *sql.Tx that idemsql gives
// the function (wrapped by inTx for sqlx), not on the *sqlx.DB. A write
// on the *sqlx.DB commits by itself, outside idem's transaction, and
// stays behind when the function fails.
package payments

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jmoiron/sqlx"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// Schema is the service's table.
const Schema = `
CREATE TABLE IF NOT EXISTS payment (
    id           bigserial PRIMARY KEY,
    tenant       text   NOT NULL,
    order_id     text   NOT NULL,
    amount_cents bigint NOT NULL,
    currency     text   NOT NULL
)`

// Payment is a row of the table, as sqlx maps it.
type Payment struct {
	ID          int64  `db:"id" json:"id"`
	Tenant      string `db:"tenant" json:"-"`
	OrderID     string `db:"order_id" json:"order_id"`
	AmountCents int64  `db:"amount_cents" json:"amount_cents"`
	Currency    string `db:"currency" json:"currency"`
}

// Request is what a client asks for.
type Request struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// ErrDeclined is the card's refusal: nothing is written, and a retry
// with the same key runs again.
var ErrDeclined = errors.New("payments: card declined")

// Service pays orders with sqlx.
type Service struct {
	DB *sqlx.DB
	// Charge stands for the call that authorises the card; it runs
	// inside the transaction, after the payment row was written.
	Charge func(ctx context.Context, p Payment) error
}

// Pay records the payment req asks for once per (tenant, key): a retry
// gets the first answer, with replayed set; the same key with another
// request gets idem.ErrFingerprintMismatch.
func (s *Service) Pay(ctx context.Context, tenant, key string, req Request) (p Payment, replayed bool, err error) {
	fp, err := idem.FingerprintJSON(req)
	if err != nil {
		return Payment{}, false, err
	}
	res, err := idemsql.Run(ctx, s.DB.DB, tenant, key, fp, func(ctx context.Context, tx *sql.Tx) (Payment, error) {
		p := Payment{Tenant: tenant, OrderID: req.OrderID, AmountCents: req.AmountCents, Currency: req.Currency}
		if err := insertPayment(ctx, s.inTx(tx), &p); err != nil {
			return Payment{}, err
		}
		if s.Charge != nil {
			if err := s.Charge(ctx, p); err != nil {
				return Payment{}, err // idem rolls back, the row with it
			}
		}
		return p, nil
	})
	return res.Value, res.Replayed, err
}

// insertPayment is the repository's write, with sqlx's named parameters
// and struct scanning, on whatever transaction it is given.
func insertPayment(ctx context.Context, tx *sqlx.Tx, p *Payment) error {
	query, args, err := sqlx.BindNamed(sqlx.DOLLAR, `
		INSERT INTO payment (tenant, order_id, amount_cents, currency)
		VALUES (:tenant, :order_id, :amount_cents, :currency)
		RETURNING id, tenant, order_id, amount_cents, currency`, p)
	if err != nil {
		return err
	}
	return tx.GetContext(ctx, p, query, args...)
}

// inTx is tx for sqlx, with the *sqlx.DB's column mapping. A sqlx.Tx made
// this way does not know its driver: bind named queries with
// sqlx.BindNamed(sqlx.DOLLAR, ...), as insertPayment does.
func (s *Service) inTx(tx *sql.Tx) *sqlx.Tx { return &sqlx.Tx{Tx: tx, Mapper: s.DB.Mapper} }
