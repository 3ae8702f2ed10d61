package idemgrpc_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

func TestNewServerInterceptorRefusesEveryFieldThatCannotWork(t *testing.T) {
	t.Parallel()
	scope := func(context.Context) (string, error) { return "t", nil }
	db := &pgxpool.Pool{} // never used: every case is refused first
	for _, tc := range []struct {
		field string
		db    idem.TxBeginner
		cfg   idemgrpc.Config
	}{
		{"NewServerInterceptor", nil, idemgrpc.Config{Scope: scope}},
		{"Config.Scope", db, idemgrpc.Config{}},
		{"Config.Methods", db, idemgrpc.Config{Scope: scope, Methods: []string{}}},
		{"Config.Methods", db, idemgrpc.Config{Scope: scope, Methods: []string{"payments.v1.Payments/Create"}}},
		{"Config.Methods", db, idemgrpc.Config{Scope: scope, Methods: []string{"/payments.v1.Payments"}}},
		{"Config.Optional", db, idemgrpc.Config{Scope: scope, Optional: []string{"/p.S/M"}}},
		{"Config.Optional", db, idemgrpc.Config{Scope: scope, Required: true, Optional: []string{"/p.S/"}}},
		{"Config.Optional", db, idemgrpc.Config{Scope: scope, Required: true, Methods: []string{"/p.S/A"}, Optional: []string{"/p.S/B"}}},
		{"Config.Methods", db, idemgrpc.Config{Scope: scope, Methods: []string{"/grpc.health.v1.Health/Check"}}},
		{"Config.Methods", db, idemgrpc.Config{Scope: scope, Methods: []string{testpb.PaymentsPay, testpb.PaymentsGet}}},
		{"Config.Optional", db, idemgrpc.Config{Scope: scope, Required: true, Optional: []string{"/grpc.channelz.v1.Channelz/GetServers"}}},
		{"Config.Metadata", db, idemgrpc.Config{Scope: scope, Metadata: "idempotency key"}},
		{"Config.Metadata", db, idemgrpc.Config{Scope: scope, Metadata: "idempotency-key-bin"}},
		{"Config.Metadata", db, idemgrpc.Config{Scope: scope, Metadata: "grpc-key"}},
		{"Config.Metadata", db, idemgrpc.Config{Scope: scope, Metadata: idemgrpc.ReplayedMetadata}},
		{"Config.KeyField", db, idemgrpc.Config{Scope: scope, KeyField: "request-id"}},
		{"Config.Retention", db, idemgrpc.Config{Scope: scope, Retention: time.Nanosecond}},
		{"Config.Retention", db, idemgrpc.Config{Scope: scope, Retention: -time.Hour}},
		{"Config.Wait", db, idemgrpc.Config{Scope: scope, Wait: math.MaxInt32*time.Millisecond + time.Millisecond}},
		{"Config.MaxResponseBytes", db, idemgrpc.Config{Scope: scope, MaxResponseBytes: math.MaxInt}},
		{"Config.MaxResponseBytes", db, idemgrpc.Config{Scope: scope, MaxResponseBytes: math.MaxInt / 4 * 3, Codec: &countingCodec{}}},
		{"Config.TxOptions.IsoLevel", db, idemgrpc.Config{Scope: scope, TxOptions: pgx.TxOptions{IsoLevel: "snapshot"}}},
		{"Config.TxOptions.AccessMode", db, idemgrpc.Config{Scope: scope, TxOptions: pgx.TxOptions{AccessMode: pgx.ReadOnly}}},
		{"Config.TxOptions.AccessMode", db, idemgrpc.Config{Scope: scope, TxOptions: pgx.TxOptions{AccessMode: "sometimes"}}},
		{"Config.TxOptions.DeferrableMode", db, idemgrpc.Config{Scope: scope, TxOptions: pgx.TxOptions{DeferrableMode: "later"}}},
	} {
		interceptor, err := idemgrpc.NewServerInterceptor(tc.db, tc.cfg)
		if interceptor != nil || !errors.Is(err, idem.ErrInvalidOption) || !strings.HasPrefix(fmtVal(err), "idemgrpc: "+tc.field+": ") {
			t.Errorf("%s in %+v: got %v; want an error that names it and wraps idem.ErrInvalidOption", tc.field, tc.cfg, err)
		}
	}
}

func TestNewServerInterceptorAcceptsTheZeroValuesAndNone(t *testing.T) {
	t.Parallel()
	scope := func(context.Context) (string, error) { return "t", nil }
	for _, cfg := range []idemgrpc.Config{
		{Scope: scope},
		{Scope: scope, Wait: -1, MaxResponseBytes: -1},
		{Scope: scope, Metadata: "X-Request-Key", KeyField: "request_id"},
		{Scope: scope, Required: true, Methods: []string{"/p.S/A", "/p.S/B"}, Optional: []string{"/p.S/B"}},
		{Scope: scope, TxOptions: pgx.TxOptions{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadWrite, DeferrableMode: pgx.NotDeferrable}},
		{Scope: scope, MaxResponseBytes: 1 << 30, Codec: &countingCodec{}},
	} {
		if _, err := idemgrpc.NewServerInterceptor(&pgxpool.Pool{}, cfg); err != nil {
			t.Errorf("%+v: %v", cfg, err)
		}
	}
}

func fmtVal(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
