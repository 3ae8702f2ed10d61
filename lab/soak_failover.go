package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
	"github.com/pgidem/idem/outbox"
)

// The failover soak: payments through a connection string that names a
// primary and its standby, while the primary is killed, the standby
// promoted and the old primary rebuilt as the new standby, several times.
// Each payment also enqueues a receipt, which a relay delivers through the
// same failovers to a consumer that applies it with idem.Once.

// Defaults and bounds of the failover mode.
const (
	defaultFailoverPayments = 20_000
	defaultFailovers        = 5
	defaultFailoverFlows    = 1000
	maxFailovers            = 100
	// soakLateBound is how long after its deadline an attempt may return
	// before the failover soak calls it a violation: idem's bound is about
	// a second, and a loaded machine adds to it.
	soakLateBound = 5 * time.Second
	// soakDeliveryTimeout bounds the wait, after the payments, for the
	// relay to deliver every receipt.
	soakDeliveryTimeout = 2 * time.Minute
	// soakDestination is the receipts' outbox destination.
	soakDestination = "soak.receipt"
)

// soakReceiptSchema is the consumer's table: one row per receipt applied.
// It has no unique constraint, so that a receipt applied twice would show.
const soakReceiptSchema = `
CREATE TABLE IF NOT EXISTS idem_soak_receipt (
    id         bigserial PRIMARY KEY,
    scope      text      NOT NULL,
    key        text      NOT NULL,
    payment_id bigint    NOT NULL
)`

// failoverRun is one failover soak while it runs.
type failoverRun struct {
	*soakRun
	cluster *cluster
	// consumer is the pool of the relay and of the consumer it delivers to.
	consumer *pgxpool.Pool
	// answeredAt is when each payment was answered, in Unix nanoseconds.
	answeredAt []atomic.Int64
	// done is set once the failovers are over and the last primary has
	// taken its share of payments: the clients then stop starting more.
	done      atomic.Bool
	failovers []failover
	// degraded is set from a kill until the old primary streams again as
	// the new standby; windowStarts counts the payments started since the
	// kill, at most windowBudget of which may start until then.
	degraded                   atomic.Bool
	windowStarts, windowBudget atomic.Int64

	mu sync.Mutex
	// deliveries counts the relay's calls of the consumer, and applied
	// the calls in which idem.Once ran and committed, by payment key.
	deliveries, applied map[string]int
}

