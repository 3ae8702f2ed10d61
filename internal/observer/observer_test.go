package observer_test

import (
	"testing"

	mnoop "go.opentelemetry.io/otel/metric/noop"
	tnoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/observer"
)

// *idem.Observer is a Source, checked by the compiler, and hands over the
// tracer and meter its providers gave it, or nil for a missing provider.
var _ observer.Source = (*idem.Observer)(nil)

func TestOfGivesTheObserversInstruments(t *testing.T) {
	t.Parallel()
	full, err := idem.NewObserver(idem.ObserverConfig{TracerProvider: tnoop.NewTracerProvider(), MeterProvider: mnoop.NewMeterProvider()})
	if err != nil {
		t.Fatal(err)
	}
	if tracer, meter := observer.Of(full); tracer == nil || meter == nil {
		t.Errorf("observer with both providers: tracer %v, meter %v, want both", tracer, meter)
	}
	empty, err := idem.NewObserver(idem.ObserverConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if tracer, meter := observer.Of(empty); tracer != nil || meter != nil {
		t.Errorf("observer without providers: tracer %v, meter %v, want neither", tracer, meter)
	}
}
