package bench

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/faultproxy"
)

// DelayProxy is a TCP proxy on 127.0.0.1 that puts a round trip's delay
// between a pool and its server, to measure designs as they would run with
// the database across a network instead of on the same machine.
//
// The whole round trip is added on the way back: every byte the server
// sends is held for the delay, counted from when the proxy read it, then
// passed on in order; what the client sends goes through at once. For a
// protocol of requests and replies that is the same as half the delay each
// way: the client waits the delay longer for each reply, and the server
// waits it longer for the next request after each reply, holding its locks
// meanwhile. It is also more exact: Go's timers wake no sooner than about a
// millisecond when the process is idle, so two half-millisecond waits would
// make two milliseconds. The round trip added is still somewhat longer
// than the delay asked for: the timer's lateness, and the proxy's own
// hops, 0.2 to 0.5 ms in all for 1 ms on a busy 2-core machine.
// [PingTime] measures it, and go run ./lab bench prints it.
//
// Each connection has a goroutine per direction, and one more to write
// back what was held; once a connection's buffers exist, passing messages
// allocates nothing, so the proxy does not show in the benchmark's counts
// of allocations. The proxy listens on 127.0.0.1 only, and does not read
// what it passes: TLS goes through it. It counts round trips, as the times
// a client sent something after the proxy had passed it a reply.
type DelayProxy struct {
	proxy *faultproxy.Proxy
	delay time.Duration

	roundTrips atomic.Int64
}

// delayedConn is the state one connection's two directions share.
type delayedConn struct {
	// replied is set when the client was passed something from the server,
	// and cleared when the client next sends: each clearing is a round trip.
	replied atomic.Bool
}

// NewDelayProxy starts a proxy on 127.0.0.1 that forwards every connection
// to the server at network and address (as net.Dial takes them), adding
// roundTrip to each round trip.
func NewDelayProxy(network, address string, roundTrip time.Duration) (*DelayProxy, error) {
	if roundTrip < 0 {
		return nil, fmt.Errorf("delay proxy: negative delay %v", roundTrip)
	}
	p := &DelayProxy{delay: roundTrip}
	proxy, err := faultproxy.Start(faultproxy.Config{Network: network, Address: address, Pipes: p.pipes})
	if err != nil {
		return nil, fmt.Errorf("delay proxy: %w", err)
	}
	p.proxy = proxy
	return p, nil
}

// Addr returns the address the proxy listens on.
func (p *DelayProxy) Addr() *net.TCPAddr { return p.proxy.Addr() }

// RoundTrips returns how many round trips the proxy's connections made so
// far: the times a client sent something after it had been passed a reply.
// Statements a client pipelines count once, even when the server answers
// the first before the client has sent the last, so long as the client
// sends them within the delay.
func (p *DelayProxy) RoundTrips() int64 { return p.roundTrips.Load() }

// Close stops accepting, closes every connection and waits for the proxy's
// goroutines to end.
func (p *DelayProxy) Close() { p.proxy.Close() }

// pipes returns a new connection's two directions: what the client sends
// goes on at once; what the server sends is held.
func (p *DelayProxy) pipes() (toServer, toClient faultproxy.Pipe) {
	c := new(delayedConn)
	c.replied.Store(true) // the startup message opens the first round trip
	toServer = func(server, client net.Conn) {
		buf := make([]byte, 32<<10)
		for {
			n, err := client.Read(buf)
			if n > 0 {
				if c.replied.Swap(false) {
					p.roundTrips.Add(1)
				}
				if _, werr := server.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	// When the server ends the connection, what it sent before still
	// reaches the client, late like the rest.
	toClient = func(client, server net.Conn) { p.hold(c, client, server) }
	return toServer, toClient
}

// chunk is what one read from the server returned, and when it is due.
type chunk struct {
	buf []byte
	due time.Time
}

// maxHeld bounds the chunks held per connection: a reader that gets that
// far ahead waits, as a full network would make the server wait.
const maxHeld = 64

// hold copies the server's side of c to the client's, each chunk read
// written delay later, in order. Buffers go back to a free list, so that a
// steady stream allocates none.
func (p *DelayProxy) hold(c *delayedConn, dst, src net.Conn) {
	queue := make(chan chunk, maxHeld)
	free := make(chan []byte, maxHeld+2)
	var writer sync.WaitGroup
	writer.Go(func() {
		failed := false
		for ch := range queue {
			if !failed {
				if wait := time.Until(ch.due); wait > 0 {
					time.Sleep(wait)
				}
				// Before the write: once written, the client may answer
				// before this goroutine runs again.
				c.replied.Store(true)
				if _, err := dst.Write(ch.buf); err != nil {
					// Close both, so that the reader stops too; keep
					// draining the queue until it does.
					failed = true
					_ = src.Close()
				}
			}
			select {
			case free <- ch.buf[:cap(ch.buf)]:
			default:
			}
		}
	})
	for {
		var buf []byte
		select {
		case buf = <-free:
		default:
			buf = make([]byte, 16<<10)
		}
		n, err := src.Read(buf)
		if n > 0 {
			queue <- chunk{buf: buf[:n], due: time.Now().Add(p.delay)}
		}
		if err != nil {
			break
		}
	}
	close(queue)
	writer.Wait()
}

// DelayedPool opens a pool with cfg's settings but whose connections go
// through a new DelayProxy to cfg's first host, with roundTrip added to
// each round trip, and at most maxConns connections (cfg's when 0). TLS,
// when cfg has it, still runs between pool and server. Close the pool,
// then the proxy.
func DelayedPool(ctx context.Context, cfg *pgxpool.Config, roundTrip time.Duration, maxConns int32) (*pgxpool.Pool, *DelayProxy, error) {
	cfg = cfg.Copy()
	cc := cfg.ConnConfig
	network, address := faultproxy.PostgresAddress(cc.Host, cc.Port)
	proxy, err := NewDelayProxy(network, address, roundTrip)
	if err != nil {
		return nil, nil, err
	}
	port := uint16(proxy.Addr().Port)
	cc.Host, cc.Port = "127.0.0.1", port
	for _, fb := range cc.Fallbacks {
		fb.Host, fb.Port = "127.0.0.1", port
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
		if err != nil {
			pool.Close()
		}
	}
	if err != nil {
		proxy.Close()
		return nil, nil, fmt.Errorf("connect through the delay proxy to %s: %w", address, err)
	}
	return pool, proxy, nil
}

// PingTime returns the median time of n round trips to the server on pool,
// each an empty query on a connection the pool already has.
func PingTime(ctx context.Context, pool *pgxpool.Pool, n int) (time.Duration, error) {
	n = max(n, 1)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	times := make([]time.Duration, n)
	for i := range times {
		t0 := time.Now()
		if err := conn.Ping(ctx); err != nil {
			return 0, err
		}
		times[i] = time.Since(t0)
	}
	slices.Sort(times)
	return times[n/2], nil
}
