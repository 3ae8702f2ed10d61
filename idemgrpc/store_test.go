package idemgrpc_test

import (
	"sync/atomic"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

func TestDefiniteErrorIsStoredAndReplayedWithItsDetails(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{}, p.server())
	declined := &testpb.PayRequest{AmountCents: 20000}
	first := pay(ctx, conn, tenant, "k", declined)
	retry := pay(ctx, conn, tenant, "k", declined)
	a, b := status.Convert(first.err), status.Convert(retry.err)
	if a.Code() != codes.FailedPrecondition || !proto.Equal(a.Proto(), b.Proto()) {
		t.Fatalf("retry of a declined payment got %v, want the first answer %v again", b.Proto(), a.Proto())
	}
	if info, ok := b.Details()[0].(*errdetails.ErrorInfo); !ok || info.GetReason() != "CARD_DECLINED" {
		t.Fatalf("replayed details %v, want the handler's ErrorInfo", b.Details())
	}
	if first.replayed() || !retry.replayed() {
		t.Fatalf("replayed marks: first %t, retry %t; want false, true", first.replayed(), retry.replayed())
	}
	// The declined payment's row committed with the stored error.
	if runs, rows := p.runs.Load(), countPayments(t, pool, tenant); runs != 1 || rows != 1 {
		t.Fatalf("%d runs and %d payments, want 1 and 1", runs, rows)
	}
}

func TestRetryableErrorRollsBackAndIsNotStored(t *testing.T) {
	for _, code := range []codes.Code{codes.Unavailable, codes.DeadlineExceeded, codes.Aborted, codes.Internal, codes.Unknown} {
		t.Run(code.String(), func(t *testing.T) {
			ctx, pool, tenant := setup(t)
			var p payments
			p.failWith(status.Error(code, "try again"))
			conn := serve(t, pool, idemgrpc.Config{}, p.server())
			first := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1})
			if st := status.Convert(first.err); st.Code() != code || st.Message() != "try again" {
				t.Fatalf("first call got %v, want the handler's own error", first.err)
			}
			if rows, records := countPayments(t, pool, tenant), countRecords(t, pool, tenant); rows != 0 || records != 0 {
				t.Fatalf("after %s: %d payments and %d records, want everything rolled back", code, rows, records)
			}
			p.failWith(nil)
			if retry := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1}); retry.err != nil || retry.replayed() {
				t.Fatalf("retry: %v, replayed %t; want a run of its own", retry.err, retry.replayed())
			}
			if p.runs.Load() != 2 {
				t.Fatalf("%d runs, want 2", p.runs.Load())
			}
		})
	}
}

func TestStorePolicyDecidesWhichErrorsAreStored(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	p.failWith(status.Error(codes.Unavailable, "stored on purpose"))
	storeAll := func(codes.Code) bool { return true }
	conn := serve(t, pool, idemgrpc.Config{Store: storeAll}, p.server())
	pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1})
	p.failWith(nil)
	retry := pay(ctx, conn, tenant, "k", &testpb.PayRequest{AmountCents: 1})
	if status.Code(retry.err) != codes.Unavailable || !retry.replayed() || p.runs.Load() != 1 {
		t.Fatalf("retry under a Store that keeps UNAVAILABLE: %v, replayed %t, %d runs; want the stored error", retry.err, retry.replayed(), p.runs.Load())
	}

	// A call without a key commits by the same policy: under the default,
	// an UNAVAILABLE rolls back.
	conn = serve(t, pool, idemgrpc.Config{}, p.server())
	p.failWith(status.Error(codes.Unavailable, "rolled back"))
	pay(ctx, conn, tenant, noKey, &testpb.PayRequest{AmountCents: 1})
	if n := count(t, pool, `SELECT count(*) FROM payment WHERE key = ''`); n != 0 {
		t.Fatalf("a call without a key that failed UNAVAILABLE left %d payments", n)
	}
}

func TestStoreDefinite(t *testing.T) {
	t.Parallel()
	stored := map[codes.Code]bool{
		codes.InvalidArgument: true, codes.NotFound: true, codes.AlreadyExists: true, codes.PermissionDenied: true,
		codes.FailedPrecondition: true, codes.OutOfRange: true, codes.Unimplemented: true,
	}
	for code := codes.OK; code <= codes.Unauthenticated; code++ {
		if got := idemgrpc.StoreDefinite(code); got != stored[code] {
			t.Errorf("StoreDefinite(%s) = %t, want %t", code, got, stored[code])
		}
	}
}

func TestCodecSealsTheStoredAnswer(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	codec := &countingCodec{}
	conn := serve(t, pool, idemgrpc.Config{Codec: codec}, p.server())
	req := &testpb.PayRequest{AmountCents: 42, Labels: map[string]string{"secret": "s3cr3t"}}
	first, retry := pay(ctx, conn, tenant, "k", req), pay(ctx, conn, tenant, "k", req)
	if retry.err != nil || !proto.Equal(first.res, retry.res) {
		t.Fatalf("retry under a codec: %v, %v", retry.res, retry.err)
	}
	if codec.sealed.Load() != 1 || codec.opened.Load() != 1 {
		t.Fatalf("codec sealed %d and opened %d answers, want 1 and 1", codec.sealed.Load(), codec.opened.Load())
	}
	// Sealed bytes are stored as a JSON string, not as the stored answer's
	// object.
	if n := count(t, pool, `SELECT count(*) FROM idempotency_key WHERE scope = $1 AND jsonb_typeof(response) = 'string'`, tenant); n != 1 {
		t.Fatal("the stored answer is not sealed")
	}
}

// countingCodec reverses the bytes it seals, and counts.
type countingCodec struct{ sealed, opened atomic.Int64 }

var _ idem.Codec = (*countingCodec)(nil)

func (c *countingCodec) Seal(_ string, b []byte) ([]byte, error) {
	c.sealed.Add(1)
	return reverse(b), nil
}
func (c *countingCodec) Open(_ string, b []byte) ([]byte, error) {
	c.opened.Add(1)
	return reverse(b), nil
}

func reverse(b []byte) []byte {
	out := make([]byte, len(b))
	for i := range b {
		out[len(b)-1-i] = b[i]
	}
	return out
}
