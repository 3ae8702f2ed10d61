package idemhttp

import (
	"errors"
	"log/slog"
	"net/http"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
	"github.com/pgidem/idem/internal/httpedge"
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
	// a database error, a panic in the handler, or an error of the
	// server's that the same request would meet again: Config.Scope gave
	// no valid scope, the answer could not be stored, a flow's steps
	// changed. Nothing it did was kept, or a flow's completed steps only:
	// retrying it with the same key is safe, but its detail says so only
	// when a retry can help.
	ProblemRequestFailed = "request-failed"

	// ProblemDatabaseUnavailable (503): the database could not be reached,
	// the connection to it broke, or the connection reached a standby (a
	// read-only server, as during a failover), so the request did not
	// complete, or completed without its answer reaching the client.
	// Retrying it later with the same key is safe: it runs again or
	// replays. The answer carries a Retry-After of one second: the least
	// wait, not a promise.
	ProblemDatabaseUnavailable = "database-unavailable"

	// ProblemRequestInvalid (400): the request is not what a flow endpoint
	// takes (see [FlowHandler]): the detail says why. The flow did not run.
	// Fix the request; with a new key if it was a mistake, with the same
	// key if this was its first attempt.
	ProblemRequestInvalid = "request-invalid"

	// ProblemOperationIncomplete (503): the flow serving the request did
	// not complete: a call it makes to another system failed, or its
	// outcome is not known yet. Nothing of the failure was kept: retrying
	// with the same key, after Retry-After, continues the operation where
	// it stopped, without repeating what it completed.
	ProblemOperationIncomplete = "operation-incomplete"

	// ProblemInputNotStorable (422): the operation's input, which a flow
	// endpoint reads from the request (see [FlowHandler]), cannot be
	// stored: it is larger than the flow stores, or holds what PostgreSQL
	// cannot (a NUL character, a lone UTF-16 surrogate, a number out of
	// range): the detail says which. The flow did not run and nothing was
	// recorded. The same request gets the same answer: do not retry it;
	// fix it.
	ProblemInputNotStorable = "input-not-storable"

	// ProblemOperationStopped (409): the operation with the key was
	// stopped, for a person to decide what became of it (a call it had
	// started could no longer be made again safely), or an operator ended
	// it. It will not run again: do not retry; the service's operators
	// know of it.
	ProblemOperationStopped = "operation-stopped"
)

// problem is an RFC 9457 problem details object with a code member.
type problem = httpedge.Details

// WriteError answers a request for which [Middleware.ParseKey], [idem.Run]
// or [idem.Do] returned err, as the middleware answers its own requests:
// with the same problems, codes, type URIs, Link headers, details, status
// codes and Retry-After. It is for a handler that calls idem itself:
//
//   - ParseKey's errors: 400 key-missing or key-invalid.
//   - [idem.ErrInvalidKey]: 400 key-invalid.
//   - [idem.ErrFingerprintMismatch]: 422 key-reused.
//   - [idem.ErrInProgress], and a flow's [idem.ErrLeaseLost] (another
//     executor has the flow now): 409 key-in-progress, with a Retry-After
//     of [Config.Wait] in seconds, rounded up (so give idem.Run the same
//     wait).
//   - a flow's [idem.ErrFlowStopped]: 409 operation-stopped.
//   - a flow's [idem.ErrInputNotStorable]: 422 input-not-storable.
//   - an error that says the database could not be reached or the
//     connection to it broke (pgx's connect errors, a closed connection,
//     a server shutting down), or [idem.ErrReadOnly] (a standby): 503
//     database-unavailable, with a Retry-After of 1.
//   - any other error: 500 request-failed. Its detail says that a retry
//     with the same key is safe, which holds when the error came from
//     idem, whose transaction did not commit, except for the errors that
//     the same request would meet again, which are the server's to fix:
//     [idem.ErrInvalidScope] (Config.Scope gave "" or another scope idem
//     refuses), [idem.ErrResponseTooLarge] and [idem.ErrResponseNotStorable]
//     (an answer that cannot be stored).
//
// The last two are logged to [Config.Logger], unless the request's context
// is done: the client went away. An error of the handler's own deserves an
// answer of its own.
func (m *Middleware) WriteError(w http.ResponseWriter, r *http.Request, err error) {
	var keyErr *keyError
	switch {
	case errors.As(err, &keyErr) && keyErr.missing:
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyMissing, "This request needs an "+m.header+" header.")
	case errors.As(err, &keyErr):
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "The "+m.header+" header "+keyErr.problem+".")
	case errors.Is(err, idem.ErrInvalidKey):
		m.writeProblem(w, http.StatusBadRequest, ProblemKeyInvalid, "The "+m.header+" header does not hold a valid key.")
	case errors.Is(err, idem.ErrFingerprintMismatch):
		m.writeProblem(w, http.StatusUnprocessableEntity, ProblemKeyReused,
			"This "+m.header+" was already used for a different request. Use a new key for a new request.")
	case errors.Is(err, idem.ErrInProgress), errors.Is(err, idem.ErrLeaseLost):
		w.Header().Set("Retry-After", m.retryAfter)
		m.writeProblem(w, http.StatusConflict, ProblemKeyInProgress,
			"A request with this "+m.header+" is still being processed. Retry it later with the same key.")
	case errors.Is(err, idem.ErrInputNotStorable):
		// Before ErrResponseTooLarge and ErrResponseNotStorable, which say
		// why: the input comes from the request, not from the server.
		why := "it holds what the database cannot store (a NUL character, a lone UTF-16 surrogate or a number out of range)"
		if errors.Is(err, idem.ErrResponseTooLarge) {
			why = "it is larger than the server stores"
		}
		m.writeProblem(w, http.StatusUnprocessableEntity, ProblemInputNotStorable,
			"The operation's input, read from this request, cannot be stored: "+why+". Nothing ran and nothing was recorded; the same request would get this answer again.")
	case errors.Is(err, idem.ErrFlowStopped):
		m.logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: operation stopped; it needs a person's decision",
			slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()), slog.Any("error", err))
		m.writeProblem(w, http.StatusConflict, ProblemOperationStopped,
			"The operation with this "+m.header+" was stopped and will not run again: the service's operators are to decide what became of it. Do not retry it.")
	default:
		m.writeFailed(w, r, err, true)
	}
}

