// Package adapter is the core that idem's adapters share, so that each of
// them is only its protocol: idemhttp, idemhttp/webhook and idemgrpc check
// their configurations here (field errors, retention, wait, the stored
// size of an answer, transaction options, the options handed idem.Run),
// tell an unavailable database from a failed statement here, classify why
// a flow gave no answer here, and make keys here.
//
// idemgrpc is a module of its own and imports this package, which Go
// allows since its import path lies below the root module's. A build may
// pair an idemgrpc with a newer idem than the one it requires (minimum
// version selection takes the newest any module asks for), so what
// idemgrpc uses here changes only by addition: a function whose meaning
// must change is written anew, and the old one stays until no released
// idemgrpc uses it. The cmd/idem module, a program, imports none of
// internal/ instead (see its imports test).
package adapter

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// Invalid is the field of pkg's configuration that cannot work.
func Invalid(pkg, field, format string, args ...any) error {
	return &idem.FieldError{Package: pkg, Field: field, Problem: fmt.Sprintf(format, args...)}
}

// Refused is the field of pkg's configuration whose value idem refused
// with err, in idem's words.
func Refused(pkg, field string, err error) error {
	problem := strings.TrimPrefix(err.Error(), idem.ErrInvalidOption.Error()+": ")
	if fe, ok := errors.AsType[*idem.FieldError](err); ok {
		problem = fe.Problem
	}
	return &idem.FieldError{Package: pkg, Field: field, Problem: problem, Err: err}
}

// Retention is the retention that field asks for, def when it is zero.
func Retention(pkg, field string, d, def time.Duration) (time.Duration, error) {
	d = cmp.Or(d, def)
	if err := idem.CheckOptions(idem.WithRetention(d)); err != nil {
		return 0, Refused(pkg, field, err)
	}
	return d, nil
}

// Wait is the wait that field asks for: [idem.DefaultWait] when it is
// zero, and zero, no wait, when it is negative.
func Wait(pkg, field string, d time.Duration) (time.Duration, error) {
	wait := max(cmp.Or(d, idem.DefaultWait), 0)
	if err := idem.CheckOptions(idem.WithWait(wait)); err != nil {
		return 0, &idem.FieldError{Package: pkg, Field: field, Err: err,
			Problem: fmt.Sprintf("must not exceed math.MaxInt32 milliseconds, the longest lock_timeout, got %s", d)}
	}
	return wait, nil
}

// RetryAfter is how long a duplicate turned away after wait is told to
// wait before it tries again: wait rounded up to whole seconds, at least
// one, since the first request has taken that long already.
func RetryAfter(wait time.Duration) time.Duration {
	return max((wait+time.Second-1)/time.Second*time.Second, time.Second)
}

// Sizes of the stored form of an answer.
const (
	// MaxMaxResponseBytes is the largest positive limit on the answers an
	// adapter stores: the size of the stored form, the answer in base64
	// plus storedAllowance, must still fit in an int.
	MaxMaxResponseBytes = (math.MaxInt - storedAllowance) / 4 * 3

	// storedAllowance is what a stored answer may take beyond its body in
	// base64: its status or type and its headers or metadata, generously.
	storedAllowance = 1 << 20
)

// responseLimit checks the limit that field sets on the answers stored
// (negative: none; zero: def) and returns it, math.MaxInt for none, with
// the largest value idem may then store for one answer
// ([idem.WithMaxResponseSize]): the answer in base64 and its headers,
// sealed by a codec when sealed is set.
func responseLimit(pkg, field string, n, def int, sealed bool) (limit, stored int, err error) {
	switch {
	case n < 0:
		return math.MaxInt, math.MaxInt, nil
	case n > MaxMaxResponseBytes:
		return 0, 0, Invalid(pkg, field,
			"must not exceed %d, or the size of its stored form would not fit in an int; negative means no limit; got %d",
			MaxMaxResponseBytes, n)
	}
	limit = cmp.Or(n, def)
	stored, ok := storedSize(limit, sealed)
	if !ok {
		// Only a codec gets here: without one, the bound above holds.
		return 0, 0, Invalid(pkg, field,
			"%d is too large to store sealed by Config.Codec: its stored form would not fit in an int; negative means no limit", limit)
	}
	return limit, stored, nil
}

// storedSize is the largest stored value, in bytes of JSON, for an answer
// of n bytes, or false when that does not fit in an int: the answer in
// base64 plus an allowance for its status and headers; sealed by a codec,
// that again in base64, with the allowance again for what the codec adds.
func storedSize(n int, sealed bool) (int, bool) {
	size, ok := base64Size(n)
	if !ok || size > math.MaxInt-storedAllowance {
		return 0, false
	}
	size += storedAllowance
	if !sealed {
		return size, true
	}
	if size > math.MaxInt-storedAllowance {
		return 0, false
	}
	return base64Size(size + storedAllowance)
}

// base64Size is the length of n bytes in padded base64, or false when that
// does not fit in an int.
func base64Size(n int) (int, bool) {
	groups := n / 3
	if n%3 != 0 {
		groups++
	}
	if groups > math.MaxInt/4 {
		return 0, false
	}
	return 4 * groups, true
}

