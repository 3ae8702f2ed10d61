package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
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

// chaosProxy is a TCP proxy between the soak's pool and PostgreSQL that
// cuts connections on purpose. It reads the wire protocol in both
// directions, so that it can cut at the two moments that matter most to
// exactly-once: just before a COMMIT reaches the server (the transaction
// rolls back, the client cannot tell) and just after the server answered
// a COMMIT (the transaction committed, the client cannot tell). It also
// cuts a random connection whenever asked to.
//
// It listens on 127.0.0.1 only and cuts only connections it accepted, so
// its chaos never reaches anything outside the soak.
//
// The proxied connections must not use TLS: the proxy could not read the
// protocol through it.
type chaosProxy struct {
	listener net.Listener
	dial     func(ctx context.Context) (net.Conn, error)

	// cutBeforeCommit and cutAfterCommit are the chances that a COMMIT
	// seen in one direction or the other gets its connection cut.
	cutBeforeCommit float64
	cutAfterCommit  float64
	// startupDelay holds back the server's first ReadyForQuery on every
	// connection, as a busy machine makes connecting slow. Tests set it.
	startupDelay time.Duration

	mu     sync.Mutex
	conns  map[*proxiedConn]struct{}
	closed bool
	wg     sync.WaitGroup

	accepted         atomic.Int64
	cutsBeforeCommit atomic.Int64
	cutsAfterCommit  atomic.Int64
	cutsRandom       atomic.Int64
}

// proxiedConn is one client connection and its connection to the server.
type proxiedConn struct {
	client, server net.Conn
	closeOnce      sync.Once
}

// close closes both sides, and reports whether they were still open. A cut
// is nothing more: each side sees its peer vanish without a goodbye.
func (c *proxiedConn) close() bool {
	closed := false
	c.closeOnce.Do(func() {
		_ = c.client.Close()
		_ = c.server.Close()
		closed = true
	})
	return closed
}

// newChaosProxy starts a proxy on 127.0.0.1 that forwards every connection
// to the server that dial reaches, each startupDelay slower to start.
func newChaosProxy(dial func(ctx context.Context) (net.Conn, error), cutBeforeCommit, cutAfterCommit float64, startupDelay time.Duration) (*chaosProxy, error) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy: listen: %w", err)
	}
	p := &chaosProxy{
		listener:        listener,
		dial:            dial,
		cutBeforeCommit: cutBeforeCommit,
		cutAfterCommit:  cutAfterCommit,
		startupDelay:    startupDelay,
		conns:           make(map[*proxiedConn]struct{}),
	}
	p.wg.Go(p.accept)
	return p, nil
}

// addr returns the address the proxy listens on.
func (p *chaosProxy) addr() *net.TCPAddr { return p.listener.Addr().(*net.TCPAddr) }

// close stops accepting, cuts every connection and waits for the proxy's
// goroutines to end.
func (p *chaosProxy) close() {
	_ = p.listener.Close()
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// cutRandom cuts one connection chosen at random, whatever it is doing, and
// reports whether there was one to cut.
func (p *chaosProxy) cutRandom() bool {
	p.mu.Lock()
	var victim *proxiedConn
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
	if victim == nil || !victim.close() {
		return false
	}
	p.cutsRandom.Add(1)
	return true
}

// cutClient cuts the connection whose client end is at addr, and reports
// whether it was open.
func (p *chaosProxy) cutClient(addr net.Addr) bool {
	p.mu.Lock()
	var victim *proxiedConn
	for c := range p.conns {
		if c.client.RemoteAddr().String() == addr.String() {
			victim = c
			break
		}
	}
	p.mu.Unlock()
	return victim != nil && victim.close()
}

func (p *chaosProxy) accept() {
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

// proxyDialTimeout bounds the connection to the server, so that a server
// that is down (restarting) fails the client's connect instead of hanging.
const proxyDialTimeout = 5 * time.Second

func (p *chaosProxy) serve(client net.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), proxyDialTimeout)
	server, err := p.dial(ctx)
	cancel()
	if err != nil {
		_ = client.Close()
		return
	}
	c := &proxiedConn{client: client, server: server}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.close()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	defer func() {
		c.close()
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
	}()

	var pumps sync.WaitGroup
	pumps.Go(func() { p.pumpFrontend(c); c.close() })
	pumps.Go(func() { p.pumpBackend(c); c.close() })
	pumps.Wait()
}

// maxMessageLength bounds the length field the proxy trusts. Nothing the
// soak sends or receives comes near it; a larger value means the stream is
// not what the proxy thinks it is, and the connection is dropped.
const maxMessageLength = 64 << 20

// messageReader splits a protocol stream into whole messages: a type byte,
// then a length that counts itself. The first message a client sends (the
// startup or cancel request) has no type byte.
type messageReader struct {
	r       *bufio.Reader
	untyped bool
	buf     []byte
}

// next returns the next whole message, header included. The slice is only
// valid until the following call.
func (m *messageReader) next() ([]byte, error) {
	header := 5
	if m.untyped {
		header = 4
	}
	m.buf = grow(m.buf, header)
	if _, err := io.ReadFull(m.r, m.buf); err != nil {
		return nil, err
	}
	length := binary.BigEndian.Uint32(m.buf[header-4:])
	if length < 4 || length > maxMessageLength {
		return nil, fmt.Errorf("proxy: message length %d out of bounds", length)
	}
	m.untyped = false
	m.buf = grow(m.buf, header+int(length)-4)
	if _, err := io.ReadFull(m.r, m.buf[header:]); err != nil {
		return nil, err
	}
	return m.buf, nil
}

