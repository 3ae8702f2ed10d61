package idemhttp_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp"
)

// rawServer accepts connections on 127.0.0.1 and hands the nth (from 1)
// to serve, with its listener; it returns the listener's address.
func rawServer(t *testing.T, serve func(n int, conn net.Conn, ln net.Listener)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for n := 1; ; n++ {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				serve(n, conn, ln)
			}()
		}
	}()
	return ln.Addr().String()
}

// readRequest reads one request, body and all, from r.
func readRequest(r *bufio.Reader) error {
	req, err := http.ReadRequest(r)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, req.Body)
	return err
}

// refusedAddr returns an address on which nothing listens.
func refusedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// postThrough posts a body to url through a Transport over base and
// returns the error, failing the test on an answer.
func postThrough(t *testing.T, tr *idemhttp.Transport, url string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"amount_cents": 100}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("got %d, want an error", resp.StatusCode)
	}
	return err
}

func TestTransportErrorsThatProveNothingWasSentWrapErrNotSent(t *testing.T) {
	t.Parallel()
	noDNS := &net.Resolver{PreferGo: true, Dial: func(context.Context, string, string) (net.Conn, error) {
		return nil, errors.New("no name server here")
	}}
	tlsSrv := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		t.Error("the TLS server got a request")
	}))
	t.Cleanup(tlsSrv.Close)
	// hangsUp accepts each connection and closes it unread: a TLS
	// handshake over it fails.
	var hungUp atomic.Int64
	hangsUp := rawServer(t, func(int, net.Conn, net.Listener) { hungUp.Add(1) })

	for name, c := range map[string]struct {
		base http.RoundTripper
		url  string
	}{
		"connection refused": {&http.Transport{}, "http://" + refusedAddr(t) + "/pay"},
		"name not resolved": {&http.Transport{DialContext: (&net.Dialer{Resolver: noDNS}).DialContext},
			"http://provider.invalid/pay"},
		"certificate not trusted":     {&http.Transport{}, tlsSrv.URL + "/pay"},
		"TLS handshake cut":           {&http.Transport{}, "https://" + hangsUp + "/pay"},
		"TLS handshake past deadline": {&http.Transport{TLSHandshakeTimeout: time.Nanosecond}, tlsSrv.URL + "/pay"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := postThrough(t, &idemhttp.Transport{Base: c.base, MaxAttempts: 2, BaseDelay: -1}, c.url)
			if !errors.Is(err, idem.ErrNotSent) {
				t.Fatalf("got %v; want an error that wraps idem.ErrNotSent", err)
			}
		})
	}
}

func TestTransportErrorsAfterSendingStayUncertain(t *testing.T) {
	t.Parallel()

	t.Run("reset after the request was read", func(t *testing.T) {
		t.Parallel()
		addr := rawServer(t, func(_ int, conn net.Conn, _ net.Listener) { _ = readRequest(bufio.NewReader(conn)) })
		err := postThrough(t, &idemhttp.Transport{MaxAttempts: 1}, "http://"+addr+"/pay")
		if errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; a request the server read must stay uncertain", err)
		}
	})

	t.Run("reset, then refused", func(t *testing.T) {
		t.Parallel()
		// The first attempt is read and cut; the server is gone before
		// the second, which is refused: the Transport returns the refused
		// connection, which proves nothing of the first.
		addr := rawServer(t, func(_ int, conn net.Conn, ln net.Listener) {
			_ = readRequest(bufio.NewReader(conn))
			ln.Close()
		})
		err := postThrough(t, &idemhttp.Transport{MaxAttempts: 2, BaseDelay: -1}, "http://"+addr+"/pay")
		var dial *net.OpError
		if !errors.As(err, &dial) || dial.Op != "dial" || !strings.Contains(err.Error(), "attempt 2") {
			t.Fatalf("got %v; want the refused connection of attempt 2", err)
		}
		if errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; the first attempt was read: it must stay uncertain", err)
		}
	})

	t.Run("net/http's own re-send refused", func(t *testing.T) {
		t.Parallel()
		// The first request is answered on a kept-alive connection; the
		// second goes out on it, is read, and the connection is cut with
		// the server gone: net/http sends it again by itself on a new
		// connection, which is refused, within one attempt of the
		// Transport's.
		addr := rawServer(t, func(_ int, conn net.Conn, ln net.Listener) {
			r := bufio.NewReader(conn)
			if readRequest(r) != nil {
				return
			}
			_, _ = io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			_ = readRequest(r)
			ln.Close()
		})
		tr := &idemhttp.Transport{Base: &http.Transport{}, MaxAttempts: 1}
		resp, err := (&http.Client{Transport: tr}).Post("http://"+addr+"/pay", "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		err = postThrough(t, tr, "http://"+addr+"/pay")
		var dial *net.OpError
		if !errors.As(err, &dial) || dial.Op != "dial" {
			t.Fatalf("got %v; want the refused connection of net/http's re-send", err)
		}
		if errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; the request was read before the re-send was refused: it must stay uncertain", err)
		}
	})

	t.Run("a Base that reports no connections", func(t *testing.T) {
		t.Parallel()
		refused := func(*http.Request) (*http.Response, error) {
			_, err := net.Dial("tcp", refusedAddr(t))
			return nil, err
		}
		err := postThrough(t, &idemhttp.Transport{Base: roundTripFunc(refused), MaxAttempts: 1}, "http://127.0.0.1:1/pay")
		if errors.Is(err, idem.ErrNotSent) {
			t.Fatalf("got %v; a Base whose connections the Transport cannot see proves nothing", err)
		}
	})
}

func TestTransportAttemptTimeoutGivesUpAHungAttempt(t *testing.T) {
	t.Parallel()
	// The first attempt hangs until the client gives it up; the others
	// are answered at once.
	var attempts, abandoned atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body) // so that the server watches the connection
		if attempts.Add(1) == 1 {
			<-r.Context().Done()
			abandoned.Add(1)
			return
		}
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &idemhttp.Transport{AttemptTimeout: 500 * time.Millisecond, BaseDelay: -1, MaxAttempts: -1}}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if _, n := idemhttp.Attempts(resp); err != nil || string(body) != "ok" || n < 2 {
		t.Fatalf("got %q, %v after %d attempts; want ok after the hung attempt was given up", body, err, n)
	}
	srv.Close() // waits for the handlers
	if abandoned.Load() != 1 {
		t.Fatal("the hung attempt's request did not end")
	}
}
