package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/httpedge"
)

// handler is the middleware around one handler.
type handler struct {
	*Middleware
	next http.Handler
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.methods[r.Method] {
		h.next.ServeHTTP(w, r)
		return
	}
	if isGRPC(r) {
		refuseGRPC(w, r)
		return
	}
	key, err := h.ParseKey(r)
	if err != nil {
		if isKeyMissing(err) && !h.required {
			if body, ok := h.readBody(w, r); ok {
				h.serveUnkeyed(w, r, body)
			}
			return
		}
		h.WriteError(w, r, err)
		return
	}
	scope, body, fp, ok := h.readKeyed(w, r)
	if !ok {
		return
	}
	h.serveKeyed(w, r, requestValues{scope: scope, key: key}, fp, body)
}

// readKeyed reads what a request with a key needs before anything runs:
// its scope, its body and its fingerprint; or answers the request itself
// and reports false.
func (h *handler) readKeyed(w http.ResponseWriter, r *http.Request) (scope string, body, fp []byte, ok bool) {
	scope, err := h.scope(r)
	if err != nil {
		// The error is the server's view of the caller, which the client
		// has no business reading.
		h.writeProblem(w, http.StatusBadRequest, ProblemScopeUnknown, "The request does not say who is calling, so its "+h.header+" cannot be scoped.")
		return "", nil, nil, false
	}
	if body, ok = h.readBody(w, r); !ok {
		return "", nil, nil, false
	}
	if fp, err = h.fingerprint(r, body); err != nil {
		h.writeProblem(w, http.StatusBadRequest, ProblemFingerprintFailed, "The request cannot be fingerprinted to check its "+h.header+".")
		return "", nil, nil, false
	}
	return scope, body, fp, true
}

// readBody reads the whole request body, or answers the request itself and
// reports false.
func (h *handler) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := httpedge.ReadBody(r, h.maxBodyBytes)
	switch {
	case errors.Is(err, httpedge.ErrBodyTooLarge):
		h.writeProblem(w, http.StatusRequestEntityTooLarge, ProblemBodyTooLarge,
			fmt.Sprintf("The request body is larger than %d bytes.", h.maxBodyBytes))
		return nil, false
	case err != nil:
		h.writeProblem(w, http.StatusBadRequest, ProblemBodyUnreadable, "The request body could not be read.")
		return nil, false
	}
	return body, true
}

// serveKeyed runs the handler under the claim of the request's scope and
// key, or replays the answer stored for them.
func (h *handler) serveKeyed(w http.ResponseWriter, r *http.Request, v requestValues, fp, body []byte) {
	var first *recorder
	res, err := idem.Run(r.Context(), h.db, v.scope, v.key, fp, func(ctx context.Context, tx pgx.Tx) (storedResponse, error) {
		v.tx = tx
		rec, err := h.runHandler(ctx, v, r, body, h.store)
		if err != nil {
			return storedResponse{}, err
		}
		first = rec
		stored := storedResponse{Status: rec.status, Header: storeHeader(rec.sent, h.replayHeaders)}
		if n := rec.body.Len(); n > h.maxResponseBytes {
			// Rolling back would answer 500 to this request and to every
			// retry of it, forever: the request completes instead, and its
			// retries learn that its body was not kept.
			stored.BodyNotStored = n
		} else {
			stored.Body = rec.body.Bytes()
		}
		return stored, nil
	}, h.runOptions...)

	switch {
	case err == nil && res.Replayed && res.Value.BodyNotStored > 0:
		h.replayNotStored(w, res.Value)
	case err == nil && res.Replayed:
		stored := res.Value
		header := replayHeader(stored.Header, h.replayHeaders)
		header[ReplayedHeader] = []string{"true"}
		writeResponse(w, header, stored.Status, stored.Body, r.Method == http.MethodHead)
	case err == nil:
		if n := first.body.Len(); n > h.maxResponseBytes {
			h.logger.LogAttrs(r.Context(), slog.LevelWarn,
				"idemhttp: answer too large to store; it committed, and its retries get 410 "+ProblemResponseNotStored,
				slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()),
				slog.Int("status", first.status), slog.Int("body_bytes", n), slog.Int("max_response_bytes", h.maxResponseBytes))
		}
		writeResponse(w, first.sent, first.status, first.body.Bytes(), r.Method == http.MethodHead)
	case h.answerHandlerFailure(w, r, err, true):
	default:
		h.WriteError(w, r, err)
	}
}

