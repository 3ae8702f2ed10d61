package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
)

// The failover soak's flows: beside the payments, clients run a flow
// (reserve locally, charge at a provider, record locally) through the same
// failovers, against an in-process provider that honours idempotency keys
// and counts its charges per logical operation. A flow whose row an
// asynchronous failover lost runs again on the new primary; its call must
// reach the provider with the key the lost run sent, so that the provider
// answers it with the charge it made, and charges once.

// failoverFlowClients is how many clients run flows.
const failoverFlowClients = 4

// failoverFlowLease is the flows' lease: short, so that a flow whose
// executor's connection a failover broke is taken over soon.
const failoverFlowLease = time.Second

// failoverProvider is the in-process provider: one charge per
// idempotency key, and the keys it charged per operation.
type failoverProvider struct {
	mu      sync.Mutex
	charges map[string]flowSoakCharge
	amounts map[string]int64
	byOp    map[string][]string // operation key -> provider keys charged
	calls   map[string]int      // provider key -> calls
	n       int
}

func newFailoverProvider() *failoverProvider {
	return &failoverProvider{charges: make(map[string]flowSoakCharge), amounts: make(map[string]int64),
		byOp: make(map[string][]string), calls: make(map[string]int)}
}

// charge charges amount for operation op under key, once per key. It
// takes a moment, as a provider does, so that failovers meet calls in
// flight.
func (p *failoverProvider) charge(ctx context.Context, key, op string, amount int64) (flowSoakCharge, error) {
	if err := sleep(ctx, time.Duration(rand.IntN(3000))*time.Microsecond); err != nil {
		return flowSoakCharge{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[key]++
	if c, ok := p.charges[key]; ok {
		if p.amounts[key] != amount {
			return flowSoakCharge{}, errors.New("provider: key reused with another amount")
		}
		return c, nil
	}
	p.n++
	status := "charged"
	if amount%20 == 0 {
		status = "declined"
	}
	c := flowSoakCharge{ID: fmt.Sprintf("ch_%d", p.n), Status: status}
	p.charges[key], p.amounts[key] = c, amount
	p.byOp[op] = append(p.byOp[op], key)
	return c, nil
}

// failoverFlows is the flows of one failover soak.
type failoverFlows struct {
	f        *failoverRun
	pool     *pgxpool.Pool
	flow     *idem.Flow[flowSoakInput, flowSoakAnswer]
	provider *failoverProvider

	attempts, executed, replayed atomic.Int64
	mu                           sync.Mutex
	answers                      []flowSoakAnswer
	errs                         []error
	answeredAt                   []time.Time
}

func failoverFlowKey(i int) string   { return fmt.Sprintf("flow-%d", i) }
func failoverFlowAmount(i int) int64 { return int64(100 + i) }

func newFailoverFlows(f *failoverRun, pool *pgxpool.Pool) *failoverFlows {
	ff := &failoverFlows{f: f, pool: pool, provider: newFailoverProvider()}
	ff.flow = idem.MustNewFlow("soak-flow", func(ctx context.Context, s *idem.Steps, in flowSoakInput) (flowSoakAnswer, error) {
		paymentID, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO idem_flowsoak_payment (scope, key, amount_cents, status)
				VALUES ($1, $2, $3, 'reserved') RETURNING id`, s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return flowSoakAnswer{}, err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (flowSoakCharge, error) {
			return ff.provider.charge(ctx, providerKey, s.Key(), in.Amount)
		})
		if err != nil {
			return flowSoakAnswer{}, err
		}
		_, err = idem.Local(s, "record", func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO idem_flowsoak_ledger (scope, key, payment_id, charge_id, status) VALUES ($1, $2, $3, $4, $5)`,
				s.Scope(), s.Key(), paymentID, charge.ID, charge.Status)
			b.Queue(`UPDATE idem_flowsoak_payment SET status = $2, charge_id = $3 WHERE id = $1`, paymentID, charge.Status, charge.ID)
			return struct{}{}, tx.SendBatch(ctx, b).Close()
		})
		if err != nil {
			return flowSoakAnswer{}, err
		}
		return flowSoakAnswer{PaymentID: paymentID, ChargeID: charge.ID, Status: charge.Status, Amount: in.Amount}, nil
	}, idem.WithLease(failoverFlowLease), idem.WithWait(3*failoverFlowLease))
	return ff
}

