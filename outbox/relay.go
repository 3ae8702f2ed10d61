package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/observer"
)

// Handler delivers one message to its destination. It returns nil once the
// destination has accepted the message, and an error to have the relay try
// again later, or wrapped with [Park] to give up at once.
//
// The relay calls it with no database transaction open, concurrently for
// the messages of one batch and from every relay, so it must be safe for
// concurrent use. It may be called more than once for one message (see
// the package documentation): pass msg.IdempotencyKey to the destination
// so that it can recognise the repeats. Its context ends shortly before
// the message's lease runs out, leaving the relay time to record the
// outcome (a handler that needs longer calls [ExtendLease]), and when the
// relay stops. A call cut short by the lease counts as a failed attempt.
// The context carries the trace context stored by [Enqueue].
type Handler func(ctx context.Context, msg Message) error

// Park wraps err so that the relay parks the message at once instead of
// retrying it: for failures that no retry can fix, such as a destination
// that rejects the payload as invalid. A nil err gives nil.
func Park(err error) error {
	if err == nil {
		return nil
	}
	return &parkError{err}
}

type parkError struct{ err error }

func (e *parkError) Error() string { return "park: " + e.err.Error() }
func (e *parkError) Unwrap() error { return e.err }

// RetryAfter wraps err so that the relay retries the message no sooner
// than d from now, as a destination's Retry-After asks: the delay before
// the next attempt is the longer of d and the relay's own backoff, capped,
// as every delay is, at [Config.MaxRetryDelay]. The attempt counts as a
// failed one. A nil err gives nil; a d that is not positive leaves the
// relay's backoff as it is. [Park] wins over it.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &retryAfterError{err: err, after: d}
}

type retryAfterError struct {
	err   error
	after time.Duration
}

func (e *retryAfterError) Error() string {
	return e.err.Error() + " (retry after " + e.after.String() + ")"
}
func (e *retryAfterError) Unwrap() error { return e.err }

// Relay delivers the outbox's messages to a [Handler], at least once each.
// Run as many relays as needed, in one process or many: they share the
// work through leases and never wait for one another.
type Relay struct {
	db      idem.TxBeginner
	handler Handler
	config  Config // with its defaults, from Config.withDefaults
	logger  *slog.Logger
	running atomic.Bool
	// cancel stops the relay StartRelay started; done is closed once it
	// has stopped.
	cancel context.CancelFunc
	done   chan struct{}

	// direct is db itself when db runs statements on its own (a pool or a
	// connection): each of the relay's statements is then a transaction of
	// its own, one round trip. It is nil for other TxBeginners, on which
	// each statement gets a transaction.
	direct dbsqlc.DBTX

	// connLock is held around every statement when db is one connection
	// (*pgx.Conn, *pgxpool.Conn), which runs one statement at a time; nil
	// otherwise.
	connLock *sync.Mutex

	// listenConfig is where the relay listens for notifications; nil for
	// none.
	listenConfig *pgx.ConnConfig

	tracer  trace.Tracer // nil without a tracer
	metrics *metrics     // nil without a meter

	// Intervals, changed by tests.
	maintainEvery, probeWait, reprobeEvery time.Duration
}

// StartRelay starts a relay that leases messages through db and delivers
// them to handler, configured by config (a nil config means every
// default), in the background, until ctx ends or [Relay.Stop] is called:
// workers start and stop so throughout idem (see [idem.StartPurger]). It
// applies the defaults and checks every field once, here: an invalid
// field gives an [idem.FieldError] that names it, as does a nil db or
// handler, and a connection that is in a transaction is refused with
// [idem.ErrConnInTransaction]; no relay runs then. The relay keeps a copy
// of config; changing config afterwards changes nothing.
//
// db is usually a *pgxpool.Pool. A relay given a *pgx.Conn or a
// *pgxpool.Conn runs its statements on that connection one at a time, each
// a transaction of its own, and must be the connection's only user while
// it runs. A connection in a transaction is refused. If the connection breaks, the relay cannot
// replace it, and logs the failure at every poll until it stops. Any other
// TxBeginner must be safe for concurrent use: the relay begins
// transactions on it from several goroutines.
//
// When db is a *pgxpool.Pool, or [Config.ListenConnConfig] is set, the
// relay also opens one connection of its own while it runs, outside any
// pool (so a pool's hooks, such as AfterConnect, do not run on it), to
// listen for [Notify]; it closes it when it stops. Otherwise the relay
// only polls.
//
// Database errors do not stop a relay: it logs them and tries again at
// the next poll. When it stops, the handlers in flight see their context
// end. It waits for them and records their outcomes: deliveries that
// succeeded are marked delivered, and the others are released at once for
// another relay, without counting the interrupted attempt. A relay that
// stops without recording (a crash, a lost connection) leaves its
// messages leased; other relays deliver them once the lease runs out.
//
// While it runs, the relay also purges delivered messages and, with an
// [idem.Observer], counts its backlog, once a minute each, in a goroutine
// of their own, so that neither delays delivery.
func StartRelay(ctx context.Context, db idem.TxBeginner, handler Handler, config *Config) (*Relay, error) {
	r, err := newRelay(db, handler, config)
	if err != nil {
		return nil, err
	}
	if err := r.checkIdle(); err != nil {
		return nil, err
	}
	ctx, r.cancel = context.WithCancel(ctx)
	r.done = make(chan struct{})
	go func() {
		defer close(r.done)
		_ = r.run(ctx) // it is not running yet, and db was idle
	}()
	return r, nil
}

