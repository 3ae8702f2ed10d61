// Package faultproxy is a TCP proxy for tests and soaks that spoil the
// connections between a client and its server on purpose: cut them, freeze
// them, delay what they carry, or read it to cut at a chosen moment.
//
// A [Proxy] listens on 127.0.0.1 only and, for each connection it accepts,
// dials the server and runs a [Pipe] in each direction. When either Pipe
// returns, the proxy closes both ends: that is how a Pipe cuts its
// connection, and each side sees its peer vanish without a goodbye.
// [Copy] passes bytes on as they come; [Proxy.CutRandom] and
// [Proxy.CutClient] cut from outside.
//
//	p, err := faultproxy.Start(faultproxy.Config{
//		Address: "127.0.0.1:5432",
//		Pipes: func() (toServer, toClient faultproxy.Pipe) {
//			return faultproxy.Copy, cutAfterTheFirstReply
//		},
//	})
//	...
//	defer p.Close()
//	// connect the client to p.Addr()
//
// The lab's soak, its delay proxy for benchmarks and the library's tests of
// frozen connections are built on it.
package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// DialTimeout bounds the proxy's connection to the server: while the
// server is down, a client's connection fails within it instead of
// hanging.
const DialTimeout = 5 * time.Second

// A Pipe carries one direction of a proxied connection, from src to dst,
// and returns when it is done: when src or dst fails, or when it decides to
// cut the connection. The proxy then closes both ends, which ends the other
// direction's Pipe too.
type Pipe func(dst, src net.Conn)

// Copy is the Pipe that passes everything on as it comes.
func Copy(dst, src net.Conn) { _, _ = io.Copy(dst, src) }

// Config says where a Proxy forwards to, and how.
type Config struct {
	// Network and Address are the server's, as net.Dial takes them: "tcp"
	// and "127.0.0.1:5432", or "unix" and a socket's path. Network defaults
	// to "tcp".
	Network, Address string
	// Pipes returns the two Pipes of a new connection: toServer carries
	// what the client sends, toClient what the server sends back. It is
	// called once for each connection, so that the two may share that
	// connection's state. Nil, or a nil Pipe, means Copy.
	Pipes func() (toServer, toClient Pipe)
}

// Proxy is a running proxy. Its methods are safe for concurrent use.
type Proxy struct {
	listener net.Listener
	cfg      Config

	mu     sync.Mutex
	conns  map[*conn]struct{}
	closed bool
	wg     sync.WaitGroup

	accepted atomic.Int64
}

// conn is one client connection and its connection to the server.
type conn struct {
	client, server net.Conn
	once           sync.Once
}

// cut closes both ends, and reports whether they were still open.
func (c *conn) cut() bool {
	cut := false
	c.once.Do(func() {
		_ = c.client.Close()
		_ = c.server.Close()
		cut = true
	})
	return cut
}

// Start starts a proxy on a free port of 127.0.0.1 that forwards every
// connection to the server cfg names. Close stops it.
func Start(cfg Config) (*Proxy, error) {
	if cfg.Address == "" {
		return nil, errors.New("faultproxy: Config.Address: empty")
	}
	if cfg.Network == "" {
		cfg.Network = "tcp"
	}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen: %w", err)
	}
	p := &Proxy{listener: listener, cfg: cfg, conns: make(map[*conn]struct{})}
	p.wg.Go(p.accept)
	return p, nil
}

// PostgresAddress returns the network and address of a PostgreSQL server
// as libpq reads its host and port: a Unix socket in the directory host
// names when host is a path, or else TCP.
func PostgresAddress(host string, port uint16) (network, address string) {
	if strings.HasPrefix(host, "/") {
		return "unix", fmt.Sprintf("%s/.s.PGSQL.%d", host, port)
	}
	return "tcp", net.JoinHostPort(host, fmt.Sprint(port))
}

// Addr returns the address the proxy listens on.
func (p *Proxy) Addr() *net.TCPAddr { return p.listener.Addr().(*net.TCPAddr) }

// Accepted returns how many connections the proxy accepted so far, those
// it could not forward included.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// CutRandom cuts one connection chosen at random, whatever it is doing, and
// reports whether there was one to cut.
func (p *Proxy) CutRandom() bool {
	p.mu.Lock()
	var victim *conn
	if n := len(p.conns); n > 0 {
		skip := rand.IntN(n)
		for c := range p.conns {
			if skip == 0 {
				victim = c
				break
			}
			skip--
		}
	}
	p.mu.Unlock()
	return victim != nil && victim.cut()
}

// CutClient cuts the connection whose client end is at addr (the client's
// local address), and reports whether it was open.
func (p *Proxy) CutClient(addr net.Addr) bool {
	p.mu.Lock()
	var victim *conn
	for c := range p.conns {
		if c.client.RemoteAddr().String() == addr.String() {
			victim = c
			break
		}
	}
	p.mu.Unlock()
	return victim != nil && victim.cut()
}

// Close stops accepting, cuts every connection and waits for the proxy's
// goroutines, and so for its Pipes, to end.
func (p *Proxy) Close() {
	_ = p.listener.Close()
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.cut()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	for {
		client, err := p.listener.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// Out of file descriptors, say: the clients' connects fail
			// meanwhile, and they retry.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.accepted.Add(1)
		p.wg.Go(func() { p.serve(client) })
	}
}

func (p *Proxy) serve(client net.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), DialTimeout)
	server, err := new(net.Dialer).DialContext(ctx, p.cfg.Network, p.cfg.Address)
	cancel()
	if err != nil {
		_ = client.Close()
		return
	}
	c := &conn{client: client, server: server}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.cut()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	defer func() {
		c.cut()
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
	}()

	toServer, toClient := Copy, Copy
	if p.cfg.Pipes != nil {
		up, down := p.cfg.Pipes()
		if up != nil {
			toServer = up
		}
		if down != nil {
			toClient = down
		}
	}
	var pipes sync.WaitGroup
	pipes.Go(func() { toServer(server, client); c.cut() })
	pipes.Go(func() { toClient(client, server); c.cut() })
	pipes.Wait()
}
