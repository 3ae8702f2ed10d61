package outbox

import (
	"context"
	"errors"
	"time"
)

// NewRelay is a relay checked but not started, for the tests that set its
// intervals first or run it more than once: Run is what StartRelay runs.
var NewRelay = newRelay

// Run runs the relay until ctx ends (see StartRelay).
func (r *Relay) Run(ctx context.Context) error { return r.run(ctx) }

// SetIntervals shortens a relay's background intervals for tests: how
// often it purges and counts its backlog, how long it waits for its probe
// notification, and how long before it probes again.
func SetIntervals(r *Relay, maintain, probeWait, reprobe time.Duration) {
	r.maintainEvery, r.probeWait, r.reprobeEvery = maintain, probeWait, reprobe
}

// RecordDelivered records, on its own statement, that message id was
// delivered on its attempt-th attempt: what a relay does for the outcomes
// that arrive while its batch-mates' handlers still run.
func RecordDelivered(ctx context.Context, r *Relay, id int64, attempt int) {
	r.record(ctx, []result{{msg: Message{ID: id, Attempt: attempt}, outcome: outcomeDelivered}})
}

// Classified says what a relay makes of a handler's error: whether it
// parks the message, and the Retry-After it honours (0 for none).
func Classified(err error) (park bool, after time.Duration) {
	var p *parkError
	var ra *retryAfterError
	if errors.As(err, &ra) {
		after = ra.after
	}
	return errors.As(err, &p), after
}
