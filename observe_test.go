package idem_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/pgidem/idem"
)

// recorder is a MeterProvider and a TracerProvider that keeps what is
// recorded through them. It is built on the OpenTelemetry API's own no-op
// types, overriding the methods idem calls, so that the tests need no SDK
// (and idem's users download none).
type recorder struct {
	metricnoop.MeterProvider
	tracenoop.TracerProvider

	mu     sync.Mutex
	counts map[string]map[string]float64 // instrument -> idem.outcome -> sum
	spans  []recordedSpan                // ended spans, in order
}

type recordedSpan struct {
	name, outcome string
	status        codes.Code
}

func newRecorder() *recorder { return &recorder{counts: map[string]map[string]float64{}} }

func (r *recorder) Meter(string, ...metric.MeterOption) metric.Meter { return recMeter{r: r} }

func (r *recorder) Tracer(string, ...trace.TracerOption) trace.Tracer { return recTracer{r: r} }

func (r *recorder) add(instrument string, v float64, set attribute.Set) {
	outcome, _ := set.Value("idem.outcome")
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.counts[instrument] == nil {
		r.counts[instrument] = map[string]float64{}
	}
	r.counts[instrument][outcome.AsString()] += v
}

// count returns the sum recorded on instrument, by outcome.
func (r *recorder) count(instrument string) map[string]float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]float64{}
	for k, v := range r.counts[instrument] {
		out[k] = v
	}
	return out
}

func (r *recorder) ended() []recordedSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]recordedSpan(nil), r.spans...)
}

type recMeter struct {
	metricnoop.Meter
	r *recorder
}

func (m recMeter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	return recCounter{r: m.r, name: name}, nil
}

func (m recMeter) Float64Histogram(name string, _ ...metric.Float64HistogramOption) (metric.Float64Histogram, error) {
	return recHistogram{r: m.r, name: name}, nil
}

type recCounter struct {
	metricnoop.Int64Counter
	r    *recorder
	name string
}

func (c recCounter) Add(_ context.Context, v int64, opts ...metric.AddOption) {
	c.r.add(c.name, float64(v), metric.NewAddConfig(opts).Attributes())
}

// recHistogram counts records rather than summing them: durations vary.
type recHistogram struct {
	metricnoop.Float64Histogram
	r    *recorder
	name string
}

func (h recHistogram) Record(_ context.Context, _ float64, opts ...metric.RecordOption) {
	h.r.add(h.name, 1, metric.NewRecordConfig(opts).Attributes())
}

type recTracer struct {
	tracenoop.Tracer
	r *recorder
}

func (t recTracer) Start(ctx context.Context, name string, _ ...trace.SpanStartOption) (context.Context, trace.Span) {
	s := &recSpan{r: t.r, span: recordedSpan{name: name}}
	return trace.ContextWithSpan(ctx, s), s
}

type recSpan struct {
	tracenoop.Span
	r    *recorder
	span recordedSpan
}

func (s *recSpan) SetAttributes(kv ...attribute.KeyValue) {
	for _, a := range kv {
		if a.Key == "idem.outcome" {
			s.span.outcome = a.Value.AsString()
		}
	}
}

func (s *recSpan) SetStatus(code codes.Code, _ string) { s.span.status = code }

func (s *recSpan) End(...trace.SpanEndOption) {
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	s.r.spans = append(s.r.spans, s.span)
}

// setupObserver returns an Observer wired to a recorder and a log buffer.
func setupObserver(t *testing.T, logKeys bool) (*idem.Observer, *recorder, *bytes.Buffer) {
	t.Helper()
	rec := newRecorder()
	var logs bytes.Buffer
	observer, err := idem.NewObserver(idem.ObserverConfig{
		MeterProvider:  rec,
		TracerProvider: rec,
		Logger:         slog.New(slog.NewTextHandler(&logs, nil)),
		LogKeys:        logKeys,
	})
	if err != nil {
		t.Fatal(err)
	}
	return observer, rec, &logs
}

