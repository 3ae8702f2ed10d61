package idemhttp

import (
	"encoding/json"
	"mime"
	"net/http"
	"strings"

	"github.com/pgidem/idem"
)

// DefaultFingerprint is the fingerprint of a request unless
// [Config.Fingerprint] says otherwise: the SHA-256 digest of the method, the
// target URI (escaped path and raw query, as received), and the body.
//
// A JSON body (a media type of application/json or ending in +json) counts
// by its canonical form (see [idem.FingerprintJSON]), so that a client that
// re-encodes its request with keys in another order or other whitespace
// still gets a replay and not a 422. Any other body, and a JSON body that
// does not parse, counts by its exact bytes.
func DefaultFingerprint(r *http.Request, body []byte) []byte {
	method, target := []byte(r.Method), []byte(r.URL.RequestURI())
	if isJSON(r.Header.Get("Content-Type")) {
		if canonical, err := idem.FingerprintJSON(json.RawMessage(body)); err == nil {
			// The label keeps a canonical digest from ever equalling the
			// raw bytes of another body.
			return idem.Fingerprint(method, target, []byte("json"), canonical)
		}
	}
	return idem.Fingerprint(method, target, []byte("raw"), body)
}

func isJSON(contentType string) bool {
	mediaType, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return false
	}
	return mediaType == "application/json" || strings.HasSuffix(mediaType, "+json")
}
