package faultproxy

import (
	"io"
	"net"
	"sync"
)

// A Freezer is a Proxy that can stop forwarding without closing
// anything: to the client, a connection whose server (or network) stopped
// answering. Once frozen, it swallows what either side sends and never
// answers, on the connections it has and on those it accepts later.
type Freezer struct {
	*Proxy
	frozen chan struct{}
	once   sync.Once
}

// StartFreezer starts a Freezer in front of the server at network and
// address (as Config has them), forwarding until Freeze.
func StartFreezer(network, address string) (*Freezer, error) {
	f := &Freezer{frozen: make(chan struct{})}
	p, err := Start(Config{
		Network: network,
		Address: address,
		Pipes:   func() (Pipe, Pipe) { return f.pipe, f.pipe },
	})
	if err != nil {
		return nil, err
	}
	f.Proxy = p
	return f, nil
}

// Freeze stops forwarding, for good. It may be called more than once.
func (f *Freezer) Freeze() { f.once.Do(func() { close(f.frozen) }) }

// Close freezes the proxy, then closes it as Proxy.Close does.
func (f *Freezer) Close() {
	f.Freeze()
	f.Proxy.Close()
}

// pipe forwards from src to dst until frozen, then holds what it reads.
func (f *Freezer) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-f.frozen:
			_, _ = io.Copy(io.Discard, src) // swallow, never answer
			return
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
