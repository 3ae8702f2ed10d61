package outbox

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/guard"
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

// Config is how a [Relay] delivers. The zero value of every field means its
// default; negative values are rejected.
type Config struct {
	// BatchSize is the most messages one relay leases in one round. It
	// delivers them concurrently, records their outcomes together in one
	// statement (those of handlers that return within a few milliseconds of
	// one another; a slow handler does not hold back the others' outcomes),
	// and leases the next batch once all of them are done.
	//
	// It is also the most handler calls one relay makes at once: each
	// relay calls the handler for up to BatchSize messages concurrently,
	// each in a goroutine of its own, so n relays make up to n*BatchSize
	// concurrent calls to the destinations. Larger batches cost fewer
	// statements and commits per message (with a no-op handler, batches of
	// 10 deliver below the rate at which the same server commits bare
	// one-row inserts, and batches of 50 above it; see the README); smaller
	// ones suit a destination that takes few concurrent calls, and leave
	// fewer messages to wait out their lease after a crash. Defaults to 50.
	BatchSize int

	// Destinations limits the relay to messages for these destinations, so
	// that each destination can have relays (and handlers) of its own.
	// Defaults to every destination.
	Destinations []string

	// LeaseDuration is how long a leased message is withheld from other
	// relays. The handler's context ends a tenth of it (at most 5s) before
	// it runs out, so that the relay can record the outcome while the lease
	// still holds, and a relay that crashed leaves its messages to others
	// once it has: choose it longer than most deliveries take, and short
	// enough to wait out after a crash. A handler that needs longer calls
	// [ExtendLease]. Every duration is accepted, up to
	// math.MaxInt64 (about 292 years) for a lease that does not run out in
	// practice. Defaults to 1m.
	LeaseDuration time.Duration

	// MaxAttempts is how many attempts a message gets before it is parked.
	// A message is parked after its MaxAttempts-th attempt fails, or once
	// that attempt's lease runs out without an outcome (its relay crashed).
	// Attempts that a stopping relay interrupts are not counted. Defaults to
	// 20.
	MaxAttempts int

	// RetryDelay is the delay after a message's first failed attempt. It
	// doubles with each further failure, up to MaxRetryDelay, and each delay
	// is drawn at random between half and all of that, so that messages
	// that failed together do not retry together. Defaults to 1s.
	RetryDelay time.Duration

	// MaxRetryDelay caps the delay between two attempts of a message. With
	// the defaults, a message that keeps failing is retried for four to
	// eight hours before it is parked. Defaults to 1h.
	MaxRetryDelay time.Duration

	// PollInterval is how long an idle relay waits before it looks for due
	// messages again. It bounds the delivery delay of messages that no
	// notification announces (see [Notify]) and of retries. Defaults to 1s.
	PollInterval time.Duration

	// DeliveredRetention is how long delivered messages stay in the outbox
	// before the relay purges them (only those to its Destinations, when
	// set), once a minute, in batches of 1,000, in a goroutine of its own,
	// so that purging never holds up delivery. Parked messages are never
	// purged. math.MaxInt64 keeps them for
	// as long as a time.Duration reaches, about 292 years. Defaults to 24h.
	DeliveredRetention time.Duration

	// ListenConnConfig is where the relay opens its connection to listen
	// for [Notify]: a direct connection to the database, for relays whose
	// db goes through a pooler in transaction mode (PgBouncer's
	// pool_mode=transaction), which does not pass notifications on (and
	// keeps the LISTEN that a relay sends through it on one of its server
	// connections, where later notifications arrive for no client). Each
	// relay opens one such connection while it runs. Defaults to the
	// pool's connection settings when db is a *pgxpool.Pool, and to no
	// listening connection otherwise: the relay then only polls.
	ListenConnConfig *pgx.ConnConfig

	// Observer records the relay's deliveries through the same
	// OpenTelemetry providers as idem's calls: a span per delivery, counts
	// by outcome, latency, backlog, and whether the relay hears
	// notifications (see the package documentation for the names).
	// Defaults to none.
	Observer *idem.Observer

	// Logger receives the relay's failures: failed and parked deliveries,
	// and database errors, after which the relay keeps trying. Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// Defaults of the [Config] fields.
const (
	defaultBatchSize          = 50
	defaultLeaseDuration      = time.Minute
	defaultMaxAttempts        = 20
	defaultRetryDelay         = time.Second
	defaultMaxRetryDelay      = time.Hour
	defaultPollInterval       = time.Second
	defaultDeliveredRetention = 24 * time.Hour
)

const (
	// recordTimeout bounds the statements that record outcomes after the
	// relay's context ended, so that a stopping relay records what it knows
	// but a dead database cannot hold it forever. It also caps the part of
	// a lease kept back from the handler for recording its outcome.
	recordTimeout = 5 * time.Second

	// purgeInterval is how often a running relay purges delivered messages
	// and counts its backlog for its metrics.
	purgeInterval = time.Minute

	// recordLinger is how long an outcome waits for the outcomes of other
	// handlers of its batch, to be recorded in the same statement.
	recordLinger = 5 * time.Millisecond

	// probeTimeout is how long a relay waits for its own notification to
	// reach its listening connection before it concludes that
	// notifications do not reach it; reprobeInterval is how long it then
	// waits before it tries again.
	probeTimeout    = 5 * time.Second
	reprobeInterval = time.Minute

	// purgeBatch is how many messages one purge transaction deletes.
	purgeBatch = 1000

	// maxErrorText bounds the error text stored with a failed message.
	maxErrorText = 2000
)

// Relay delivers the outbox's messages to a [Handler], at least once each.
// Run as many relays as needed, in one process or many: they share the
// work through leases and never wait for one another.
type Relay struct {
	db      idem.TxBeginner
	handler Handler
	config  Config
	logger  *slog.Logger
	running atomic.Bool

	// direct is db itself when db runs statements on its own (a pool or a
	// connection): each of the relay's statements is then a transaction of
	// its own, one round trip. It is nil for other TxBeginners, on which
	// each statement gets a transaction.
	direct dbsqlc.DBTX

	// conn is held around every statement when db is one connection
	// (*pgx.Conn, *pgxpool.Conn), which runs one statement at a time.
	conn *sync.Mutex

	// listenConfig is where the relay listens for notifications; nil for
	// none.
	listenConfig *pgx.ConnConfig

	tracer  trace.Tracer
	metrics *metrics

	// Intervals, changed by tests.
	purgeEvery, probeWait, reprobeEvery time.Duration
}

// NewRelay returns a relay that leases messages through db and delivers
// them to handler. A nil config means every default.
//
// db is usually a *pgxpool.Pool. A relay given a *pgx.Conn or a
// *pgxpool.Conn runs its statements on that connection one at a time, each
// a transaction of its own, and must be the connection's only user while
// it runs: Run refuses a connection that is in a transaction, with
// [idem.ErrConnInTransaction]. If the connection breaks, the relay cannot
// replace it, and logs the failure at every poll until it stops. Any other
// TxBeginner must be safe for concurrent use: the relay begins
// transactions on it from several goroutines.
//
// When db is a *pgxpool.Pool, or [Config.ListenConnConfig] is set, the
// relay also opens one connection of its own while it runs, outside any
// pool (so a pool's hooks, such as AfterConnect, do not run on it), to
// listen for [Notify]; it closes it when Run returns. Otherwise the relay
// only polls.
//
// An invalid config gives [idem.ErrInvalidOption].
func NewRelay(db idem.TxBeginner, handler Handler, config *Config) (*Relay, error) {
	if db == nil || handler == nil {
		return nil, fmt.Errorf("%w: a relay needs a database and a handler", idem.ErrInvalidOption)
	}
	c := Config{}
	if config != nil {
		c = *config
		c.Destinations = append([]string(nil), config.Destinations...)
	}
	for _, field := range []struct {
		name  string
		value *time.Duration
		def   time.Duration
	}{
		{"LeaseDuration", &c.LeaseDuration, defaultLeaseDuration},
		{"RetryDelay", &c.RetryDelay, defaultRetryDelay},
		{"MaxRetryDelay", &c.MaxRetryDelay, defaultMaxRetryDelay},
		{"PollInterval", &c.PollInterval, defaultPollInterval},
		{"DeliveredRetention", &c.DeliveredRetention, defaultDeliveredRetention},
	} {
		// Every non-negative duration fits PostgreSQL's interval, whose
		// microseconds are an int64 too, and keeps now() plus or minus it
		// well within timestamptz's range: there is no upper bound to check.
		if *field.value < 0 {
			return nil, fmt.Errorf("%w: %s must not be negative, got %s", idem.ErrInvalidOption, field.name, *field.value)
		}
		if *field.value == 0 {
			*field.value = field.def
		}
	}
	for _, field := range []struct {
		name  string
		value *int
		def   int
	}{
		{"BatchSize", &c.BatchSize, defaultBatchSize},
		{"MaxAttempts", &c.MaxAttempts, defaultMaxAttempts},
	} {
		if *field.value < 0 || *field.value > math.MaxInt32 {
			return nil, fmt.Errorf("%w: %s must be between 0 and %d, got %d", idem.ErrInvalidOption, field.name, math.MaxInt32, *field.value)
		}
		if *field.value == 0 {
			*field.value = field.def
		}
	}
	if c.RetryDelay > c.MaxRetryDelay {
		return nil, fmt.Errorf("%w: RetryDelay %s exceeds MaxRetryDelay %s", idem.ErrInvalidOption, c.RetryDelay, c.MaxRetryDelay)
	}
	for _, d := range c.Destinations {
		if err := guard.CheckIdentifier(d); err != nil {
			return nil, fmt.Errorf("%w: destination %q: %s", idem.ErrInvalidOption, d, err)
		}
	}
	if c.Destinations == nil {
		c.Destinations = []string{} // nil would be sent as NULL
	}
	logger := c.Logger
	if logger == nil {
		logger = slog.Default()
	}
	r := &Relay{
		db: db, handler: handler, config: c, logger: logger,
		purgeEvery: purgeInterval, probeWait: probeTimeout, reprobeEvery: reprobeInterval,
	}
	switch db := db.(type) {
	case *pgxpool.Pool:
		r.direct = db
		r.listenConfig = db.Config().ConnConfig
	case *pgx.Conn:
		r.direct, r.conn = db, new(sync.Mutex)
	case *pgxpool.Conn:
		r.direct, r.conn = db, new(sync.Mutex)
	}
	if c.ListenConnConfig != nil {
		r.listenConfig = c.ListenConnConfig.Copy()
	}
	if c.Observer != nil {
		tracer, meter := observer.Of(c.Observer)
		r.tracer = tracer
		if meter != nil {
			var err error
			if r.metrics, err = newMetrics(meter); err != nil {
				return nil, fmt.Errorf("outbox: observer: %w", err)
			}
		}
	}
	return r, nil
}

// Run delivers messages until ctx ends, then returns nil. Database errors
// do not stop it: it logs them and tries again at the next poll. A
// connection that is in a transaction (see [NewRelay]) is refused at once.
//
// When ctx ends, the handlers in flight see their context end too. Run
// waits for them and records their outcomes before it returns: deliveries
// that succeeded are marked delivered, and the others are released at once
// for another relay, without counting the interrupted attempt. A relay
// that stops without recording (a crash, a lost connection) leaves its
// messages leased; other relays deliver them once the lease runs out.
//
// While it runs, the relay also purges delivered messages and, with an
// [idem.Observer], counts its backlog, once a minute each, in a goroutine
// of their own, so that neither delays delivery.
//
// A relay runs once at a time: Run returns an error while another call on
// the same relay is running. It may be run again after it returned.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("outbox: the relay is already running")
	}
	defer r.running.Store(false)
	if err := guard.CheckIdle(r.db, "a relay runs statements of its own on it: pass the pool, or a connection that is idle and the relay's alone"); err != nil {
		return fmt.Errorf("outbox: relay: %w", err)
	}

	notes := &notifications{relay: r}
	notes.start(ctx)
	defer notes.stop(context.WithoutCancel(ctx)) // after the listener ended
	var background sync.WaitGroup
	defer background.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // before the Wait above: the goroutines end with ctx

	wake := make(chan struct{}, 1)
	if r.listenConfig != nil {
		background.Go(func() { r.listen(ctx, notes, wake) })
	} else {
		r.logger.InfoContext(ctx, "outbox: the relay has no connection to listen for notifications on, so it only polls; "+
			"set Config.ListenConnConfig to have it listen", "poll_interval", r.config.PollInterval)
	}
	background.Go(func() { r.maintain(ctx) })

	// The outcomes of each batch's last deliveries are recorded by the
	// statement that leases the next batch.
	var carry []result
	for {
		rows, leasedAt, unblocked, err := r.lease(ctx, carry)
		carry = nil
		if len(rows) > 0 {
			// Even when ctx has ended: the handlers are then not called, and
			// the messages are released by the next round.
			carry = r.deliverBatch(ctx, rows, leasedAt)
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
		if !sleep(ctx, r.config.PollInterval, wake) {
			return nil
		}
	}
}

