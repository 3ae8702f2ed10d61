// Package httpedge is what idemhttp and idemhttp/webhook share at the HTTP
// edge: the RFC 9457 problems they answer themselves, written the same way
// with the same headers and titles, and the bounded read of a request's body.
package httpedge

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
)

// Details is an RFC 9457 problem details object with a code member.
type Details struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
	Code   string `json:"code"`
	// OriginalStatus is the status of an answer too large to store.
	OriginalStatus int `json:"original_status,omitempty"`
}

// titles are the problems' titles, by code: like their types, they never
// change from one occurrence to the next, as RFC 9457 asks. The codes are
// idemhttp's (idemhttp.ProblemKeyMissing and the constants after it) and
// idemhttp/webhook's (webhook.ProblemUnsigned and the constants after it).
var titles = map[string]string{
	"key-missing":          "Idempotency key missing",
	"key-invalid":          "Idempotency key invalid",
	"scope-unknown":        "Caller unknown",
	"fingerprint-failed":   "Request cannot be fingerprinted",
	"body-unreadable":      "Request body unreadable",
	"body-too-large":       "Request body too large",
	"key-reused":           "Idempotency key reused",
	"key-in-progress":      "Request with this idempotency key in progress",
	"response-not-stored":  "Response too large to replay",
	"request-failed":       "Request not completed",
	"database-unavailable": "Database unavailable",
	"request-invalid":      "Request invalid",
	"operation-incomplete": "Operation not completed yet",
	"operation-stopped":    "Operation stopped",
	"input-not-storable":   "Operation input cannot be stored",

	"webhook-unsigned":          "Webhook not signed",
	"webhook-malformed":         "Webhook signature malformed",
	"webhook-signature-invalid": "Webhook signature invalid",
	"webhook-stale":             "Webhook timestamp outside the tolerance",
	"webhook-id-reused":         "Webhook event id reused",
}

// Title returns the title of the problem code, "" for a code it does not
// know.
func Title(code string) string { return titles[code] }

// Write answers with p, whose type URI is base followed by its code. The
// type URI is also sent as the problem's documentation link, in a Link
// header with rel="describedby", as the IETF draft on the Idempotency-Key
// header asks of its error answers.
func Write(w http.ResponseWriter, base string, p Details) {
	p.Type = base + p.Code
	body, _ := json.Marshal(p) // strings and ints always encode
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Language", "en") // of the title and detail
	h.Set("Cache-Control", "no-store")
	h.Set("Link", "<"+p.Type+`>; rel="describedby"`)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(p.Status)
	// The client may be gone; there is nobody left to tell.
	_, _ = w.Write(body)
}

// CheckTypeBase says what is wrong with a base that would not give
// absolute type URIs, or that could not be sent in a Link header as it is;
// "" when nothing is.
func CheckTypeBase(base string) string {
	u, err := url.Parse(base)
	switch {
	case err != nil:
		return fmt.Sprintf("is not a URI: %v", err)
	case !u.IsAbs():
		return "is not an absolute URI"
	case strings.ContainsFunc(base, func(r rune) bool { return r <= ' ' || r >= 0x7f || strings.ContainsRune(`<>"`, r) }):
		return "holds a character that a URI must escape"
	}
	return ""
}

// UnavailableRetryAfter is the Retry-After of a 503, in seconds: when the
// database will be back is unknown (a restart takes seconds, a failover
// seconds to a minute), so it is the least wait, from which clients back
// off.
const UnavailableRetryAfter = "1"