// failoverSoak runs a failover soak on a primary and a standby of its own,
// in cfg.Failover's replication mode. The error is nil only when the
// mode's guarantees held (see failoverReport.violations).
func failoverSoak(ctx context.Context, cfg soakConfig, stdout io.Writer) (*failoverReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, cli.UsageError{Err: err}
	}
	stdout = &lockedWriter{w: stdout}
	fmt.Fprintf(stdout, "idem soak -failover %s: starting a primary and a standby of their own (DATABASE_URL and PG* are not used)\n", cfg.Failover)
	cl, err := startCluster(ctx, cfg.Failover, cfg.noFsync)
	if err != nil {
		return nil, cli.DatabaseError{Err: fmt.Errorf("start a primary and a standby from a local PostgreSQL installation: %w", err)}
	}
	defer func() {
		if err := cl.close(); err != nil {
			fmt.Fprintf(stdout, "could not remove the throwaway servers: %v\n", err)
			return
		}
		fmt.Fprintln(stdout, "removed the throwaway servers and their directories")
	}()

	admin, err := connectTo(ctx, cl.url(), 4)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	if err := createFailoverTables(ctx, admin); err != nil {
		return nil, err
	}
	f := &failoverRun{
		soakRun: &soakRun{
			cfg: cfg, scope: "soak-" + randomSuffix(), admin: admin,
			failures: make(map[string]int64), samples: make(map[string]string),
		},
		cluster:    cl,
		answeredAt: make([]atomic.Int64, maxSoakPayments),
		deliveries: make(map[string]int),
		applied:    make(map[string]int),
	}
	f.afterWrite = f.enqueue
	f.onAnswer = func(i int) { f.answeredAt[i].Store(time.Now().UnixNano()) }
	f.keepPaying = func() bool { return !f.done.Load() }
	f.beforeStart = f.mayStart
	// The flows' clients share the payments' pool, with connections of
	// their own in it: one connection less to open on a loaded machine.
	if f.pool, err = connectTo(ctx, cl.url(), int32(cfg.Clients+2*failoverFlowClients)); err != nil {
		return nil, err
	}
	defer f.pool.Close()
	if f.consumer, err = connectTo(ctx, cl.url(), 8); err != nil {
		return nil, err
	}
	defer f.consumer.Close()

	fmt.Fprintf(stdout, "idem soak -failover %s: at least %d payments from %d clients through %d failovers, scope %s\n",
		cfg.Failover, cfg.Payments, cfg.Clients, cfg.Failovers, f.scope)
	fmt.Fprintf(stdout, "  on %s\n", cl.describe())
	fmt.Fprintf(stdout, "  clients connect to both with target_session_attrs=read-write; each payment enqueues a receipt, which a relay delivers to a consumer that applies it with idem.Once\n")

	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone, err := f.startRelay(relayCtx)
	if err != nil {
		stopRelay()
		return nil, err
	}
	defer func() { stopRelay(); <-relayDone }()

	flows := newFailoverFlows(f, f.pool)
	var flowing sync.WaitGroup
	if cfg.Flows > 0 {
		fmt.Fprintf(stdout, "  beside them, at least %d flows from %d clients: reserve, a charge at a provider that honours keys, record\n", cfg.Flows, failoverFlowClients)
		flowing.Go(func() { flows.runAll(ctx) })
	}

	paying := make(chan struct{})
	var loopErr error
	var loop sync.WaitGroup
	loop.Go(func() { loopErr = f.failOver(ctx, paying, stdout) })
	started := time.Now()
	answers, errs, operations := f.payAll(ctx, stdout)
	elapsed := time.Since(started)
	close(paying)
	loop.Wait()
	flowing.Wait()
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("interrupted after %d payments: %w", operations, err)
	}

	rep := &failoverReport{
		soakReport: soakReport{
			Operations: operations, Attempts: f.attempts.Load(), Executed: f.executed.Load(),
			Replayed: f.replayed.Load(), Writes: f.writes.Load(), Failures: f.failures,
			Elapsed: elapsed, LongestLate: time.Duration(f.longestLate.Load()),
		},
		Mode: cfg.Failover, Requested: cfg.Failovers, Failovers: f.failovers, FailoverErr: loopErr,
	}
	// What the failovers lost, before any retry after them could run a
	// lost payment again.
	if err := f.checkLost(ctx, answers, errs, rep); err != nil {
		return rep, cli.DatabaseError{Err: err}
	}
	verified, verifyErrs := f.retryAll(ctx, answers, errs)
	if cfg.Flows > 0 {
		if rep.Flows, err = flows.check(ctx, admin); err != nil {
			return rep, cli.DatabaseError{Err: err}
		}
	}
	if err := f.waitDelivered(ctx, rep); err != nil {
		return rep, cli.DatabaseError{Err: err}
	}
	stopRelay()
	<-relayDone
	if err := f.check(ctx, answers, errs, verified, verifyErrs, rep); err != nil {
		return rep, cli.DatabaseError{Err: err}
	}
	rep.print(stdout, cfg.Verbose, f.samples)
	if v := rep.violations(); v != nil {
		return rep, v
	}
	fmt.Fprintf(stdout, "\nOK: %s\n", rep.verdict())
	return rep, nil
}

// createFailoverTables applies idem's migrations and creates the soak's
// tables on the primary.
func createFailoverTables(ctx context.Context, admin *pgxpool.Pool) error {
	sqlDB := stdlib.OpenDBFromPool(admin)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		return cli.DatabaseError{Err: err}
	}
	for _, ddl := range append([]string{soakSchema, soakIndex, soakReceiptSchema}, flowSoakSchema...) {
		if _, err := admin.Exec(ctx, ddl); err != nil {
			return cli.DatabaseError{Err: fmt.Errorf("create the soak's tables: %w", err)}
		}
	}
	return nil
}

// failOver kills the primary and fails over cfg.Failovers times, each
// after a number of answers drawn between half and all of an equal share
// of -payments, counted from when the last failover's standby was back:
// paced by the payments' progress, not by the clock. From each kill until
// then, a quarter of a share may start (mayStart). The kills alternate
// between SIGKILL of the postmaster and an immediate shutdown. It then
// waits for half a share more on the last primary, and ends the payments.
func (f *failoverRun) failOver(ctx context.Context, paying <-chan struct{}, stdout io.Writer) error {
	defer f.done.Store(true)
	share := int64(max(f.cfg.Payments/(f.cfg.Failovers+1), 4))
	f.windowBudget.Store(share / 4)
	for k := range f.cfg.Failovers {
		if !f.waitAnswers(ctx, f.answered()+share/2+rand.Int64N(share/2+1), paying) {
			return nil
		}
		var sig os.Signal = syscall.SIGKILL
		if k%2 == 1 {
			sig = syscall.SIGQUIT
		}
		ev := failover{AnsweredBefore: f.answered()}
		f.windowStarts.Store(0)
		f.degraded.Store(true)
		answering := make(chan time.Duration, 1)
		err := f.cluster.failover(ctx, sig, &ev, func() {
			n := f.answered()
			go func() {
				if f.waitAnswers(ctx, n+1, paying) {
					answering <- time.Since(ev.Killed)
				} else {
					answering <- -1
				}
			}()
		})
		f.degraded.Store(false)
		if ev.Promoted > 0 {
			ev.Answering = <-answering
		}
		f.failovers = append(f.failovers, ev)
		fmt.Fprintf(stdout, "  failover %d: %s\n", k+1, ev.describe())
		if err != nil {
			return fmt.Errorf("failover %d: %w", k+1, err)
		}
	}
	f.waitAnswers(ctx, f.answered()+share/2, paying)
	return nil
}

