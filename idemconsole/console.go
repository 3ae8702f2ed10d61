// Package idemconsole is idem's web console for operators: an
// [http.Handler] that an application mounts under a path of its own,
// behind its own authentication, and that the idem command serves on
// 127.0.0.1 (idem console).
//
// Its pages show the flows by state, records and outbox messages
// (overview); the flows stopped for a person, with their steps, attempts,
// provider keys and last error, and the actions that settle them: resolve
// the call a flow stopped at as applied (with its result) or not applied,
// or end the flow ([idem.ResolveFlow], [idem.EndFlow]); the running and
// stalled flows with their leases; a key's record; and the outbox's parked
// messages, which it requeues. It renders on the server, works without
// JavaScript, and embeds its stylesheet.
//
// It has no authentication of its own: whoever reaches it sees every
// scope's flows and keys, and may act on them. Mount it behind the
// application's own (an operators' login, a VPN, an admin network), and
// give [Config.Operator] the name of the person the application
// authenticated: every action is recorded under it ([idem.FlowInfo]
// resolutions, and the audit log, [Config.Logger]). Every action is a POST,
// refused when it comes from another site (the browser's Sec-Fetch-Site
// and Origin headers, [http.CrossOriginProtection]) or without the form's
// token, an HMAC of a cookie of the console's own (SameSite=Strict). With
// [Config.ReadOnly] it offers no action and refuses every POST. Stored
// values (inputs, answers, results, responses) are shown by their size
// unless [Config.ShowStored]; values sealed by a codec are never opened.
//
// It uses the standard library and idem's own packages only: importing
// it downloads nothing more. See docs/console.md.
package idemconsole

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"strings"

	"github.com/pgidem/idem"
)

// Config configures the console: see [New].
type Config struct {
	// DB is the database of idem's tables: a pool (or an idle
	// connection). Required.
	DB idem.TxBeginner
	// Prefix is the path the console is mounted at, without a trailing
	// slash, as "/idem" ("" for the root): its pages link to it, and it
	// serves the requests whose path starts with it. Mount it with
	// mux.Handle(prefix+"/", handler).
	Prefix string
	// Operator returns the name of the person making the request, whom
	// the application authenticated: each action is recorded and logged
	// under it, and an action whose operator is "" is refused. Required
	// unless ReadOnly.
	Operator func(r *http.Request) string
	// ReadOnly offers no action, and refuses every POST.
	ReadOnly bool
	// ShowStored shows stored values as they are stored: flows' inputs,
	// answers and step results, and keys' responses (values sealed by a
	// codec stay sealed). Otherwise they are shown by their size: they
	// may hold personal or payment data.
	ShowStored bool
	// Logger receives the audit log: one record per action, with the
	// operator, what was acted on and how, and its outcome.
	// slog.Default() when nil.
	Logger *slog.Logger
}

// console is the handler New returns.
type console struct {
	cfg   Config
	log   *slog.Logger
	mux   *http.ServeMux
	pages map[string]*template.Template
	// key signs the form tokens (see token).
	key   []byte
	cross *http.CrossOriginProtection
}

//go:embed templates/*.html console.css
var assets embed.FS

// cookieName is the console's cookie, the per-browser secret that a
// form's token is the HMAC of.
const cookieName = "idem_console"

// New returns the console configured by cfg, or a [*idem.FieldError] that
// says which field cannot work.
func New(cfg Config) (http.Handler, error) {
	invalid := func(field, problem string) error {
		return &idem.FieldError{Package: "idemconsole", Field: "Config." + field, Problem: problem}
	}
	switch {
	case cfg.DB == nil:
		return nil, invalid("DB", "nil: the console needs the database of idem's tables")
	case cfg.Operator == nil && !cfg.ReadOnly:
		return nil, invalid("Operator", "nil: the console records who acts; set ReadOnly for a console without actions")
	case cfg.Prefix != "" && (!strings.HasPrefix(cfg.Prefix, "/") || strings.HasSuffix(cfg.Prefix, "/")):
		return nil, invalid("Prefix", fmt.Sprintf("%q: want a path such as /idem, without a trailing slash, or empty", cfg.Prefix))
	case strings.ContainsAny(cfg.Prefix, "?#{} "):
		return nil, invalid("Prefix", fmt.Sprintf("%q: want a plain path", cfg.Prefix))
	}
	c := &console{cfg: cfg, log: cfg.Logger, key: make([]byte, 32), cross: http.NewCrossOriginProtection()}
	if c.log == nil {
		c.log = slog.Default()
	}
	rand.Read(c.key) // never fails (crypto/rand)
	if err := c.parse(); err != nil {
		return nil, err
	}
	c.routes()
	return c, nil
}

