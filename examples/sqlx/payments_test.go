package payments

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // the driver this example runs on

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// open returns sqlx over lib/pq on a database of the test's own, with
// idem's tables and the service's.
func open(t *testing.T) *sqlx.DB {
	t.Helper()
	t.Parallel()
	pool := idemtest.Pool(t)
	db, err := sqlx.Open("postgres", pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(20)
	t.Cleanup(func() { _ = db.Close() })
	if _, err := db.ExecContext(t.Context(), Schema); err != nil {
		t.Fatal(err)
	}
	return db
}

func count(t *testing.T, db *sqlx.DB) int {
	t.Helper()
	var n int
	if err := db.GetContext(t.Context(), &n, `SELECT count(*) FROM payment`); err != nil {
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

// TestADeclinedCardLeavesNoRow is the trap idemsql closes: sqlx's write,
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
		t.Fatalf("%d rows after the decline, want 0: sqlx wrote outside idem's transaction", n)
	}
	decline = false
	p, replayed, err := s.Pay(t.Context(), "merchant-1", "key-2", req)
	if err != nil || replayed || p.ID == 0 || p.Tenant != "merchant-1" {
		t.Fatalf("retry: %+v, replayed %v, %v; want a payment", p, replayed, err)
	}
	if n := count(t, db); n != 1 {
		t.Errorf("%d rows, want 1", n)
	}
}
