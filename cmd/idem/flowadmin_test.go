package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
	"github.com/pgidem/idem/internal/testdb"
)

// stoppedFlows makes a flow that texts at most once, and stops it at the
// text for each key: its first answer is lost.
func stoppedFlows(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope string, keys ...string) *idem.Flow[struct{}, string] {
	t.Helper()
	var lose atomic.Bool
	flow := idem.MustNewFlow(testdb.Name("notify"), func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error) {
		return idem.Call(s, "sms", func(context.Context, string) (string, error) {
			if lose.Load() {
				return "", errors.New("read tcp: i/o timeout")
			}
			return "sms_again", nil
		}, idem.AtMostOnce())
	})
	lose.Store(true)
	for _, key := range keys {
		for range 2 {
			if _, err := flow.Run(ctx, pool, scope, key, nil, struct{}{}); err == nil {
				t.Fatal("the run meant to fail succeeded")
			}
		}
	}
	lose.Store(false)
	return flow
}

func TestFlowsListsTheStoppedOnesAndFlowResolveSettlesOne(t *testing.T) {
	url := env.URL(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scope := testdb.Name("resolve")
	flow := stoppedFlows(t, ctx, pool, scope, "order-1", "order-2", "order-3")

	code, out := runCommand(t, url, "flows", "-scope", scope, "-limit", "2")
	more := regexp.MustCompile(`more: idem flows .* -after (\S+)`).FindStringSubmatch(out)
	if code != cli.ExitOK || !strings.Contains(out, "order-3") || !strings.Contains(out, "order-2") || strings.Contains(out, "order-1") ||
		!strings.Contains(out, "at most once") || more == nil {
		t.Fatalf("flows: exit %d\n%s", code, out)
	}
	if code, out := runCommand(t, url, "flows", "-scope", scope, "-limit", "2", "-after", more[1]); code != cli.ExitOK ||
		!strings.Contains(out, "order-1") || strings.Contains(out, "more:") {
		t.Fatalf("flows, the next page: exit %d\n%s", code, out)
	}
	for _, args := range [][]string{
		{"flow-resolve", scope, "order-1", "sms", "applied", "-reason", "r"},                     // no result
		{"flow-resolve", scope, "order-1", "sms", "applied", "-reason", "r", "-result", "{nope"}, // not JSON
		{"flow-resolve", scope, "order-1", "sms", "maybe", "-reason", "r"},                       // no such outcome
		{"flow-resolve", scope, "order-1", "sms", "not-applied"},                                 // no reason
		{"flow-resolve", scope, "order-1", "sms", "not-applied", "-reason", "r", "-result", "1"}, // a result not applied
		{"flows", "-state", "done"},
	} {
		if code, out := runCommand(t, url, args...); code != cli.ExitUsage {
			t.Errorf("%v: exit %d, want %d\n%s", args, code, cli.ExitUsage, out)
		}
	}
	if code, out := runCommand(t, url, "flow-resolve", scope, "order-1", "charge", "not-applied", "-reason", "r"); code != cli.ExitFailure ||
		!strings.Contains(out, "another step") {
		t.Fatalf("flow-resolve of another step: exit %d\n%s", code, out)
	}
	code, out = runCommand(t, url, "flow-resolve", "-by", "alice", "-reason", "the gateway delivered it", "-result", `"sms_1"`,
		scope, "order-1", "sms", "applied")
	if code != cli.ExitOK || !strings.Contains(out, "resolved") {
		t.Fatalf("flow-resolve: exit %d\n%s", code, out)
	}
	if res, err := flow.Run(ctx, pool, scope, "order-1", nil, struct{}{}); err != nil || res.Value != "sms_1" {
		t.Fatalf("the client's retry: %+v, %v", res, err)
	}
	if code, out := runCommand(t, url, "inspect", "-flow", scope, "order-1"); code != cli.ExitOK ||
		!strings.Contains(out, "step sms applied by alice: the gateway delivered it") {
		t.Fatalf("inspect -flow: exit %d\n%s", code, out)
	}
	if code, out := runCommand(t, url, "flow-resolve", "-reason", "r", scope, "order-1", "sms", "not-applied"); code != cli.ExitFailure ||
		!strings.Contains(out, "not stopped") {
		t.Fatalf("flow-resolve of a flow no longer stopped: exit %d\n%s", code, out)
	}
}

func TestConsoleRefusesAnAddressBeyondTheLoopbackWithoutAToken(t *testing.T) {
	url := env.URL(t)
	t.Setenv(tokenVariable, "")
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0", "192.0.2.1:8080"} {
		if code, out := runCommand(t, url, "console", "-addr", addr); code != cli.ExitUsage || !strings.Contains(out, tokenVariable) {
			t.Errorf("console -addr %s: exit %d\n%s", addr, code, out)
		}
	}
	t.Setenv(tokenVariable, "short")
	if code, out := runCommand(t, url, "console", "-addr", "0.0.0.0:0"); code != cli.ExitUsage || !strings.Contains(out, "16") {
		t.Errorf("console with a short token: exit %d\n%s", code, out)
	}
	for _, addr := range []string{"127.0.0.1:0", "localhost:0", "[::1]:0"} {
		if ok, err := isLoopback(addr); !ok || err != nil {
			t.Errorf("%s: loopback %t, %v", addr, ok, err)
		}
	}
}

func TestConsoleServesOnTheLoopbackUntilInterrupted(t *testing.T) {
	t.Setenv("DATABASE_URL", env.URL(t))
	t.Setenv(tokenVariable, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r, w := io.Pipe()
	exit := make(chan int, 1)
	go func() {
		exit <- run(ctx, []string{"console", "-addr", "127.0.0.1:0", "-read-only"}, w, w)
		w.Close()
	}()
	lines := bufio.NewScanner(r)
	var base string
	for base == "" && lines.Scan() {
		if m := regexp.MustCompile(`serving on (http://\S+) \(read-only\)`).FindStringSubmatch(lines.Text()); m != nil {
			base = m[1]
		}
	}
	go io.Copy(io.Discard, r)
	if base == "" {
		t.Fatalf("the console did not say where it serves (exit %d)", <-exit)
	}
	resp, err := http.Get(base + "flows?state=attention")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "Needing attention") {
		t.Fatalf("GET flows: %d\n%s", resp.StatusCode, body)
	}
	cancel()
	if code := <-exit; code != cli.ExitOK {
		t.Fatalf("interrupted: exit %d", code)
	}
}
