// Package payments is a complete example of idem with GORM: a payment
// service whose writes go through GORM, made exactly-once per client key
// with idemsql, in a module of its own so that no user of idem downloads
// GORM.
//
// The one rule: GORM must write on the *sql.Tx that idemsql gives the
// function (inTx), not on its own *gorm.DB. A write on the *gorm.DB
// commits by itself, outside idem's transaction, and stays behind when
// the function fails.
package payments

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"gorm.io/gorm"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemsql"
)

// Payment is the service's table, as GORM maps it.
type Payment struct {
	ID          int64  `gorm:"primaryKey" json:"id"`
	Tenant      string `gorm:"not null" json:"-"`
	OrderID     string `gorm:"not null" json:"order_id"`
	AmountCents int64  `gorm:"not null" json:"amount_cents"`
	Currency    string `gorm:"not null" json:"currency"`
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

// Service pays orders through GORM.
type Service struct {
	DB *gorm.DB
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
	sqlDB, err := s.DB.DB()
	if err != nil {
		return Payment{}, false, err
	}
	res, err := idemsql.Run(ctx, sqlDB, tenant, key, fp, func(ctx context.Context, tx *sql.Tx) (Payment, error) {
		orm := inTx(ctx, s.DB, tx)
		p := Payment{Tenant: tenant, OrderID: req.OrderID, AmountCents: req.AmountCents, Currency: req.Currency}
		if err := orm.Create(&p).Error; err != nil {
			return Payment{}, fmt.Errorf("record payment: %w", err)
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

// inTx returns db bound to tx: what GORM runs on it runs in idem's
// transaction, as GORM's own Transaction binds its *gorm.DB to the
// transaction it begins.
func inTx(ctx context.Context, db *gorm.DB, tx *sql.Tx) *gorm.DB {
	orm := db.Session(&gorm.Session{Context: ctx, NewDB: true})
	orm.Statement.ConnPool = tx
	return orm
}
