package webhook

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/observer"
)

// The outcomes of a delivery, as the idem.webhook.outcome attribute spells
// them: each delivery has one.
const (
	outcomeApplied   = "applied"   // verified, new: the handler ran and its writes committed with the id
	outcomeDuplicate = "duplicate" // verified, already applied: answered 204, the handler did not run
	outcomeRefused   = "refused"   // answered 4xx: a retry of the same delivery gets the same (see reason)
	outcomeFailed    = "failed"    // not completed, answered 409 or 5xx: the sender retries (see reason)
)

// The reasons of refused and failed deliveries, as idem.webhook.reason
// spells them.
const (
	reasonUnsigned            = "unsigned"
	reasonMalformed           = "malformed"
	reasonSignatureInvalid    = "signature_invalid"
	reasonStale               = "stale"
	reasonBodyTooLarge        = "body_too_large"
	reasonBodyUnreadable      = "body_unreadable"
	reasonScopeUnknown        = "scope_unknown"
	reasonIDReused            = "id_reused"
	reasonInProgress          = "in_progress"
	reasonDatabaseUnavailable = "database_unavailable"
	reasonHandler             = "handler"
	reasonError               = "error"
)

// metrics are a receiver's instruments, made from an idem.Observer's
// meter. Their methods do nothing on a nil receiver.
type metrics struct {
	deliveries metric.Int64Counter
}

// newMetrics returns the instruments of o's meter, or nil when it has none.
func newMetrics(o *idem.Observer) (*metrics, error) {
	_, meter := observer.Of(o)
	if meter == nil {
		return nil, nil
	}
	counter, err := meter.Int64Counter("idem.webhook.deliveries",
		metric.WithDescription("Webhook deliveries received, each once, by outcome (applied, duplicate, refused, failed), "+
			"reason (for refused and failed ones) and whether it passed verification."),
		metric.WithUnit("{delivery}"))
	if err != nil {
		return nil, fmt.Errorf("idem.webhook.deliveries: %w", err)
	}
	return &metrics{deliveries: counter}, nil
}

// delivery counts one delivery. verified says whether it passed
// verification: a signature that matches, within the tolerance.
func (m *metrics) delivery(ctx context.Context, outcome, reason string, verified bool) {
	if m == nil {
		return
	}
	attrs := []attribute.KeyValue{
		attribute.String("idem.webhook.outcome", outcome),
		attribute.Bool("idem.webhook.verified", verified),
	}
	if reason != "" {
		attrs = append(attrs, attribute.String("idem.webhook.reason", reason))
	}
	m.deliveries.Add(ctx, 1, metric.WithAttributes(attrs...))
}
