package faultproxy_test

import (
	"errors"
	"io"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/faultproxy"
)

// server listens on 127.0.0.1 until the test ends, and hands each
// connection it accepts to the test.
func server(t *testing.T) (string, <-chan net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns := make(chan net.Conn, 16)
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		served []net.Conn
	)
	t.Cleanup(func() {
		_ = l.Close()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range served {
			_ = c.Close()
		}
	})
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			served = append(served, c)
			mu.Unlock()
			conns <- c
		}
	})
	return l.Addr().String(), conns
}

// echo sends back what c reads, until c closes.
func echo(c net.Conn) { go func() { _, _ = io.Copy(c, c) }() }

func start(t *testing.T, cfg faultproxy.Config) *faultproxy.Proxy {
	t.Helper()
	p, err := faultproxy.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func dial(t *testing.T, p *faultproxy.Proxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func accepted(t *testing.T, conns <-chan net.Conn) net.Conn {
	t.Helper()
	select {
	case c := <-conns:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("the proxy did not connect to the server")
		return nil
	}
}

// roundTrip sends msg on c and reads it back from the echo behind it.
func roundTrip(t *testing.T, c net.Conn, msg string) error {
	t.Helper()
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != msg {
		t.Fatalf("read %q back, sent %q", got, msg)
	}
	return nil
}

// cut reports whether c was closed by its peer: it reads EOF, or a reset.
func cut(t *testing.T, c net.Conn) bool {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := c.Read(make([]byte, 1))
	var timeout net.Error
	if errors.As(err, &timeout) && timeout.Timeout() {
		return false
	}
	return err != nil
}

func TestProxyForwardsBothWaysOnLoopbackOnly(t *testing.T) {
	t.Parallel()
	addr, conns := server(t)
	p := start(t, faultproxy.Config{Address: addr})
	if !p.Addr().IP.IsLoopback() {
		t.Fatalf("the proxy listens on %v, not on loopback", p.Addr())
	}
	c := dial(t, p)
	echo(accepted(t, conns))
	for _, msg := range []string{"one", "two", "three"} {
		if err := roundTrip(t, c, msg); err != nil {
			t.Fatal(err)
		}
	}
	if n := p.Accepted(); n != 1 {
		t.Fatalf("Accepted() = %d, want 1", n)
	}
}

// TestAPipeThatReturnsCutsBothEnds checks how a Pipe cuts: when it returns,
// the client and the server each see their peer gone, and the other
// direction's Pipe ends too.
func TestAPipeThatReturnsCutsBothEnds(t *testing.T) {
	t.Parallel()
	addr, conns := server(t)
	var ended atomic.Int64
	p := start(t, faultproxy.Config{Address: addr, Pipes: func() (faultproxy.Pipe, faultproxy.Pipe) {
		toServer := func(dst, src net.Conn) { faultproxy.Copy(dst, src); ended.Add(1) }
		// Passes the first reply on, and cuts instead of passing the second.
		toClient := func(dst, src net.Conn) {
			defer ended.Add(1)
			buf := make([]byte, 64)
			for i := 0; ; i++ {
				n, err := src.Read(buf)
				if err != nil || i == 1 {
					return
				}
				if _, err := dst.Write(buf[:n]); err != nil {
					return
				}
			}
		}
		return toServer, toClient
	}})
	c := dial(t, p)
	s := accepted(t, conns)
	echo(s)
	if err := roundTrip(t, c, "first"); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(t, c, "second"); err == nil {
		t.Fatal("the second reply came through a Pipe that cut the connection")
	}
	if !cut(t, c) {
		t.Fatal("the client's connection is still open")
	}
	if !cut(t, s) {
		t.Fatal("the server's connection is still open")
	}
	p.Close()
	if n := ended.Load(); n != 2 {
		t.Fatalf("%d Pipes ended after Close, want both", n)
	}
}

func TestCutClientAndCutRandomCutOneConnection(t *testing.T) {
	t.Parallel()
	addr, conns := server(t)
	p := start(t, faultproxy.Config{Address: addr})
	if p.CutRandom() {
		t.Fatal("CutRandom cut something with no connection open")
	}
	a, b := dial(t, p), dial(t, p)
	echo(accepted(t, conns))
	echo(accepted(t, conns))
	// Both are forwarded, so the proxy holds both.
	for _, c := range []net.Conn{a, b} {
		if err := roundTrip(t, c, "hello"); err != nil {
			t.Fatal(err)
		}
	}
	if !p.CutClient(a.LocalAddr()) {
		t.Fatal("CutClient did not find the first connection")
	}
	if !cut(t, a) {
		t.Fatal("CutClient left its connection open")
	}
	if p.CutClient(a.LocalAddr()) {
		t.Fatal("CutClient cut a connection twice")
	}
	if err := roundTrip(t, b, "still"); err != nil {
		t.Fatalf("CutClient cut the other connection too: %v", err)
	}
	// The cut connection may not be gone from the proxy yet: CutRandom
	// may pick it, and then reports false. It cuts b within a few tries.
	deadline := time.Now().Add(10 * time.Second)
	for !p.CutRandom() {
		if time.Now().After(deadline) {
			t.Fatal("CutRandom cut nothing")
		}
	}
	if !cut(t, b) {
		t.Fatal("CutRandom left the open connection open")
	}
}

func TestCloseCutsEveryConnectionAndEndsThePipes(t *testing.T) {
	t.Parallel()
	addr, conns := server(t)
	var running atomic.Int64
	p, err := faultproxy.Start(faultproxy.Config{Address: addr, Pipes: func() (faultproxy.Pipe, faultproxy.Pipe) {
		pipe := func(dst, src net.Conn) { running.Add(1); faultproxy.Copy(dst, src); running.Add(-1) }
		return pipe, pipe
	}})
	if err != nil {
		t.Fatal(err)
	}
	clients := []net.Conn{dial(t, p), dial(t, p), dial(t, p)}
	for range clients {
		echo(accepted(t, conns))
	}
	for _, c := range clients {
		if err := roundTrip(t, c, "ping"); err != nil {
			t.Fatal(err)
		}
	}
	p.Close()
	if n := running.Load(); n != 0 {
		t.Fatalf("%d Pipes still running after Close", n)
	}
	for i, c := range clients {
		if !cut(t, c) {
			t.Fatalf("connection %d still open after Close", i)
		}
	}
}

func TestAnUnreachableServerClosesTheClientsConnection(t *testing.T) {
	t.Parallel()
	// A socket nobody listens on, which no other test can take.
	p := start(t, faultproxy.Config{Network: "unix", Address: filepath.Join(t.TempDir(), "nobody")})
	c := dial(t, p)
	if !cut(t, c) {
		t.Fatal("the client's connection stayed open with no server behind it")
	}
	if n := p.Accepted(); n != 1 {
		t.Fatalf("Accepted() = %d, want 1", n)
	}
}

func TestStartRefusesNoAddress(t *testing.T) {
	t.Parallel()
	if p, err := faultproxy.Start(faultproxy.Config{}); err == nil {
		p.Close()
		t.Fatal("Start accepted a Config without an Address")
	}
}

func TestPostgresAddressReadsTheHostAsLibpqDoes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		host             string
		network, address string
	}{
		{"127.0.0.1", "tcp", "127.0.0.1:5432"},
		{"::1", "tcp", "[::1]:5432"},
		{"db.example.com", "tcp", "db.example.com:5432"},
		{"/var/run/postgresql", "unix", "/var/run/postgresql/.s.PGSQL.5432"},
	} {
		network, address := faultproxy.PostgresAddress(c.host, 5432)
		if network != c.network || address != c.address {
			t.Errorf("PostgresAddress(%q, 5432) = %s %s, want %s %s", c.host, network, address, c.network, c.address)
		}
	}
}
