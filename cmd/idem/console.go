package main

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/pgidem/idem/cmd/idem/cli"
	"github.com/pgidem/idem/idemconsole"
)

// tokenVariable names the variable that holds the token a console on an
// address other than the loopback requires.
const tokenVariable = "IDEM_CONSOLE_TOKEN"

func runConsole(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "console", `console [-addr 127.0.0.1:8080] [-read-only] [-show-stored] [-operator NAME]

Serves idem's web console (docs/console.md) for the database: the flows by
state, those needing attention with their steps and the actions that
settle them (resolve the call a flow stopped at, end the flow), running
and stalled flows, a key's record, and the outbox's dead letters, which
it requeues. Open the address it prints in a browser; it needs no
JavaScript. Stop it with Ctrl-C.

The console has no authentication of its own. It serves on the loopback
address by default, for the operator on this machine, and records their
actions under -operator. It refuses any other address unless the
variable `+tokenVariable+` holds a token, which every request must then
give as the password of HTTP basic authentication (its user name is the
operator's name); put TLS in front of it (a proxy) before it leaves the
machine.`)
	addr := fs.String("addr", "127.0.0.1:8080", "the address to serve on")
	readOnly := fs.Bool("read-only", false, "offer no action")
	showStored := fs.Bool("show-stored", false, "show stored inputs, answers, results and responses (otherwise their size)")
	operator := fs.String("operator", currentUser(), "the name actions are recorded under (without a token)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return cli.UsageError{Err: errors.New("takes no operands")}
	}
	token := os.Getenv(tokenVariable)
	loopback, err := isLoopback(*addr)
	switch {
	case err != nil:
		return cli.UsageError{Err: fmt.Errorf("-addr %q: %w", *addr, err)}
	case !loopback && token == "":
		return cli.UsageError{Err: fmt.Errorf("-addr %q is not a loopback address: the console has no authentication of its own; "+
			"set %s to a token that requests must give, or serve on 127.0.0.1", *addr, tokenVariable)}
	case token != "" && len(token) < 16:
		return cli.UsageError{Err: fmt.Errorf("%s: use a token of at least 16 characters", tokenVariable)}
	}
	pool, err := connectMigrated(ctx, stdout, "console")
	if err != nil {
		return err
	}
	defer pool.Close()
	name := func(r *http.Request) string {
		if user, _, ok := r.BasicAuth(); ok && token != "" && user != "" {
			return user
		}
		return *operator
	}
	logger := slog.New(slog.NewTextHandler(stdout, nil))
	console, err := idemconsole.New(idemconsole.Config{DB: pool, Operator: name, ReadOnly: *readOnly,
		ShowStored: *showStored, Logger: logger})
	if err != nil {
		return cli.UsageError{Err: err}
	}
	handler := console
	if token != "" {
		handler = requireToken(token, console)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	mode := "actions are recorded as " + *operator
	switch {
	case *readOnly:
		mode = "read-only"
	case token != "":
		mode = "actions are recorded under the basic authentication's user name"
	}
	fmt.Fprintf(stdout, "idem console: serving on http://%s/ (%s)\n", ln.Addr(), mode)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(shutdown)
	}
}

// isLoopback reports whether addr (host:port) listens on the loopback
// only: localhost, or a loopback IP.
func isLoopback(addr string) (bool, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false, err
	}
	if strings.EqualFold(host, "localhost") {
		return true, nil
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback(), nil
}

// requireToken serves h to requests whose basic authentication's password
// is token, and asks the others for it.
func requireToken(token string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, password, ok := r.BasicAuth()
		if !ok || subtle.ConstantTimeCompare([]byte(password), []byte(token)) != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="idem console", charset="UTF-8"`)
			http.Error(w, "the console's token is required (HTTP basic authentication's password)", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}
