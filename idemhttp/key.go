package idemhttp

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/pgidem/idem"
)

// ParseKey returns the idempotency key of r, unquoted, read from the header
// field that [Config.Header] names, as the middleware reads it (see "Keys"
// in the package documentation). It is for a handler that calls idem
// itself, so that its keys are the middleware's keys. The error wraps
// [idem.ErrInvalidKey] and says what is wrong with the field; given to
// [Middleware.WriteError], it is answered 400 key-missing when r has no such
// field and 400 key-invalid otherwise, as the middleware answers it.
//
// The field is found whatever the case of its name in r.Header, where an
// entry set in the map directly, such as r.Header["idempotency-key"],
// keeps its own spelling: values under two spellings are a field sent
// twice, which is invalid.
func (m *Middleware) ParseKey(r *http.Request) (string, error) {
	values, _ := fieldValues(r.Header, m.header)
	if len(values) == 0 {
		return "", &keyError{header: m.header, problem: "is missing", missing: true}
	}
	key, err := parseKey(values)
	if err != nil {
		return "", &keyError{header: m.header, problem: err.Error()}
	}
	return key, nil
}

// fieldValues returns the values of the header field name in h, whatever
// the case its name is spelled in, and the spellings other than the
// canonical one that hold it. http.Header's methods canonicalize names,
// and net/http does so for a request it reads, but an entry set in the map
// directly, such as h["idempotency-key"], keeps its own spelling, as
// http.Header's documentation allows: a key there must not be missed, nor
// a second key beside it. The canonical entry's values come first, then
// those of the other spellings, in the order of their names.
func fieldValues(h http.Header, name string) (values, others []string) {
	canonical := http.CanonicalHeaderKey(name)
	for n := range h {
		if n != canonical && strings.EqualFold(n, canonical) {
			others = append(others, n)
		}
	}
	if len(others) == 0 {
		return h[canonical], nil
	}
	slices.Sort(others)
	values = slices.Clone(h[canonical])
	for _, n := range others {
		values = append(values, h[n]...)
	}
	return values, others
}

// keyError is a request's key field that cannot be used.
type keyError struct {
	header string
	// problem completes "the <header> header ...".
	problem string
	// missing is set when the request has no such field.
	missing bool
}

func (e *keyError) Error() string { return "idemhttp: the " + e.header + " header " + e.problem }

func (e *keyError) Unwrap() error { return idem.ErrInvalidKey }

// isKeyMissing reports whether err says that the request has no key.
func isKeyMissing(err error) bool {
	var keyErr *keyError
	return errors.As(err, &keyErr) && keyErr.missing
}

// parseKey reads the key from the values of the key's header field.
//
// The draft specifies the value as an RFC 8941 sf-string: a DQUOTE, then
// characters %x20-21 / %x23-5B / %x5D-7E or the escapes \" and \\, then a
// DQUOTE. Stripe-style clients send the key bare instead, so a token of
// visible ASCII (%x21-7E) is accepted too; a value that starts with a DQUOTE
// is always read as an sf-string. The length bound applies to the key after
// unquoting, since that is what is stored. Structured-field parameters are
// not accepted: the draft defines none.
//
// The errors are phrased to complete "the <header> header ...".
func parseKey(values []string) (string, error) {
	if len(values) > 1 {
		return "", errors.New("appears more than once")
	}
	// Callers only pass a present field, but an absent one must not pass.
	if len(values) == 0 {
		return "", errors.New("is missing")
	}
	v := strings.Trim(values[0], " \t")
	var key string
	if strings.HasPrefix(v, `"`) {
		var err error
		if key, err = unquote(v); err != nil {
			return "", err
		}
	} else {
		for i := range len(v) {
			if v[i] < 0x21 || v[i] > 0x7e {
				return "", fmt.Errorf("holds the byte %#02x at offset %d: a bare key must be visible ASCII, or else send an sf-string", v[i], i)
			}
		}
		key = v
	}
	switch {
	case key == "":
		return "", errors.New("is empty")
	case len(key) > idem.MaxKeyLength:
		return "", fmt.Errorf("holds a key of %d bytes, more than %d", len(key), idem.MaxKeyLength)
	}
	return key, nil
}

// unquote parses v, which starts with a DQUOTE, as a whole sf-string.
func unquote(v string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", fmt.Errorf(`holds an invalid escape at offset %d: an sf-string escapes only \" and \\`, i-1)
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", fmt.Errorf("holds more after the closing quote at offset %d", i)
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("holds the byte %#02x at offset %d: an sf-string is printable ASCII", c, i)
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("holds an sf-string without its closing quote")
}
