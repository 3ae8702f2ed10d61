package payments

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// open returns GORM on a database of the test's own, with idem's tables
// and the service's, over pgx's stdlib driver (GORM's postgres driver).
func open(t *testing.T) *gorm.DB {
	t.Helper()
	t.Parallel()
	pool := idemtest.Pool(t)
	db, err := gorm.Open(postgres.Open(pool.Config().ConnString()), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		t.Fatal(err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatal(err)
	}
	sqlDB.SetMaxOpenConns(20)
	t.Cleanup(func() { _ = sqlDB.Close() })
	if err := db.AutoMigrate(&Payment{}); err != nil {
		t.Fatal(err)
	}
	return db
}

func count(t *testing.T, db *gorm.DB) int64 {
	t.Helper()
	var n int64
	if err := db.Model(&Payment{}).Count(&n).Error; err != nil {
		t.Fatal(err)
	}
	return n
}

// TestADuplicateStormPaysOnce sends one key from 16 goroutines at once:
// one payment row, one answer, 15 replays of it.
func TestADuplicateStormPaysOnce(t *testing.T) {
	db := open(t)
	var charges atomic.Int64
	s := &Service{DB: db, Charge: func(context.Context, Payment) error { charges.Add(1); return nil }}
	req := Request{OrderID: "order-1", AmountCents: 1200, Currency: "EUR"}
	const n = 16
	got := make([]Payment, n)
	replays := make([]bool, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { got[i], replays[i], errs[i] = s.Pay(t.Context(), "merchant-1", "key-1", req) })
	}
	wg.Wait()
	replayed := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if got[i].ID != got[0].ID || got[i].AmountCents != 1200 {
			t.Errorf("call %d: %+v, call 0: %+v", i, got[i], got[0])
		}
		if replays[i] {
			replayed++
		}
	}
	if replayed != n-1 || charges.Load() != 1 || count(t, db) != 1 {
		t.Errorf("%d replays, %d charges, %d rows; want %d, 1, 1", replayed, charges.Load(), count(t, db), n-1)
	}
	_, _, err := s.Pay(t.Context(), "merchant-1", "key-1", Request{OrderID: "order-1", AmountCents: 9900, Currency: "EUR"})
	if !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("the key with another amount: %v, want ErrFingerprintMismatch", err)
	}
}

// TestADeclinedCardLeavesNoRow is the trap idemsql closes: GORM's write,
// made before the charge failed, rolls back with idem's transaction, and
// the retry pays.
func TestADeclinedCardLeavesNoRow(t *testing.T) {
	db := open(t)
	decline := true
	s := &Service{DB: db, Charge: func(context.Context, Payment) error {
		if decline {
			return ErrDeclined
		}
		return nil
	}}
	req := Request{OrderID: "order-2", AmountCents: 500, Currency: "EUR"}
	if _, _, err := s.Pay(t.Context(), "merchant-1", "key-2", req); !errors.Is(err, ErrDeclined) {
		t.Fatalf("err = %v, want ErrDeclined", err)
	}
	if n := count(t, db); n != 0 {
		t.Fatalf("%d rows after the decline, want 0: GORM wrote outside idem's transaction", n)
	}
	decline = false
	p, replayed, err := s.Pay(t.Context(), "merchant-1", "key-2", req)
	if err != nil || replayed || p.ID == 0 {
		t.Fatalf("retry: %+v, replayed %v, %v; want a payment", p, replayed, err)
	}
	if n := count(t, db); n != 1 {
		t.Errorf("%d rows, want 1", n)
	}
}