func (c *console) parse() error {
	funcs := template.FuncMap{"path": c.path, "when": when, "ago": ago, "stored": c.stored, "sealed": sealed,
		"short": short, "hex": hexOf}
	base, err := template.New("layout.html").Funcs(funcs).ParseFS(assets, "templates/layout.html")
	if err != nil {
		return err
	}
	c.pages = make(map[string]*template.Template)
	for _, page := range []string{"overview", "flows", "flow", "key", "outbox", "problem"} {
		t, err := template.Must(base.Clone()).ParseFS(assets, "templates/"+page+".html")
		if err != nil {
			return err
		}
		c.pages[page] = t
	}
	return nil
}

func (c *console) routes() {
	c.mux = http.NewServeMux()
	c.mux.HandleFunc("GET /{$}", c.overview)
	c.mux.HandleFunc("GET /flows", c.flows)
	c.mux.HandleFunc("GET /flow", c.flow)
	c.mux.HandleFunc("GET /key", c.keyPage)
	c.mux.HandleFunc("GET /outbox", c.outbox)
	c.mux.HandleFunc("GET /console.css", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/css; charset=utf-8")
		w.Header().Set("Cache-Control", "max-age=3600")
		http.ServeFileFS(w, r, assets, "console.css")
	})
	c.mux.HandleFunc("POST /flow/resolve", c.action(c.resolve))
	c.mux.HandleFunc("POST /flow/end", c.action(c.end))
	c.mux.HandleFunc("POST /outbox/requeue", c.action(c.requeue))
}

// ServeHTTP serves the requests under the prefix; others get 404.
func (c *console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rest, ok := strings.CutPrefix(r.URL.Path, c.cfg.Prefix)
	if !ok || rest != "" && rest[0] != '/' {
		http.NotFound(w, r)
		return
	}
	if rest == "" {
		http.Redirect(w, r, c.path("/"), http.StatusSeeOther)
		return
	}
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	r2 := r.Clone(r.Context())
	r2.URL.Path = rest
	r2.URL.RawPath = ""
	c.mux.ServeHTTP(w, r2)
}

// path is the console's path p (from "/"), under its prefix.
func (c *console) path(p string) string { return c.cfg.Prefix + p }

// token returns the token the forms of the page carry for r's browser,
// setting the console's cookie first if r has none. The token is the HMAC
// of the cookie under the console's key: a page of another site can
// neither read it nor make it.
func (c *console) token(w http.ResponseWriter, r *http.Request) string {
	if c.cfg.ReadOnly {
		return ""
	}
	secret := ""
	if ck, err := r.Cookie(cookieName); err == nil && len(ck.Value) >= 32 {
		secret = ck.Value
	} else {
		b := make([]byte, 32)
		rand.Read(b)
		secret = base64.RawURLEncoding.EncodeToString(b)
		http.SetCookie(w, &http.Cookie{Name: cookieName, Value: secret, Path: c.path("/"), HttpOnly: true,
			Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	}
	return c.sign(secret)
}

func (c *console) sign(secret string) string {
	m := hmac.New(sha256.New, c.key)
	m.Write([]byte(secret))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// action wraps a POST's handler: it refuses the request unless the console
// takes actions, the request is the console's own (the browser says it
// comes from the console's origin, and its form carries the token of its
// cookie), and the application names its operator; then it runs act with
// the operator's name.
func (c *console) action(act func(w http.ResponseWriter, r *http.Request, operator string)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		refuse := func(status int, why string) {
			c.log.Warn("idem console: action refused", "path", r.URL.Path, "why", why, "remote", r.RemoteAddr)
			c.problem(w, r, status, why)
		}
		if c.cfg.ReadOnly {
			refuse(http.StatusForbidden, "this console is read-only: it takes no action")
			return
		}
		if err := c.cross.Check(r); err != nil {
			refuse(http.StatusForbidden, "a request from another site: refused")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
		if err := r.ParseForm(); err != nil {
			refuse(http.StatusBadRequest, "the form could not be read")
			return
		}
		ck, err := r.Cookie(cookieName)
		if err != nil || !hmac.Equal([]byte(r.PostForm.Get("token")), []byte(c.sign(ck.Value))) {
			refuse(http.StatusForbidden, "the form's token is missing or wrong: reload the page and try again")
			return
		}
		operator := strings.TrimSpace(c.cfg.Operator(r))
		if operator == "" {
			refuse(http.StatusForbidden, "no operator: the application did not say who you are")
			return
		}
		act(w, r, operator)
	}
}

// audit logs an action: the audit log.
func (c *console) audit(r *http.Request, operator, action string, err error, attrs ...any) {
	attrs = append([]any{"operator", operator, "action", action, "remote", r.RemoteAddr}, attrs...)
	if err != nil {
		c.log.Warn("idem console: action failed", append(attrs, "error", err.Error())...)
		return
	}
	c.log.Info("idem console: action", attrs...)
}
