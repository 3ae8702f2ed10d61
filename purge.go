package idem

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// DefaultPurgeBatch is the number of records a purge deletes per
// transaction unless told otherwise.
const DefaultPurgeBatch = 1000

// Purge deletes every expired record, and every finished flow whose
// retention has passed (with its steps; a flow in progress, or stopped for
// attention, never expires), batch rows per transaction, and returns how
// many it deleted. Short transactions keep each one's locks and
// WAL small; rows another transaction holds are skipped rather than waited
// for, and a reclaim whose expired record is purged under it inserts a new
// one instead. Each batch starts at the expiry where the last one stopped,
// so that none walks again over the index entries its predecessors left
// for VACUUM. Purging is never needed for correctness: an expired record
// already counts as absent. It keeps the table and its indexes small.
//
// batch must be between 1 and math.MaxInt32; [DefaultPurgeBatch] is a
// reasonable start. For purging in the background, see [StartPurger].
func Purge(ctx context.Context, db TxBeginner, batch int) (int64, error) {
	if err := checkBatch(batch); err != nil {
		return 0, err
	}
	if err := dberr.CheckIdle(db, purgeAdvice); err != nil {
		return 0, err
	}
	var total int64
	w := newPurgeWalk(db, batch)
	for {
		deleted, done, err := w.next(ctx)
		total += deleted
		if err != nil || done {
			return total, err
		}
	}
}

// purgeAdvice says what to do instead of purging on a connection in a
// transaction: each batch commits a transaction of its own.
const purgeAdvice = "a purge commits transactions of its own: pass the pool or an idle connection"

func checkBatch(batch int) error {
	if batch < 1 || batch > math.MaxInt32 {
		return &FieldError{Package: "idem", Field: "Purge", Problem: fmt.Sprintf("batch must be between 1 and %d, got %d", math.MaxInt32, batch)}
	}
	return nil
}

// purgeWalk is one pass over the expired records, in order of expiry, one
// transaction of up to batch records at a time (KeyPurgeExpired), then
// over the finished flows whose retention has passed (FlowPurgeExpired).
type purgeWalk struct {
	db    TxBeginner
	batch int
	// after is the expiry the next batch of records starts at: the latest
	// expiry the last batch deleted, at first the oldest there is.
	after pgtype.Timestamptz
	// flows is set once no expired record is left: the pass goes on with
	// the flows.
	flows bool
	// citus is whether the database has Citus, which refuses row locks in
	// a statement that spans shards: the batches are then deleted without
	// them (KeyPurgeExpiredCitus). Nil until the first batch asks.
	citus *bool
}

func newPurgeWalk(db TxBeginner, batch int) *purgeWalk {
	return &purgeWalk{db: db, batch: batch,
		after: pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}}
}

// next deletes the next batch in a transaction of its own. done is true
// when the batch was the pass's last: one of flows that deleted fewer than
// batch.
//
// On a pool or a connection the batch is one statement sent on its own
// (see onDB). It cannot deadlock or fail to serialize, since it waits for
// no row (SKIP LOCKED). On Citus it waits for a row another transaction
// holds: a claim written early over an expired record, at REPEATABLE READ
// or SERIALIZABLE, until that transaction ends.
func (w *purgeWalk) next(ctx context.Context) (deleted int64, done bool, err error) {
	if w.citus == nil {
		var citus bool
		err := onDB(ctx, w.db, func(q *dbsqlc.Queries) (err error) {
			citus, err = q.CitusInstalled(ctx)
			return err
		})
		if err != nil {
			return 0, true, translate("idem: purge", err)
		}
		w.citus = &citus
	}
	var row dbsqlc.KeyPurgeExpiredRow
	flows, citus := w.flows, *w.citus
	err = onDB(ctx, w.db, func(q *dbsqlc.Queries) (err error) {
		switch {
		case flows && citus:
			deleted, err = q.FlowPurgeExpiredCitus(ctx, int32(w.batch))
		case flows:
			deleted, err = q.FlowPurgeExpired(ctx, int32(w.batch))
		case citus:
			var r dbsqlc.KeyPurgeExpiredCitusRow
			r, err = q.KeyPurgeExpiredCitus(ctx, dbsqlc.KeyPurgeExpiredCitusParams{After: w.after, MaxRows: int32(w.batch)})
			row = dbsqlc.KeyPurgeExpiredRow(r)
		default:
			row, err = q.KeyPurgeExpired(ctx, dbsqlc.KeyPurgeExpiredParams{After: w.after, MaxRows: int32(w.batch)})
		}
		if !flows {
			deleted = row.Deleted
		}
		return err
	})
	if err != nil {
		return 0, true, translate("idem: purge", err)
	}
	if flows {
		return deleted, deleted < int64(w.batch), nil
	}
	if row.Reached.Valid {
		w.after = row.Reached
	}
	w.flows = deleted < int64(w.batch)
	return deleted, false, nil
}

