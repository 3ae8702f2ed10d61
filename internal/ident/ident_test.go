package ident

import (
	"strings"
	"testing"
)

func TestCheckAppliesTheRules(t *testing.T) {
	t.Parallel()
	for s, ok := range map[string]bool{
		"k":                              true,
		strings.Repeat("é", 127) + "k":   true, // 255 bytes
		strings.Repeat("k", MaxLength):   true,
		"":                               false,
		strings.Repeat("k", MaxLength+1): false,
		"\xff":                           false,
		"a\x00b":                         false,
	} {
		if err := Check(s); (err == nil) != ok {
			t.Errorf("Check(%q) = %v, want ok %v", s, err, ok)
		}
		if err := Check(s); err != nil && s != "" && strings.Contains(err.Error(), s) {
			t.Errorf("Check(%q) = %v: the error must not hold the value", s, err)
		}
	}
}
