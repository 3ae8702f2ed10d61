package idemhttp_test

import (
	"bytes"
	"net/http/httptest"
	"testing"

	"github.com/pgidem/idem/idemhttp"
)

func TestDefaultFingerprint(t *testing.T) {
	t.Parallel()
	fp := func(method, target, contentType, body string) []byte {
		r := httptest.NewRequest(method, target, nil)
		if contentType != "" {
			r.Header.Set("Content-Type", contentType)
		}
		return idemhttp.DefaultFingerprint(r, []byte(body))
	}
	base := fp("POST", "/payments?x=1", "application/json", `{"a":1,"b":[true,null]}`)

	same := map[string][]byte{
		"JSON keys reordered, spaced, numbers respelled": fp("POST", "/payments?x=1", "application/json", "{ \"b\": [true, null],\n\"a\": 1.0 }"),
		"+json media type with parameters":               fp("POST", "/payments?x=1", "application/merge-patch+json; charset=utf-8", `{"b":[true,null],"a":1e0}`),
	}
	for name, got := range same {
		if !bytes.Equal(got, base) {
			t.Errorf("%s: fingerprint differs", name)
		}
	}

	different := map[string][]byte{
		"method":        fp("PATCH", "/payments?x=1", "application/json", `{"a":1,"b":[true,null]}`),
		"path":          fp("POST", "/payment?x=1", "application/json", `{"a":1,"b":[true,null]}`),
		"query":         fp("POST", "/payments?x=2", "application/json", `{"a":1,"b":[true,null]}`),
		"no query":      fp("POST", "/payments", "application/json", `{"a":1,"b":[true,null]}`),
		"JSON value":    fp("POST", "/payments?x=1", "application/json", `{"a":2,"b":[true,null]}`),
		"not JSON type": fp("POST", "/payments?x=1", "text/plain", `{"a":1,"b":[true,null]}`),
	}
	for name, got := range different {
		if bytes.Equal(got, base) {
			t.Errorf("another %s gives the same fingerprint", name)
		}
	}

	// Bodies that are not JSON count byte for byte.
	if bytes.Equal(fp("POST", "/p", "text/plain", "a b"), fp("POST", "/p", "text/plain", "a  b")) {
		t.Error("two plain-text bodies that differ in spacing share a fingerprint")
	}
	if bytes.Equal(fp("POST", "/p", "application/json", "{not json"), fp("POST", "/p", "application/json", "{not  json")) {
		t.Error("two unparsable JSON bodies that differ share a fingerprint")
	}
}
