package idem

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// encodeResponse encodes v for the jsonb column, refusing what the column
// would reject, so that the failure is typed, nothing is sent, and the
// caller's transaction stays usable. With a codec, the sealed bytes are
// stored as a JSON string.
func encodeResponse(v any, scope string, o *options) ([]byte, error) {
	encoded, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrResponseNotStorable, err)
	}
	// encoding/json checks the syntax of a json.RawMessage or a Marshaler's
	// output, not its encoding; PostgreSQL rejects invalid UTF-8 in text.
	if !utf8.Valid(encoded) {
		return nil, fmt.Errorf("%w: the JSON is not valid UTF-8", ErrResponseNotStorable)
	}
	if o.codec != nil {
		sealed, err := o.codec.Seal(scope, encoded)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrResponseNotStorable, sealError{err})
		}
		encoded, _ = json.Marshal(sealed) // a []byte always encodes
	}
	if len(encoded) > o.maxResponseSize {
		return nil, fmt.Errorf("%w: %d bytes of JSON, limit %d", ErrResponseTooLarge, len(encoded), o.maxResponseSize)
	}
	switch problems := scanJSON(encoded); {
	case problems&jsonbNUL != 0:
		return nil, fmt.Errorf("%w: a string holds a NUL character, which jsonb cannot store", ErrResponseNotStorable)
	case problems&jsonbLoneSurrogate != 0:
		return nil, fmt.Errorf("%w: a string holds a lone UTF-16 surrogate escape, which jsonb rejects", ErrResponseNotStorable)
	case problems&jsonbNumberRange != 0:
		return nil, fmt.Errorf("%w: a number is beyond the range of jsonb's numeric type", ErrResponseNotStorable)
	}
	return encoded, nil
}

// sealError is a codec's failure to seal a value: the server's, whatever
// the value.
type sealError struct{ err error }

func (e sealError) Error() string { return "seal: " + e.err.Error() }
func (e sealError) Unwrap() error { return e.err }

// replayed decodes a stored response into the result of a replay.
func replayed[T any](stored []byte, scope string, o *options) (Result[T], error) {
	res := Result[T]{Replayed: true}
	if stored == nil {
		return res, nil // the key recorded only that its operation ran (Once)
	}
	if o.codec != nil {
		var sealed []byte
		if err := json.Unmarshal(stored, &sealed); err != nil {
			return Result[T]{}, fmt.Errorf("idem: stored response is not sealed by a codec: %w", err)
		}
		opened, err := o.codec.Open(scope, sealed)
		if err != nil {
			return Result[T]{}, fmt.Errorf("idem: open stored response: %w", err)
		}
		stored = opened
	}
	if err := json.Unmarshal(stored, &res.Value); err != nil {
		return Result[T]{}, fmt.Errorf("idem: decode stored response: %w", err)
	}
	return res, nil
}

// jsonbProblem flags what PostgreSQL's jsonb rejects in valid JSON.
type jsonbProblem uint8

const (
	// jsonbNUL: a string holds \u0000, which jsonb's text cannot hold.
	jsonbNUL jsonbProblem = 1 << iota
	// jsonbLoneSurrogate: a \uD800-\uDFFF escape that is not half of a
	// surrogate pair. Go's decoder would turn it into U+FFFD.
	jsonbLoneSurrogate
	// jsonbNumberRange: a number beyond jsonb's numeric type: more than
	// 131072 digits before the decimal point or 16383 after it.
	jsonbNumberRange
)

// jsonb's numeric limits, in decimal digits.
const (
	numericMaxIntegerDigits  = 131072
	numericMaxFractionDigits = 16383
	// numericMaxExponent bounds the exponent PostgreSQL's numeric input
	// accepts at all, whatever the digits, zero included: INT_MAX / 2.
	numericMaxExponent = 1<<30 - 1
)

// scanJSON returns every problem that valid JSON b has for jsonb, in one
// pass. Every backslash in valid JSON starts an escape, so stepping over
// each escape whole keeps "\\u0000" (an escaped backslash, then text) from
// counting.
func scanJSON(b []byte) jsonbProblem {
	var problems jsonbProblem
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			for i++; i < len(b) && b[i] != '"'; i++ {
				if b[i] != '\\' {
					continue
				}
				if i+5 >= len(b) || b[i+1] != 'u' {
					i++
					continue
				}
				r := hex4(b[i+2 : i+6])
				switch {
				case r == 0:
					problems |= jsonbNUL
				case r >= 0xDC00 && r <= 0xDFFF:
					problems |= jsonbLoneSurrogate
				case r >= 0xD800 && r <= 0xDBFF:
					if i+11 < len(b) && b[i+6] == '\\' && b[i+7] == 'u' {
						if low := hex4(b[i+8 : i+12]); low >= 0xDC00 && low <= 0xDFFF {
							i += 6 // the low half belongs to this pair
							break
						}
					}
					problems |= jsonbLoneSurrogate
				}
				i += 5
			}
		case c == '-' || c >= '0' && c <= '9':
			j := i
			for j < len(b) && strings.IndexByte("+-.0123456789eE", b[j]) >= 0 {
				j++
			}
			if !numericFits(string(b[i:j])) {
				problems |= jsonbNumberRange
			}
			i = j - 1
		}
	}
	return problems
}

func hex4(b []byte) rune {
	r, err := strconv.ParseUint(string(b), 16, 16)
	if err != nil {
		return -1
	}
	return rune(r)
}

// numberParts splits a valid JSON number literal into its sign, its
// significant digits (no leading zeros; empty for zero), the number of
// those digits that came from the fraction, and its exponent. ok is false
// when the exponent does not fit in 18 digits.
func numberParts(lit string) (negative bool, digits string, fracLen int, exp int64, ok bool) {
	negative = strings.HasPrefix(lit, "-")
	lit = strings.TrimPrefix(lit, "-")
	mantissa := lit
	if i := strings.IndexAny(lit, "eE"); i >= 0 {
		mantissa = lit[:i]
		expLit := strings.TrimPrefix(lit[i+1:], "+")
		if len(strings.TrimLeft(strings.TrimPrefix(expLit, "-"), "0")) > 18 {
			return negative, "", 0, 0, false
		}
		var err error
		if exp, err = strconv.ParseInt(expLit, 10, 64); err != nil {
			return negative, "", 0, 0, false
		}
	}
	intPart, frac := mantissa, ""
	if i := strings.IndexByte(mantissa, '.'); i >= 0 {
		intPart, frac = mantissa[:i], mantissa[i+1:]
	}
	return negative, strings.TrimLeft(intPart+frac, "0"), len(frac), exp, true
}

// numericFits reports whether jsonb's numeric type accepts lit, by the
// rules of PostgreSQL's numeric input: the digits written after the
// decimal point, once the exponent has moved it, count toward the scale
// (trailing zeros included); the integer digits of a non-zero value count
// toward the weight.
func numericFits(lit string) bool {
	_, digits, fracLen, exp, ok := numberParts(lit)
	if !ok || exp >= numericMaxExponent || exp <= -numericMaxExponent {
		return false
	}
	if scale := int64(fracLen) - exp; scale > numericMaxFractionDigits {
		return false
	}
	if digits == "" {
		return true // zero has no integer digits to count
	}
	return int64(len(digits))-int64(fracLen)+exp <= numericMaxIntegerDigits
}
