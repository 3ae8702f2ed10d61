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
// It returns an error when v cannot be encoded as JSON, or when a
// json.RawMessage does not hold exactly one valid JSON value.
func FingerprintJSON(v any) ([]byte, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("idem: fingerprint: %w", err)
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
