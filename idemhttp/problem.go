package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// DefaultProblemTypeBase is the start of every problem's type URI unless
// [Config.ProblemTypeBase] says otherwise: the page of this package that
// documents each code under a heading of its name, so that the type URI
// of a problem, followed, explains it.
const DefaultProblemTypeBase = "https://github.com/pgidem/idem/blob/main/idemhttp/PROBLEMS.md#"

// Codes of the problems the middleware answers itself. A problem's type URI
// is [Config.ProblemTypeBase] followed by its code, and its body carries
// the code again as the "code" member, so that a client can tell one
// problem from another without reading prose. The codes are stable: a code
// is never given another meaning.
const (
	// ProblemKeyMissing (400): Config.Required is set and the request has
	// no key. The handler did not run. Send a key.
	ProblemKeyMissing = "key-missing"

	// ProblemKeyInvalid (400): the key's header field is malformed, empty,
	// longer than 255 bytes, or sent twice. The handler did not run.
	ProblemKeyInvalid = "key-invalid"

	// ProblemScopeUnknown (400): Config.Scope could not tell who is
	// calling, so the key cannot be scoped. The handler did not run.
	ProblemScopeUnknown = "scope-unknown"

	// ProblemFingerprintFailed (400): Config.Fingerprint could not
	// fingerprint the request. The handler did not run.
	ProblemFingerprintFailed = "fingerprint-failed"

	// ProblemBodyUnreadable (400): the request body could not be read. The
	// handler did not run.
	ProblemBodyUnreadable = "body-unreadable"

	// ProblemBodyTooLarge (413): the request body is larger than
	// Config.MaxBodyBytes. The handler did not run.
	ProblemBodyTooLarge = "body-too-large"

	// ProblemKeyReused (422): the key was used before for a different
	// request (another fingerprint). The handler did not run. Use a new key
	// for a new request.
	ProblemKeyReused = "key-reused"

	// ProblemKeyInProgress (409): a request with the key is still running,
	// and did not finish within Config.Wait. Retry after Retry-After, with
	// the same key.
	ProblemKeyInProgress = "key-in-progress"

	// ProblemResponseNotStored (410): the request with the key completed,
	// but its answer was larger than Config.MaxResponseBytes, so only its
	// status (the problem's "original_status" member) and its allow-listed
	// headers other than the body's own were kept. The request will not run
	// again: do not retry it.
	ProblemResponseNotStored = "response-not-stored"

	// ProblemRequestFailed (500): the request did not complete, because of
	// a database failure, a panic in the handler, or a bug in
	// Config.Scope. Nothing it did was kept: retrying it with the same key
	// is safe.
	ProblemRequestFailed = "request-failed"
)

// problemTitles are the problems' titles: like their types, they never
// change from one occurrence to the next, as RFC 9457 asks.
var problemTitles = map[string]string{
	ProblemKeyMissing:        "Idempotency key missing",
	ProblemKeyInvalid:        "Idempotency key invalid",
	ProblemScopeUnknown:      "Caller unknown",
	ProblemFingerprintFailed: "Request cannot be fingerprinted",
	ProblemBodyUnreadable:    "Request body unreadable",
	ProblemBodyTooLarge:      "Request body too large",
	ProblemKeyReused:         "Idempotency key reused",
	ProblemKeyInProgress:     "Request with this idempotency key in progress",
	ProblemResponseNotStored: "Response too large to replay",
	ProblemRequestFailed:     "Request not completed",
}

// problem is an RFC 9457 problem details object with a code member.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
	Code   string `json:"code"`
	// OriginalStatus is the status of an answer too large to store.
	OriginalStatus int `json:"original_status,omitempty"`
}

// checkProblemTypeBase rejects a base that would not give absolute type
// URIs, or that could not be sent in a Link header as it is.
func checkProblemTypeBase(base string) error {
	u, err := url.Parse(base)
	switch {
	case err != nil:
		return fmt.Errorf("idemhttp: Config.ProblemTypeBase %q is not a URI: %v", base, err)
	case !u.IsAbs():
		return fmt.Errorf("idemhttp: Config.ProblemTypeBase %q is not an absolute URI", base)
	case strings.ContainsFunc(base, func(r rune) bool { return r <= ' ' || r >= 0x7f || strings.ContainsRune(`<>"`, r) }):
		return fmt.Errorf("idemhttp: Config.ProblemTypeBase %q holds a character that a URI must escape", base)
	}
	return nil
}

// writeProblem answers with the problem code, its status and detail. Its
// type URI is also its documentation link: the IETF draft asks for one on
// its error answers, in the body or in a Link header with rel="describedby".
func (m *middleware) writeProblem(w http.ResponseWriter, status int, code, detail string) {
	m.writeProblemOf(w, problem{Status: status, Code: code, Detail: detail})
}

func (m *middleware) writeProblemOf(w http.ResponseWriter, p problem) {
	p.Type = m.problemTypeBase + p.Code
	p.Title = problemTitles[p.Code]
	body, _ := json.Marshal(p) // strings and ints always encode
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Language", "en") // of the title and detail
	h.Set("Cache-Control", "no-store")
	h.Set("Link", "<"+p.Type+`>; rel="describedby"`)
	writeResponse(w, nil, p.Status, body, false)
}
