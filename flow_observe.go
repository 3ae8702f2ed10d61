package idem

import (
	"context"
	"errors"
	"log/slog"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// What an Observer records of flows: a span per run ("idem.Flow.Run",
// "idem.Flow.Resume") with a span per local step ("idem.Local") and per
// call attempt ("idem.Call", with the provider key) inside it; the
// counter idem.flow.events, by flow (idem.flow) and event (idem.event):
// started, resumed, replayed, completed, stopped (the flow needs a
// person's decision, found so or stopped now), mismatch, in_progress,
// lease_lost and failed; the counter idem.flow.step.attempts, by flow,
// kind of step (idem.step.kind: local, call) and outcome (idem.outcome:
// done, failed, lease_lost), which counts the steps that ran, not those
// whose recorded result was returned; and the counter
// idem.flow.reconciliations, by flow and outcome (found, not_found,
// failed), which counts the lookups of calls whose outcome was not known
// (see Reconcile).

// Flow events, as idem.flow.events's idem.event spells them. A claim's
// outcomes are Do's: claimed (spelled started here), replayed, mismatch,
// in_progress.
const (
	outcomeResumed   = "resumed"    // the flow was taken over from an executor that stopped
	outcomeStopped   = "stopped"    // the flow needs a person's decision
	outcomeCompleted = "completed"  // the flow's answer was recorded
	outcomeLeaseLost = "lease_lost" // the executor lost the flow to another
)

// flowObservation is one run of a flow being observed; its methods do
// nothing on a nil receiver.
type flowObservation struct {
	observer *Observer
	ctx      context.Context
	flow     attribute.KeyValue
	span     trace.Span
}

// observeFlow starts observing a run of the flow named flow; span names
// the run's span ("idem.Flow.Run").
func (o *Observer) observeFlow(ctx context.Context, span, flow string) (context.Context, *flowObservation) {
	if o == nil {
		return ctx, nil
	}
	obs := &flowObservation{observer: o, flow: attribute.String("idem.flow", flow)}
	if o.tracer != nil {
		ctx, obs.span = o.tracer.Start(ctx, span, trace.WithSpanKind(trace.SpanKindInternal),
			trace.WithAttributes(obs.flow))
	}
	obs.ctx = ctx
	return ctx, obs
}

// event counts one of the flow's events.
func (obs *flowObservation) event(event string) {
	if obs == nil {
		return
	}
	if obs.span != nil {
		obs.span.AddEvent(event)
	}
	if c := obs.observer.flowEvents; c != nil {
		c.Add(obs.ctx, 1, metric.WithAttributes(obs.flow, attribute.String("idem.event", event)))
	}
}

// claimDone notes what the run's claim found.
func (obs *flowObservation) claimDone(outcome string) {
	if outcome == outcomeClaimed {
		outcome = "started"
	}
	obs.event(outcome)
}

func (obs *flowObservation) flowCompleted() { obs.event(outcomeCompleted) }
func (obs *flowObservation) flowStopped()   { obs.event(outcomeStopped) }

// reconciled counts a call's lookup with its outcome.
func (obs *flowObservation) reconciled(outcome string) {
	if obs == nil {
		return
	}
	if obs.span != nil {
		obs.span.AddEvent("reconciled", trace.WithAttributes(attribute.String("idem.outcome", outcome)))
	}
	if c := obs.observer.flowReconciles; c != nil {
		c.Add(obs.ctx, 1, metric.WithAttributes(obs.flow, attribute.String("idem.outcome", outcome)))
	}
}

// step starts observing a step that runs: a local step, or one attempt of a
// call with its provider key. The function it returns ends the step with
// its error.
func (obs *flowObservation) step(ctx context.Context, kind, spanName, name, providerKey string, attempt int) (context.Context, func(error)) {
	if obs == nil {
		return ctx, func(error) {}
	}
	var span trace.Span
	if obs.observer.tracer != nil {
		attrs := []attribute.KeyValue{obs.flow, attribute.String("idem.step", name)}
		if kind == stepCall {
			attrs = append(attrs, attribute.String("idem.provider_key", providerKey), attribute.Int("idem.call.attempt", attempt))
		}
		ctx, span = obs.observer.tracer.Start(ctx, spanName, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
	}
	return ctx, func(err error) {
		outcome := "done"
		switch {
		case errors.Is(err, ErrLeaseLost):
			outcome = outcomeLeaseLost
		case err != nil:
			outcome = outcomeFailed
		}
		if c := obs.observer.flowStepAttempts; c != nil {
			c.Add(obs.ctx, 1, metric.WithAttributes(obs.flow, attribute.String("idem.step.kind", kind),
				attribute.String("idem.outcome", outcome)))
		}
		if span != nil {
			span.SetAttributes(attribute.String("idem.outcome", outcome))
			if err != nil {
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			}
			span.End()
		}
	}
}

// end ends the run's observation with the run's error.
func (obs *flowObservation) end(scope, key string, err error) {
	if obs == nil {
		return
	}
	switch {
	case errors.Is(err, ErrLeaseLost):
		obs.event(outcomeLeaseLost)
	case errors.Is(err, ErrFingerprintMismatch), errors.Is(err, ErrInProgress), errors.Is(err, ErrFlowStopped):
		// counted as the claim's outcome
	case err != nil:
		obs.event(outcomeFailed)
	}
	o := obs.observer
	if obs.span != nil {
		if err != nil {
			obs.span.RecordError(err)
			obs.span.SetStatus(codes.Error, err.Error())
		}
		obs.span.End()
	}
	if o.logger != nil && errors.Is(err, ErrFlowStopped) {
		o.logger.LogAttrs(obs.ctx, slog.LevelWarn, "idem: flow stopped; it needs a person's decision",
			slog.String("flow", obs.flow.Value.AsString()), slog.String("scope", scope),
			slog.String("key", o.loggedKey(key)), slog.Any("error", err))
	}
}