// replayNotStored answers the retry of a request whose answer was too large
// to store: a problem that says so, with the status the request got and the
// allow-listed headers that describe something other than the body that is
// missing, such as Location.
func (h *handler) replayNotStored(w http.ResponseWriter, stored storedResponse) {
	dst := w.Header()
	for name, values := range replayHeader(stored.Header, h.replayHeaders) {
		if !describesBody(name) {
			dst[name] = values
		}
	}
	dst.Set(ReplayedHeader, "true")
	h.writeProblemOf(w, problem{
		Status: http.StatusGone,
		Code:   ProblemResponseNotStored,
		Detail: fmt.Sprintf("The request with this %s completed with status %d, but its answer of %d bytes was too large to keep, "+
			"so it cannot be sent again. The request will not run again: do not retry it.",
			h.header, stored.Status, stored.BodyNotStored),
		OriginalStatus: stored.Status,
	})
}

// serveUnkeyed runs the handler in a transaction without a claim: what it
// writes commits unless it answers 5xx or panics.
func (h *handler) serveUnkeyed(w http.ResponseWriter, r *http.Request, body []byte) {
	var rec *recorder
	err := idem.WithTx(r.Context(), h.db, h.txOptions, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		rec, err = h.runHandler(ctx, requestValues{tx: tx}, r, body, StoreBelow500)
		return err
	})
	switch {
	case err == nil:
		writeResponse(w, rec.sent, rec.status, rec.body.Bytes(), r.Method == http.MethodHead)
	case h.answerHandlerFailure(w, r, err, false):
	default:
		h.writeFailed(w, r, err, false)
	}
}

// refusedAnswer is a handler's answer whose status the store policy
// refuses, such as a 5xx, returned as an error so that its transaction
// rolls back; the client still gets the answer.
type refusedAnswer struct{ rec *recorder }

func (e *refusedAnswer) Error() string {
	return fmt.Sprintf("idemhttp: handler answered %d, which is not stored", e.rec.status)
}

// handlerPanic is a handler's panic, returned as an error so that its
// transaction rolls back.
type handlerPanic struct {
	value any
	stack []byte
}

func (e *handlerPanic) Error() string { return fmt.Sprintf("idemhttp: handler panicked: %v", e.value) }

// runHandler runs the handler once in the transaction of v, with a fresh
// copy of the body, and records its answer. An answer whose status store
// refuses, and a panic, come back as errors, for the caller to roll back.
func (h *handler) runHandler(ctx context.Context, v requestValues, r *http.Request, body []byte, store func(int) bool) (rec *recorder, err error) {
	rec = newRecorder()
	defer func() {
		if p := recover(); p != nil {
			err = &handlerPanic{value: p, stack: debug.Stack()}
		}
	}()
	req := r.WithContext(context.WithValue(ctx, requestKey{}, v))
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	h.next.ServeHTTP(rec, req)
	rec.finish()
	if !store(rec.status) {
		return rec, &refusedAnswer{rec: rec}
	}
	return rec, nil
}

// answerHandlerFailure answers a request whose transaction rolled back
// because of the handler, and reports whether it did: an answer that is
// not stored goes to the client as the handler wrote it, and a panic
// becomes a 500 problem (keyed says whether the request has a key), or, for
// http.ErrAbortHandler, a cut connection.
func (h *handler) answerHandlerFailure(w http.ResponseWriter, r *http.Request, err error, keyed bool) bool {
	var refused *refusedAnswer
	if errors.As(err, &refused) {
		writeResponse(w, refused.rec.sent, refused.rec.status, refused.rec.body.Bytes(), r.Method == http.MethodHead)
		return true
	}
	var panicked *handlerPanic
	if !errors.As(err, &panicked) {
		return false
	}
	if panicked.value == http.ErrAbortHandler {
		// The handler asked net/http to cut the connection; do so, now
		// that its transaction has rolled back.
		panic(http.ErrAbortHandler)
	}
	h.logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: handler panicked; its transaction was rolled back",
		slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()),
		slog.Any("panic", panicked.value), slog.String("stack", string(panicked.stack)))
	h.writeProblem(w, http.StatusInternalServerError, ProblemRequestFailed, h.failedDetail("The request could not be completed.", keyed))
	return true
}
