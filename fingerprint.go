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
	if scanJSON(raw)&jsonbLoneSurrogate != 0 {
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

// canonicalNumber spells a JSON number exactly, in one form for every
// spelling of its value: its significant digits without leading or trailing
// zeros, then "e" and the exponent that makes them the value. 1, 1.0, 1e0
// and 0.1e1 are all "1e0"; distinct values never meet, since nothing is
// rounded. It takes linear time, whatever the digits or exponent. The rare
// exponent longer than 18 digits keeps its literal spelling, marked so that
// it never meets a canonical one.
func canonicalNumber(lit string) string {
	negative, digits, fracLen, exp, ok := numberParts(lit)
	if !ok {
		return "~" + strings.ToLower(lit)
	}
	if digits == "" {
		return "0"
	}
	trimmed := strings.TrimRight(digits, "0")
	exp += int64(len(digits)-len(trimmed)) - int64(fracLen)
	sign := ""
	if negative {
		sign = "-"
	}
	return sign + trimmed + "e" + strconv.FormatInt(exp, 10)
}
