package outbox

import (
	"context"
	"fmt"
	"slices"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// traceContext reads and writes W3C trace context (traceparent and
// tracestate), which Enqueue stores with a message and the relay restores
// around its delivery.
var traceContext propagation.TraceContext

// traceHeaders returns the W3C trace context of ctx's span, or empty strings
// when ctx has no valid span context.
func traceHeaders(ctx context.Context) (parent, state string) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return "", ""
	}
	carrier := propagation.MapCarrier{}
	traceContext.Inject(ctx, carrier)
	parent, state = carrier.Get("traceparent"), carrier.Get("tracestate")
	if len(parent) > maxTraceParent {
		return "", "" // a future version of the format, longer than the column takes
	}
	if len(state) > maxTraceState {
		state = "" // the W3C limit: a vendor that exceeds it loses its state, not the trace
	}
	return parent, state
}

// Bounds of the stored trace context, as the table's checks enforce them.
const (
	maxTraceParent = 55
	maxTraceState  = 512
)

// metrics are a relay's instruments, made from an idem.Observer's meter.
// Their methods do nothing on a nil receiver: a relay without metrics.
type metrics struct {
	deliveries metric.Int64Counter
	latency    metric.Float64Histogram
	backlog    metric.Int64Gauge
	relays     metric.Int64UpDownCounter

	// seen are the destinations whose backlog has been reported, so that
	// one that empties is reported as zero rather than left at its last
	// count. Only the relay's maintain goroutine uses it.
	seen map[string]bool
}

func newMetrics(meter metric.Meter) (*metrics, error) {
	m := &metrics{seen: map[string]bool{}}
	var err error
	if m.deliveries, err = meter.Int64Counter("idem.outbox.deliveries",
		metric.WithDescription("Recorded delivery attempts, by outcome (delivered, retried, parked, released) and destination. "+
			"Failed attempts are the retried and parked ones."),
		metric.WithUnit("{attempt}")); err != nil {
		return nil, fmt.Errorf("idem.outbox.deliveries: %w", err)
	}
	if m.latency, err = meter.Float64Histogram("idem.outbox.delivery.latency",
		metric.WithDescription("Time from the start of the transaction that enqueued a message to its handler's success, by destination."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)); err != nil {
		return nil, fmt.Errorf("idem.outbox.delivery.latency: %w", err)
	}
	if m.backlog, err = meter.Int64Gauge("idem.outbox.backlog",
		metric.WithDescription("Messages not yet delivered, by state (pending, parked) and destination, as a relay last counted them."),
		metric.WithUnit("{message}")); err != nil {
		return nil, fmt.Errorf("idem.outbox.backlog: %w", err)
	}
	if m.relays, err = meter.Int64UpDownCounter("idem.outbox.relays",
		metric.WithDescription("Running relays, by whether they hear notifications (idem.outbox.notifications: listening, polling)."),
		metric.WithUnit("{relay}")); err != nil {
		return nil, fmt.Errorf("idem.outbox.relays: %w", err)
	}
	return m, nil
}

// recorded counts the outcomes of batch that the database took (those
// whose ids are in changed).
func (m *metrics) recorded(ctx context.Context, batch []result, changed []int64) {
	if m == nil {
		return
	}
	for _, res := range batch {
		if !slices.Contains(changed, res.msg.ID) {
			continue // another relay's lease is newer, or the message is done
		}
		dest := attribute.String("idem.outbox.destination", res.msg.Destination)
		m.deliveries.Add(ctx, 1, metric.WithAttributes(attribute.String("idem.outbox.outcome", res.outcome), dest))
		if res.outcome == outcomeDelivered {
			m.latency.Record(ctx, res.latency.Seconds(), metric.WithAttributes(dest))
		}
	}
}

// backlogCounted reports the counts of rows, and zero for the destinations
// reported before that no longer have a backlog.
func (m *metrics) backlogCounted(ctx context.Context, destinations []string, rows []dbsqlc.OutboxBacklogRow) {
	if m == nil {
		return
	}
	counted := map[string]bool{}
	report := func(dest string, pending, parked int64) {
		d := attribute.String("idem.outbox.destination", dest)
		m.backlog.Record(ctx, pending, metric.WithAttributes(d, attribute.String("idem.outbox.state", "pending")))
		m.backlog.Record(ctx, parked, metric.WithAttributes(d, attribute.String("idem.outbox.state", "parked")))
		counted[dest] = true
		m.seen[dest] = true
	}
	for _, row := range rows {
		report(row.Destination, row.Pending, row.Parked)
	}
	for _, dest := range destinations {
		if !counted[dest] {
			report(dest, 0, 0)
		}
	}
	for dest := range m.seen {
		if !counted[dest] {
			report(dest, 0, 0)
		}
	}
}

// relayState adds one running relay (add) or removes one, listening or
// polling.
func (m *metrics) relayState(ctx context.Context, listening, add bool) {
	if m == nil {
		return
	}
	state := "polling"
	if listening {
		state = "listening"
	}
	n := int64(-1)
	if add {
		n = 1
	}
	m.relays.Add(ctx, n, metric.WithAttributes(attribute.String("idem.outbox.notifications", state)))
}
