package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// The soak's load: its clients make the payments, each retrying until it
// is answered, and count how their attempts failed.

// payAll runs the clients until every payment is started, or Duration has
// passed, and every started payment has ended. It returns each payment's
// answer or error, and how many were started.
//
// When r.keepPaying is set, payments go on being started past Payments
// while it returns true, up to maxSoakPayments. When r.beforeStart is set,
// a client calls it before it starts a payment, and stops if it returns
// false.
func (r *soakRun) payAll(ctx context.Context, stdout io.Writer) ([]soakPayment, []error, int) {
	size := r.cfg.Payments
	if r.keepPaying != nil {
		size = maxSoakPayments
	}
	answers := make([]soakPayment, size)
	errs := make([]error, size)
	var done atomic.Int64
	var mu sync.Mutex
	next := 0
	// start returns the index of the next payment to make, if one is
	// still to be started: one decision at a time, so that the payments
	// started are 0 to next-1 whenever keepPaying turns false.
	start := func() (int, bool) {
		mu.Lock()
		defer mu.Unlock()
		if next >= size || (next >= r.cfg.Payments && (r.keepPaying == nil || !r.keepPaying())) {
			return 0, false
		}
		next++
		return next - 1, true
	}
	var stopStarting time.Time
	if r.cfg.Duration > 0 {
		stopStarting = time.Now().Add(r.cfg.Duration)
	}

	progressCtx, stopProgress := context.WithCancel(ctx)
	var progress sync.WaitGroup
	defer progress.Wait()
	defer stopProgress()
	started := time.Now()
	progress.Go(func() {
		every(progressCtx, soakProgressEvery, func() {
			fmt.Fprintf(stdout, "  %s: %d payments answered, %d attempts\n",
				time.Since(started).Round(time.Second), done.Load(), r.attempts.Load())
		})
	})

	var clients sync.WaitGroup
	for range r.cfg.Clients {
		clients.Go(func() {
			for ctx.Err() == nil && (stopStarting.IsZero() || time.Now().Before(stopStarting)) {
				if r.beforeStart != nil && !r.beforeStart(ctx) {
					return
				}
				i, ok := start()
				if !ok {
					return
				}
				var res idem.Result[soakPayment]
				res, errs[i] = r.pay(ctx, i)
				answers[i] = res.Value
				if errs[i] == nil && r.onAnswer != nil {
					r.onAnswer(i)
				}
				done.Add(1)
			}
		})
	}
	clients.Wait()
	return answers[:next], errs[:next], next
}

