package idemgrpc_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// blocking wraps payments: each run reports its backend's pid on started
// after its insert, then answers only once release is closed.
type blocking struct {
	payments
	started     chan int32
	release     chan struct{}
	releaseOnce sync.Once
}

func newBlocking(t *testing.T) *blocking {
	b := &blocking{started: make(chan int32, 10), release: make(chan struct{})}
	// Never leave a handler blocked: the server waits for it to stop.
	t.Cleanup(b.unblock)
	return b
}

func (b *blocking) unblock() { b.releaseOnce.Do(func() { close(b.release) }) }

func (b *blocking) server() *testpb.PaymentsServer {
	return &testpb.PaymentsServer{Pay: func(ctx context.Context, req *testpb.PayRequest) (*testpb.Payment, error) {
		var pid int32
		if err := idemgrpc.Tx(ctx).QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return nil, err
		}
		res, err := b.pay(ctx, req)
		b.started <- pid
		<-b.release
		return res, err
	}}
}

// awaitStarted returns the pid that the handler reports once it has
// started on the call answered on first, failing the test when that call
// is answered first, or after a minute.
func (b *blocking) awaitStarted(t *testing.T, first <-chan answer) int32 {
	t.Helper()
	select {
	case pid := <-b.started:
		return pid
	case a := <-first:
		t.Fatalf("the first call was answered (%v) before its handler started", a.err)
	case <-time.After(time.Minute):
		t.Fatal("the first call's handler did not start within a minute")
	}
	return 0
}

// payAsync calls pay on a goroutine of its own and delivers the answer.
func payAsync(ctx context.Context, conn *grpc.ClientConn, tenant, key string, req *testpb.PayRequest) <-chan answer {
	out := make(chan answer, 1)
	go func() { out <- pay(ctx, conn, tenant, key, req) }()
	return out
}

func TestConcurrentDuplicateWaitsAndReplays(t *testing.T) {
	ctx, pool, tenant := setup(t)
	b := newBlocking(t)
	conn := serve(t, pool, idemgrpc.Config{Wait: time.Minute}, b.server())
	req := &testpb.PayRequest{AmountCents: 300}

	firstDone := payAsync(ctx, conn, tenant, "k", req)
	pid := b.awaitStarted(t, firstDone)
	secondDone := payAsync(ctx, conn, tenant, "k", req)
	waitForBlocked(ctx, t, pool, pid)
	b.unblock()
	first, second := <-firstDone, <-secondDone
	if first.err != nil || second.err != nil || !proto.Equal(first.res, second.res) || !second.replayed() {
		t.Fatalf("first %v %v, duplicate %v %v replayed %t; want the first answer replayed", first.res, first.err, second.res, second.err, second.replayed())
	}
	if runs, rows := b.runs.Load(), countPayments(t, pool, tenant); runs != 1 || rows != 1 {
		t.Fatalf("%d runs and %d payments, want 1 and 1", runs, rows)
	}
}

func TestStillRunningPastTheWaitIsAbortedWithRetryInfo(t *testing.T) {
	ctx, pool, tenant := setup(t)
	b := newBlocking(t)
	conn := serve(t, pool, idemgrpc.Config{Wait: -1}, b.server())
	req := &testpb.PayRequest{AmountCents: 300}

	firstDone := payAsync(ctx, conn, tenant, "k", req)
	b.awaitStarted(t, firstDone)
	second := pay(ctx, conn, tenant, "k", req)
	st := wantReason(t, second.err, codes.Aborted, idemgrpc.ReasonKeyInProgress)
	var delay time.Duration
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.RetryInfo); ok {
			delay = info.GetRetryDelay().AsDuration()
		}
	}
	// No wait: the delay is the least, a second.
	if delay != time.Second {
		t.Fatalf("RetryInfo delay %s, want 1s", delay)
	}
	if got := second.trailer.Get("grpc-retry-pushback-ms"); len(got) != 1 || got[0] != "1000" {
		t.Fatalf("trailer grpc-retry-pushback-ms %q, want 1000", got)
	}
	b.unblock()
	if first := <-firstDone; first.err != nil {
		t.Fatal(first.err)
	}
	if retry := pay(ctx, conn, tenant, "k", req); retry.err != nil || !retry.replayed() || b.runs.Load() != 1 {
		t.Fatalf("the retry after the first completed: %v, replayed %t, %d runs", retry.err, retry.replayed(), b.runs.Load())
	}
}

func TestDuplicateStormHasOneEffect(t *testing.T) {
	ctx, pool, tenant := setup(t)
	var p payments
	conn := serve(t, pool, idemgrpc.Config{Wait: time.Minute}, p.server())
	const keys, duplicates = 8, 8
	answers := make(chan answer, keys*duplicates)
	var wg sync.WaitGroup
	for k := range keys {
		for range duplicates {
			wg.Go(func() {
				a := pay(ctx, conn, tenant, "storm-"+string(rune('a'+k)), &testpb.PayRequest{AmountCents: int64(k)})
				answers <- a
			})
		}
	}
	wg.Wait()
	close(answers)
	byAmount := map[int64]*testpb.Payment{}
	for a := range answers {
		if a.err != nil {
			t.Fatalf("a duplicate failed: %v", status.Convert(a.err).Proto())
		}
		if first, ok := byAmount[a.res.GetAmountCents()]; ok && !proto.Equal(first, a.res) {
			t.Fatalf("duplicates of one key got %v and %v", first, a.res)
		}
		byAmount[a.res.GetAmountCents()] = a.res
	}
	if runs, rows := p.runs.Load(), countPayments(t, pool, tenant); runs != keys || rows != keys {
		t.Fatalf("%d calls on %d keys: %d runs and %d payments, want %d", keys*duplicates, keys, runs, rows, keys)
	}
}
