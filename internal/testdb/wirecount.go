package testdb

import (
	"context"
	"encoding/binary"
	"net"
	"sync"
)

// WireCount counts what a client sends on the connections it dials (give
// its Dial to pgconn.Config.DialFunc): round trips, each write that
// follows a read, and statements, the extended protocol's Execute
// messages and the simple protocol's Query messages. It is safe for
// concurrent use.
type WireCount struct {
	mu     sync.Mutex
	counts Counts
}

// Counts are a WireCount's totals.
type Counts struct {
	RoundTrips, Statements int64
}

// Dial dials as a net.Dialer does, and counts what is sent on the
// connection.
func (w *WireCount) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &countedConn{Conn: c, w: w, read: true}, nil
}

// Counts returns the totals so far.
func (w *WireCount) Counts() Counts {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.counts
}

type countedConn struct {
	net.Conn
	w *WireCount
	// read is set by a read: the next write starts a round trip.
	read bool
	// started is set once the startup message, which has no type byte,
	// was passed; head holds the start of a message's header, skip the
	// bytes of its body still to pass.
	started bool
	head    []byte
	skip    int
}

func (c *countedConn) Write(b []byte) (int, error) {
	c.w.mu.Lock()
	if c.read {
		c.w.counts.RoundTrips++
		c.read = false
	}
	c.parse(b)
	c.w.mu.Unlock()
	return c.Conn.Write(b)
}

func (c *countedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.w.mu.Lock()
		c.read = true
		c.w.mu.Unlock()
	}
	return n, err
}

// parse passes over the messages in b, counting statements.
func (c *countedConn) parse(b []byte) {
	for len(b) > 0 {
		if c.skip > 0 {
			n := min(c.skip, len(b))
			c.skip, b = c.skip-n, b[n:]
			continue
		}
		size := 5 // a type byte and a length
		if !c.started {
			size = 4
		}
		n := min(size-len(c.head), len(b))
		c.head, b = append(c.head, b[:n]...), b[n:]
		if len(c.head) < size {
			return
		}
		if c.started && (c.head[0] == 'E' || c.head[0] == 'Q') {
			c.w.counts.Statements++
		}
		c.skip = int(binary.BigEndian.Uint32(c.head[size-4:])) - 4
		c.started, c.head = true, c.head[:0]
	}
}
