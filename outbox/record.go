package outbox

import (
	"cmp"
	"context"
	"slices"
	"time"

	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
)

// Outcomes of an attempt, as OutboxRecordAndLease takes them and as the
// idem.outbox.deliveries counter labels them.
const (
	outcomeDelivered = "delivered"
	outcomeRetried   = "retried"
	outcomeParked    = "parked"
	outcomeReleased  = "released"
)

// recordTimeout bounds the statements that record outcomes after the
// relay's context ended, so that a stopping relay records what it knows but
// a dead database cannot hold it forever. It also caps the part of a lease
// kept back from the handler for recording its outcome.
const recordTimeout = 5 * time.Second

// result is the outcome of one attempt, waiting to be recorded.
type result struct {
	msg     Message
	outcome string
	cause   error
	delay   time.Duration // before the next attempt, when retried
	latency time.Duration // from created_at to the handler's success
}

// recordAndLease records the outcomes in unrecorded and leases due
// messages, in one statement. It reports whether it recorded that a message
// with an ordering key was delivered or parked, which makes the next
// message with that key due, from the next statement on. Once ctx has
// ended, it only records unrecorded, within recordTimeout.
//
// When the statement fails, the outcomes in unrecorded are recorded once
// more on their own; if that fails too, their messages stay leased and are
// delivered again once their leases run out.
func (r *Relay) recordAndLease(ctx context.Context, unrecorded []result) (leased []dbsqlc.OutboxRecordAndLeaseRow, leasedAt time.Time, unblocked bool, err error) {
	if ctx.Err() != nil {
		if len(unrecorded) > 0 {
			unblocked = r.record(ctx, unrecorded)
		}
		return nil, time.Time{}, unblocked, nil
	}
	stmtCtx := ctx
	if len(unrecorded) > 0 {
		// Outcomes are recorded even when the relay stops meanwhile; the
		// messages leased then are released by the next round.
		var cancel context.CancelFunc
		stmtCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
		defer cancel()
	}
	leasedAt = time.Now()
	leased, applied, err := r.recordStatement(stmtCtx, "outbox: lease", unrecorded, r.config.BatchSize)
	if err != nil {
		if len(unrecorded) > 0 {
			// The outcomes are worth another try on their own, on another
			// of the pool's connections if this one broke.
			unblocked = r.record(ctx, unrecorded)
		}
		return nil, leasedAt, unblocked, err
	}
	return leased, leasedAt, r.recorded(ctx, unrecorded, applied), nil
}

// record stores the outcomes of batch, and leases nothing, in the same
// statement as recordAndLease (with a lease of no messages). It reports
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
	_, applied, err := r.recordStatement(ctx, "outbox: record outcomes", batch, 0)
	if err != nil {
		ids := make([]int64, len(batch))
		for i, res := range batch {
			ids[i] = res.msg.ID
		}
		r.logger.ErrorContext(ctx, "outbox: record outcomes; the messages will be delivered again after their leases",
			"message_ids", ids, "error", err)
		return false
	}
	return r.recorded(ctx, batch, applied)
}

// recordStatement runs OutboxRecordAndLease, the one statement that writes
// outcomes: it records outcomes and leases up to maxMessages due messages
// (none for 0). It returns the leased messages, and the ids of the
// messages whose outcomes the database took (applied). what names the
// statement in its error.
func (r *Relay) recordStatement(ctx context.Context, what string, outcomes []result, maxMessages int) (leased []dbsqlc.OutboxRecordAndLeaseRow, applied []int64, err error) {
	p := outcomeParams(outcomes)
	p.Lease = pgtime.Interval(r.config.LeaseDuration)
	p.Destinations = r.config.Destinations
	p.MaxMessages = int32(maxMessages) // at most math.MaxInt32: see Config.withDefaults
	var rows []dbsqlc.OutboxRecordAndLeaseRow
	err = r.do(ctx, func(ctx context.Context, q *dbsqlc.Queries) error {
		var err error
		if rows, err = q.OutboxRecordAndLease(ctx, p); err != nil {
			return dberr.Translate(what, err)
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	for _, row := range rows {
		if row.Kind == "recorded" {
			applied = append(applied, row.ID)
		} else {
			leased = append(leased, row)
		}
	}
	return leased, applied, nil
}

// outcomeParams spells outcomes as OutboxRecordAndLease's arrays, sorted by
// id so that concurrent statements lock rows in one order.
func outcomeParams(outcomes []result) dbsqlc.OutboxRecordAndLeaseParams {
	slices.SortFunc(outcomes, func(a, b result) int { return cmp.Compare(a.msg.ID, b.msg.ID) })
	p := dbsqlc.OutboxRecordAndLeaseParams{
		Ids:        make([]int64, len(outcomes)),
		Attempts:   make([]int32, len(outcomes)),
		Outcomes:   make([]string, len(outcomes)),
		DelaysUs:   make([]int64, len(outcomes)),
		LastErrors: make([]string, len(outcomes)),
	}
	for i, res := range outcomes {
		p.Ids[i] = res.msg.ID
		p.Attempts[i] = int32(res.msg.Attempt)
		p.Outcomes[i] = res.outcome
		p.DelaysUs[i] = pgtime.Interval(res.delay).Microseconds
		if res.cause != nil {
			p.LastErrors[i] = errorText(res.cause)
		}
	}
	return p
}

// recorded counts the outcomes of batch that the database took (applied),
// and reports whether one of them delivered or parked a message with an
// ordering key.
func (r *Relay) recorded(ctx context.Context, batch []result, applied []int64) (unblocked bool) {
	for _, res := range batch {
		if res.msg.OrderingKey != "" && (res.outcome == outcomeDelivered || res.outcome == outcomeParked) {
			unblocked = true
		}
	}
	r.metrics.recorded(ctx, batch, applied)
	return unblocked
}
