package idem

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Once runs fn in tx unless the message identified by (scope, id) was
// already handled, and records it as handled in tx, beside fn's writes: a
// redelivered message is then a no-op, reported as ran == false. It is how a
// consumer of an at-least-once broker applies each message once.
//
// Once shares [Do]'s claim: the same validation of scope and id, the same
// wait for a concurrent delivery of the same message (by default up to
// [DefaultWait], then [ErrInProgress]), the same retention ([DefaultRetention])
// after which the id counts as new. It stores no response. When fn fails,
// the id is not recorded and the error is returned; the caller rolls back
// and the broker redelivers.
//
// Options work as for Do: [WithWait], [WithRetention] and [WithObserver]
// apply; options about stored values do not.
//
// Choose id from the message's business identity (the producer's event id,
// or an entity id and version) rather than a broker offset, which changes
// when a topic is rebuilt.
func Once(ctx context.Context, tx pgx.Tx, scope, id string, fn func(ctx context.Context, tx pgx.Tx) error, opts ...Option) (ran bool, err error) {
	o, err := newOptions(opts)
	ctx, obs := o.observer.observe(ctx, "idem.Once")
	defer func() { obs.end(ctx, scope, id, err) }()
	if err != nil {
		return false, err
	}
	o.noResponse = true
	res, err := do(ctx, tx, scope, id, nil, func(ctx context.Context, tx pgx.Tx) (struct{}, error) {
		return struct{}{}, fn(ctx, tx)
	}, &o, obs)
	if err != nil {
		return false, err
	}
	return !res.Replayed, nil
}
