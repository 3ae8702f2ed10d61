// Package otelrec records what idem's code sends through the OpenTelemetry
// API, for tests: the counters' sums, by idem.outcome (or, for a counter
// of events, idem.event; for the webhook receiver's, idem.webhook.outcome,
// followed by ":" and idem.webhook.reason when it has one), and the ended
// spans.
package otelrec

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// Recorder is a MeterProvider and a TracerProvider that keeps what is
// recorded through them. It is built on the OpenTelemetry API's own no-op
// types, overriding the methods idem calls, so that the tests need no SDK
// (and idem's users download none).
type Recorder struct {
	metricnoop.MeterProvider
	tracenoop.TracerProvider

	mu     sync.Mutex
	counts map[string]map[string]float64 // instrument -> idem.outcome -> sum
	spans  []Span                        // ended spans, in order
}

// Span is an ended span: its name, its idem.outcome attribute, its status,
// and all its string and int attributes, as strings.
type Span struct {
	Name, Outcome string
	Status        codes.Code
	Attrs         map[string]string
}

// New returns an empty Recorder.
func New() *Recorder { return &Recorder{counts: map[string]map[string]float64{}} }

func (r *Recorder) Meter(string, ...metric.MeterOption) metric.Meter { return recMeter{r: r} }

func (r *Recorder) Tracer(string, ...trace.TracerOption) trace.Tracer { return recTracer{r: r} }

func (r *Recorder) add(instrument string, v float64, set attribute.Set) {
	outcome, ok := set.Value("idem.outcome")
	if !ok {
		outcome, _ = set.Value("idem.event")
	}
	key := outcome.AsString()
	if webhook, ok := set.Value("idem.webhook.outcome"); ok {
		key = webhook.AsString()
		if reason, ok := set.Value("idem.webhook.reason"); ok {
			key += ":" + reason.AsString()
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.counts[instrument] == nil {
		r.counts[instrument] = map[string]float64{}
	}
	r.counts[instrument][key] += v
}

// Count returns the sum recorded on instrument, by outcome.
func (r *Recorder) Count(instrument string) map[string]float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]float64{}
	for k, v := range r.counts[instrument] {
		out[k] = v
	}
	return out
}

// Ended returns the spans ended so far, in order.
func (r *Recorder) Ended() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Span(nil), r.spans...)
}

type recMeter struct {
	metricnoop.Meter
	r *Recorder
}

func (m recMeter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	return recCounter{r: m.r, name: name}, nil
}

func (m recMeter) Float64Histogram(name string, _ ...metric.Float64HistogramOption) (metric.Float64Histogram, error) {
	return recHistogram{r: m.r, name: name}, nil
}

type recCounter struct {
	metricnoop.Int64Counter
	r    *Recorder
	name string
}

func (c recCounter) Add(_ context.Context, v int64, opts ...metric.AddOption) {
	c.r.add(c.name, float64(v), metric.NewAddConfig(opts).Attributes())
}

// recHistogram counts records rather than summing them: durations vary.
type recHistogram struct {
	metricnoop.Float64Histogram
	r    *Recorder
	name string
}

func (h recHistogram) Record(_ context.Context, _ float64, opts ...metric.RecordOption) {
	h.r.add(h.name, 1, metric.NewRecordConfig(opts).Attributes())
}

type recTracer struct {
	tracenoop.Tracer
	r *Recorder
}

func (t recTracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	s := &recSpan{r: t.r, span: Span{Name: name, Attrs: map[string]string{}}}
	cfg := trace.NewSpanStartConfig(opts...)
	s.SetAttributes(cfg.Attributes()...)
	return trace.ContextWithSpan(ctx, s), s
}

type recSpan struct {
	tracenoop.Span
	r    *Recorder
	span Span
}

func (s *recSpan) SetAttributes(kv ...attribute.KeyValue) {
	for _, a := range kv {
		if a.Key == "idem.outcome" {
			s.span.Outcome = a.Value.AsString()
		}
		s.span.Attrs[string(a.Key)] = a.Value.String()
	}
}

func (s *recSpan) SetStatus(code codes.Code, _ string) { s.span.Status = code }

func (s *recSpan) End(...trace.SpanEndOption) {
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	s.r.spans = append(s.r.spans, s.span)
}
