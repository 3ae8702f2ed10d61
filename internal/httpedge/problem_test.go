package httpedge_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/pgidem/idem/idemhttp"
	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/internal/httpedge"
)

// Every code that idemhttp or idemhttp/webhook answers has its title here.
func TestEveryCodeHasATitle(t *testing.T) {
	t.Parallel()
	for _, code := range []string{
		idemhttp.ProblemKeyMissing, idemhttp.ProblemKeyInvalid, idemhttp.ProblemScopeUnknown,
		idemhttp.ProblemFingerprintFailed, idemhttp.ProblemBodyUnreadable, idemhttp.ProblemBodyTooLarge,
		idemhttp.ProblemKeyReused, idemhttp.ProblemKeyInProgress, idemhttp.ProblemResponseNotStored,
		idemhttp.ProblemRequestFailed, idemhttp.ProblemDatabaseUnavailable,
		idemhttp.ProblemRequestInvalid, idemhttp.ProblemOperationIncomplete, idemhttp.ProblemOperationStopped,
		idemhttp.ProblemInputNotStorable,
		webhook.ProblemUnsigned, webhook.ProblemMalformed, webhook.ProblemSignatureInvalid,
		webhook.ProblemStale, webhook.ProblemIDReused,
	} {
		if httpedge.Title(code) == "" {
			t.Errorf("%s has no title", code)
		}
	}
}

func TestWriteSendsTheProblemWithItsLink(t *testing.T) {
	t.Parallel()
	w := httptest.NewRecorder()
	httpedge.Write(w, "https://example.com/p#", httpedge.Details{Status: 422, Code: "key-reused", Title: "T", Detail: "D"})
	var got httpedge.Details
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	want := httpedge.Details{Type: "https://example.com/p#key-reused", Title: "T", Status: 422, Detail: "D", Code: "key-reused"}
	if w.Code != 422 || got != want {
		t.Errorf("%d %+v, want %+v", w.Code, got, want)
	}
	for name, value := range map[string]string{
		"Content-Type": "application/problem+json", "Content-Language": "en", "Cache-Control": "no-store",
		"Link": `<https://example.com/p#key-reused>; rel="describedby"`,
	} {
		if got := w.Header().Get(name); got != value {
			t.Errorf("%s: %q, want %q", name, got, value)
		}
	}
	if w.Header().Get("Content-Length") == "" || w.Result().StatusCode != http.StatusUnprocessableEntity {
		t.Error("no Content-Length")
	}
}
