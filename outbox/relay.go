package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/guard"
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
// outcome, and when the relay stops. A call cut short by the lease counts
// as a failed attempt.
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
	// delivers them concurrently, records each outcome as soon as its
	// handler returns, and leases the next batch once all of them are done.
	// Defaults to 10.
	BatchSize int

	// Destinations limits the relay to messages for these destinations, so
	// that each destination can have relays (and handlers) of its own.
	// Defaults to every destination.
	Destinations []string

	// LeaseDuration is how long a leased message is withheld from other
	// relays. The handler's context ends a tenth of it (at most 5s) before
	// it runs out, so that the relay can record the outcome while the lease
	// still holds, and a relay that crashed leaves its messages to others
	// once it has: choose it longer than a delivery takes, and short enough
	// to wait out after a crash. Every duration is accepted, up to
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
	// set). Parked messages are never purged. math.MaxInt64 keeps them for
	// as long as a time.Duration reaches, about 292 years. Defaults to 24h.
	DeliveredRetention time.Duration

	// Logger receives the relay's failures: failed and parked deliveries,
	// and database errors, after which the relay keeps trying. Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// Defaults of the [Config] fields.
const (
	defaultBatchSize          = 10
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

	// purgeInterval is how often a running relay purges delivered messages.
	purgeInterval = time.Minute

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
}

// NewRelay returns a relay that leases messages through db and delivers
// them to handler. A nil config means every default.
//
// When db is a *pgxpool.Pool, the relay also opens one connection of its
// own while it runs, with the pool's connection settings but outside the
// pool (so its hooks, such as AfterConnect, do not run on it), to listen
// for [Notify]; it takes none of the pool's connections for that, and
// closes it when Run returns. With any other TxBeginner the relay only
// polls.
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
	return &Relay{db: db, handler: handler, config: c, logger: logger}, nil
}