// sleep waits for d, or until wake (when not nil) signals, and reports
// false when ctx ended first.
func sleep(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-wake:
	case <-timer.C:
	}
	return true
}

// do runs one statement: on db itself when it is a pool or a connection,
// one at a time on a connection, and in a READ COMMITTED transaction of its
// own on any other TxBeginner.
func (r *Relay) do(ctx context.Context, stmt func(ctx context.Context, q *dbsqlc.Queries) error) error {
	if r.conn != nil {
		r.conn.Lock()
		defer r.conn.Unlock()
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

// Outcomes of an attempt, as OutboxRecordAndLease takes them and as the
// idem.outbox.deliveries counter labels them.
const (
	outcomeDelivered = "delivered"
	outcomeRetried   = "retried"
	outcomeParked    = "parked"
	outcomeReleased  = "released"
)

// result is the outcome of one attempt, waiting to be recorded.
type result struct {
	msg     Message
	outcome string
	cause   error
	delay   time.Duration // before the next attempt, when retried
	latency time.Duration // from created_at to the handler's success
}

// lease records the outcomes in carry and leases due messages, in one
// statement. It reports whether it recorded that a message with an
// ordering key was delivered or parked, which makes the next message with
// that key due, from the next statement on. Once ctx has ended, it only
// records carry, within recordTimeout.
//
// When the statement fails, the outcomes in carry are recorded once more
// on their own; if that fails too, their messages stay leased and are
// delivered again once their leases run out.
func (r *Relay) lease(ctx context.Context, carry []result) (rows []dbsqlc.OutboxRecordAndLeaseRow, leasedAt time.Time, unblocked bool, err error) {
	if ctx.Err() != nil {
		if len(carry) > 0 {
			unblocked = r.record(ctx, carry)
		}
		return nil, time.Time{}, unblocked, nil
	}
	params := outcomeParams(carry)
	params.Lease = interval(r.config.LeaseDuration)
	params.Destinations = r.config.Destinations
	params.MaxMessages = int32(r.config.BatchSize)
	stmtCtx := ctx
	if len(carry) > 0 {
		// Outcomes are recorded even when the relay stops meanwhile; the
		// messages leased then are released by the next round.
		var cancel context.CancelFunc
		stmtCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
		defer cancel()
	}
	leasedAt = time.Now()
	var all []dbsqlc.OutboxRecordAndLeaseRow
	err = r.do(stmtCtx, func(ctx context.Context, q *dbsqlc.Queries) error {
		var err error
		if all, err = q.OutboxRecordAndLease(ctx, params); err != nil {
			return guard.Translate("outbox: lease", err)
		}
		return nil
	})
	if err != nil {
		if len(carry) > 0 {
			// The outcomes are worth another try on their own, on another
			// of the pool's connections if this one broke.
			unblocked = r.record(ctx, carry)
		}
		return nil, leasedAt, unblocked, err
	}
	var changed []int64
	for _, row := range all {
		if row.Kind == "recorded" {
			changed = append(changed, row.ID)
		} else {
			rows = append(rows, row)
		}
	}
	return rows, leasedAt, r.recorded(ctx, carry, changed), nil
}

// deliverBatch delivers leased messages with no transaction open, all at
// once, and returns the outcomes of the last ones for the next lease
// statement to record. When handlers return more than recordLinger apart,
// the outcomes that are in are recorded meanwhile, so that a slow handler
// does not keep its batch-mates leased.
func (r *Relay) deliverBatch(ctx context.Context, rows []dbsqlc.OutboxRecordAndLeaseRow, leasedAt time.Time) (last []result) {
	results := make(chan result, len(rows))
	for _, row := range rows {
		go func() { results <- r.attempt(ctx, row, leasedAt) }()
	}
	var batch []result
	var linger *time.Timer
	var lingered <-chan time.Time
	for remaining := len(rows); remaining > 0; {
		select {
		case res := <-results:
			remaining--
			batch = append(batch, res)
			if remaining > 0 && linger == nil {
				linger = time.NewTimer(recordLinger)
				lingered = linger.C
			}
		case <-lingered:
			linger, lingered = nil, nil
			r.record(ctx, batch)
			batch = nil
		}
	}
	if linger != nil {
		linger.Stop()
	}
	return batch
}

// attempt delivers one leased message and says what its outcome is.
func (r *Relay) attempt(ctx context.Context, row dbsqlc.OutboxRecordAndLeaseRow, leasedAt time.Time) result {
	msg := Message{
		ID:             row.ID,
		Scope:          row.Scope,
		Key:            row.Key,
		Destination:    row.Destination,
		Payload:        row.Payload,
		OrderingKey:    row.OrderingKey,
		IdempotencyKey: row.IdempotencyKey,
		Attempt:        int(row.Attempts),
		CreatedAt:      row.CreatedAt.Time,
	}
	if msg.Attempt > r.config.MaxAttempts {
		cause := Park(errors.New("no attempts left: the last one ended without an outcome, its lease ran out"))
		return r.classify(ctx, msg, cause, 0)
	}

	// The message joins the trace of the transaction that enqueued it.
	hctx := traceContext.Extract(ctx, propagation.MapCarrier{"traceparent": row.TraceParent, "tracestate": row.TraceState})
	var span trace.Span
	if r.tracer != nil {
		hctx, span = r.tracer.Start(hctx, "idem.outbox.deliver",
			trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(
				attribute.String("idem.outbox.destination", msg.Destination),
				attribute.Int64("idem.outbox.message_id", msg.ID),
				attribute.Int("idem.outbox.attempt", msg.Attempt),
			))
	}
	// The lease began by the server's clock after leasedAt, so a context
	// that ends before leasedAt+lease ends before another relay can lease
	// the message, whatever the two clocks say. The margin is the time
	// left to record the outcome under the lease: recorded any later, the
	// outcome may lose to another relay's lease, which delivers the message
	// again.
	lc := newLeaseContext(hctx, &delivery{relay: r, id: msg.ID, attempt: row.Attempts},
		leasedAt.Add(r.config.LeaseDuration-leaseMargin(r.config.LeaseDuration)))
	cause := r.deliver(lc, msg)
	lc.end(context.Canceled)
	// From the enqueuing transaction's start to the handler's success, with
	// the server's clock up to the lease and the relay's after, so that
	// the two clocks need not agree.
	latency := row.LeasedAt.Time.Sub(msg.CreatedAt) + time.Since(leasedAt)
	res := r.classify(ctx, msg, cause, latency)
	if span != nil {
		span.SetAttributes(attribute.String("idem.outbox.outcome", res.outcome))
		if cause != nil {
			span.RecordError(cause)
			span.SetStatus(codes.Error, cause.Error())
		}
		span.End()
	}
	return res
}

// leaseMargin is the part of a lease kept back from the handler for
// recording its outcome.
func leaseMargin(lease time.Duration) time.Duration { return min(lease/10, recordTimeout) }

// deliver calls the handler, turning a panic into an error so that one bad
// message cannot take the relay, and the other messages of its batch, down.
func (r *Relay) deliver(ctx context.Context, msg Message) (err error) {
	if err := ctx.Err(); err != nil {
		return err // stopping, or the lease is gone: do not start a call
	}
	defer func() {
		if p := recover(); p != nil {
			r.logger.ErrorContext(ctx, "outbox: handler panicked", "message_id", msg.ID, "panic", p, "stack", string(debug.Stack()))
			err = fmt.Errorf("outbox: handler panicked: %v", p)
		}
	}()
	return r.handler(ctx, msg)
}

// classify decides what the attempt's outcome makes of the message, and
// logs failures.
func (r *Relay) classify(ctx context.Context, msg Message, cause error, latency time.Duration) result {
	res := result{msg: msg, cause: cause, latency: latency}
	if cause == nil {
		res.outcome = outcomeDelivered
		return res
	}
	var park *parkError
	explicit := errors.As(cause, &park)
	attrs := []any{"message_id", msg.ID, "destination", msg.Destination, "attempt", msg.Attempt, "error", cause}
	switch {
	case ctx.Err() != nil && !explicit:
		res.outcome = outcomeReleased
	case explicit || msg.Attempt >= r.config.MaxAttempts:
		res.outcome = outcomeParked
		r.logger.ErrorContext(ctx, "outbox: delivery failed; message parked", attrs...)
	default:
		res.outcome = outcomeRetried
		res.delay = retryDelay(msg.Attempt, r.config.RetryDelay, r.config.MaxRetryDelay)
		r.logger.WarnContext(ctx, "outbox: delivery failed; will retry", append(attrs, "retry_in", res.delay)...)
	}
	return res
}

// record stores the outcomes of batch in one statement, and reports
// whether it delivered or parked a message with an ordering key. It runs
// even when ctx has ended, within recordTimeout, so that a stopping relay
// records what it knows. When the statement fails, the messages stay
// leased and are delivered again once their leases run out.
//
// Outcomes other than a delivery apply only while the attempt is still
// the message's newest lease: when another relay's lease is newer, that
// relay records the outcome.
func (r *Relay) record(ctx context.Context, batch []result) (unblocked bool) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	// The statement that leases, leasing no messages: outcomes are
	// written by one statement only.
	p := outcomeParams(batch)
	p.Lease = interval(r.config.LeaseDuration)
	p.Destinations = r.config.Destinations
	p.MaxMessages = 0
	var changed []int64
	err := r.do(ctx, func(ctx context.Context, q *dbsqlc.Queries) error {
		rows, err := q.OutboxRecordAndLease(ctx, p)
		if err != nil {
			return guard.Translate("outbox: record outcomes", err)
		}
		for _, row := range rows {
			changed = append(changed, row.ID) // all of kind "recorded"
		}
		return nil
	})
	if err != nil {
		r.logger.ErrorContext(ctx, "outbox: record outcomes; the messages will be delivered again after their leases",
			"message_ids", p.Ids, "error", err)
		return false
	}
	return r.recorded(ctx, batch, changed)
}

// outcomeParams spells the outcomes of batch as OutboxRecordAndLease's arrays,
// sorted by id so that concurrent statements lock rows in one order.
func outcomeParams(batch []result) dbsqlc.OutboxRecordAndLeaseParams {
	slices.SortFunc(batch, func(a, b result) int { return cmp.Compare(a.msg.ID, b.msg.ID) })
	p := dbsqlc.OutboxRecordAndLeaseParams{
		Ids:        make([]int64, len(batch)),
		Attempts:   make([]int32, len(batch)),
		Outcomes:   make([]string, len(batch)),
		DelaysUs:   make([]int64, len(batch)),
		LastErrors: make([]string, len(batch)),
	}
	for i, res := range batch {
		p.Ids[i] = res.msg.ID
		p.Attempts[i] = int32(res.msg.Attempt)
		p.Outcomes[i] = res.outcome
		p.DelaysUs[i] = interval(res.delay).Microseconds
		if res.cause != nil {
			p.LastErrors[i] = errorText(res.cause)
		}
	}
	return p
}

// recorded counts the outcomes of batch that the database took (changed),
// and reports whether one of them delivered or parked a message with an
// ordering key.
func (r *Relay) recorded(ctx context.Context, batch []result, changed []int64) (unblocked bool) {
	for _, res := range batch {
		if res.msg.OrderingKey != "" && (res.outcome == outcomeDelivered || res.outcome == outcomeParked) {
			unblocked = true
		}
	}
	r.metrics.recorded(ctx, batch, changed)
	return unblocked
}

// maintain purges delivered messages and counts the backlog, now and then
// every purgeEvery, until ctx ends.
func (r *Relay) maintain(ctx context.Context) {
	for {
		r.purge(ctx)
		r.countBacklog(ctx)
		if !sleep(ctx, r.purgeEvery, nil) {
			return
		}
	}
}

// purge deletes delivered messages older than the retention, in batches of
// purgeBatch, each its own statement, until fewer are left or ctx ends.
func (r *Relay) purge(ctx context.Context) {
	for ctx.Err() == nil {
		var deleted int64
		err := r.do(ctx, func(ctx context.Context, q *dbsqlc.Queries) error {
			var err error
			deleted, err = q.OutboxPurgeDelivered(ctx, dbsqlc.OutboxPurgeDeliveredParams{
				Retention:    interval(r.config.DeliveredRetention),
				Destinations: r.config.Destinations,
				MaxRows:      purgeBatch,
			})
			if err != nil {
				return guard.Translate("outbox: purge delivered messages", err)
			}
			return nil
		})
		if err != nil {
			if ctx.Err() == nil {
				r.logger.ErrorContext(ctx, "outbox: purge delivered messages; trying again later", "error", err)
			}
			return
		}
		if deleted < purgeBatch {
			return
		}
	}
}

// countBacklog records the pending and parked messages to the relay's
// destinations, when the relay has metrics.
func (r *Relay) countBacklog(ctx context.Context) {
	if r.metrics == nil || ctx.Err() != nil {
		return
	}
	var rows []dbsqlc.OutboxBacklogRow
	err := r.do(ctx, func(ctx context.Context, q *dbsqlc.Queries) error {
		var err error
		if rows, err = q.OutboxBacklog(ctx, r.config.Destinations); err != nil {
			return guard.Translate("outbox: count the backlog", err)
		}
		return nil
	})
	if err != nil {
		if ctx.Err() == nil {
			r.logger.ErrorContext(ctx, "outbox: count the backlog; trying again later", "error", err)
		}
		return
	}
	r.metrics.backlogCounted(ctx, r.config.Destinations, rows)
}

// errNotHeard says that the relay's own notification did not reach its
// listening connection.
var errNotHeard = errors.New("notifications do not reach the relay's listening connection " +
	"(is it connected through a pooler in transaction mode, such as PgBouncer's pool_mode=transaction? " +
	"set Config.ListenConnConfig to a direct connection)")

// listen wakes the relay whenever a transaction that called Notify commits.
// While it cannot listen, the relay still polls, and notes says so.
//
// It listens on a connection of its own rather than one of the pool's: a
// connection held for as long as the relay runs would starve a small pool
// (one of a single connection would deliver nothing), and would keep
// pgxpool.Pool.Close waiting until the relay stopped.
func (r *Relay) listen(ctx context.Context, notes *notifications, wake chan<- struct{}) {
	for {
		err := r.listenOnce(ctx, notes, wake)
		if ctx.Err() != nil {
			return
		}
		notes.failed(ctx, err)
		wait := r.config.PollInterval
		if errors.Is(err, errNotHeard) {
			wait = r.reprobeEvery
		}
		if !sleep(ctx, wait, nil) {
			return
		}
	}
}

// listenOnce opens a connection, listens on it, checks that a
// notification sent the way Notify sends them reaches it, and then wakes
// the relay at each notification until the connection fails or ctx ends.
func (r *Relay) listenOnce(ctx context.Context, notes *notifications, wake chan<- struct{}) error {
	conn, err := connect(ctx, r.listenConfig)
	if err != nil {
		return fmt.Errorf("outbox: connect to listen: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if err := dbsqlc.New(conn).OutboxListen(ctx); err != nil {
		return guard.Translate("outbox: listen", err)
	}

	// A pooler in transaction mode runs LISTEN on whichever server
	// connection it lends, and never passes a notification on: probe
	// through db, the way Notify's transactions reach the database.
	probe := "probe:" + crand.Text()
	err = r.do(ctx, func(ctx context.Context, q *dbsqlc.Queries) error {
		if err := q.OutboxNotifyProbe(ctx, probe); err != nil {
			return guard.Translate("outbox: send a probe notification", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	probeCtx, cancel := context.WithTimeout(ctx, r.probeWait)
	defer cancel()
	for {
		n, err := conn.WaitForNotification(probeCtx)
		if err != nil {
			if ctx.Err() == nil && probeCtx.Err() != nil {
				return errNotHeard
			}
			return fmt.Errorf("outbox: wait for notification: %w", err)
		}
		if n.Payload == probe {
			break
		}
		signal(wake)
	}
	notes.listening(ctx)
	// Messages committed before the subscription took effect were not
	// announced to it: look once.
	signal(wake)
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return fmt.Errorf("outbox: wait for notification: %w", err)
		}
		signal(wake)
	}
}

// connect opens a connection with config, or a copy of it: ConnectConfig
// requires a config that it has not used before, and one that
// pgx.ParseConfig made, or it panics.
func connect(ctx context.Context, config *pgx.ConnConfig) (conn *pgx.Conn, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("the connection config must come from pgx.ParseConfig: %v", p)
		}
	}()
	return pgx.ConnectConfig(ctx, config.Copy())
}

// notifications tracks whether a running relay hears notifications, and
// says so in its log and its metrics: once when it stops hearing them, and
// once when it hears them again.
type notifications struct {
	relay *Relay
	mu    sync.Mutex
	heard bool // the relay hears notifications
	told  bool // the relay logged that it does not
}

func (n *notifications) start(ctx context.Context) { n.relay.metrics.relayState(ctx, false, true) }

func (n *notifications) stop(ctx context.Context) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.relay.metrics.relayState(ctx, n.heard, false)
}

// listening notes that the relay hears notifications.
func (n *notifications) listening(ctx context.Context) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.heard {
		return
	}
	n.relay.metrics.relayState(ctx, false, false)
	n.relay.metrics.relayState(ctx, true, true)
	n.heard = true
	if n.told {
		n.relay.logger.InfoContext(ctx, "outbox: the relay hears notifications again")
		n.told = false
	}
}