// Stop stops the relay and waits for it: for its handlers in flight and
// for their outcomes to be recorded (see [StartRelay]).
func (r *Relay) Stop() {
	r.cancel()
	<-r.done
}

// checkIdle refuses a connection that is in a transaction.
func (r *Relay) checkIdle() error {
	if err := dberr.CheckIdle(r.db, "a relay runs statements of its own on it: pass the pool, or a connection that is idle and the relay's alone"); err != nil {
		return fmt.Errorf("outbox: relay: %w", err)
	}
	return nil
}

// newRelay is a relay checked and configured, not started.
func newRelay(db idem.TxBeginner, handler Handler, config *Config) (*Relay, error) {
	if db == nil {
		return nil, &idem.FieldError{Package: "outbox", Field: "StartRelay", Problem: "db must not be nil"}
	}
	if handler == nil {
		return nil, &idem.FieldError{Package: "outbox", Field: "StartRelay", Problem: "handler must not be nil"}
	}
	c, err := config.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Relay{
		db: db, handler: handler, config: c, logger: c.Logger,
		maintainEvery: maintainInterval, probeWait: probeTimeout, reprobeEvery: reprobeInterval,
	}
	switch db := db.(type) {
	case *pgxpool.Pool:
		r.direct = db
		r.listenConfig = db.Config().ConnConfig
	case *pgx.Conn:
		r.direct, r.connLock = db, new(sync.Mutex)
	case *pgxpool.Conn:
		r.direct, r.connLock = db, new(sync.Mutex)
	}
	if c.ListenConnConfig != nil {
		r.listenConfig = c.ListenConnConfig
	}
	if c.Observer != nil {
		tracer, meter := observer.Of(c.Observer)
		r.tracer = tracer
		if meter != nil {
			if r.metrics, err = newMetrics(meter); err != nil {
				return nil, fmt.Errorf("outbox: Config.Observer: %w", err)
			}
		}
	}
	return r, nil
}

// run delivers messages until ctx ends, then returns nil, once its
// handlers in flight have ended and their outcomes are recorded. A relay
// runs once at a time: run returns an error while another call on the
// same relay is running. It may be run again after it returned.
func (r *Relay) run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("outbox: the relay is already running")
	}
	defer r.running.Store(false)
	if err := r.checkIdle(); err != nil {
		return err
	}

	hearing := &hearing{relay: r}
	hearing.start(ctx)
	defer hearing.stop(context.WithoutCancel(ctx)) // after the listener ended
	var background sync.WaitGroup
	defer background.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // before the Wait above: the goroutines end with ctx

	wake := make(chan struct{}, 1)
	if r.listenConfig != nil {
		background.Go(func() { r.listen(ctx, hearing, wake) })
	} else {
		r.logger.InfoContext(ctx, "outbox: the relay has no connection to listen for notifications on, so it only polls; "+
			"set Config.ListenConnConfig to have it listen", "poll_interval", r.config.PollInterval)
	}
	background.Go(func() { r.maintain(ctx) })

	// The outcomes of each batch's last deliveries are recorded by the
	// statement that leases the next batch.
	var unrecorded []result
	for {
		rows, leasedAt, unblocked, err := r.recordAndLease(ctx, unrecorded)
		unrecorded = nil
		if len(rows) > 0 {
			// Even when ctx has ended: the handlers are then not called, and
			// the messages are released by the next round.
			unrecorded = r.deliverBatch(ctx, rows, leasedAt)
			continue
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			r.logger.ErrorContext(ctx, "outbox: lease messages; trying again at the next poll", "error", err)
		} else if unblocked {
			// An ordered message is done: the next one with its key is due
			// now, and no notification announces it.
			continue
		}
		if backoff.SleepOrWake(ctx, r.config.PollInterval, wake) != nil {
			return nil
		}
	}
}

// do runs one statement: on db itself when it is a pool or a connection,
// one at a time on a connection, and in a READ COMMITTED transaction of its
// own on any other TxBeginner.
func (r *Relay) do(ctx context.Context, stmt func(ctx context.Context, q *dbsqlc.Queries) error) error {
	if r.connLock != nil {
		r.connLock.Lock()
		defer r.connLock.Unlock()
		// pgx closes a connection whose statement its context interrupts,
		// and the relay cannot replace a connection it was given: let the
		// statement finish, within recordTimeout.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
		defer cancel()
	}
	if r.direct != nil {
		return stmt(ctx, dbsqlc.New(r.direct))
	}
	return idem.WithTx(ctx, r.db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
		return stmt(ctx, dbsqlc.New(tx))
	})
}
