package outbox

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dbsqlc"
)

const (
	// recordLinger is how long an outcome waits for the outcomes of other
	// handlers of its batch, to be recorded in the same statement.
	recordLinger = 5 * time.Millisecond

	// maxErrorText bounds the error text stored with a failed message.
	maxErrorText = 2000
)

// deliverBatch delivers leased messages with no transaction open, all at
// once, and returns the outcomes of the last ones for the next
// recordAndLease to record. When handlers return more than recordLinger
// apart, the outcomes that are in are recorded meanwhile, so that a slow
// handler does not keep its batch-mates leased.
func (r *Relay) deliverBatch(ctx context.Context, rows []dbsqlc.OutboxRecordAndLeaseRow, leasedAt time.Time) (unrecorded []result) {
	results := make(chan result, len(rows))
	for _, row := range rows {
		go func() { results <- r.attempt(ctx, row, leasedAt) }()
	}
	var linger *time.Timer
	var lingered <-chan time.Time
	for remaining := len(rows); remaining > 0; {
		select {
		case res := <-results:
			remaining--
			unrecorded = append(unrecorded, res)
			if remaining > 0 && linger == nil {
				linger = time.NewTimer(recordLinger)
				lingered = linger.C
			}
		case <-lingered:
			linger, lingered = nil, nil
			r.record(ctx, unrecorded)
			unrecorded = nil
		}
	}
	if linger != nil {
		linger.Stop()
	}
	return unrecorded
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
		res.delay = backoff.Jitter(msg.Attempt, r.config.RetryDelay, r.config.MaxRetryDelay)
		var after *retryAfterError
		if errors.As(cause, &after) {
			res.delay = max(res.delay, min(after.after, r.config.MaxRetryDelay))
		}
		r.logger.WarnContext(ctx, "outbox: delivery failed; will retry", append(attrs, "retry_in", res.delay)...)
	}
	return res
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
