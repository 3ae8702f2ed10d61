package idem

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// DefaultPurgeBatch is the number of records a purge deletes per
// transaction unless told otherwise.
const DefaultPurgeBatch = 1000

// Purge deletes every expired record, batch rows per transaction, and
// returns how many it deleted. Short transactions keep each one's locks and
// WAL small; rows another transaction holds are skipped rather than waited
// for, and a reclaim whose expired record is purged under it inserts a new
// one instead. Purging is never needed for
// correctness: an expired record already counts as absent. It keeps the
// table and its indexes small.
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
	for {
		deleted, err := purgeBatch(ctx, db, batch)
		total += deleted
		if err != nil || deleted < int64(batch) {
			return total, err
		}
	}
}

// purgeAdvice says what to do instead of purging on a connection in a
// transaction: each batch commits a transaction of its own.
const purgeAdvice = "a purge commits transactions of its own: pass the pool or an idle connection"

func checkBatch(batch int) error {
	if batch < 1 || batch > math.MaxInt32 {
		return fmt.Errorf("%w: purge batch must be between 1 and %d, got %d", ErrInvalidOption, math.MaxInt32, batch)
	}
	return nil
}

// purgeBatch deletes up to batch expired records in one transaction.
func purgeBatch(ctx context.Context, db TxBeginner, batch int) (int64, error) {
	var deleted int64
	err := WithTx(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		deleted, err = dbsqlc.New(tx).KeyPurgeExpired(ctx, int32(batch))
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("idem: purge: %w", err)
	}
	return deleted, nil
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

	// Pause is how long the purger rests between two batches while expired
	// records remain, so that it paces itself instead of taking a core.
	// Defaults to 10ms.
	Pause time.Duration

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
		return invalidPurgerField("Pause", "must not be negative (0 means the default, 10ms), got %s", cfg.Pause)
	case cfg.Pause == 0:
		cfg.Pause = 10 * time.Millisecond
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

func invalidPurgerField(field, format string, args ...any) error {
	return fmt.Errorf("idem: PurgerConfig.%s: %s: %w", field, fmt.Sprintf(format, args...), ErrInvalidOption)
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
		return nil, fmt.Errorf("idem: StartPurger: db must not be nil: %w", ErrInvalidOption)
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
		for {
			deleted, err := purgeBatch(ctx, db, cfg.Batch)
			pass += deleted
			p.deleted.Add(deleted)
			if err != nil {
				if ctx.Err() == nil {
					cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: purge failed", slog.Any("error", err))
				}
				break
			}
			if deleted < int64(cfg.Batch) {
				break
			}
			if backoff.Sleep(ctx, cfg.Pause) != nil {
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

// Stop stops the purger and waits for its current batch to end.
func (p *Purger) Stop() {
	p.once.Do(p.cancel)
	<-p.done
}

// Deleted returns how many records the purger has deleted so far.
func (p *Purger) Deleted() int64 { return p.deleted.Load() }
