package idem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The flow of these tests charges a card: it reserves the payment locally,
// calls the provider with the call's provider key, and records the charge
// locally, answering with both.

type chargeIn struct {
	Amount int64 `json:"amount"`
}

type chargeOut struct {
	PaymentID int64  `json:"payment_id"`
	ChargeID  string `json:"charge_id"`
	Declined  bool   `json:"declined"`
}

// provider is a payment provider that honours idempotency keys: a charge
// made again with a key it knows is answered from its records and applied
// once. It counts the charges it applied and the keys it saw.
type provider struct {
	mu      sync.Mutex
	charges map[string]string    // provider key → charge id
	at      map[string]time.Time // provider key → when it was first charged
	applied int                  // charges applied
	// keep is how long the provider keeps a key (0: for ever); past it, a
	// charge with the key is a new one, as at Stripe after 24 hours.
	keep time.Duration
	keys []string
	// amounts are the amounts of the calls, by provider key.
	amounts map[string][]int64
	// keyless makes the provider ignore keys, as some do: every charge it
	// is asked for is a new one. It keeps each charge under the reference
	// of the caller's that came with it, which lookup finds.
	keyless bool
	refs    map[string]string // reference → charge id
	lookups atomic.Int64
	// before runs as each call arrives, after runs once it is applied and
	// before it is answered; either may fail the call.
	before, after func(key string, attempt int) error
	calls         atomic.Int64
}

func newProvider() *provider {
	return &provider{charges: make(map[string]string), at: make(map[string]time.Time), amounts: make(map[string][]int64),
		refs: make(map[string]string)}
}

// charge charges amount once per key; an amount of 402 is declined.
func (p *provider) charge(ctx context.Context, key string, amount int64) (string, bool, error) {
	return p.chargeRef(ctx, key, "", amount)
}

// lookup returns the charge made with the caller's reference ref, if any.
func (p *provider) lookup(ref string) (string, bool) {
	p.lookups.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	id, ok := p.refs[ref]
	return id, ok
}

// chargeRef is charge with a reference of the caller's, which a keyless
// provider keeps with the charge.
func (p *provider) chargeRef(ctx context.Context, key, ref string, amount int64) (string, bool, error) {
	attempt := int(p.calls.Add(1))
	if p.before != nil {
		if err := p.before(key, attempt); err != nil {
			return "", false, err
		}
	}
	if amount == 402 {
		return "", true, nil
	}
	p.mu.Lock()
	p.keys = append(p.keys, key)
	p.amounts[key] = append(p.amounts[key], amount)
	id, ok := p.charges[key]
	if ok && (p.keyless || p.keep > 0 && time.Since(p.at[key]) > p.keep) {
		ok = false // forgotten, or never looked at
	}
	if !ok {
		p.applied++
		id = fmt.Sprintf("ch_%d", p.applied)
		p.charges[key] = id
		p.at[key] = time.Now()
		if ref != "" {
			p.refs[ref] = id
		}
	}
	p.mu.Unlock()
	if p.after != nil {
		if err := p.after(key, attempt); err != nil {
			return "", false, err
		}
	}
	return id, false, ctx.Err()
}

// effects counts the charges the provider applied, and the distinct keys
// it was called with.
func (p *provider) effects() (charges int, keys map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	keys = make(map[string]int)
	for _, k := range p.keys {
		keys[k]++
	}
	return p.applied, keys
}

// chargeFlow returns the tests' flow, named uniquely, over p; steps counts
// the local steps that ran.
func chargeFlow(p *provider, steps *atomic.Int64, opts ...idem.FlowOption) *idem.Flow[chargeIn, chargeOut] {
	return idem.MustNewFlow(testdb.Name("charge"), func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			if err == nil {
				steps.Add(1) // the step ran: its statement did
			}
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		type charged struct {
			ID       string `json:"id"`
			Declined bool   `json:"declined"`
		}
		c, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (charged, error) {
			id, declined, err := p.charge(ctx, providerKey, in.Amount)
			return charged{ID: id, Declined: declined}, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		if c.Declined {
			return chargeOut{PaymentID: id, Declined: true}, nil
		}
		_, err = idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
			_, err := tx.Exec(ctx, `UPDATE payment SET amount_cents = amount_cents WHERE id = $1`, id)
			if err == nil {
				steps.Add(1)
			}
			return struct{}{}, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		return chargeOut{PaymentID: id, ChargeID: c.ID}, nil
	}, opts...)
}

// ran is what a Run returned, for a test to read from a channel.
type ran[T any] struct {
	idem.Result[T]
	err error
}

// providerKeyOf returns the provider key of the call named step of the flow
// operation (scope, key), as InspectFlow reads it.
func providerKeyOf(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key, step string) string {
	t.Helper()
	call := testdb.FlowStep(t, ctx, pool, scope, key, step)
	if call.ProviderKey == "" {
		t.Fatalf("the step %s of the flow for %s is no call: %+v", step, key, call)
	}
	return call.ProviderKey
}

// setupFlow is setup for the flow tests: the context, the pool, a scope of
// the test's own, and a provider.
func setupFlow(t *testing.T) (context.Context, *pgxpool.Pool, string, *provider) {
	ctx, pool, scope := setup(t)
	return ctx, pool, scope, newProvider()
}

var fpCharge = idem.Fingerprint([]byte("charge 2500"))