// pay makes logical payment i: it retries with the same key and request
// until an attempt answers, an error says retrying cannot help, or the
// payment's bounds run out.
func (r *soakRun) pay(ctx context.Context, i int) (idem.Result[soakPayment], error) {
	key := soakKey(i)
	amount := soakAmount(i)
	fp, err := idem.FingerprintJSON(soakRequest{AmountCents: amount})
	if err != nil {
		return idem.Result[soakPayment]{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PaymentTimeout)
	defer cancel()

	var lastErr error
	// hit says whether a fault tied to writes hit the payment's last
	// attempt: the next one is spared.
	hit := false
	for attempt := 1; attempt <= soakMaxAttempts; attempt++ {
		var res idem.Result[soakPayment]
		res, hit, err = r.attempt(ctx, key, amount, fp, hit)
		if err == nil {
			if res.Replayed {
				r.replayed.Add(1)
			} else {
				r.executed.Add(1)
			}
			return res, nil
		}
		lastErr = err
		if isDefinitive(err) {
			return idem.Result[soakPayment]{}, fmt.Errorf("%s: %w", key, err)
		}
		// Back off as a real client would, so that a server that is down
		// is not hammered.
		ceiling := min(time.Millisecond<<min(attempt-1, 10), soakRetryDelayMax)
		if sleep(ctx, rand.N(ceiling)+1) != nil {
			break
		}
	}
	return idem.Result[soakPayment]{}, fmt.Errorf("%s: no answer within %s and %d attempts, last error: %w",
		key, r.cfg.PaymentTimeout, soakMaxAttempts, lastErr)
}

// soakKey and soakAmount are logical payment i's key and amount.
func soakKey(i int) string   { return fmt.Sprintf("payment-%d", i) }
func soakAmount(i int) int64 { return int64(100 + i) }

// attempt is one call of idem.Run, possibly under a deadline short enough
// that the client walks away from it mid-flight, or with a fault tied to
// writes injected in its transaction, unless spare. It reports whether
// such a fault was injected.
func (r *soakRun) attempt(ctx context.Context, key string, amount int64, fp []byte, spare bool) (idem.Result[soakPayment], bool, error) {
	timeout := soakAttemptTimeout
	abandon := rand.Float64() < r.cfg.TimeoutRate
	if abandon {
		timeout = time.Millisecond + rand.N(soakShortTimeoutMax-time.Millisecond)
	}
	attemptCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	var opts []idem.Option
	if rand.IntN(2) == 0 {
		// Half the attempts look the key up first, so that both of Run's
		// paths meet the faults.
		opts = append(opts, idem.WithLookupFirst())
	}
	r.attempts.Add(1)
	injected := false
	res, err := idem.Run(attemptCtx, r.pool, r.scope, key, fp, func(ctx context.Context, tx pgx.Tx) (soakPayment, error) {
		// Run may call fn again in the same attempt; one fault is enough.
		fault := r.dueFault(r.writes.Add(1), spare || injected)
		// Before the write, the claim alone is at stake; after it, the
		// payment's row too.
		before := rand.IntN(2) == 0
		if fault != noFault && before {
			injected = r.inject(ctx, tx, fault)
		}
		p := soakPayment{Key: key, AmountCents: amount}
		err := tx.QueryRow(ctx,
			`INSERT INTO idem_soak_payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			r.scope, key, amount).Scan(&p.ID)
		if err != nil {
			return p, err
		}
		if fault != noFault && !before {
			injected = r.inject(ctx, tx, fault)
		}
		if r.afterWrite != nil {
			if err := r.afterWrite(ctx, tx, p); err != nil {
				return p, err
			}
		}
		// The work a real payment does before it commits keeps the
		// transaction open, so that the chaos hits some mid-way.
		return p, sleep(ctx, rand.N(2*time.Millisecond))
	}, opts...)
	if deadline, _ := attemptCtx.Deadline(); time.Now().After(deadline) {
		r.noteLate(time.Since(deadline))
	}
	if err != nil {
		timedOut := abandon && errors.Is(attemptCtx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
		if timedOut {
			r.timedOut.Add(1)
		}
		r.recordFailure(failureKind(err, timedOut), err)
	}
	return res, injected, err
}

// noteLate records that an attempt returned late past its deadline.
func (r *soakRun) noteLate(late time.Duration) {
	for {
		longest := r.longestLate.Load()
		if int64(late) <= longest || r.longestLate.CompareAndSwap(longest, int64(late)) {
			return
		}
	}
}

func (r *soakRun) recordFailure(kind string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures[kind]++
	if _, ok := r.samples[kind]; !ok {
		r.samples[kind] = err.Error()
	}
}

// failureKind names the way an attempt failed, for the report.
func failureKind(err error, timedOut bool) string {
	var pgErr *pgconn.PgError
	switch {
	case timedOut:
		return "abandoned by the client's deadline"
	case errors.Is(err, idem.ErrInProgress):
		return "key held by an earlier attempt still in flight"
	case errors.Is(err, idem.ErrReadOnly):
		return "read-only: the connection reached a standby"
	case errors.As(err, &pgErr) && pgErr.Code == "57P01":
		return "backend terminated, or server shut down (SQLSTATE 57P01)"
	case errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "57"):
		return "server shutting down or starting (SQLSTATE " + pgErr.Code + ")"
	case errors.As(err, &pgErr):
		return "server error (SQLSTATE " + pgErr.Code + ")"
	case errors.As(err, new(*pgconn.ConnectError)):
		return "could not connect"
	case errors.Is(err, context.DeadlineExceeded):
		return "attempt deadline of " + soakAttemptTimeout.String()
	}
	return "connection lost"
}

// isDefinitive reports whether retrying a payment that failed with err
// cannot help: the request itself is wrong, or the server rejected what
// was sent. Those are bugs, in the soak or in idem, not faults.
func isDefinitive(err error) bool {
	for _, target := range []error{idem.ErrFingerprintMismatch, idem.ErrInvalidKey, idem.ErrInvalidScope,
		idem.ErrInvalidOption, idem.ErrResponseTooLarge, idem.ErrResponseNotStorable} {
		if errors.Is(err, target) {
			return true
		}
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// Data exceptions, integrity violations, syntax or access errors,
		// internal errors.
		switch pgErr.Code[:2] {
		case "22", "23", "42", "XX":
			return true
		}
	}
	return false
}

// sleep waits for d or until ctx ends, and then returns ctx's error.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
