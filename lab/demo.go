package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
)

// demoSchema is the demo's business table, as an application would have.
const demoSchema = `
CREATE TABLE IF NOT EXISTS idem_demo_payment (
    id           bigserial   PRIMARY KEY,
    scope        text        NOT NULL,
    key          text        NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
)`

type demoPayment struct {
	ID          int64 `json:"id"`
	AmountCents int64 `json:"amount_cents"`
}

type demoStats struct {
	requests, lostAfterCommit, abandoned, replays, mismatches atomic.Int64
	mu                                                        sync.Mutex
	latencies                                                 []time.Duration
}

func runDemo(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "demo", `demo [flags]

Fires a retry storm of payments through idem.Run and checks that none is
lost or doubled. It writes only where it made room for itself: with
DATABASE_URL or PG* variables, a database of its own on that server (a
schema of its own where it may not create databases), dropped at the end;
with neither, a throwaway server from a local PostgreSQL installation, or
one fetched by embedded-postgres.`)
	payments := fs.Int("payments", 1000, "logical payments to make")
	clients := fs.Int("clients", 32, "concurrent clients")
	lose := fs.Float64("lose", 0.3, "chance that a response is lost after the server committed, so the client retries")
	abandon := fs.Float64("abandon", 0.1, "chance that a client times out while the server is still working, and retries")
	twin := fs.Float64("twin", 0.2, "chance that a payment is sent by two clients at once")
	reuse := fs.Float64("reuse", 0.02, "chance that a buggy client reuses a key for another amount")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if *payments < 1 || *clients < 1 {
		return cli.UsageError{Err: errors.New("-payments and -clients must be at least 1")}
	}

	sc, err := openScratch(ctx, stdout, "demo")
	if err != nil {
		return err
	}
	defer sc.Close()
	pool, err := connectTo(ctx, sc.URL, int32(min(*clients+2, 64)))
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		return cli.DatabaseError{Err: err}
	}
	if _, err := pool.Exec(ctx, demoSchema); err != nil {
		return cli.DatabaseError{Err: fmt.Errorf("create demo table: %w", err)}
	}

	scope := fmt.Sprintf("demo-%d", time.Now().UnixNano())
	fmt.Fprintf(stdout, "idem demo: %d payments from %d clients, scope %s\n", *payments, *clients, scope)
	fmt.Fprintf(stdout, "  responses lost after commit: %.0f%%, client timeouts: %.0f%%, twin sends: %.0f%%, key reuse: %.0f%%\n",
		*lose*100, *abandon*100, *twin*100, *reuse*100)

	stats := &demoStats{}
	send := func(key string, amount int64, timeout time.Duration) (idem.Result[demoPayment], error) {
		callCtx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		fp, err := idem.FingerprintJSON(map[string]int64{"amount_cents": amount})
		if err != nil {
			return idem.Result[demoPayment]{}, err
		}
		started := time.Now()
		stats.requests.Add(1)
		res, err := idem.Run(callCtx, pool, scope, key, fp, func(ctx context.Context, tx pgx.Tx) (demoPayment, error) {
			p := demoPayment{AmountCents: amount}
			err := tx.QueryRow(ctx,
				`INSERT INTO idem_demo_payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				scope, key, amount).Scan(&p.ID)
			// The work a real payment does widens every race window.
			time.Sleep(time.Duration(1+rand.IntN(5)) * time.Millisecond)
			return p, err
		}, idem.WithWait(10*time.Second))
		stats.mu.Lock()
		stats.latencies = append(stats.latencies, time.Since(started))
		stats.mu.Unlock()
		return res, err
	}

	// pay is one client's logical payment: retry with the same key until an
	// answer arrives that the client actually receives.
	pay := func(key string, amount int64) (demoPayment, error) {
		for {
			if err := ctx.Err(); err != nil {
				return demoPayment{}, err
			}
			timeout := 30 * time.Second
			if rand.Float64() < *abandon {
				timeout = time.Duration(1+rand.IntN(4)) * time.Millisecond
			}
			res, err := send(key, amount, timeout)
			switch {
			case errors.Is(err, context.DeadlineExceeded), errors.Is(err, idem.ErrInProgress):
				stats.abandoned.Add(1)
				continue
			case err != nil:
				return demoPayment{}, err
			}
			if res.Replayed {
				stats.replays.Add(1)
			}
			if rand.Float64() < *lose {
				stats.lostAfterCommit.Add(1)
				continue
			}
			return res.Value, nil
		}
	}

	type job struct {
		key    string
		amount int64
	}
	jobs := make(chan job)
	var failures atomic.Int64
	var firstErr error
	var errOnce sync.Once
	fail := func(err error) {
		failures.Add(1)
		errOnce.Do(func() { firstErr = err })
	}
	answers := make([]demoPayment, *payments)
	var wg sync.WaitGroup
	started := time.Now()
	for range *clients {
		wg.Go(func() {
			for j := range jobs {
				var twinAnswer demoPayment
				var twinErr error
				var twinWG sync.WaitGroup
				if rand.Float64() < *twin {
					twinWG.Go(func() { twinAnswer, twinErr = pay(j.key, j.amount) })
				}
				got, err := pay(j.key, j.amount)
				twinWG.Wait()
				switch {
				case err != nil:
					fail(err)
					continue
				case twinErr != nil:
					fail(twinErr)
					continue
				case got.AmountCents != j.amount:
					fail(fmt.Errorf("key %s: answered amount %d, sent %d", j.key, got.AmountCents, j.amount))
				case twinAnswer != (demoPayment{}) && twinAnswer != got:
					fail(fmt.Errorf("key %s: twins got different answers %+v and %+v", j.key, got, twinAnswer))
				}
				var i int
				fmt.Sscanf(j.key, "payment-%d", &i)
				answers[i] = got
				if rand.Float64() < *reuse {
					if _, err := send(j.key, j.amount+1, 30*time.Second); errors.Is(err, idem.ErrFingerprintMismatch) {
						stats.mismatches.Add(1)
					} else {
						fail(fmt.Errorf("key %s reused for another amount: %v, want a mismatch", j.key, err))
					}
				}
			}
		})
	}
	for i := range *payments {
		select {
		case jobs <- job{key: fmt.Sprintf("payment-%d", i), amount: int64(100 + i)}:
		case <-ctx.Done():
		}
	}
	close(jobs)
	wg.Wait()
	elapsed := time.Since(started)

	var effects int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_demo_payment WHERE scope = $1`, scope).Scan(&effects); err != nil {
		return cli.DatabaseError{Err: err}
	}
	// Every answer a client accepted must be the payment the table holds.
	var mismatchedAnswers int
	for i, a := range answers {
		var amount int64
		err := pool.QueryRow(ctx, `SELECT amount_cents FROM idem_demo_payment WHERE id = $1 AND scope = $2 AND key = $3`,
			a.ID, scope, fmt.Sprintf("payment-%d", i)).Scan(&amount)
		if err != nil || amount != a.AmountCents {
			mismatchedAnswers++
		}
	}

	slices.Sort(stats.latencies)
	pct := func(p float64) time.Duration {
		return stats.latencies[min(int(p*float64(len(stats.latencies))), len(stats.latencies)-1)].Round(10 * time.Microsecond)
	}
	fmt.Fprintf(stdout, "\nlogical payments:     %d\n", *payments)
	fmt.Fprintf(stdout, "requests sent:        %d (%.1f per payment) in %s\n", stats.requests.Load(),
		float64(stats.requests.Load())/float64(*payments), elapsed.Round(time.Millisecond))
	fmt.Fprintf(stdout, "  responses lost:     %d (retried)\n", stats.lostAfterCommit.Load())
	fmt.Fprintf(stdout, "  timeouts:           %d (retried)\n", stats.abandoned.Load())
	fmt.Fprintf(stdout, "  replays:            %d (answered from the stored response)\n", stats.replays.Load())
	fmt.Fprintf(stdout, "  mismatches:         %d (key reused for another amount, rejected)\n", stats.mismatches.Load())
	fmt.Fprintf(stdout, "effects applied:      %d (payment rows)\n", effects)
	fmt.Fprintf(stdout, "answers != stored:    %d\n", mismatchedAnswers)
	fmt.Fprintf(stdout, "latency per request:  p50 %s  p95 %s  p99 %s  max %s\n", pct(0.50), pct(0.95), pct(0.99), pct(1))

	switch {
	case firstErr != nil:
		return fmt.Errorf("%d payments failed, first: %w", failures.Load(), firstErr)
	case effects != int64(*payments):
		return fmt.Errorf("VIOLATION: %d effects for %d logical payments", effects, *payments)
	case mismatchedAnswers != 0:
		return fmt.Errorf("VIOLATION: %d answers differ from the stored payment", mismatchedAnswers)
	}
	fmt.Fprintln(stdout, "\nOK: every payment applied exactly once, every answer matches what was stored.")
	return nil
}