func TestFlowRunsItsStepsOnceAndReplaysItsAnswer(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)

	first, err := flow.Run(ctx, pool, scope, "order-1", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	if first.Replayed || first.Value.ChargeID == "" || first.Value.PaymentID == 0 {
		t.Fatalf("first run = %+v", first)
	}
	retry, err := flow.Run(ctx, pool, scope, "order-1", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	if !retry.Replayed || retry.Value != first.Value {
		t.Fatalf("retry = %+v, want a replay of %+v", retry, first.Value)
	}
	charges, keys := p.effects()
	if charges != 1 || len(keys) != 1 || steps.Load() != 2 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("charges %d, keys %v, local steps run %d, payments %d; want 1, one key, 2, 1",
			charges, keys, steps.Load(), countPayments(t, pool, scope))
	}
	if _, ok := keys[providerKeyOf(t, ctx, pool, scope, "order-1", "charge")]; !ok {
		t.Fatalf("the provider saw %v, not the call's provider key", keys)
	}
}

func TestFlowRefusesAnotherRequestBeforeAnyStep(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	// Another fingerprint, then another flow, on the same key.
	_, err := flow.Run(ctx, pool, scope, "k", idem.Fingerprint([]byte("charge 9900")), chargeIn{Amount: 9900})
	if !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("another fingerprint: %v, want ErrFingerprintMismatch", err)
	}
	other := chargeFlow(p, &steps)
	if _, err := other.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("another flow: %v, want ErrFingerprintMismatch", err)
	}
	// And on a flow still in progress: a failed first run.
	p.before = func(string, int) error { return errors.New("provider timeout") }
	if _, err := flow.Run(ctx, pool, scope, "k2", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the failing run succeeded")
	}
	calls, ran := p.calls.Load(), steps.Load()
	_, err = flow.Run(ctx, pool, scope, "k2", idem.Fingerprint([]byte("charge 9900")), chargeIn{Amount: 9900})
	if !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("another fingerprint on a flow in progress: %v, want ErrFingerprintMismatch", err)
	}
	if p.calls.Load() != calls || steps.Load() != ran {
		t.Fatal("a refused request ran a step")
	}
}

func TestFlowUncertainFailureIsNotStoredAndTheRetryCallsWithTheSameKey(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	// A lease of an hour: a retry that continues at once proves that the
	// failed run gave its lease up.
	flow := chargeFlow(p, &steps, idem.WithLease(time.Hour), idem.WithWait(0))
	// The provider applies the charge, then the answer is lost.
	p.after = func(_ string, attempt int) error {
		if attempt == 1 {
			return errors.New("read tcp: connection reset by peer")
		}
		return nil
	}
	_, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err == nil || errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("first run: %v, want the call's error", err)
	}
	retry, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatalf("retry: %v", err)
	}
	if retry.Replayed || retry.Value.ChargeID != "ch_1" {
		t.Fatalf("retry = %+v, want the first charge, completed now", retry)
	}
	charges, keys := p.effects()
	if charges != 1 || len(keys) != 1 || p.calls.Load() != 2 || countPayments(t, pool, scope) != 1 || steps.Load() != 2 {
		t.Fatalf("charges %d, keys %v, calls %d, payments %d, local steps %d; want 1, one key seen twice, 2, 1, 2",
			charges, keys, p.calls.Load(), countPayments(t, pool, scope), steps.Load())
	}
}

func TestFlowDefiniteFailureIsStoredAndReplayedWithoutCalling(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	fp := idem.Fingerprint([]byte("charge 402"))
	first, err := flow.Run(ctx, pool, scope, "k", fp, chargeIn{Amount: 402})
	if err != nil || !first.Value.Declined {
		t.Fatalf("first run = %+v, %v; want declined", first, err)
	}
	retry, err := flow.Run(ctx, pool, scope, "k", fp, chargeIn{Amount: 402})
	if err != nil || !retry.Replayed || retry.Value != first.Value {
		t.Fatalf("retry = %+v, %v; want the declined answer replayed", retry, err)
	}
	if p.calls.Load() != 1 {
		t.Fatalf("the provider was called %d times, want once", p.calls.Load())
	}
}

func TestFlowDuplicateDuringASlowCallWaitsAndReplays(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	calling, release := make(chan struct{}), make(chan struct{})
	p.before = func(string, int) error {
		close(calling)
		<-release
		return nil
	}
	var first idem.Result[chargeOut]
	var firstErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		first, firstErr = flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	}()
	<-calling

	// Past a budget of nothing, the duplicate gets ErrInProgress.
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(0)); !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("duplicate with no wait: %v, want ErrInProgress", err)
	}
	// Within its budget, it waits for the first and replays its answer.
	dup := make(chan idem.Result[chargeOut], 1)
	go func() {
		res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
		if err != nil {
			t.Error(err)
		}
		dup <- res
	}()
	close(release)
	<-done
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	res := <-dup
	if !res.Replayed || res.Value != first.Value {
		t.Fatalf("duplicate = %+v, want a replay of %+v", res, first.Value)
	}
	if p.calls.Load() != 1 || countPayments(t, pool, scope) != 1 {
		t.Fatalf("%d calls, %d payments; want 1, 1", p.calls.Load(), countPayments(t, pool, scope))
	}
}