// writeFailed answers a request whose transaction did not commit, or may
// not have, for a reason other than the handler's answer: 503 when the
// database is unavailable, 500 otherwise, and logs err. keyed says whether
// the request has a key, with which a retry is safe.
func (m *Middleware) writeFailed(w http.ResponseWriter, r *http.Request, err error, keyed bool) {
	status, code, detail := http.StatusInternalServerError, ProblemRequestFailed, "The request could not be completed."
	switch {
	case adapter.DatabaseUnavailable(err):
		status, code, detail = http.StatusServiceUnavailable, ProblemDatabaseUnavailable, "The request could not be completed: the database is unavailable."
		w.Header().Set("Retry-After", httpedge.UnavailableRetryAfter)
	case errors.Is(err, idem.ErrInvalidScope), errors.Is(err, idem.ErrResponseTooLarge), errors.Is(err, idem.ErrResponseNotStorable):
		// The server's own misconfiguration or bug, which the same request
		// meets again: safe to retry, since nothing was kept, but no use.
		detail, keyed = serverFaultDetail, false
	}
	// When the client went away, it cancelled its own request: nothing
	// went wrong that an operator must hear about.
	if r.Context().Err() == nil {
		m.logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: request failed; its transaction did not commit",
			slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()), slog.Int("status", status), slog.Any("error", err))
	}
	m.writeProblem(w, status, code, m.failedDetail(detail, keyed))
}

// serverFaultDetail is the detail of a request that failed because of an
// error of the server's that a retry would meet again.
const serverFaultDetail = "The request could not be completed because of an error of the server's, " +
	"which retrying would meet again until the service is fixed; its operators are told."

// failedDetail is detail, the reason a request failed, plus, when it has
// a key, that retrying with it is safe.
func (m *Middleware) failedDetail(detail string, keyed bool) string {
	if keyed {
		detail += " Retrying it with the same " + m.header + " is safe."
	}
	return detail
}

// writeProblem answers with the problem code, its status and detail. Its
// type URI is also its documentation link: the IETF draft asks for one on
// its error answers, in the body or in a Link header with rel="describedby".
func (s *settings) writeProblem(w http.ResponseWriter, status int, code, detail string) {
	s.writeProblemOf(w, problem{Status: status, Code: code, Detail: detail})
}

func (s *settings) writeProblemOf(w http.ResponseWriter, p problem) {
	p.Title = httpedge.Title(p.Code)
	httpedge.Write(w, s.problemTypeBase, p)
}
