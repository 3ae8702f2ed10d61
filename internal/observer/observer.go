// Package observer carries an idem.Observer's tracer and meter to the
// packages built on idem (the outbox's relay), so that they record through
// the same providers, without idem.Observer exporting them.
//
// idem.Observer embeds an [Instruments] under an unexported alias
// (type instruments = observer.Instruments). The field is then unexported,
// and Instruments' one method, also unexported, is promoted to
// *idem.Observer, which thereby satisfies [Source]: the compiler checks the
// link, nothing runs at init, and idem.Observer's API shows none of it.
package observer

import (
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Instruments are an observer's tracer and meter. The zero value has
// neither. It has no exported fields or methods, so that embedding it
// adds nothing to idem.Observer's API.
type Instruments struct {
	tracer trace.Tracer
	meter  metric.Meter
}

// New returns the instruments of tracer and meter, each nil when the
// observer has no provider for it.
func New(tracer trace.Tracer, meter metric.Meter) Instruments {
	return Instruments{tracer: tracer, meter: meter}
}

// Source is what embeds Instruments: *idem.Observer.
type Source interface {
	instruments() *Instruments
}

func (i *Instruments) instruments() *Instruments { return i }

// Of returns src's tracer and meter, nil for what it has no provider for.
// src must not be nil, nor a nil *idem.Observer.
func Of(src Source) (trace.Tracer, metric.Meter) {
	i := src.instruments()
	return i.tracer, i.meter
}
