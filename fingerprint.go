package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Fingerprint returns the SHA-256 digest of parts. Each part is prefixed with
// its length before it is hashed, so moving bytes from one part to the next
// changes the result: Fingerprint([]byte("ab"), []byte("c")) differs from
// Fingerprint([]byte("a"), []byte("bc")).
//
// Pass the fields that make two requests the same operation: for an HTTP
// request, the method, the path and the body.
func Fingerprint(parts ...[]byte) []byte {
	h := sha256.New()
	var length [8]byte
	for _, part := range parts {
		binary.BigEndian.PutUint64(length[:], uint64(len(part)))
		h.Write(length[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// FingerprintJSON returns the SHA-256 digest of v's canonical JSON form. Two
// values that encode to the same JSON document get the same fingerprint even
// when object keys come in another order, whitespace differs, or numbers are
// spelled differently (1, 1.0 and 1e0 are one number). A [json.RawMessage] is
// taken as the document itself, which suits a request body read off the wire.
//
// It returns an error when v cannot be encoded as JSON, when a non-nil
// json.RawMessage does not hold exactly one valid JSON value (a nil one is
// null), and when a json.RawMessage holds invalid UTF-8 or a lone UTF-16
// surrogate escape: decoding would turn those into U+FFFD, so that distinct
// documents would share a fingerprint. Go strings with invalid UTF-8 have
// that problem already when they are encoded; pass valid strings.
func FingerprintJSON(v any) ([]byte, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("idem: fingerprint: %w", err)
	}
	if !utf8.Valid(raw) {
		return nil, errors.New("idem: fingerprint: JSON holds invalid UTF-8")
	}
	if hasLoneSurrogate(raw) {
		return nil, errors.New("idem: fingerprint: JSON holds a lone UTF-16 surrogate escape")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return nil, fmt.Errorf("idem: fingerprint: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("idem: fingerprint: more than one JSON value")
	}
	h := sha256.New()
	if err := writeCanonical(h, tree); err != nil {
		return nil, fmt.Errorf("idem: fingerprint: %w", err)
	}
	return h.Sum(nil), nil
}

// hasLoneSurrogate reports whether valid JSON holds a \uD800-\uDFFF escape
// that is not half of a surrogate pair. Every backslash in valid JSON starts
// an escape, so stepping over each escape whole keeps "\\ud800" (an escaped
// backslash, then text) from counting.
func hasLoneSurrogate(raw []byte) bool {
	for i := 0; i < len(raw)-1; i++ {
		if raw[i] != '\\' {
			continue
		}
		if raw[i+1] != 'u' || i+6 > len(raw) {
			i++
			continue
		}
		r, err := strconv.ParseUint(string(raw[i+2:i+6]), 16, 16)
		switch {
		case err != nil || r < 0xD800 || r > 0xDFFF:
		case r >= 0xDC00:
			return true // a low half with no high half before it
		default:
			if i+12 > len(raw) || raw[i+6] != '\\' || raw[i+7] != 'u' {
				return true
			}
			low, err := strconv.ParseUint(string(raw[i+8:i+12]), 16, 16)
			if err != nil || low < 0xDC00 || low > 0xDFFF {
				return true
			}
			i += 6 // the low half is part of this pair
		}
		i += 5
	}
	return false
}

// writeCanonical writes a decoded JSON tree with sorted object keys, no
// insignificant whitespace and numbers in one exact canonical spelling.
func writeCanonical(h hash.Hash, node any) error {
	switch n := node.(type) {
	case nil:
		h.Write([]byte("null"))
	case bool:
		h.Write([]byte(strconv.FormatBool(n)))
	case string:
		writeString(h, n)
	case json.Number:
		h.Write([]byte(canonicalNumber(n.String())))
	case []any:
		h.Write([]byte{'['})
		for i, elem := range n {
			if i > 0 {
				h.Write([]byte{','})
			}
			if err := writeCanonical(h, elem); err != nil {
				return err
			}
		}
		h.Write([]byte{']'})
	case map[string]any:
		keys := make([]string, 0, len(n))
		for k := range n {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		h.Write([]byte{'{'})
		for i, k := range keys {
			if i > 0 {
				h.Write([]byte{','})
			}
			writeString(h, k)
			h.Write([]byte{':'})
			if err := writeCanonical(h, n[k]); err != nil {
				return err
			}
		}
		h.Write([]byte{'}'})
	default:
		return fmt.Errorf("unexpected JSON node %T", node)
	}
	return nil
}

func writeString(h hash.Hash, s string) {
	// Marshalling a string cannot fail; it settles on one escaping for each
	// character, whatever escaping the input used.
	b, _ := json.Marshal(s)
	h.Write(b)
}

// maxExactExponent bounds the exponents that are compared exactly. Past it a
// number keeps its literal spelling (lower-cased), which is still
// deterministic, without letting "1e999999999" allocate a huge integer.
const maxExactExponent = 1000

// canonicalNumber spells a JSON number as an exact fraction in lowest terms,
// so that every spelling of one value hashes alike and distinct values never
// collide (no rounding through float64).
func canonicalNumber(lit string) string {
	if i := strings.IndexAny(lit, "eE"); i >= 0 {
		exp, err := strconv.Atoi(strings.TrimPrefix(lit[i+1:], "+"))
		if err != nil || exp > maxExactExponent || exp < -maxExactExponent {
			return strings.ToLower(lit)
		}
	}
	r, ok := new(big.Rat).SetString(lit)
	if !ok {
		return lit
	}
	return r.RatString()
}