// runAll runs the flows from their clients until the failovers are over
// and at least cfg.Flows were started, and every started one has ended.
func (ff *failoverFlows) runAll(ctx context.Context) {
	var clients sync.WaitGroup
	for range failoverFlowClients {
		clients.Go(func() {
			for ctx.Err() == nil {
				ff.mu.Lock()
				i := len(ff.answers)
				if i >= maxSoakPayments || (i >= ff.f.cfg.Flows && ff.f.done.Load()) {
					ff.mu.Unlock()
					return
				}
				ff.answers = append(ff.answers, flowSoakAnswer{})
				ff.errs = append(ff.errs, nil)
				ff.answeredAt = append(ff.answeredAt, time.Time{})
				ff.mu.Unlock()
				res, err := ff.run(ctx, i)
				ff.mu.Lock()
				ff.answers[i], ff.errs[i], ff.answeredAt[i] = res.Value, err, time.Now()
				ff.mu.Unlock()
			}
		})
	}
	clients.Wait()
}

// run runs flow i until an attempt answers, an error says no retry can
// help, or the payment timeout passes.
func (ff *failoverFlows) run(ctx context.Context, i int) (idem.Result[flowSoakAnswer], error) {
	ctx, cancel := context.WithTimeout(ctx, ff.f.cfg.PaymentTimeout)
	defer cancel()
	in := flowSoakInput{Amount: failoverFlowAmount(i)}
	fp, err := idem.FingerprintJSON(in)
	if err != nil {
		return idem.Result[flowSoakAnswer]{}, err
	}
	var lastErr error
	for attempt := 1; attempt <= soakMaxAttempts; attempt++ {
		ff.attempts.Add(1)
		res, err := ff.flow.Run(ctx, ff.pool, ff.f.scope, failoverFlowKey(i), fp, in)
		if err == nil {
			if res.Replayed {
				ff.replayed.Add(1)
			} else {
				ff.executed.Add(1)
			}
			return res, nil
		}
		lastErr = err
		if errors.Is(err, idem.ErrFingerprintMismatch) || errors.Is(err, idem.ErrFlowStopped) || errors.Is(err, idem.ErrFlowChanged) {
			break
		}
		ceiling := min(time.Millisecond<<min(attempt-1, 10), soakRetryDelayMax)
		if sleep(ctx, rand.N(ceiling)+1) != nil {
			break
		}
	}
	return idem.Result[flowSoakAnswer]{}, fmt.Errorf("%s: %w", failoverFlowKey(i), lastErr)
}

// failoverFlowReport is what the flows of a failover soak did and found.
type failoverFlowReport struct {
	// Started and Answered count the logical flow operations; Attempts,
	// the runs the clients made.
	Started, Answered int
	Attempts          int64
	// Lost counts the answered flows whose row a failover lost; ReRun, the
	// flows that ran again when retried after the failovers, and
	// SameKey, those of them whose call reached the provider with a key it
	// had charged already.
	Lost, ReRun, SameKey int
	// Charges is the provider's charges; Doubled, operations charged under
	// more than one key; Uncharged, answered operations it never charged.
	Charges, Doubled, Uncharged int
	// BadRows counts answered operations without exactly one payment and
	// one ledger row that agree with the stored answer; Wrong, answers a
	// client got that differ from the one finally stored; RetryFailed,
	// retries after the failovers that failed; Unanswered, operations
	// never answered.
	BadRows, Wrong, RetryFailed, Unanswered int
}

