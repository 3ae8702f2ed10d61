package idem

import (
	"encoding/json"
	"testing"
)

// TestAppendJSONStringIsJSON: a step name or lookup outcome written into a
// record, plain or escaped, reads back as itself.
func TestAppendJSONStringIsJSON(t *testing.T) {
	for _, s := range []string{"", "reserve", "charge-2", "a b<c>&d", `quo"te`, `back\slash`, "tab\there", "é", "日本", "\x7f"} {
		b := appendJSONString([]byte("x"), s)
		var got string
		if err := json.Unmarshal(b[1:], &got); err != nil || got != s || string(b[:1]) != "x" {
			t.Errorf("%q written as %s: reads back %q, %v", s, b, got, err)
		}
	}
}
