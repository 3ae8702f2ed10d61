package bench_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem/lab/bench"
)

// echoServer listens on 127.0.0.1 and sends back what it reads, until the
// test ends. It returns its address.
func echoServer(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = l.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				continue
			}
			wg.Go(func() { _, _ = io.Copy(c, c); _ = c.Close() })
		}
	})
	return l.Addr().String()
}

func dialProxy(t *testing.T, p *bench.DelayProxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestDelayProxyAddsTheRoundTripAndKeepsTheOrder(t *testing.T) {
	const delay = 30 * time.Millisecond
	p, err := bench.NewDelayProxy("tcp", echoServer(t), delay)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if !p.Addr().IP.IsLoopback() {
		t.Fatalf("proxy listens on %v, not on loopback", p.Addr())
	}
	c := dialProxy(t, p)
	// Many writes in a row, faster than the delay: all held at once, and
	// given back in the order sent.
	var sent bytes.Buffer
	start := time.Now()
	for i := range 200 {
		msg := []byte{byte(i), byte(i >> 8), 'x'}
		sent.Write(msg)
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
	}
	got := make([]byte, sent.Len())
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if elapsed := time.Since(start); elapsed < delay {
		t.Errorf("echo came back after %v, before the %v delay", elapsed, delay)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatal("bytes came back out of order or changed")
	}
	// One round trip at a time: each one the delay longer, not two (the
	// median, so that one stall of a busy machine does not fail the test).
	var rts []time.Duration
	for range 5 {
		t0 := time.Now()
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, got[:4]); err != nil {
			t.Fatal(err)
		}
		rts = append(rts, time.Since(t0))
	}
	slices.Sort(rts)
	// The 200 writes made at least one round trip (the first ones may have
	// gone before the echo of any came back) and at most a few; each ping
	// one more.
	if n := p.RoundTrips(); n < 6 || n > 5+10 {
		t.Errorf("%d round trips counted, want 5 pings and a few for the burst", n)
	}
	if rts[0] < delay || rts[2] > delay*3/2 {
		t.Errorf("round trips through a %v proxy took %v", delay, rts)
	}
}

func TestDelayProxyAllocatesNothingPerMessage(t *testing.T) {
	p, err := bench.NewDelayProxy("tcp", echoServer(t), 100*time.Microsecond)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c := dialProxy(t, p)
	buf := make([]byte, 64)
	roundTrip := func() {
		if _, err := c.Write(buf); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatal(err)
		}
	}
	for range 50 {
		roundTrip()
	}
	const n = 1000
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		roundTrip()
	}
	runtime.ReadMemStats(&after)
	if per := float64(after.Mallocs-before.Mallocs) / n; per > 0.2 {
		t.Errorf("%.2f allocations per round trip through the proxy and the echo server", per)
	}
}

func TestDelayProxyCloseEndsItsConnections(t *testing.T) {
	p, err := bench.NewDelayProxy("tcp", echoServer(t), time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	c := dialProxy(t, p)
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	p.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("read after Close: %v, want EOF", err)
	}
}
