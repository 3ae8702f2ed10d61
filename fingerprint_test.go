package idem_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/pgidem/idem"
)

func TestFingerprintSeparatesParts(t *testing.T) {
	t.Parallel()
	if bytes.Equal(idem.Fingerprint([]byte("ab"), []byte("c")), idem.Fingerprint([]byte("a"), []byte("bc"))) {
		t.Fatal(`("ab","c") and ("a","bc") share a fingerprint`)
	}
	if bytes.Equal(idem.Fingerprint([]byte("a")), idem.Fingerprint([]byte("a"), nil)) {
		t.Fatal("an empty trailing part does not change the fingerprint")
	}
	if len(idem.Fingerprint()) != 32 {
		t.Fatal("not a SHA-256 digest")
	}
}

func TestFingerprintJSONIsCanonical(t *testing.T) {
	t.Parallel()
	same := [][]string{
		{`{"a":1,"b":[true,null,"x"]}`, ` { "b" : [ true , null , "\u0078" ] , "a" : 1.0 } `, `{"b":[true,null,"x"],"a":1e0}`},
		{`{"s":"😀"}`, `{"s":"\ud83d\ude00"}`},
		{`12345678901234567890`, `1234567890123456789.0e1`},
		{`1e1001`, `10e1000`, `0.1e1002`},
		{`0`, `-0`, `0.000e-5`, `0e99`},
	}
	for _, group := range same {
		want := fp(t, group[0])
		for _, doc := range group[1:] {
			if !bytes.Equal(fp(t, doc), want) {
				t.Errorf("%s and %s differ", group[0], doc)
			}
		}
	}
	different := []string{`{"a":1}`, `{"a":2}`, `{"a":"1"}`, `{"b":1}`, `[{"a":1}]`, `{"a":1.0000000000000000001}`,
		`12345678901234567890`, `12345678901234567891`, `1e1000000000000000000`, `1e100000000000000000`, `-1`}
	seen := map[string]string{}
	for _, doc := range different {
		key := string(fp(t, doc))
		if other, ok := seen[key]; ok {
			t.Errorf("%s and %s share a fingerprint", doc, other)
		}
		seen[key] = doc
	}
}

func TestFingerprintJSONRejectsWhatDecodingWouldBlur(t *testing.T) {
	t.Parallel()
	for _, doc := range []string{"\"a\xff\"", `"a\ud800"`, `"a\udfff"`, `"\ud800\u0041"`, `{"a":1} {"b":2}`, `{`, ``} {
		if _, err := idem.FingerprintJSON(json.RawMessage(doc)); err == nil {
			t.Errorf("FingerprintJSON(%q) gave no error", doc)
		}
	}
	// An escaped backslash followed by text that looks like an escape is
	// plain text, and fine.
	if _, err := idem.FingerprintJSON(json.RawMessage(`"\\ud800"`)); err != nil {
		t.Errorf(`"\\ud800": %v`, err)
	}
}

func fp(t *testing.T, doc string) []byte {
	t.Helper()
	sum, err := idem.FingerprintJSON(json.RawMessage(doc))
	if err != nil {
		t.Fatalf("FingerprintJSON(%s): %v", doc, err)
	}
	return sum
}
