package idem

import (
	"strconv"
	"strings"
)

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
	if !ok {
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