// grow returns b resized to n bytes, keeping its contents.
func grow(b []byte, n int) []byte {
	if n <= cap(b) {
		return b[:n]
	}
	grown := make([]byte, n, max(n, 2*cap(b)))
	copy(grown, b)
	return grown
}

// pumpFrontend forwards client messages to the server, and cuts the
// connection instead of forwarding a COMMIT when the dice say so. The
// server then sees the transaction's statements but never its COMMIT, and
// rolls it back when it sees the connection gone.
func (p *chaosProxy) pumpFrontend(c *proxiedConn) {
	in := &messageReader{r: bufio.NewReaderSize(c.client, 32<<10), untyped: true}
	out := bufio.NewWriterSize(c.server, 32<<10)
	// commitStatements holds the names of the prepared statements that are
	// a COMMIT, since a prepared COMMIT runs by name, without its text.
	commitStatements := make(map[string]bool)
	for {
		msg, err := in.next()
		if err != nil {
			return
		}
		if isFrontendCommit(msg, commitStatements) && rand.Float64() < p.cutBeforeCommit {
			if out.Flush() == nil {
				p.cutsBeforeCommit.Add(1)
			}
			return
		}
		if _, err := out.Write(msg); err != nil {
			return
		}
		if in.r.Buffered() == 0 {
			if err := out.Flush(); err != nil {
				return
			}
		}
	}
}

// pumpBackend forwards server messages to the client, and cuts the
// connection instead of forwarding the completion of a COMMIT when the dice
// say so. The server has committed by then; the client never learns it.
func (p *chaosProxy) pumpBackend(c *proxiedConn) {
	in := &messageReader{r: bufio.NewReaderSize(c.server, 32<<10)}
	out := bufio.NewWriterSize(c.client, 32<<10)
	started := false
	for {
		msg, err := in.next()
		if err != nil {
			return
		}
		if msg[0] == 'Z' && !started {
			// The connection is the proxy's, and can be cut, while the
			// client still waits for it.
			started = true
			time.Sleep(p.startupDelay)
		}
		if msg[0] == 'C' && string(cstring(msg[5:])) == "COMMIT" && rand.Float64() < p.cutAfterCommit {
			if out.Flush() == nil {
				p.cutsAfterCommit.Add(1)
			}
			return
		}
		if _, err := out.Write(msg); err != nil {
			return
		}
		if in.r.Buffered() == 0 {
			if err := out.Flush(); err != nil {
				return
			}
		}
	}
}

// isFrontendCommit reports whether a client message runs a COMMIT: a simple
// query whose text is one, or the Bind of a prepared statement that is one.
// It records in commitStatements which prepared statements are COMMITs.
func isFrontendCommit(msg []byte, commitStatements map[string]bool) bool {
	if len(msg) < 5 {
		return false
	}
	body := msg[5:]
	switch msg[0] {
	case 'Q': // Query: the SQL text
		return isCommitSQL(string(cstring(body)))
	case 'P': // Parse: statement name, SQL text, parameter types
		name := cstring(body)
		query := cstring(body[min(len(name)+1, len(body)):])
		if isCommitSQL(string(query)) {
			commitStatements[string(name)] = true
		} else {
			delete(commitStatements, string(name))
		}
	case 'B': // Bind: portal name, statement name, ...
		portal := cstring(body)
		statement := cstring(body[min(len(portal)+1, len(body)):])
		return commitStatements[string(statement)]
	}
	return false
}

// isCommitSQL reports whether query is a COMMIT, once "--" comments (sqlc
// puts the query's name in one) and a trailing semicolon are set aside.
func isCommitSQL(query string) bool {
	var code strings.Builder
	for line := range strings.SplitSeq(query, "\n") {
		if i := strings.Index(line, "--"); i >= 0 {
			line = line[:i]
		}
		code.WriteString(line)
		code.WriteByte(' ')
	}
	stmt := strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(code.String()), ";"))
	return strings.EqualFold(stmt, "COMMIT") || strings.EqualFold(stmt, "END")
}

// cstring returns b up to its first NUL byte.
func cstring(b []byte) []byte {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		return b[:i]
	}
	return b
}

// dialerFor returns how the proxy reaches the server at host and port: a
// Unix socket when host is a directory, as libpq reads it, or else TCP.
func dialerFor(host string, port uint16) func(ctx context.Context) (net.Conn, error) {
	network, address := "tcp", net.JoinHostPort(host, fmt.Sprint(port))
	if strings.HasPrefix(host, "/") {
		network, address = "unix", fmt.Sprintf("%s/.s.PGSQL.%d", host, port)
	}
	var d net.Dialer
	return func(ctx context.Context) (net.Conn, error) {
		conn, err := d.DialContext(ctx, network, address)
		if err != nil {
			return nil, fmt.Errorf("proxy: dial %s: %w", address, err)
		}
		return conn, nil
	}
}