// txOptions checks the transaction options that field sets, with idem's
// own check ([idem.WithTxOptions]), and returns them with READ COMMITTED
// when they name no isolation level.
func txOptions(pkg, field string, o pgx.TxOptions) (pgx.TxOptions, error) {
	if err := idem.CheckOptions(idem.WithTxOptions(o)); err != nil {
		if fe, ok := errors.AsType[*idem.FieldError](err); ok {
			// "WithTxOptions.AccessMode" is field's AccessMode.
			if _, sub, ok := strings.Cut(fe.Field, "."); ok {
				field += "." + sub
			}
		}
		return o, Refused(pkg, field, err)
	}
	o.IsoLevel = cmp.Or(o.IsoLevel, pgx.ReadCommitted)
	return o, nil
}

// Config is what an adapter's Config sets of idem.Run's options, as its
// user wrote it: the fields of the same names there.
type Config struct {
	Retention               time.Duration
	Wait                    time.Duration
	MaxResponseBytes        int
	DefaultMaxResponseBytes int
	TxOptions               pgx.TxOptions
	LookupFirst             bool
	Codec                   idem.Codec
	Observer                *idem.Observer
}

// Settings are a Config checked, with its defaults applied.
type Settings struct {
	// Wait is the wait, zero for none.
	Wait time.Duration
	// MaxResponseBytes is the largest answer stored, math.MaxInt for no
	// limit.
	MaxResponseBytes int
	// TxOptions are the options of the handler's transaction.
	TxOptions pgx.TxOptions
	// RunOptions are what each keyed request hands idem.Run.
	RunOptions []idem.Option
	// FlowOptions are what a flow's request hands the flow's Run: only the
	// wait, which the answer to a duplicate tells; how a flow stores is the
	// flow's own (NewFlow's options), which its resumer uses too.
	FlowOptions []idem.FlowOption
}

// Check checks c, a part of pkg's Config, and applies its defaults: an
// invalid field is refused as Config.<its name>, so that a configuration
// that cannot work stops the program at its start rather than fail every
// request.
func Check(pkg string, c Config) (Settings, error) {
	var s Settings
	retention, err := Retention(pkg, "Config.Retention", c.Retention, idem.DefaultRetention)
	if err != nil {
		return s, err
	}
	if s.Wait, err = Wait(pkg, "Config.Wait", c.Wait); err != nil {
		return s, err
	}
	var stored int
	s.MaxResponseBytes, stored, err = responseLimit(pkg, "Config.MaxResponseBytes",
		c.MaxResponseBytes, c.DefaultMaxResponseBytes, c.Codec != nil)
	if err != nil {
		return s, err
	}
	if s.TxOptions, err = txOptions(pkg, "Config.TxOptions", c.TxOptions); err != nil {
		return s, err
	}
	s.RunOptions = []idem.Option{
		idem.WithRetention(retention),
		idem.WithWait(s.Wait),
		idem.WithTxOptions(s.TxOptions),
		idem.WithMaxResponseSize(stored),
	}
	s.FlowOptions = []idem.FlowOption{idem.WithWait(s.Wait)}
	if c.LookupFirst {
		s.RunOptions = append(s.RunOptions, idem.WithLookupFirst())
	}
	if c.Codec != nil {
		s.RunOptions = append(s.RunOptions, idem.WithCodec(c.Codec))
	}
	if c.Observer != nil {
		s.RunOptions = append(s.RunOptions, idem.WithObserver(c.Observer))
	}
	// Whatever else idem would refuse on every request stops the program
	// too; each field above was checked on its own, so this is a backstop.
	if err := idem.CheckOptions(s.RunOptions...); err != nil {
		return s, Refused(pkg, "Config", err)
	}
	return s, nil
}

// SQLSTATE codes with which PostgreSQL ends a session it will not serve.
const (
	sqlstateAdminShutdown    = "57P01"
	sqlstateCrashShutdown    = "57P02"
	sqlstateCannotConnectNow = "57P03"
)

// DatabaseUnavailable reports whether err says that the database could not
// be reached, that the connection to it broke, or that it reached a
// standby (idem.ErrReadOnly: an adapter never asks for a read-only
// transaction), rather than that a statement failed: the first is worth
// a retry later (503, UNAVAILABLE), the second is not.
func DatabaseUnavailable(err error) bool {
	var connectErr *pgconn.ConnectError
	var opErr *net.OpError
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &connectErr), errors.Is(err, pgconn.ErrConnClosed),
		errors.As(err, &opErr), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, idem.ErrReadOnly):
		return true
	case errors.As(err, &pgErr):
		switch pgErr.Code {
		case sqlstateAdminShutdown, sqlstateCrashShutdown, sqlstateCannotConnectNow:
			return true
		}
	}
	return false
}

// NewUUID returns a random UUID, version 4 (RFC 9562): the key a client
// adapter gives a request that has none.
func NewUUID() string {
	var u [16]byte
	_, _ = rand.Read(u[:]) // never fails: crypto/rand crashes the program rather
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	h := hex.EncodeToString(u[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}
