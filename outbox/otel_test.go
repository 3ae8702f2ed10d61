package outbox_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	membedded "go.opentelemetry.io/otel/metric/embedded"
	mnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tembedded "go.opentelemetry.io/otel/trace/embedded"
	tnoop "go.opentelemetry.io/otel/trace/noop"
)

// The tests record spans and metrics through the OpenTelemetry API's own
// interfaces, so that they need no SDK, which would reach the module graphs
// of idem's users.

// tracerProvider records every span its tracers start.
type tracerProvider struct {
	tembedded.TracerProvider
	mu    sync.Mutex
	spans []*span
}

func (p *tracerProvider) Tracer(string, ...trace.TracerOption) trace.Tracer { return &tracer{p: p} }

// named returns the spans named name.
func (p *tracerProvider) named(name string) []*span {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*span
	for _, s := range p.spans {
		if s.name == name {
			out = append(out, s)
		}
	}
	return out
}

type tracer struct {
	tembedded.Tracer
	p *tracerProvider
}

func (t *tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	cfg := trace.NewSpanStartConfig(opts...)
	parent := trace.SpanContextFromContext(ctx)
	var tid trace.TraceID
	var sid trace.SpanID
	if parent.IsValid() {
		tid = parent.TraceID()
	} else {
		_, _ = rand.Read(tid[:])
	}
	_, _ = rand.Read(sid[:])
	s := &span{
		name:   name,
		kind:   cfg.SpanKind(),
		parent: parent,
		sc:     trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}),
		attrs:  cfg.Attributes(),
	}
	t.p.mu.Lock()
	t.p.spans = append(t.p.spans, s)
	t.p.mu.Unlock()
	return trace.ContextWithSpan(ctx, s), s
}

type span struct {
	tnoop.Span
	name   string
	kind   trace.SpanKind
	parent trace.SpanContext
	sc     trace.SpanContext

	mu     sync.Mutex
	attrs  []attribute.KeyValue
	status codes.Code
	ended  bool
}

func (s *span) SpanContext() trace.SpanContext { return s.sc }
func (s *span) IsRecording() bool              { return true }

func (s *span) End(...trace.SpanEndOption) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ended = true
}

func (s *span) SetAttributes(kv ...attribute.KeyValue) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.attrs = append(s.attrs, kv...)
}

func (s *span) SetStatus(code codes.Code, _ string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.status = code
}

// attr returns the last value of the attribute key.
func (s *span) attr(key string) attribute.Value {
	s.mu.Lock()
	defer s.mu.Unlock()
	var v attribute.Value
	for _, kv := range s.attrs {
		if string(kv.Key) == key {
			v = kv.Value
		}
	}
	return v
}

// meterProvider records what every instrument of its meter is given:
// sums for counters, values for histograms, the last value for gauges.
type meterProvider struct {
	membedded.MeterProvider
	meter *meter
}

func newMeterProvider() *meterProvider {
	return &meterProvider{meter: &meter{sums: map[string]int64{}, values: map[string][]float64{}, last: map[string]int64{}}}
}

func (p *meterProvider) Meter(string, ...metric.MeterOption) metric.Meter { return p.meter }

type meter struct {
	mnoop.Meter
	mu     sync.Mutex
	sums   map[string]int64
	values map[string][]float64
	last   map[string]int64
}

// series names an instrument's time series: its name and attributes.
func series(name string, attrs ...attribute.KeyValue) string {
	set := attribute.NewSet(attrs...)
	return name + "{" + set.Encoded(attribute.DefaultEncoder()) + "}"
}

func (m *meter) sum(name string, attrs ...attribute.KeyValue) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sums[series(name, attrs...)]
}

func (m *meter) recorded(name string, attrs ...attribute.KeyValue) []float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]float64(nil), m.values[series(name, attrs...)]...)
}

func (m *meter) gauge(name string, attrs ...attribute.KeyValue) (int64, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.last[series(name, attrs...)]
	return v, ok
}

func (m *meter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	return &int64Counter{m: m, name: name}, nil
}

func (m *meter) Int64UpDownCounter(name string, _ ...metric.Int64UpDownCounterOption) (metric.Int64UpDownCounter, error) {
	return &int64UpDownCounter{m: m, name: name}, nil
}

func (m *meter) Float64Histogram(name string, _ ...metric.Float64HistogramOption) (metric.Float64Histogram, error) {
	return &float64Histogram{m: m, name: name}, nil
}

func (m *meter) Int64Gauge(name string, _ ...metric.Int64GaugeOption) (metric.Int64Gauge, error) {
	return &int64Gauge{m: m, name: name}, nil
}

func (m *meter) add(key string, v int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sums[key] += v
}

type int64Counter struct {
	mnoop.Int64Counter
	m    *meter
	name string
}

func (c *int64Counter) Add(_ context.Context, v int64, opts ...metric.AddOption) {
	set := metric.NewAddConfig(opts).Attributes()
	c.m.add(series(c.name, set.ToSlice()...), v)
}

type int64UpDownCounter struct {
	mnoop.Int64UpDownCounter
	m    *meter
	name string
}

func (c *int64UpDownCounter) Add(_ context.Context, v int64, opts ...metric.AddOption) {
	set := metric.NewAddConfig(opts).Attributes()
	c.m.add(series(c.name, set.ToSlice()...), v)
}

type float64Histogram struct {
	mnoop.Float64Histogram
	m    *meter
	name string
}

func (h *float64Histogram) Record(_ context.Context, v float64, opts ...metric.RecordOption) {
	set := metric.NewRecordConfig(opts).Attributes()
	key := series(h.name, set.ToSlice()...)
	h.m.mu.Lock()
	defer h.m.mu.Unlock()
	h.m.values[key] = append(h.m.values[key], v)
}

type int64Gauge struct {
	mnoop.Int64Gauge
	m    *meter
	name string
}

func (g *int64Gauge) Record(_ context.Context, v int64, opts ...metric.RecordOption) {
	set := metric.NewRecordConfig(opts).Attributes()
	key := series(g.name, set.ToSlice()...)
	g.m.mu.Lock()
	defer g.m.mu.Unlock()
	g.m.last[key] = v
}

// logBuffer keeps what a relay logs, for tests that check what it says.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// count returns how many logged lines contain s.
func (b *logBuffer) count(s string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for line := range strings.Lines(b.buf.String()) {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}

// capturingLogger logs from Info up, both to the test's output and to the
// returned buffer.
func capturingLogger(t *testing.T) (*slog.Logger, *logBuffer) {
	b := &logBuffer{}
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	return slog.New(&teeHandler{slog.NewTextHandler(t.Output(), opts), slog.NewTextHandler(b, opts)}), b
}

type teeHandler [2]slog.Handler

func (h *teeHandler) Enabled(ctx context.Context, l slog.Level) bool { return h[0].Enabled(ctx, l) }
func (h *teeHandler) Handle(ctx context.Context, r slog.Record) error {
	_ = h[0].Handle(ctx, r.Clone())
	return h[1].Handle(ctx, r)
}
func (h *teeHandler) WithAttrs(a []slog.Attr) slog.Handler {
	return &teeHandler{h[0].WithAttrs(a), h[1].WithAttrs(a)}
}
func (h *teeHandler) WithGroup(g string) slog.Handler {
	return &teeHandler{h[0].WithGroup(g), h[1].WithGroup(g)}
}