// Run delivers messages until ctx ends, then returns nil. Database errors
// do not stop it: it logs them and tries again at the next poll.
//
// When ctx ends, the handlers in flight see their context end too. Run
// waits for them and records their outcomes before it returns: deliveries
// that succeeded are marked delivered, and the others are released at once
// for another relay, without counting the interrupted attempt. A relay
// that stops without recording (a crash, a lost connection) leaves its
// messages leased; other relays deliver them once the lease runs out.
//
// A relay runs once at a time: Run returns an error while another call on
// the same relay is running. It may be run again after it returned.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("outbox: the relay is already running")
	}
	defer r.running.Store(false)

	wake := make(chan struct{}, 1)
	var listener sync.WaitGroup
	defer listener.Wait()
	if pool, ok := r.db.(*pgxpool.Pool); ok {
		listener.Go(func() { r.listen(ctx, pool.Config().ConnConfig, wake) })
	}

	var nextPurge time.Time
	for {
		if now := time.Now(); !now.Before(nextPurge) {
			r.purge(ctx)
			nextPurge = now.Add(purgeInterval)
		}
		leased, unblocked, err := r.deliverBatch(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			r.logger.ErrorContext(ctx, "outbox: lease messages; trying again at the next poll", "error", err)
		} else if leased == r.config.BatchSize || unblocked {
			// A full batch: more messages may be due right now. An ordered
			// message that is done: the next one with its key is due now,
			// and no notification announces it.
			continue
		}
		timer := time.NewTimer(r.config.PollInterval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-wake:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// deliverBatch leases due messages in a short transaction, delivers them
// with no transaction open, and records each outcome in a short transaction
// of its own as soon as its handler returns. It returns how many messages
// it leased, and whether it delivered or parked one with an ordering key,
// which makes the next message with that key due.
func (r *Relay) deliverBatch(ctx context.Context) (leased int, unblocked bool, err error) {
	leasedAt := time.Now()
	var rows []dbsqlc.OutboxLeaseRow
	err = idem.WithTx(ctx, r.db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		rows, err = dbsqlc.New(tx).OutboxLease(ctx, dbsqlc.OutboxLeaseParams{
			Lease:        interval(r.config.LeaseDuration),
			Destinations: r.config.Destinations,
			MaxMessages:  int32(r.config.BatchSize),
		})
		if err != nil {
			return guard.Translate("outbox: lease", err)
		}
		return nil
	})
	if err != nil || len(rows) == 0 {
		return 0, false, err
	}

	// The lease began by the server's clock after leasedAt, so a context
	// that ends before leasedAt+lease ends before another relay can lease
	// the message, whatever the two clocks say. The margin is the time
	// left to record the outcome under the lease: recorded any later, the
	// outcome may lose to another relay's lease, which delivers the message
	// again.
	margin := min(r.config.LeaseDuration/10, recordTimeout)
	deliverCtx, cancel := context.WithDeadline(ctx, leasedAt.Add(r.config.LeaseDuration-margin))
	defer cancel()
	var done atomic.Bool
	var wg sync.WaitGroup
	for _, row := range rows {
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
		// Each message is recorded on its own, so that a slow one does not
		// keep the others leased until their leases run out too.
		wg.Go(func() {
			var outcome error
			if msg.Attempt > r.config.MaxAttempts {
				outcome = Park(errors.New("no attempts left: the last one ended without an outcome, its lease ran out"))
			} else {
				outcome = r.deliver(deliverCtx, msg)
			}
			if r.record(ctx, msg, outcome) && msg.OrderingKey != "" {
				done.Store(true)
			}
		})
	}
	wg.Wait()
	return len(rows), done.Load(), nil
}

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

// record stores the outcome of one message and reports whether the message
// is now done: delivered or parked. It runs even when ctx has ended, within
// recordTimeout, so that a stopping relay records what it knows. When the
// statement fails, the message stays leased and is delivered again once the
// lease runs out.
func (r *Relay) record(ctx context.Context, msg Message, cause error) bool {
	stopping := ctx.Err() != nil
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()

	if cause == nil {
		err := r.exec(ctx, func(q *dbsqlc.Queries) (int64, error) { return q.OutboxMarkDelivered(ctx, []int64{msg.ID}) })
		if err != nil {
			r.logger.ErrorContext(ctx, "outbox: record delivery; it will be made again after its lease",
				"message_id", msg.ID, "error", err)
			return false
		}
		return true
	}

	var park *parkError
	explicit := errors.As(cause, &park)
	text := errorText(cause)
	attrs := []any{"message_id", msg.ID, "destination", msg.Destination, "attempt", msg.Attempt, "error", cause}
	var err error
	parked := false
	switch {
	case stopping && !explicit:
		err = r.exec(ctx, func(q *dbsqlc.Queries) (int64, error) {
			return q.OutboxRelease(ctx, dbsqlc.OutboxReleaseParams{ID: msg.ID, Attempt: int32(msg.Attempt), LastError: text})
		})
	case explicit || msg.Attempt >= r.config.MaxAttempts:
		parked = true
		r.logger.ErrorContext(ctx, "outbox: delivery failed; message parked", attrs...)
		err = r.exec(ctx, func(q *dbsqlc.Queries) (int64, error) {
			return q.OutboxPark(ctx, dbsqlc.OutboxParkParams{ID: msg.ID, Attempt: int32(msg.Attempt), LastError: text})
		})
	default:
		delay := retryDelay(msg.Attempt, r.config.RetryDelay, r.config.MaxRetryDelay)
		r.logger.WarnContext(ctx, "outbox: delivery failed; will retry", append(attrs, "retry_in", delay)...)
		err = r.exec(ctx, func(q *dbsqlc.Queries) (int64, error) {
			return q.OutboxRetry(ctx, dbsqlc.OutboxRetryParams{ID: msg.ID, Attempt: int32(msg.Attempt), Delay: interval(delay), LastError: text})
		})
	}
	if err != nil {
		r.logger.ErrorContext(ctx, "outbox: record failed delivery; the message will be retried after its lease",
			"message_id", msg.ID, "error", err)
		return false
	}
	return parked
}

// exec runs one statement in a transaction of its own. Statements guarded by
// the attempt number may affect no row: another relay's lease is newer, and
// that relay records the outcome.
func (r *Relay) exec(ctx context.Context, stmt func(q *dbsqlc.Queries) (int64, error)) error {
	return idem.WithTx(ctx, r.db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := stmt(dbsqlc.New(tx)); err != nil {
			return guard.Translate("outbox: record outcome", err)
		}
		return nil
	})
}

// purge deletes delivered messages older than the retention, in batches.
func (r *Relay) purge(ctx context.Context) {
	for {
		var deleted int64
		err := idem.WithTx(ctx, r.db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			deleted, err = dbsqlc.New(tx).OutboxPurgeDelivered(ctx, dbsqlc.OutboxPurgeDeliveredParams{
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

// listen wakes the relay whenever a transaction that called Notify commits.
// While it cannot listen, the relay still polls.
//
// It listens on a connection of its own rather than one of the pool's: a
// connection held for as long as the relay runs would starve a small pool
// (one of a single connection would deliver nothing), and would keep
// pgxpool.Pool.Close waiting until the relay stopped.
func (r *Relay) listen(ctx context.Context, connConfig *pgx.ConnConfig, wake chan<- struct{}) {
	for {
		err := r.listenOnce(ctx, connConfig, wake)
		if ctx.Err() != nil {
			return
		}
		r.logger.WarnContext(ctx, "outbox: listen for notifications; polling meanwhile", "error", err)
		timer := time.NewTimer(r.config.PollInterval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
	}
}

// listenOnce opens a connection, listens on it until it fails or ctx ends,
// and closes it.
func (r *Relay) listenOnce(ctx context.Context, connConfig *pgx.ConnConfig, wake chan<- struct{}) error {
	// ConnectConfig requires a config that it has not used before.
	conn, err := pgx.ConnectConfig(ctx, connConfig.Copy())
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