// failed notes that the relay does not hear notifications, because of err.
func (n *notifications) failed(ctx context.Context, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.heard {
		n.relay.metrics.relayState(ctx, true, false)
		n.relay.metrics.relayState(ctx, false, true)
		n.heard = false
	}
	if !n.told {
		n.relay.logger.WarnContext(ctx, "outbox: the relay does not hear notifications; it polls meanwhile, and says so again once it hears them",
			"poll_interval", n.relay.config.PollInterval, "error", err)
		n.told = true
	}
}

// signal wakes the relay without blocking: one pending wake-up is enough.
func signal(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}

// retryDelay is the delay after a message's attempt-th failed attempt:
// base doubled attempt-1 times, capped at ceiling, then drawn at random
// between half and all of that.
func retryDelay(attempt int, base, ceiling time.Duration) time.Duration {
	d := base
	for i := 1; i < attempt && d < ceiling; i++ {
		if d > ceiling/2 {
			d = ceiling // doubling would pass the cap, or overflow
			break
		}
		d *= 2
	}
	d = min(d, ceiling)
	return d/2 + rand.N(d/2+1)
}

// interval spells d for PostgreSQL in whole microseconds, rounded up, so
// that a positive duration never becomes zero. It rounds after dividing,
// because adding before would overflow for durations near the largest
// (math.MaxInt64, "forever") and give a negative interval.
func interval(d time.Duration) pgtype.Interval {
	us := d / time.Microsecond
	if d%time.Microsecond > 0 {
		us++
	}
	return pgtype.Interval{Microseconds: int64(us), Valid: true}
}

// errorText makes an error storable in a text column: valid UTF-8, no NUL
// byte, and bounded.
func errorText(err error) string {
	s := strings.ToValidUTF8(err.Error(), "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "")
	if len(s) <= maxErrorText {
		return s
	}
	cut := maxErrorText
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