// mayStart lets a client start a payment, unless a quarter of a share of
// payments has started since the last kill and the old primary does not
// stream again yet: payments then wait for it. The new primary takes
// payments without a standby, but not many, so that a slow rebuild (a
// base backup) does not fill the run with them.
func (f *failoverRun) mayStart(ctx context.Context) bool {
	for f.degraded.Load() && f.windowStarts.Add(1) > f.windowBudget.Load() {
		if sleep(ctx, 5*time.Millisecond) != nil {
			return false
		}
	}
	return true
}

// answered is the number of payments answered so far.
func (f *failoverRun) answered() int64 { return f.executed.Load() + f.replayed.Load() }

// waitAnswers waits until n payments are answered, and reports whether
// they were before the payments ended.
func (f *failoverRun) waitAnswers(ctx context.Context, n int64, paying <-chan struct{}) bool {
	for f.answered() < n {
		select {
		case <-ctx.Done():
			return false
		case <-paying:
			return false
		case <-time.After(2 * time.Millisecond):
		}
	}
	return true
}

// enqueue enqueues payment p's receipt in its transaction.
func (f *failoverRun) enqueue(ctx context.Context, tx pgx.Tx, p soakPayment) error {
	payload, err := json.Marshal(p)
	if err != nil {
		return err
	}
	_, err = outbox.Enqueue(ctx, tx, outbox.Entry{Scope: f.scope, Key: p.Key, Destination: soakDestination, Payload: payload})
	return err
}

// startRelay starts a relay of the receipts to consume, until ctx ends;
// the returned channel is closed when it has stopped. Its leases and
// retries are short, so that a receipt whose lease a failover orphaned
// is delivered within seconds.
func (f *failoverRun) startRelay(ctx context.Context) (<-chan struct{}, error) {
	relay, err := outbox.StartRelay(ctx, f.consumer, f.consume, &outbox.Config{
		BatchSize:     16,
		Destinations:  []string{soakDestination},
		LeaseDuration: 5 * time.Second,
		MaxAttempts:   1_000_000,
		RetryDelay:    100 * time.Millisecond,
		MaxRetryDelay: time.Second,
		PollInterval:  100 * time.Millisecond,
		// Its failures during a failover are expected: the check says
		// whether every receipt got through.
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		relay.Stop()
	}()
	return done, nil
}

// consume is the consumer: it applies a receipt once, with idem.Once on
// the message's idempotency key, beside its own write.
func (f *failoverRun) consume(ctx context.Context, msg outbox.Message) error {
	var p soakPayment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return outbox.Park(err)
	}
	f.mu.Lock()
	f.deliveries[msg.Key]++
	f.mu.Unlock()
	var ran bool
	err := idem.WithTx(ctx, f.consumer, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		ran, err = idem.Once(ctx, tx, f.scope+"-receipts", msg.IdempotencyKey, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO idem_soak_receipt (scope, key, payment_id) VALUES ($1, $2, $3)`, f.scope, msg.Key, p.ID)
			return err
		})
		return err
	})
	if err != nil {
		return err
	}
	if ran {
		f.mu.Lock()
		f.applied[msg.Key]++
		f.mu.Unlock()
	}
	return nil
}

// retryAll retries every answered payment once more with its key, as a
// client that lost its answer would, after the failovers: a payment that a
// failover lost runs again, with a new answer; the others replay theirs.
func (f *failoverRun) retryAll(ctx context.Context, answers []soakPayment, errs []error) ([]idem.Result[soakPayment], []error) {
	results := make([]idem.Result[soakPayment], len(answers))
	retryErrs := make([]error, len(answers))
	var next atomic.Int64
	var workers sync.WaitGroup
	for range f.cfg.Clients {
		workers.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(answers) {
					return
				}
				if errs[i] == nil {
					results[i], retryErrs[i] = f.pay(ctx, i)
				}
			}
		})
	}
	workers.Wait()
	return results, retryErrs
}

// waitDelivered waits until the relay delivered every receipt, and counts
// those parked.
func (f *failoverRun) waitDelivered(ctx context.Context, rep *failoverReport) error {
	ctx, cancel := context.WithTimeout(ctx, soakDeliveryTimeout)
	defer cancel()
	for {
		var pending, parked int
		err := f.admin.QueryRow(ctx, `
			SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'parked')
			FROM outbox_message WHERE scope = $1`, f.scope).Scan(&pending, &parked)
		if err != nil {
			return fmt.Errorf("count the receipts not delivered: %w", err)
		}
		rep.Parked, rep.Pending = parked, pending
		if pending == 0 {
			return nil
		}
		if sleep(ctx, 100*time.Millisecond) != nil {
			// Reported as receipts not delivered.
			return nil
		}
	}
}
