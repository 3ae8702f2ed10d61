package outbox

import (
	"context"
	"time"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
)

const (
	// maintainInterval is how often a running relay purges delivered
	// messages and counts its backlog for its metrics.
	maintainInterval = time.Minute

	// purgeBatch is how many messages one purge statement deletes.
	purgeBatch = 1000
)

// maintain purges delivered messages (unless Config.DeliveredRetention is
// negative) and counts the backlog, now and then every maintainEvery, until
// ctx ends.
func (r *Relay) maintain(ctx context.Context) {
	for {
		if r.config.DeliveredRetention >= 0 {
			r.purge(ctx)
		}
		r.countBacklog(ctx)
		if backoff.Sleep(ctx, r.maintainEvery) != nil {
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
				Retention:    pgtime.Interval(r.config.DeliveredRetention),
				Destinations: r.config.Destinations,
				MaxRows:      purgeBatch,
			})
			if err != nil {
				return dberr.Translate("outbox: purge delivered messages", err)
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
			return dberr.Translate("outbox: count the backlog", err)
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
