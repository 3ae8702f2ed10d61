package main

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem/internal/faultproxy"
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
	*faultproxy.Proxy

	// cutBeforeCommit and cutAfterCommit are the chances that a COMMIT
	// seen in one direction or the other gets its connection cut.
	cutBeforeCommit float64
	cutAfterCommit  float64
	// startupDelay holds back the server's first ReadyForQuery on every
	// connection, as a busy machine makes connecting slow. Tests set it.
	startupDelay time.Duration

	cutsBeforeCommit atomic.Int64
	cutsAfterCommit  atomic.Int64
	cutsRandom       atomic.Int64
}

// newChaosProxy starts a proxy on 127.0.0.1 that forwards every connection
// to the server at host and port, as libpq reads them, each startupDelay
// slower to start.
func newChaosProxy(host string, port uint16, cutBeforeCommit, cutAfterCommit float64, startupDelay time.Duration) (*chaosProxy, error) {
	p := &chaosProxy{
		cutBeforeCommit: cutBeforeCommit,
		cutAfterCommit:  cutAfterCommit,
		startupDelay:    startupDelay,
	}
	network, address := faultproxy.PostgresAddress(host, port)
	proxy, err := faultproxy.Start(faultproxy.Config{
		Network: network,
		Address: address,
		Pipes:   func() (faultproxy.Pipe, faultproxy.Pipe) { return p.pumpFrontend, p.pumpBackend },
	})
	if err != nil {
		return nil, err
	}
	p.Proxy = proxy
	return p, nil
}

// cutRandom cuts one connection chosen at random, whatever it is doing, and
// reports whether there was one to cut.
func (p *chaosProxy) cutRandom() bool {
	if !p.CutRandom() {
		return false
	}
	p.cutsRandom.Add(1)
	return true
}

// proxyDialTimeout bounds the connection to the server, so that a server
// that is down (restarting) fails the client's connect instead of hanging.
const proxyDialTimeout = faultproxy.DialTimeout

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
func (p *chaosProxy) pumpFrontend(server, client net.Conn) {
	in := &messageReader{r: bufio.NewReaderSize(client, 32<<10), untyped: true}
	out := bufio.NewWriterSize(server, 32<<10)
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
func (p *chaosProxy) pumpBackend(client, server net.Conn) {
	in := &messageReader{r: bufio.NewReaderSize(server, 32<<10)}
	out := bufio.NewWriterSize(client, 32<<10)
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
