// Package observer lets idem's subpackages record through the idem
// package's Observer without the Observer exporting its instruments.
package observer

import (
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Instruments returns an *idem.Observer's tracer and meter, nil for what it
// has no provider for, or both nil for a nil observer. The idem package
// sets it when it is initialized; every importer of a subpackage imports
// idem too.
var Instruments func(observer any) (trace.Tracer, metric.Meter)
