package idemhttp

import (
	"errors"
	"log/slog"
	"net/http"
	"runtime/debug"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/adapter"
)

// FlowHandler returns a handler that serves each request it is given with a
// run of flow ([idem.Flow.Run]), for endpoints whose write calls another
// system (charging a card, reserving stock): the middleware holds no
// transaction of its own (the flow's local steps hold one each, briefly,
// and its calls none), and the flow's own record makes the request
// exactly-once. Keys, scopes, fingerprints, body
// limits and problems are m's, as for the requests [Middleware.Wrap]
// serves, with these differences:
//
//   - every request needs a key, whatever [Config.Required] says (400
//     key-missing otherwise): a flow is identified by its key; and
//     [Config.Methods] does not apply: route the methods to serve to it;
//   - input reads the flow's input from the request and its whole body.
//     When it returns an error, the request gets 400 request-invalid, with
//     the error's message as the problem's detail, so say there what is
//     wrong with the request and nothing more, and the flow does not run;
//   - answer writes the flow's answer, out, as the response: on the first
//     request, and again on each retry, with Idempotent-Replayed: true set
//     before it is called. What is stored is out, as JSON, not the
//     response's bytes: answer must write the same response for the same
//     out (a definite failure, such as a declined card, is part of out,
//     and answered, say, 402, the same each time);
//   - an input that the flow cannot store ([idem.ErrInputNotStorable]:
//     too large, or holding a NUL character, say) is 422
//     input-not-storable, and the flow does not run;
//   - an error of the flow (a call that failed or whose outcome is
//     unknown: [idem.ErrFlowIncomplete]) is not stored: 503
//     operation-incomplete, with Retry-After, and the client's retry
//     continues the flow where it stopped; a flow whose steps changed
//     ([idem.ErrFlowChanged]), or whose answer cannot be stored, is 500
//     request-failed, whose detail does not invite a retry: the same
//     request would meet it again;
//   - a duplicate waits for the flow's executor up to [Config.Wait], as
//     the middleware's do, then gets 409 key-in-progress; a flow stopped
//     for a person's decision gets 409 operation-stopped.
//
// [Config.Wait] is given to every run. How the flow stores its records is
// the flow's own affair, set by the options given to [idem.NewFlow], which
// its completer ([idem.Flow.Resume]) uses too: the fields of Config that
// concern stored answers (Retention, Codec, Observer, Store,
// ReplayHeaders, MaxResponseBytes, LookupFirst, TxOptions) do not apply to
// flows.
func FlowHandler[In, Out any](m *Middleware, flow *idem.Flow[In, Out],
	input func(r *http.Request, body []byte) (In, error),
	answer func(w http.ResponseWriter, r *http.Request, out Out),
) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, err := m.ParseKey(r)
		if err != nil {
			m.WriteError(w, r, err)
			return
		}
		scope, body, fp, ok := (&handler{Middleware: m}).readKeyed(w, r)
		if !ok {
			return
		}
		in, err := input(r, body)
		if err != nil {
			m.writeProblem(w, http.StatusBadRequest, ProblemRequestInvalid, err.Error())
			return
		}
		res, err := runFlow(m, r, flow, scope, key, fp, in)
		if err != nil {
			m.writeFlowError(w, r, err)
			return
		}
		if res.Replayed {
			w.Header().Set(ReplayedHeader, "true")
		}
		answer(w, r, res.Value)
	})
}

// runFlow runs flow for the request, turning a panic of its function into
// an error, as the middleware does for a handler's.
func runFlow[In, Out any](m *Middleware, r *http.Request, flow *idem.Flow[In, Out], scope, key string, fp []byte, in In) (res idem.Result[Out], err error) {
	defer func() {
		if p := recover(); p != nil {
			if p == http.ErrAbortHandler {
				panic(p)
			}
			err = &handlerPanic{value: p, stack: debug.Stack()}
		}
	}()
	return flow.Run(r.Context(), m.db, scope, key, fp, in, m.flowOptions...)
}

// writeFlowError answers a request whose flow did not give an answer. The
// failure is classified as idemgrpc classifies it
// (adapter.ClassifyFlowError): a flow gets the same answer over both.
func (m *Middleware) writeFlowError(w http.ResponseWriter, r *http.Request, err error) {
	var panicked *handlerPanic
	switch failure := adapter.ClassifyFlowError(err); {
	case errors.As(err, &panicked):
		m.logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: flow panicked; it gave its lease up",
			slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()),
			slog.Any("panic", panicked.value), slog.String("stack", string(panicked.stack)))
		m.writeProblem(w, http.StatusInternalServerError, ProblemRequestFailed, m.failedDetail("The request could not be completed.", true))
	case failure == adapter.FlowChanged:
		// A deployment changed the flow's steps under operations in
		// progress: no retry gets further until the code or an operator
		// does something.
		m.logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: flow's steps differ from those its operation recorded",
			slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()), slog.Any("error", err))
		m.writeProblem(w, http.StatusInternalServerError, ProblemRequestFailed, serverFaultDetail)
	case failure != adapter.FlowIncomplete:
		m.WriteError(w, r, err)
	default:
		// The flow's own error (idem.ErrFlowIncomplete): a call failed, or
		// its outcome is unknown, whatever the error it returned says (a
		// provider's connection refused is no database outage). It stays
		// resumable, and nothing of the error is kept. An outcome the
		// client's retry mends, not a failure for a person: INFO.
		if r.Context().Err() == nil {
			m.logger.LogAttrs(r.Context(), slog.LevelInfo, "idemhttp: flow did not complete; a retry continues it",
				slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()), slog.Any("error", err))
		}
		w.Header().Set("Retry-After", "1")
		m.writeProblem(w, http.StatusServiceUnavailable, ProblemOperationIncomplete,
			"The operation did not complete: a call it makes failed, or its outcome is not known yet. "+
				"Retrying with the same "+m.header+" continues it.")
	}
}
