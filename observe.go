package idem

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem/internal/observer"
)

// ObserverConfig configures [NewObserver]. The zero value records nothing.
type ObserverConfig struct {
	// MeterProvider receives the idem.calls counter and the
	// idem.claim.duration histogram. Defaults to none.
	MeterProvider metric.MeterProvider

	// TracerProvider receives a span per call, named after the function
	// ("idem.Do", "idem.Run"). Defaults to none.
	TracerProvider trace.TracerProvider

	// Logger receives a line for what deserves a human's attention: a key
	// reused with another request (a client bug), a duplicate that gave up
	// waiting, a claim that could not be released. Never the stored value.
	// Defaults to slog.Default(), as everywhere in idem; to log nothing,
	// give slog.New(slog.DiscardHandler).
	Logger *slog.Logger

	// LogKeys logs keys in full. Defaults to false: keys are logged as the
	// first 12 hex digits of their SHA-256, enough to correlate, too little
	// to read a key that carries data.
	LogKeys bool
}

// Observer records what [Do], [Run] and [Once] do, with OpenTelemetry and
// log/slog. It uses only the OpenTelemetry API: the application brings the
// SDK. Create one at start-up and pass it to every call with
// [WithObserver]; calls without one record nothing and spend nothing on it.
type Observer struct {
	// instruments hold the tracer and meter for the packages built on idem,
	// such as the outbox's relay (see internal/observer).
	instruments

	tracer        trace.Tracer
	calls         metric.Int64Counter
	claimDuration metric.Float64Histogram
	// Of flows (see flow_observe.go).
	flowEvents       metric.Int64Counter
	flowStepAttempts metric.Int64Counter
	flowReconciles   metric.Int64Counter
	logger           *slog.Logger
	logKeys          bool
}

// instruments is observer.Instruments under an unexported name, so that
// Observer embeds it without exporting the field.
type instruments = observer.Instruments

// instrumentationName names the package to OpenTelemetry.
const instrumentationName = "github.com/pgidem/idem"

// NewObserver builds the instruments once, so that each call only records.
func NewObserver(cfg ObserverConfig) (*Observer, error) {
	o := &Observer{logger: cfg.Logger, logKeys: cfg.LogKeys}
	if o.logger == nil {
		o.logger = slog.Default()
	}
	if cfg.TracerProvider != nil {
		o.tracer = cfg.TracerProvider.Tracer(instrumentationName)
	}
	var meter metric.Meter
	if cfg.MeterProvider != nil {
		meter = cfg.MeterProvider.Meter(instrumentationName)
		var err error
		o.calls, err = meter.Int64Counter("idem.calls",
			metric.WithDescription("Calls of Do, Run and Once, by outcome."),
			metric.WithUnit("{call}"))
		if err != nil {
			return nil, fmt.Errorf("idem: observer: %w", err)
		}
		o.claimDuration, err = meter.Float64Histogram("idem.claim.duration",
			metric.WithDescription("Time to claim a key, including any wait for a concurrent attempt, by outcome."),
			metric.WithUnit("s"),
			metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
		if err != nil {
			return nil, fmt.Errorf("idem: observer: %w", err)
		}
		o.flowEvents, err = meter.Int64Counter("idem.flow.events",
			metric.WithDescription("What runs of flows found and did: started, resumed, replayed, completed, stopped, and failures."),
			metric.WithUnit("{event}"))
		if err != nil {
			return nil, fmt.Errorf("idem: observer: %w", err)
		}
		o.flowStepAttempts, err = meter.Int64Counter("idem.flow.step.attempts",
			metric.WithDescription("Steps of flows that ran, local steps and call attempts, by outcome."),
			metric.WithUnit("{attempt}"))
		if err != nil {
			return nil, fmt.Errorf("idem: observer: %w", err)
		}
		o.flowReconciles, err = meter.Int64Counter("idem.flow.reconciliations",
			metric.WithDescription("Lookups made for calls whose outcome was not known (idem.Reconcile), by outcome: found, not_found, failed."),
			metric.WithUnit("{lookup}"))
		if err != nil {
			return nil, fmt.Errorf("idem: observer: %w", err)
		}
	}
	o.instruments = observer.New(o.tracer, meter)
	return o, nil
}

// observation is one call being observed. Its methods do nothing on a nil
// receiver, which is what a call without an Observer gets.
type observation struct {
	observer *Observer
	span     trace.Span
	start    time.Time
	claimed  time.Duration
	outcome  string
}

// observe starts observing a call named name; ctx carries its span.
func (o *Observer) observe(ctx context.Context, name string) (context.Context, *observation) {
	if o == nil {
		return ctx, nil
	}
	obs := &observation{observer: o, start: time.Now()}
	if o.tracer != nil {
		ctx, obs.span = o.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal))
	}
	return ctx, obs
}

// claimDone notes the claim's outcome and how long it took.
func (obs *observation) claimDone(outcome string) {
	if obs == nil {
		return
	}
	obs.outcome = outcome
	obs.claimed = time.Since(obs.start)
}

// end records the call: the outcome its claim had, or one derived from err.
func (obs *observation) end(ctx context.Context, scope, key string, err error) {
	if obs == nil {
		return
	}
	outcome := obs.outcome
	switch {
	case errors.Is(err, ErrInvalidKey), errors.Is(err, ErrInvalidScope), errors.Is(err, ErrInvalidOption), errors.Is(err, ErrInvalidBatch),
		errors.Is(err, ErrConnInTransaction):
		outcome = outcomeInvalid
	case errors.Is(err, ErrFingerprintMismatch):
		outcome = outcomeMismatch
	case errors.Is(err, ErrInProgress):
		outcome = outcomeInProgress
	case err != nil:
		outcome = outcomeFailed
	}
	attrs := attribute.NewSet(attribute.String("idem.outcome", outcome))
	o := obs.observer
	if o.calls != nil {
		o.calls.Add(ctx, 1, metric.WithAttributeSet(attrs))
		if obs.claimed > 0 {
			o.claimDuration.Record(ctx, obs.claimed.Seconds(), metric.WithAttributeSet(attrs))
		}
	}
	if obs.span != nil {
		obs.span.SetAttributes(attribute.String("idem.outcome", outcome))
		if err != nil && outcome == outcomeFailed {
			obs.span.RecordError(err)
			obs.span.SetStatus(codes.Error, err.Error())
		}
		obs.span.End()
	}
	if o.logger != nil {
		switch outcome {
		case outcomeMismatch:
			o.logger.LogAttrs(ctx, slog.LevelWarn, "idem: key reused with a different request",
				slog.String("scope", scope), slog.String("key", o.loggedKey(key)))
		case outcomeInProgress:
			o.logger.LogAttrs(ctx, slog.LevelInfo, "idem: duplicate gave up waiting for a concurrent attempt",
				slog.String("scope", scope), slog.String("key", o.loggedKey(key)))
		}
	}
}

// logRelease reports a claim that could not be released after a failure.
func (o *Observer) logRelease(ctx context.Context, scope, key string, err error) {
	if o == nil || o.logger == nil {
		return
	}
	o.logger.LogAttrs(ctx, slog.LevelError, "idem: could not release a claim; roll the transaction back",
		slog.String("scope", scope), slog.String("key", o.loggedKey(key)), slog.Any("error", err))
}

// loggedKey is key as logs and errors show it: in full with
// ObserverConfig.LogKeys, else hashed (also without an Observer).
func (o *Observer) loggedKey(key string) string {
	if o != nil && o.logKeys {
		return key
	}
	sum := sha256.Sum256([]byte(key))
	return "sha256:" + hex.EncodeToString(sum[:6])
}