// PurgerConfig configures [StartPurger]. The zero value of every field
// means its default, so the zero value is usable; [StartPurger] refuses a
// field that cannot work with an error that names it and wraps
// [ErrInvalidOption].
type PurgerConfig struct {
	// Batch is how many records one transaction deletes. Small batches keep
	// each transaction short, so live claims never wait on it for long. At
	// most math.MaxInt32. Defaults to DefaultPurgeBatch.
	Batch int

	// Pause is how long the purger rests at least between two batches while
	// expired records remain, so that it paces itself instead of taking a
	// core. Defaults to 5ms.
	Pause time.Duration

	// PauseFactor lengthens the rest after a batch to PauseFactor times
	// the time that batch took, when that is longer than Pause (and never
	// beyond Interval). The purger then spends at most 1/(1+PauseFactor)
	// of its time purging: on a busy server, where each batch takes longer,
	// it slows down with the server instead of taking a larger share of
	// it. Negative means none: the rest is Pause alone. Defaults to 0.25.
	PauseFactor float64

	// Interval is how long the purger sleeps once nothing expired is left,
	// and after a failed batch. Defaults to 1m.
	Interval time.Duration

	// Logger receives a line per pass that deleted something, and failures.
	// Defaults to slog.Default(), as everywhere in idem; to log nothing,
	// give slog.New(slog.DiscardHandler).
	Logger *slog.Logger
}

// check applies the defaults to cfg's zero fields, and refuses the first
// field that cannot work.
func (cfg *PurgerConfig) check() error {
	if cfg.Batch == 0 {
		cfg.Batch = DefaultPurgeBatch
	}
	if cfg.Batch < 1 || cfg.Batch > math.MaxInt32 {
		return invalidPurgerField("Batch", "must be between 1 and %d, got %d", math.MaxInt32, cfg.Batch)
	}
	switch {
	case cfg.Pause < 0:
		return invalidPurgerField("Pause", "must not be negative (0 means the default, %s), got %s", defaultPause, cfg.Pause)
	case cfg.Pause == 0:
		cfg.Pause = defaultPause
	}
	switch {
	case math.IsNaN(cfg.PauseFactor) || math.IsInf(cfg.PauseFactor, 0):
		return invalidPurgerField("PauseFactor", "must be a finite number, got %v", cfg.PauseFactor)
	case cfg.PauseFactor == 0:
		cfg.PauseFactor = defaultPauseFactor
	}
	switch {
	case cfg.Interval < 0:
		return invalidPurgerField("Interval", "must not be negative (0 means the default, 1m), got %s", cfg.Interval)
	case cfg.Interval == 0:
		cfg.Interval = time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return nil
}

// The defaults of PurgerConfig's pacing, with batches of DefaultPurgeBatch,
// as BenchmarkPurgerMillionRows measures them (docs/performance.md).
const (
	defaultPause       = 5 * time.Millisecond
	defaultPauseFactor = 0.25
)

func invalidPurgerField(field, format string, args ...any) error {
	return &FieldError{Package: "idem", Field: "PurgerConfig." + field, Problem: fmt.Sprintf(format, args...)}
}

// Purger deletes expired records in the background until stopped. Create it
// with [StartPurger].
type Purger struct {
	cancel  context.CancelFunc
	done    chan struct{}
	deleted atomic.Int64
	once    sync.Once
}

// StartPurger starts deleting expired records in the background, in
// batches with a pause between them, and sleeping between passes. It stops
// when ctx is cancelled or Stop is called. Several purgers (one per
// replica) can run at once: each skips rows another holds. A failed batch is
// logged and retried after Interval.
func StartPurger(ctx context.Context, db TxBeginner, cfg PurgerConfig) (*Purger, error) {
	if db == nil {
		return nil, &FieldError{Package: "idem", Field: "StartPurger", Problem: "db must not be nil"}
	}
	if err := cfg.check(); err != nil {
		return nil, err
	}
	// Once the purger runs, the connection is its alone: checked now, it
	// fails the start rather than every pass.
	if err := dberr.CheckIdle(db, purgeAdvice); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	p := &Purger{cancel: cancel, done: make(chan struct{})}
	go p.run(ctx, db, cfg)
	return p, nil
}

func (p *Purger) run(ctx context.Context, db TxBeginner, cfg PurgerConfig) {
	defer close(p.done)
	for {
		pass := int64(0)
		started := time.Now()
		w := newPurgeWalk(db, cfg.Batch)
		for {
			batchStarted := time.Now()
			deleted, done, err := w.next(ctx)
			took := time.Since(batchStarted)
			pass += deleted
			p.deleted.Add(deleted)
			if err != nil {
				if ctx.Err() == nil {
					cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: purge failed", slog.Any("error", err))
				}
				break
			}
			if done {
				break
			}
			if backoff.Sleep(ctx, cfg.rest(took)) != nil {
				return
			}
		}
		if pass > 0 {
			cfg.Logger.LogAttrs(ctx, slog.LevelInfo, "idem: purged expired records",
				slog.Int64("deleted", pass), slog.Duration("took", time.Since(started)))
		}
		if backoff.Sleep(ctx, cfg.Interval) != nil {
			return
		}
	}
}

// rest is how long the purger rests after a batch that took took: Pause,
// or PauseFactor times took when that is longer, up to Interval.
func (cfg *PurgerConfig) rest(took time.Duration) time.Duration {
	scaled := cfg.PauseFactor * float64(took) // in float: no overflow
	if scaled <= float64(cfg.Pause) {
		return cfg.Pause
	}
	return max(cfg.Pause, time.Duration(min(scaled, float64(cfg.Interval))))
}

// Stop stops the purger and waits for its current batch to end.
func (p *Purger) Stop() {
	p.once.Do(p.cancel)
	<-p.done
}

// Deleted returns how many records the purger has deleted so far. A batch
// that Stop or the end of ctx interrupts as it commits is not counted,
// though it may have committed.
func (p *Purger) Deleted() int64 { return p.deleted.Load() }
