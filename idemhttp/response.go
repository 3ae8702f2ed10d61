package idemhttp

import (
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// storedResponse is the value idem stores for a key and replays. Body and
// the header values are []byte, which encoding/json writes as base64: they
// survive the jsonb column byte for byte, whatever they hold, where a JSON
// string would turn bytes that are not UTF-8 into U+FFFD.
type storedResponse struct {
	Status int `json:"status"`
	// Header holds the stored fields by canonical name. A field the handler
	// set to nil, as net/http asks of a handler that wants no Content-Type
	// sniffed, is stored as null, which decodes to a present nil entry
	// again: the replay then suppresses what the first answer suppressed.
	Header map[string][][]byte `json:"header,omitempty"`
	Body   []byte              `json:"body"`
	// BodyNotStored is the length of a body too large to store, which
	// Body then lacks; zero when Body is the whole body.
	BodyNotStored int `json:"body_not_stored,omitempty"`
}

// storeHeader returns the fields of h that allowed lists, and those needed
// to read the body, in their stored form.
func storeHeader(h http.Header, allowed map[string]bool) map[string][][]byte {
	filtered := filterHeader(h, allowed)
	if filtered == nil {
		return nil
	}
	out := make(map[string][][]byte, len(filtered))
	for name, values := range filtered {
		if values == nil {
			out[name] = nil
			continue
		}
		stored := make([][]byte, len(values))
		for i, v := range values {
			stored[i] = []byte(v)
		}
		out[name] = stored
	}
	return out
}

// replayHeader returns the fields of a stored response that allowed still
// lists, and those needed to read the body, as the header of the replay.
// It is never nil.
func replayHeader(stored map[string][][]byte, allowed map[string]bool) http.Header {
	h := make(http.Header, len(stored))
	for name, values := range stored {
		if values == nil {
			h[name] = nil
			continue
		}
		strs := make([]string, len(values))
		for i, v := range values {
			strs[i] = string(v)
		}
		h[name] = strs
	}
	// Filtered again: the configuration may have changed since the
	// response was stored.
	out := filterHeader(h, allowed)
	if out == nil {
		out = make(http.Header, 1)
	}
	return out
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

// bodyFields are the fields needed to read a stored body: whatever
// Config.ReplayHeaders lists, they are stored and replayed with it, since
// without them the replay of, say, a gzipped answer is bytes the client
// cannot decode. Content-Length is not among them: it is always the length
// of the body sent (see writeResponse), so that it never disagrees with it.
var bodyFields = map[string]bool{
	"Content-Type":     true,
	"Content-Encoding": true,
	"Content-Range":    true,
}

// describesBody reports whether the field named name (canonical) describes
// the body itself, and so has no place on an answer that replaces the body.
func describesBody(name string) bool {
	switch name {
	case "Etag", "Last-Modified", "Digest", "Repr-Digest":
		return true
	}
	return strings.HasPrefix(name, "Content-")
}

// filterHeader returns the fields of h that allowed lists, and the
// bodyFields, keyed by their canonical names, but never Content-Length or
// the neverReplayed fields. A field with no values is kept, as a nil entry:
// it tells net/http not to add that field itself.
func filterHeader(h http.Header, allowed map[string]bool) http.Header {
	var out http.Header
	for name, values := range h {
		name = http.CanonicalHeaderKey(name)
		if !allowed[name] && !bodyFields[name] || neverReplayed[name] || name == "Content-Length" {
			continue
		}
		if out == nil {
			out = make(http.Header)
		}
		if len(values) == 0 {
			if _, ok := out[name]; !ok {
				out[name] = nil
			}
			continue
		}
		out[name] = append(out[name], values...)
	}
	return out
}

// writeResponse sends a complete response. Its Content-Length is always the
// length of body, whatever the handler set, so that a first answer and its
// replays are framed alike and by the bytes actually stored. A 204 or 304,
// which may carry no body, gets no length either, and the answer to a HEAD
// (head), which has no body to measure, keeps the length the handler set.
func writeResponse(w http.ResponseWriter, header http.Header, status int, body []byte, head bool) {
	dst := w.Header()
	for name, values := range header {
		dst[name] = values
	}
	bodyAllowed := status != http.StatusNoContent && status != http.StatusNotModified && !head
	if bodyAllowed && dst.Get("Transfer-Encoding") == "" {
		dst["Content-Length"] = []string{strconv.Itoa(len(body))}
	}
	w.WriteHeader(status)
	if bodyAllowed && len(body) > 0 {
		// The client may be gone; there is nobody left to tell.
		_, _ = w.Write(body)
	}
}