func TestObserverRecordsOutcomesSpansAndLogs(t *testing.T) {
	ctx, pool, scope := setup(t)
	observer, rec, logs := setupObserver(t, false)
	with := idem.WithObserver(observer)
	var calls atomic.Int64

	run := func(key string, fp []byte) error {
		_, err := idem.Run(ctx, pool, scope, key, fp, pay(scope, key, 1, &calls), with)
		return err
	}
	_ = run("k1", fpA)                           // claimed
	_ = run("k1", fpA)                           // replayed
	_ = run("k1", fpB)                           // mismatch
	_ = run("", fpA)                             // invalid
	expire(t, pool, scope, "k1")                 //
	_ = run("k1", fpB)                           // expired_reclaimed
	_, _ = idem.Run(ctx, pool, scope, "k2", fpA, // failed
		func(context.Context, pgx.Tx) (int, error) { return 0, errors.New("boom") }, with)

	want := map[string]float64{"claimed": 1, "replayed": 1, "mismatch": 1, "invalid": 1, "expired_reclaimed": 1, "failed": 1}
	got := rec.count("idem.calls")
	for outcome, n := range want {
		if got[outcome] != n {
			t.Errorf("outcome %s counted %v times, want %v (all: %v)", outcome, got[outcome], n, got)
		}
	}
	// Every call that reached its claim timed it: all but the invalid one.
	claims := rec.count("idem.claim.duration")
	for outcome := range want {
		if n := claims[outcome]; (outcome == "invalid") != (n == 0) {
			t.Errorf("claim.duration recorded %v times for %s (all: %v)", n, outcome, claims)
		}
	}
	spans := rec.ended()
	if len(spans) != 6 {
		t.Errorf("%d spans ended, want 6: %+v", len(spans), spans)
	}
	for i, s := range spans {
		if s.name != "idem.Run" {
			t.Errorf("span named %q, want idem.Run", s.name)
		}
		if wantErr := s.outcome == "failed"; wantErr != (s.status == codes.Error) {
			t.Errorf("span %d (%s) has status %v", i, s.outcome, s.status)
		}
	}
	if spans := rec.ended(); len(spans) == 6 && spans[5].outcome != "failed" {
		t.Errorf("last span's outcome %q, want failed", spans[5].outcome)
	}
	if !strings.Contains(logs.String(), "key reused with a different request") {
		t.Errorf("no log line for the mismatch:\n%s", logs.String())
	}
	if strings.Contains(logs.String(), "key=k1") {
		t.Errorf("the key was logged in full without LogKeys:\n%s", logs.String())
	}
}

func TestObserverLogsFullKeysOnlyWhenAsked(t *testing.T) {
	ctx, pool, scope := setup(t)
	observer, _, logs := setupObserver(t, true)
	var calls atomic.Int64
	_, _ = idem.Run(ctx, pool, scope, "visible-key", fpA, pay(scope, "k", 1, &calls), idem.WithObserver(observer))
	_, _ = idem.Run(ctx, pool, scope, "visible-key", fpB, pay(scope, "k", 1, &calls), idem.WithObserver(observer))
	if !strings.Contains(logs.String(), "key=visible-key") {
		t.Fatalf("LogKeys did not log the key:\n%s", logs.String())
	}
}

// reverseCodec stands in for encryption: what it stores is unreadable as
// the value's JSON.
type reverseCodec struct{ sealed, opened atomic.Int64 }

func (c *reverseCodec) Seal(_ string, p []byte) ([]byte, error) {
	c.sealed.Add(1)
	out := make([]byte, len(p))
	for i, b := range p {
		out[len(p)-1-i] = b ^ 0x5a
	}
	return out, nil
}

func (c *reverseCodec) Open(scope string, s []byte) ([]byte, error) {
	c.opened.Add(1)
	c.sealed.Add(-1) // Seal is its own inverse; keep the count honest
	return c.Seal(scope, s)
}

func TestCodecSealsStoredResponses(t *testing.T) {
	ctx, pool, scope := setup(t)
	codec := &reverseCodec{}
	var calls atomic.Int64
	first, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 4200, &calls), idem.WithCodec(codec))
	if err != nil {
		t.Fatal(err)
	}
	var stored string
	if err := pool.QueryRow(ctx, `SELECT response::text FROM idempotency_key WHERE scope = $1`, scope).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(stored, "4200") || strings.Contains(stored, "amount_cents") {
		t.Fatalf("stored response is readable: %s", stored)
	}
	replay, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 4200, &calls), idem.WithCodec(codec))
	if err != nil || !replay.Replayed || replay.Value != first.Value {
		t.Fatalf("replay through the codec: %+v, %v; want %+v", replay, err, first.Value)
	}
	if codec.opened.Load() != 1 {
		t.Fatalf("codec opened %d times, want 1", codec.opened.Load())
	}
	// Without the codec, the sealed record cannot be read as a value.
	if _, err := idem.Run(ctx, pool, scope, "k", fpA, pay(scope, "k", 4200, &calls)); err == nil {
		t.Fatal("a sealed record replayed without its codec")
	}
}
