package idem_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/codes"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/otelrec"
)

// setupObserver returns an Observer wired to a recorder and a log buffer.
func setupObserver(t *testing.T, logKeys bool) (*idem.Observer, *otelrec.Recorder, *bytes.Buffer) {
	t.Helper()
	rec := otelrec.New()
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
	got := rec.Count("idem.calls")
	for outcome, n := range want {
		if got[outcome] != n {
			t.Errorf("outcome %s counted %v times, want %v (all: %v)", outcome, got[outcome], n, got)
		}
	}
	// Every call that reached its claim timed it: all but the invalid one.
	claims := rec.Count("idem.claim.duration")
	for outcome := range want {
		if n := claims[outcome]; (outcome == "invalid") != (n == 0) {
			t.Errorf("claim.duration recorded %v times for %s (all: %v)", n, outcome, claims)
		}
	}
	spans := rec.Ended()
	if len(spans) != 6 {
		t.Errorf("%d spans ended, want 6: %+v", len(spans), spans)
	}
	for i, s := range spans {
		if s.Name != "idem.Run" {
			t.Errorf("span named %q, want idem.Run", s.Name)
		}
		if wantErr := s.Outcome == "failed"; wantErr != (s.Status == codes.Error) {
			t.Errorf("span %d (%s) has status %v", i, s.Outcome, s.Status)
		}
	}
	if spans := rec.Ended(); len(spans) == 6 && spans[5].Outcome != "failed" {
		t.Errorf("last span's outcome %q, want failed", spans[5].Outcome)
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

// ObserverConfig has no value that NewObserver refuses: each field is
// listed here with what its zero value means, so that a field added with
// values that cannot work gets a test that they are refused.
func TestObserverConfigTakesEveryValue(t *testing.T) {
	t.Parallel()
	anyValue := map[string]string{
		"MeterProvider":  "nil means no metrics",
		"TracerProvider": "nil means no spans",
		"Logger":         "nil means slog.Default()",
		"LogKeys":        "false logs hashed keys",
	}
	for f := range reflect.TypeFor[idem.ObserverConfig]().Fields() {
		if anyValue[f.Name] == "" {
			t.Errorf("ObserverConfig.%s: not listed as taking every value; if some values cannot work, NewObserver must refuse them, naming the field", f.Name)
		}
	}
	if _, err := idem.NewObserver(idem.ObserverConfig{}); err != nil {
		t.Errorf("zero ObserverConfig: %v", err)
	}
}