// check retries every answered flow once more, as a client that lost its
// answer would, after the failovers, and compares per operation the
// provider's charges, the rows, the stored answer and the answers.
func (ff *failoverFlows) check(ctx context.Context, admin *pgxpool.Pool) (*failoverFlowReport, error) {
	rep := &failoverFlowReport{Started: len(ff.answers), Attempts: ff.attempts.Load()}
	scope := ff.f.scope
	// Lost: answered, and no flow row once the failovers are over.
	for i := range ff.answers {
		if ff.errs[i] != nil {
			rep.Unanswered++
			continue
		}
		rep.Answered++
		var n int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem_flow WHERE scope = $1 AND key = $2 AND state = 'done'`,
			scope, failoverFlowKey(i)).Scan(&n); err != nil {
			return nil, fmt.Errorf("read flows: %w", err)
		}
		if n == 0 {
			rep.Lost++
		}
	}
	callsBefore := make(map[string]int)
	ff.provider.mu.Lock()
	for k, n := range ff.provider.calls {
		callsBefore[k] = n
	}
	ff.provider.mu.Unlock()
	retried := make([]flowSoakAnswer, len(ff.answers))
	for i := range ff.answers {
		if ff.errs[i] != nil {
			continue
		}
		res, err := ff.run(ctx, i)
		switch {
		case err != nil:
			rep.RetryFailed++
		case !res.Replayed:
			rep.ReRun++
		}
		retried[i] = res.Value
	}

	payments, err := flowSoakRows(ctx, admin, `SELECT key, id, status, coalesce(charge_id, '') FROM idem_flowsoak_payment WHERE scope = $1`, scope)
	if err != nil {
		return nil, fmt.Errorf("read payments: %w", err)
	}
	ledger, err := flowSoakRows(ctx, admin, `SELECT key, payment_id, status, charge_id FROM idem_flowsoak_ledger WHERE scope = $1`, scope)
	if err != nil {
		return nil, fmt.Errorf("read the ledger: %w", err)
	}
	p := ff.provider
	p.mu.Lock()
	defer p.mu.Unlock()
	rep.Charges = len(p.charges)
	for i := range ff.answers {
		if ff.errs[i] != nil {
			continue
		}
		key := failoverFlowKey(i)
		keys := p.byOp[key]
		switch {
		case len(keys) == 0:
			rep.Uncharged++
		case len(keys) > 1:
			rep.Doubled++
		}
		if len(keys) == 1 && callsBefore[keys[0]] > 0 && p.calls[keys[0]] > callsBefore[keys[0]] {
			rep.SameKey++
		}
		final := retried[i]
		ok := len(keys) == 1 && len(payments[key]) == 1 && len(ledger[key]) == 1
		if ok {
			c := p.charges[keys[0]]
			pay, entry := payments[key][0], ledger[key][0]
			want := flowSoakAnswer{PaymentID: pay.ID, ChargeID: c.ID, Status: c.Status, Amount: failoverFlowAmount(i)}
			ok = final == want && pay == flowSoakRow{pay.ID, c.Status, c.ID} && entry == flowSoakRow{pay.ID, c.Status, c.ID}
		}
		if !ok {
			rep.BadRows++
		}
		if ff.answers[i] != final {
			rep.Wrong++
		}
	}
	return rep, nil
}

// violations says what broke the mode's promises for flows: in both
// modes, one charge per operation, one payment and one ledger row, every
// retry answered; with synchronous replication, also no answered flow
// lost or changed.
func (r *failoverFlowReport) violations(mode string) []string {
	var v []string
	add := func(cond bool, format string, args ...any) {
		if cond {
			v = append(v, fmt.Sprintf(format, args...))
		}
	}
	add(r.Unanswered > 0, "%d flows got no answer", r.Unanswered)
	add(r.Doubled > 0, "%d flows charged twice", r.Doubled)
	add(r.Uncharged > 0, "%d answered flows never charged", r.Uncharged)
	add(r.BadRows > 0, "%d flows without exactly one charge, one payment and one ledger row that agree with the stored answer", r.BadRows)
	add(r.RetryFailed > 0, "the retry of %d flows after the failovers failed", r.RetryFailed)
	if mode == replicationSync {
		add(r.Lost > 0, "%d answered flows lost", r.Lost)
		add(r.ReRun > 0, "%d answered flows ran again", r.ReRun)
		add(r.Wrong > 0, "%d flow answers differ from what was finally stored", r.Wrong)
	}
	return v
}

func (r *failoverFlowReport) print(w io.Writer) {
	fmt.Fprintf(w, "flows (reserve, a call to a provider that honours keys, record): %d started, %d answered, %d runs\n",
		r.Started, r.Answered, r.Attempts)
	fmt.Fprintf(w, "  answered, then lost in a failover: %d; run again by the retry after the failovers: %d, of which %d reached the provider with a key it had charged\n",
		r.Lost, r.ReRun, r.SameKey)
	fmt.Fprintf(w, "  provider charges: %d for %d answered flows (charged twice %d, never %d)\n", r.Charges, r.Answered, r.Doubled, r.Uncharged)
	fmt.Fprintf(w, "  without one charge, one payment and one ledger row that agree: %d; answers != stored: %d; retries failed: %d\n",
		r.BadRows, r.Wrong, r.RetryFailed)
}
