// Package ident holds the rules for the identifiers idem and its
// subpackages accept: scopes, keys, and the outbox's destinations and
// ordering keys.
package ident

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// MaxLength is the longest scope, key or name accepted, in bytes.
const MaxLength = 255

// Check applies the rules for scopes, keys and names: 1 to MaxLength bytes
// of valid UTF-8 without NUL. Out-of-bounds input is rejected, never
// truncated, because truncation turns distinct identifiers into one. The
// error says what is wrong, without the value.
func Check(s string) error {
	switch {
	case s == "":
		return errors.New("empty")
	case len(s) > MaxLength:
		return fmt.Errorf("%d bytes, more than %d", len(s), MaxLength)
	case !utf8.ValidString(s):
		return errors.New("not valid UTF-8")
	case strings.IndexByte(s, 0) >= 0:
		return errors.New("contains a NUL byte")
	}
	return nil
}
