package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync/atomic"

	"github.com/pgidem/idem"
)

// This file holds what the Transport keeps of one attempt: its body, its
// timeout, the connections it asked for and got, and its error.

// bodySource returns the body of each attempt, numbered from 1.
type bodySource func(n int) (io.ReadCloser, error)

// replayable makes out's body one that every attempt can send whole, and
// net/http too when it re-sends an attempt: req's GetBody when it has one,
// or else req's body read whole. It closes req's body when it returns an
// error.
func (s *transportSettings) replayable(req, out *http.Request) (bodySource, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return func(int) (io.ReadCloser, error) { return req.Body, nil }, nil
	}
	if req.GetBody != nil {
		return func(n int) (io.ReadCloser, error) {
			if n == 1 {
				return req.Body, nil
			}
			return req.GetBody()
		}, nil
	}
	defer req.Body.Close()
	tooLarge := func() error {
		return fmt.Errorf("idemhttp: Transport: the request body is larger than Transport.MaxBodyBytes and has no GetBody, "+
			"so it could not be sent again: %w", &http.MaxBytesError{Limit: s.maxBodyBytes})
	}
	if req.ContentLength > s.maxBodyBytes {
		return nil, tooLarge()
	}
	limit := s.maxBodyBytes
	if limit < math.MaxInt64 {
		limit++ // one byte more tells a body over the limit from one at it
	}
	body, err := io.ReadAll(io.LimitReader(req.Body, limit))
	switch {
	case err != nil:
		return nil, fmt.Errorf("idemhttp: Transport: reading the request body: %w", err)
	case int64(len(body)) > s.maxBodyBytes:
		return nil, tooLarge()
	}
	getBody := func() (io.ReadCloser, error) {
		if len(body) == 0 {
			return http.NoBody, nil
		}
		return io.NopCloser(bytes.NewReader(body)), nil
	}
	out.GetBody = getBody
	out.ContentLength = int64(len(body))
	return func(int) (io.ReadCloser, error) { return getBody() }, nil
}

// attemptContext returns the context of an attempt, which ends
// AttemptTimeout after it begins, and the function that releases it.
func (s *transportSettings) attemptContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.attemptTimeout == 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeoutCause(ctx, s.attemptTimeout, errAttemptTimeout)
}

// errAttemptTimeout is the cause of an attempt's context that ended with
// its AttemptTimeout.
var errAttemptTimeout = errors.New("idemhttp: the attempt took longer than Transport.AttemptTimeout")

// cancelOnClose is the body of an answer, which releases its attempt's
// context once it is read to its end or closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b *cancelOnClose) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.cancel()
	}
	return n, err
}

func (b *cancelOnClose) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

// attemptError is the error of the last attempt of a request, or of the
// wait after it, with the request's key and the number of its attempts.
type attemptError struct {
	key   string
	n     int
	doing string // such as "attempt", followed by the attempt's number
	err   error
	// unsent is set when no attempt may have reached the server.
	unsent bool
}

func (e *attemptError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "idemhttp: %s %d", e.doing, e.n)
	if e.key != "" {
		fmt.Fprintf(&b, " with key %q", e.key)
	}
	b.WriteString(": ")
	b.WriteString(e.err.Error())
	if e.unsent {
		b.WriteString(" (no attempt was sent)")
	}
	return b.String()
}

func (e *attemptError) Unwrap() []error {
	if e.unsent {
		return []error{e.err, idem.ErrNotSent}
	}
	return []error{e.err}
}

// Timeout reports whether the error is a timeout, as the error it wraps
// says, so that url.Error.Timeout still sees through the Transport.
func (e *attemptError) Timeout() bool {
	var t interface{ Timeout() bool }
	return errors.As(e.err, &t) && t.Timeout()
}

// unsentError is an error that the Transport returns before sending
// anything: its text is the error's, and its chain has [idem.ErrNotSent]
// too.
type unsentError struct{ err error }

func unsent(err error) error { return &unsentError{err: err} }

func (e *unsentError) Error() string { return e.err.Error() }

func (e *unsentError) Unwrap() []error { return []error{e.err, idem.ErrNotSent} }

// connTrace is what an attempt's [httptrace.ClientTrace] saw of its
// connections.
type connTrace struct {
	asked atomic.Bool // GetConn: a connection was asked for
	got   atomic.Bool // GotConn: a connection was handed to the request
}

// traceConns returns ctx with a trace of the connections its request
// asks for and gets, in addition to any trace ctx carries already.
func traceConns(ctx context.Context) (context.Context, *connTrace) {
	c := &connTrace{}
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GetConn: func(string) { c.asked.Store(true) },
		GotConn: func(httptrace.GotConnInfo) { c.got.Store(true) },
	}), c
}

// neverGot reports whether the attempt's request surely never left: a
// connection was asked for and none was ever handed to it.
//
// net/http's Transport writes a request only on a connection it has got
// (GotConn, which HTTP/1 reports as getConn hands it over, and HTTP/2 as
// it takes a connection from its pool, before it opens the stream), and
// gets one only once it is dialled and, for https, its TLS handshake is
// complete: so an attempt that failed to resolve the host's name, to
// connect (refused, unreachable, timed out) or to complete its TLS
// handshake, or that ended while it waited for a connection, wrote no
// byte of the request. The kind of error alone proves nothing: net/http
// sends a request again by itself on a new connection when a kept-alive
// one broke, so that a refused connection can be the error of a request
// that the server got on the connection before. A Base that reports no
// connection at all (not an [http.Transport], or one that hides the
// request's trace) proves nothing either: its errors stay uncertain.
func (c *connTrace) neverGot() bool { return c.asked.Load() && !c.got.Load() }
