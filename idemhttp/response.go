package idemhttp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
)

// storedResponse is the value idem stores for a key and replays. Body is a
// []byte, which encoding/json writes as base64: it survives the jsonb column
// byte for byte, whatever it holds.
type storedResponse struct {
	Status int                 `json:"status"`
	Header map[string][]string `json:"header,omitempty"`
	Body   []byte              `json:"body"`
}

// recorder is the http.ResponseWriter the handler writes to: nothing reaches
// the client before the transaction has committed. It deliberately offers
// no Flush, Hijack or Unwrap, through which a handler (or
// http.ResponseController) would reach the client early.
type recorder struct {
	header http.Header
	// status is 0 until the handler writes a header or a body.
	status int
	// sent is the header as it was when the status was written: like
	// net/http, later changes to the header are not part of the response.
	sent http.Header
	body bytes.Buffer
}

func newRecorder() *recorder { return &recorder{header: make(http.Header)} }

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(status int) {
	if status < 100 || status > 999 {
		// As net/http does; the middleware turns the panic into a 500.
		panic(fmt.Sprintf("idemhttp: invalid WriteHeader code %v", status))
	}
	// An informational answer cannot go out before the final one has
	// committed, so it is dropped.
	if rec.status != 0 || status < 200 {
		return
	}
	rec.status = status
	rec.sent = rec.header.Clone()
}

func (rec *recorder) Write(p []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	return rec.body.Write(p)
}

// finish settles what a handler that returned gave as its response.
func (rec *recorder) finish() {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
}

// neverReplayed lists the fields that are never stored or replayed, whatever
// the configuration says: credentials, which must not reach whoever retries
// with a key, and connection-specific fields, which describe a connection
// that is gone.
var neverReplayed = map[string]bool{
	"Authentication-Info":       true,
	"Authorization":             true,
	"Cookie":                    true,
	"Proxy-Authenticate":        true,
	"Proxy-Authentication-Info": true,
	"Proxy-Authorization":       true,
	"Set-Cookie":                true,
	"Set-Cookie2":               true,
	"Www-Authenticate":          true,
	"Connection":                true,
	"Keep-Alive":                true,
	"Proxy-Connection":          true,
	"Te":                        true,
	"Trailer":                   true,
	"Transfer-Encoding":         true,
	"Upgrade":                   true,
	ReplayedHeader:              true,
}

// filterHeader returns the fields of h that allowed lists, keyed by their
// canonical names.
func filterHeader(h http.Header, allowed map[string]bool) map[string][]string {
	var out map[string][]string
	for name, values := range h {
		name = http.CanonicalHeaderKey(name)
		if !allowed[name] || neverReplayed[name] || len(values) == 0 {
			continue
		}
		if out == nil {
			out = make(map[string][]string)
		}
		out[name] = append(out[name], values...)
	}
	return out
}

// writeResponse sends a complete response. Its length is always stated, so
// that a replay is framed as its first answer was, and a 204 or 304, which
// may carry neither a body nor a length, gets neither.
func writeResponse(w http.ResponseWriter, header map[string][]string, status int, body []byte) {
	dst := w.Header()
	for name, values := range header {
		dst[name] = values
	}
	bodyAllowed := status != http.StatusNoContent && status != http.StatusNotModified
	if bodyAllowed && dst.Get("Content-Length") == "" && dst.Get("Transfer-Encoding") == "" {
		dst.Set("Content-Length", strconv.Itoa(len(body)))
	}
	w.WriteHeader(status)
	if bodyAllowed && len(body) > 0 {
		// The client may be gone; there is nobody left to tell.
		_, _ = w.Write(body)
	}
}

// problem is an RFC 9457 problem details object. Type is always
// "about:blank", so Title is the status's reason phrase as that RFC asks,
// and Detail tells what went wrong.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
}

func writeProblem(w http.ResponseWriter, status int, detail string) {
	body, _ := json.Marshal(problem{ // strings and an int always encode
		Type:   "about:blank",
		Title:  http.StatusText(status),
		Status: status,
		Detail: detail,
	})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	writeResponse(w, nil, status, body)
}
