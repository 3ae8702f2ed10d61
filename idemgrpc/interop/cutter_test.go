package interop_test

import (
	"encoding/binary"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

// cutter is a TCP proxy on 127.0.0.1 in front of a gRPC server that cuts
// connections after the server answered: it reads the HTTP/2 frames the
// server sends, and when a frame ends the every-th answer (a HEADERS frame
// with END_STREAM on a call's stream: the trailers, which the server sends
// only once the handler has returned), it drops what it read instead of
// forwarding it and closes both connections. The client never learns how
// the call ended, and so do the other calls in flight on that connection.
// Its faults are tied to the answers' count, not to the clock.
type cutter struct {
	lis    net.Listener
	target string
	every  int64

	answers atomic.Int64 // answers seen
	cuts    atomic.Int64 // connections cut

	mu    sync.Mutex
	conns map[net.Conn]bool
	wg    sync.WaitGroup
}

// newCutter starts a cutter in front of target until the test ends.
func newCutter(t *testing.T, target string, every int64) *cutter {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{lis: lis, target: target, every: every, conns: map[net.Conn]bool{}}
	c.wg.Go(c.accept)
	t.Cleanup(c.close)
	return c
}

func (c *cutter) addr() string { return c.lis.Addr().String() }

func (c *cutter) accept() {
	for {
		client, err := c.lis.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", c.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		c.track(client, server)
		c.wg.Go(func() {
			// Requests go through as they are.
			_, _ = io.Copy(server, client)
			c.drop(client, server)
		})
		c.wg.Go(func() { c.answer(client, server) })
	}
}

// answer forwards what the server sends, until an every-th answer.
func (c *cutter) answer(client, server net.Conn) {
	defer c.drop(client, server)
	var frames frameScanner
	buf := make([]byte, 32<<10)
	for {
		n, err := server.Read(buf)
		cut := false
		frames.scan(buf[:n], func(typ, flags byte, stream uint32) {
			const headers, endStream = 0x1, 0x1
			if typ == headers && flags&endStream != 0 && stream != 0 && c.answers.Add(1)%c.every == 0 {
				cut = true
			}
		})
		if cut {
			c.cuts.Add(1)
			return
		}
		if _, werr := client.Write(buf[:n]); werr != nil || err != nil {
			return
		}
	}
}

func (c *cutter) track(conns ...net.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range conns {
		c.conns[conn] = true
	}
}

func (c *cutter) drop(conns ...net.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range conns {
		_ = conn.Close()
		delete(c.conns, conn)
	}
}

func (c *cutter) close() {
	_ = c.lis.Close()
	c.mu.Lock()
	for conn := range c.conns {
		_ = conn.Close()
	}
	c.mu.Unlock()
	c.wg.Wait()
}

// frameScanner follows the HTTP/2 frames of one direction of a connection
// across the chunks it is read in.
type frameScanner struct {
	header []byte // of the frame being read, while shorter than 9 bytes
	skip   int    // bytes of the current frame's payload still to come
}

// scan calls onFrame for each frame whose header ends in b.
func (s *frameScanner) scan(b []byte, onFrame func(typ, flags byte, stream uint32)) {
	for len(b) > 0 {
		if s.skip > 0 {
			n := min(s.skip, len(b))
			s.skip -= n
			b = b[n:]
			continue
		}
		n := min(9-len(s.header), len(b))
		s.header = append(s.header, b[:n]...)
		b = b[n:]
		if len(s.header) < 9 {
			return
		}
		h := s.header
		s.skip = int(h[0])<<16 | int(h[1])<<8 | int(h[2])
		onFrame(h[3], h[4], binary.BigEndian.Uint32(h[5:9])&0x7fffffff)
		s.header = s.header[:0]
	}
}

func TestFrameScannerFollowsFramesAcrossChunks(t *testing.T) {
	t.Parallel()
	frame := func(length int, typ, flags byte, stream uint32) []byte {
		h := []byte{byte(length >> 16), byte(length >> 8), byte(length), typ, flags, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(h[5:], stream)
		return append(h, make([]byte, length)...)
	}
	stream := append(append(frame(6, 0x4, 0, 0), frame(3, 0x0, 0, 1)...), frame(2, 0x1, 0x1|0x4, 1)...)
	var got []uint32
	var s frameScanner
	// One byte at a time: every frame boundary falls between two reads.
	for i := range stream {
		s.scan(stream[i:i+1], func(typ, flags byte, id uint32) { got = append(got, uint32(typ)<<16|uint32(flags)<<8|id) })
	}
	want := []uint32{0x4 << 16, 1, 0x1<<16 | 0x5<<8 | 1} // SETTINGS, DATA on stream 1, HEADERS+END_STREAM on 1
	if !slices.Equal(got, want) {
		t.Fatalf("frames %x, want %x", got, want)
	}
}
