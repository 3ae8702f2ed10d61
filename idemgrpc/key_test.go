package idemgrpc_test

import (
	"bytes"
	"errors"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

func TestKeyFieldCarriesTheKeyAsAIP155Asks(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{KeyField: "request_id"}, p.server())
	withID := &testpb.PayRequest{RequestId: "r-1", AmountCents: 500}

	first := pay(ctx, conn, tenant, noKey, withID)
	if first.err != nil {
		t.Fatal(first.err)
	}
	if n := count(t, pool, `SELECT count(*) FROM payment WHERE scope = $1 AND key = 'r-1'`, tenant); n != 1 {
		t.Fatalf("%d payments under the key r-1, want the request_id as the call's key", n)
	}
	// The same key in the metadata instead: the fingerprint leaves the key's
	// field out, so that this is the same request.
	for _, retry := range []struct {
		name string
		key  string
		req  *testpb.PayRequest
	}{
		{"request_id again", noKey, withID},
		{"the key in the metadata", "r-1", &testpb.PayRequest{AmountCents: 500}},
		{"the same key in both", "r-1", withID},
	} {
		a := pay(ctx, conn, tenant, retry.key, retry.req)
		if a.err != nil || !a.replayed() || !proto.Equal(a.res, first.res) {
			t.Fatalf("%s: %v %v, replayed %t; want the first answer replayed", retry.name, a.res, a.err, a.replayed())
		}
	}
	a := pay(ctx, conn, tenant, "r-2", withID)
	wantReason(t, a.err, codes.InvalidArgument, idemgrpc.ReasonKeyInvalid)
	if p.runs.Load() != 1 {
		t.Fatalf("%d runs, want 1", p.runs.Load())
	}
}

func TestKeyFieldThatIsNoStringIsInternal(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{KeyField: "amount_cents", Logger: discard}, p.server())
	a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1})
	wantReason(t, a.err, codes.Internal, idemgrpc.ReasonRequestFailed)
	if p.runs.Load() != 0 {
		t.Fatal("the handler ran")
	}
}

// rawCodec sends a rawMessage as its bytes, as they are, under the name
// of gRPC's protobuf codec, which the server then uses to read them.
type rawCodec struct{}

type rawMessage []byte

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) ([]byte, error) { return v.(rawMessage), nil }

func (rawCodec) Unmarshal(data []byte, v any) error { return proto.Unmarshal(data, v.(proto.Message)) }

func TestFingerprintIgnoresTheOrderOfMapEntriesOnTheWire(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{}, p.server())
	part := func(m *testpb.PayRequest) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	// Messages concatenated on the wire are merged: the same request, with
	// its map's entries in two orders.
	amount, a, b := part(&testpb.PayRequest{AmountCents: 5}), part(&testpb.PayRequest{Labels: map[string]string{"a": "1"}}),
		part(&testpb.PayRequest{Labels: map[string]string{"b": "2"}})
	abOrder, baOrder := bytes.Join([][]byte{amount, a, b}, nil), bytes.Join([][]byte{amount, b, a}, nil)
	if bytes.Equal(abOrder, baOrder) {
		t.Fatal("the two encodings are the same bytes")
	}
	ctx = metadata.AppendToOutgoingContext(ctx, tenantMetadata, tenant, idemgrpc.DefaultMetadata, "k")
	var first, retry testpb.Payment
	var header metadata.MD
	if err := conn.Invoke(ctx, testpb.PaymentsPay, rawMessage(abOrder), &first, grpc.ForceCodec(rawCodec{})); err != nil {
		t.Fatal(err)
	}
	if err := conn.Invoke(ctx, testpb.PaymentsPay, rawMessage(baOrder), &retry, grpc.ForceCodec(rawCodec{}), grpc.Header(&header)); err != nil {
		t.Fatalf("the same request with its map in another order: %v", err)
	}
	if !proto.Equal(&first, &retry) || len(header.Get(idemgrpc.ReplayedMetadata)) != 1 || len(first.GetLabels()) != 2 {
		t.Fatalf("retry got %v, header %v; want %v replayed", &retry, header, &first)
	}
}

func TestFingerprintFromConfig(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	byAmount := func(method string, req proto.Message) ([]byte, error) {
		pr := req.(*testpb.PayRequest)
		if pr.GetAmountCents() < 0 {
			return nil, errors.New("negative")
		}
		return []byte(method + string(rune(pr.GetAmountCents()))), nil
	}
	conn := serve(t, pool, idemgrpc.Config{Fingerprint: byAmount}, p.server())
	pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1, Labels: map[string]string{"note": "one"}})
	if a := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1, Labels: map[string]string{"note": "two"}}); a.err != nil || !a.replayed() {
		t.Fatalf("a retry that differs only where the fingerprint does not look: %v, replayed %t", a.err, a.replayed())
	}
	a := pay(ctx, conn, tenant, "k2", &testpb.PayRequest{AmountCents: -1})
	wantReason(t, a.err, codes.InvalidArgument, idemgrpc.ReasonFingerprintFailed)
}
