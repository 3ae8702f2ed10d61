package outbox

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestErrorTextIsStorable(t *testing.T) {
	t.Parallel()
	cases := map[string]error{
		"NUL":         errors.New("a\x00b"),
		"invalid":     errors.New("bad \xff byte"),
		"long":        errors.New(strings.Repeat("é", maxErrorText)),
		"long, ascii": errors.New(strings.Repeat("x", 3*maxErrorText)),
	}
	for name, err := range cases {
		got := errorText(err)
		if !utf8.ValidString(got) || strings.ContainsRune(got, 0) || len(got) > maxErrorText+len("…") {
			t.Errorf("%s: %q (%d bytes) is not storable", name, got[:min(len(got), 40)], len(got))
		}
	}
	if got := errorText(errors.New("plain")); got != "plain" {
		t.Errorf("plain error stored as %q", got)
	}
}
