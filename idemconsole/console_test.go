package idemconsole_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconsole"
	"github.com/pgidem/idem/internal/testdb"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// stopped makes a flow that texts a customer at most once, and stops it
// at the text: its first answer is lost. It returns the flow.
func stopped(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) *idem.Flow[string, string] {
	t.Helper()
	var sends atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("notify"), func(ctx context.Context, s *idem.Steps, to string) (string, error) {
		id, err := idem.Call(s, "sms", func(ctx context.Context, key string) (string, error) {
			if sends.Add(1) == 1 {
				return "", errors.New("read tcp: i/o timeout")
			}
			return "sms_again", nil
		}, idem.AtMostOnce())
		return "sent " + id, err
	})
	for range 2 {
		if _, err := flow.Run(ctx, pool, scope, key, nil, "+15550100"); err == nil {
			t.Fatal("the run meant to fail succeeded")
		}
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, key); err != nil || info.State != "attention" {
		t.Fatalf("the flow: %+v, %v; want it stopped", info, err)
	}
	return flow
}

// serve serves the console with cfg (DB and Prefix filled in) and returns
// its server and a client with a cookie jar, as a browser has.
func serve(t *testing.T, pool *pgxpool.Pool, cfg idemconsole.Config) (*httptest.Server, *http.Client) {
	t.Helper()
	cfg.DB, cfg.Prefix = pool, "/ops/idem"
	h, err := idemconsole.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/idem/", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	return srv, &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

var tokenField = regexp.MustCompile(`name="token" value="([^"]+)"`)

// post posts form to u as the console's own page does, from origin.
func post(t *testing.T, c *http.Client, u, origin string, form url.Values) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", u, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if origin != "" {
		req.Header.Set("Origin", origin)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestConsoleResolvesAStoppedFlowAndAuditsWho(t *testing.T) {
	ctx, pool, scope := env.Setup(t, "console")
	flow := stopped(t, ctx, pool, scope, "order-1")
	var audit bytes.Buffer
	srv, c := serve(t, pool, idemconsole.Config{Operator: func(*http.Request) string { return "alice" },
		Logger: slog.New(slog.NewTextHandler(&audit, nil))})
	page := srv.URL + "/ops/idem/flow?" + url.Values{"scope": {scope}, "key": {"order-1"}}.Encode()
	code, body := get(t, c, page)
	m := tokenField.FindStringSubmatch(body)
	if code != 200 || m == nil || !strings.Contains(body, "Record as applied") || !strings.Contains(body, "at most once") {
		t.Fatalf("the flow's page: %d\n%s", code, body)
	}
	form := url.Values{"token": {m[1]}, "scope": {scope}, "key": {"order-1"}, "step": {"sms"}, "outcome": {"applied"},
		"result": {`"sms_1"`}, "reason": {"the gateway delivered it"}}
	if code, body := post(t, c, srv.URL+"/ops/idem/flow/resolve", srv.URL, form); code != http.StatusSeeOther {
		t.Fatalf("the resolution: %d\n%s", code, body)
	}
	res, err := flow.Run(ctx, pool, scope, "order-1", nil, "+15550100")
	if err != nil || res.Value != "sent sms_1" {
		t.Fatalf("the client's retry: %+v, %v", res, err)
	}
	info, _ := idem.InspectFlow(ctx, pool, scope, "order-1")
	if len(info.Resolutions) != 1 || info.Resolutions[0].By != "alice" || info.Resolutions[0].Reason != "the gateway delivered it" {
		t.Fatalf("the resolution recorded: %+v", info.Resolutions)
	}
	if !strings.Contains(audit.String(), "operator=alice action=resolve") || !strings.Contains(audit.String(), "key=order-1") {
		t.Fatalf("the audit log:\n%s", audit.String())
	}
	// A second resolution, from a page left open, is refused with why.
	if code, body := post(t, c, srv.URL+"/ops/idem/flow/resolve", srv.URL, form); code != http.StatusConflict ||
		!strings.Contains(body, "not stopped") {
		t.Fatalf("a second resolution: %d\n%s", code, body)
	}
}

func TestConsoleRefusesAPostFromAnotherSiteOrWithoutItsToken(t *testing.T) {
	ctx, pool, scope := env.Setup(t, "console")
	stopped(t, ctx, pool, scope, "k")
	srv, c := serve(t, pool, idemconsole.Config{Operator: func(*http.Request) string { return "alice" }})
	_, body := get(t, c, srv.URL+"/ops/idem/flow?"+url.Values{"scope": {scope}, "key": {"k"}}.Encode())
	token := tokenField.FindStringSubmatch(body)[1]
	form := url.Values{"scope": {scope}, "key": {"k"}, "step": {"sms"}, "outcome": {"not_applied"}, "reason": {"r"}}
	for name, try := range map[string]struct {
		origin, token string
		client        *http.Client
	}{
		"another site, with the token": {"https://evil.example", token, c},
		"no token":                     {srv.URL, "", c},
		"another browser's token":      {srv.URL, token, &http.Client{}},
		"a forged token":               {srv.URL, strings.Repeat("A", len(token)), c},
	} {
		form.Set("token", try.token)
		if code, body := post(t, try.client, srv.URL+"/ops/idem/flow/resolve", try.origin, form); code != http.StatusForbidden {
			t.Errorf("%s: %d\n%s", name, code, body)
		}
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); info.State != "attention" {
		t.Fatalf("a refused POST changed the flow: %+v", info)
	}
	// A GET never acts.
	if code, _ := get(t, c, srv.URL+"/ops/idem/flow/resolve?"+form.Encode()); code != http.StatusMethodNotAllowed {
		t.Fatalf("a GET of an action: %d", code)
	}
}

func TestReadOnlyConsoleOffersNoActionAndRefusesEveryPost(t *testing.T) {
	ctx, pool, scope := env.Setup(t, "console")
	stopped(t, ctx, pool, scope, "k")
	srv, c := serve(t, pool, idemconsole.Config{ReadOnly: true})
	for _, page := range []string{"/", "/flows?state=attention", "/flow?" + url.Values{"scope": {scope}, "key": {"k"}}.Encode(), "/outbox"} {
		code, body := get(t, c, srv.URL+"/ops/idem"+page)
		if code != 200 || strings.Contains(body, "<form method=\"post\"") || strings.Contains(body, "<button") && page != "/flows?state=attention" {
			t.Fatalf("%s in read-only: %d, offers an action\n%s", page, code, body)
		}
	}
	form := url.Values{"scope": {scope}, "key": {"k"}, "reason": {"r"}}
	if code, body := post(t, c, srv.URL+"/ops/idem/flow/end", srv.URL, form); code != http.StatusForbidden || !strings.Contains(body, "read-only") {
		t.Fatalf("a POST to a read-only console: %d\n%s", code, body)
	}
	if info, _ := idem.InspectFlow(ctx, pool, scope, "k"); info.State != "attention" {
		t.Fatalf("the read-only console changed the flow: %+v", info)
	}
}

func TestConsoleShowsStoredValuesOnlyWhenAllowed(t *testing.T) {
	ctx, pool, scope := env.Setup(t, "console")
	if _, err := idem.Run(ctx, pool, scope, "paid", nil, func(context.Context, pgx.Tx) (string, error) {
		return "card 4242 charged", nil
	}); err != nil {
		t.Fatal(err)
	}
	page := "/ops/idem/key?" + url.Values{"scope": {scope}, "key": {"paid"}}.Encode()
	srv, c := serve(t, pool, idemconsole.Config{ReadOnly: true})
	if _, body := get(t, c, srv.URL+page); strings.Contains(body, "4242") || !strings.Contains(body, "bytes, not shown") {
		t.Fatalf("the key's page shows its response:\n%s", body)
	}
	srv, c = serve(t, pool, idemconsole.Config{ReadOnly: true, ShowStored: true})
	if _, body := get(t, c, srv.URL+page); !strings.Contains(body, "card 4242 charged") {
		t.Fatalf("the key's page with ShowStored:\n%s", body)
	}
}

func TestNewRefusesAConfigThatCannotWork(t *testing.T) {
	pool := env.Pool(t)
	for name, cfg := range map[string]idemconsole.Config{
		"no database":          {ReadOnly: true},
		"no operator":          {DB: pool},
		"a trailing slash":     {DB: pool, ReadOnly: true, Prefix: "/idem/"},
		"a prefix not a path":  {DB: pool, ReadOnly: true, Prefix: "idem"},
		"a prefix with a hole": {DB: pool, ReadOnly: true, Prefix: "/a b"},
	} {
		var fe *idem.FieldError
		if _, err := idemconsole.New(cfg); !errors.As(err, &fe) {
			t.Errorf("%s: %v, want a FieldError", name, err)
		}
	}
}
