package outbox_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	membedded "go.opentelemetry.io/otel/metric/embedded"
	mnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tembedded "go.opentelemetry.io/otel/trace/embedded"
	tnoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// A relay with an Observer records, through the same providers as idem's
// calls, a span per delivery in the trace of the enqueuing request, counts
// by outcome, latency, backlog, and whether it hears notifications.
func TestRelayObservesDeliveries(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	tp, mp := &tracerProvider{}, newMeterProvider()
	observer, err := idem.NewObserver(idem.ObserverConfig{TracerProvider: tp, MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	requestCtx, request := tp.Tracer("test").Start(ctx, "request")
	err = idem.WithTx(requestCtx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := outbox.EnqueueMany(ctx, tx, []outbox.Entry{
			{Scope: scope, Key: "ok", Destination: dest},
			{Scope: scope, Key: "flaky", Destination: dest},
			{Scope: scope, Key: "rejected", Destination: dest},
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	request.End()

	var mu sync.Mutex
	handlerSpans := map[trace.SpanID]string{}
	var flaky atomic.Int32
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		mu.Lock()
		handlerSpans[trace.SpanContextFromContext(ctx).SpanID()] = msg.Key
		mu.Unlock()
		switch msg.Key {
		case "flaky":
			if flaky.Add(1) == 1 {
				return errors.New("unavailable")
			}
		case "rejected":
			return outbox.Park(errors.New("invalid"))
		}
		return nil
	}, outbox.Config{
		Destinations: []string{dest}, PollInterval: 10 * time.Millisecond,
		RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 20 * time.Millisecond, Observer: observer,
	}, 20*time.Millisecond, 5*time.Second, time.Minute)

	destAttr := attribute.String("idem.outbox.destination", dest)
	state := func(s string) attribute.KeyValue { return attribute.String("idem.outbox.state", s) }
	notifications := func(s string) attribute.KeyValue { return attribute.String("idem.outbox.notifications", s) }
	outcome := func(s string) attribute.KeyValue { return attribute.String("idem.outbox.outcome", s) }
	waitFor(t, "the backlog counted after every outcome", func() bool {
		pending, ok1 := mp.meter.gauge("idem.outbox.backlog", destAttr, state("pending"))
		parked, ok2 := mp.meter.gauge("idem.outbox.backlog", destAttr, state("parked"))
		return ok1 && ok2 && pending == 0 && parked == 1 && countState(t, pool, dest, "delivered") == 2
	})
	waitFor(t, "the relay listening", func() bool {
		return mp.meter.sum("idem.outbox.relays", notifications("listening")) == 1
	})
	if n := mp.meter.sum("idem.outbox.relays", notifications("polling")); n != 0 {
		t.Errorf("idem.outbox.relays{polling} = %d, want 0", n)
	}

	for name, want := range map[string]int64{"delivered": 2, "retried": 1, "parked": 1, "released": 0} {
		if got := mp.meter.sum("idem.outbox.deliveries", outcome(name), destAttr); got != want {
			t.Errorf("idem.outbox.deliveries{%s} = %d, want %d", name, got, want)
		}
	}
	latencies := mp.meter.recorded("idem.outbox.delivery.latency", destAttr)
	if len(latencies) != 2 {
		t.Errorf("%d latencies recorded, want 2", len(latencies))
	}
	for _, l := range latencies {
		if l <= 0 || l > 60 {
			t.Errorf("latency %gs, want between 0 and a minute", l)
		}
	}

	spans := tp.named("idem.outbox.deliver")
	if len(spans) != 4 {
		t.Fatalf("%d delivery spans, want one per attempt: 4", len(spans))
	}
	outcomes := map[string]int{}
	for _, s := range spans {
		if s.parent.TraceID() != request.SpanContext().TraceID() || s.parent.SpanID() != request.SpanContext().SpanID() || !s.parent.IsRemote() {
			t.Errorf("delivery span's parent %v, want the enqueuing request's span %v, remote", s.parent, request.SpanContext())
		}
		if s.kind != trace.SpanKindConsumer || !s.ended {
			t.Errorf("delivery span: kind %v, ended %t; want a consumer span, ended", s.kind, s.ended)
		}
		o := s.attr("idem.outbox.outcome").AsString()
		outcomes[o]++
		if (o == "delivered") != (s.status != codes.Error) {
			t.Errorf("delivery span with outcome %s has status %v", o, s.status)
		}
		mu.Lock()
		key, ok := handlerSpans[s.sc.SpanID()]
		mu.Unlock()
		if !ok || s.attr("idem.outbox.destination").AsString() != dest {
			t.Errorf("delivery span %v is not the handler's context's span (key %q)", s.sc.SpanID(), key)
		}
	}
	if fmt.Sprint(outcomes) != fmt.Sprint(map[string]int{"delivered": 2, "parked": 1, "retried": 1}) {
		t.Errorf("delivery span outcomes %v, want 2 delivered, 1 retried, 1 parked", outcomes)
	}
}

// The trace context of the enqueuing transaction reaches the handler's
// context even without an Observer, so that the handler's own
// instrumentation (an HTTP client's) joins the request's trace.
func TestTraceContextReachesHandler(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	tp := &tracerProvider{}
	requestCtx, request := tp.Tracer("test").Start(ctx, "request")
	enqueue(t, requestCtx, pool, outbox.Entry{Scope: scope, Key: "traced", Destination: dest})
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "untraced", Destination: dest})

	got := make(chan trace.SpanContext, 2)
	keys := make(chan string, 2)
	startRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		got <- trace.SpanContextFromContext(ctx)
		keys <- msg.Key
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})
	for range 2 {
		sc, key := <-got, <-keys
		switch key {
		case "traced":
			if !sc.Equal(request.SpanContext().WithRemote(true)) {
				t.Errorf("handler's span context %v, want the request's %v", sc, request.SpanContext())
			}
		case "untraced":
			if sc.IsValid() {
				t.Errorf("handler's span context %v for a message enqueued without a trace", sc)
			}
		}
	}
}

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

func (s *span) IsRecording() bool { return true }

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
