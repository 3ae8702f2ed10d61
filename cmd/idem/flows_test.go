package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
	"github.com/pgidem/idem/internal/testdb"
)

func TestInspectFlowAndFlowEnd(t *testing.T) {
	url := env.URL(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	scope := testdb.Name("flow-ops")
	// A flow whose call failed: in progress, its lease given up.
	flow := idem.MustNewFlow(testdb.Name("ops"), func(ctx context.Context, s *idem.Steps, _ struct{}) (string, error) {
		return idem.Call(s, "charge", func(context.Context, string) (string, error) {
			return "", errors.New("provider timeout")
		})
	})
	if _, err := flow.Run(ctx, pool, scope, "k", nil, struct{}{}); err == nil {
		t.Fatal("the failing flow succeeded")
	}

	code, out := runCommand(t, url, "inspect", "-flow", scope, "k")
	if code != cli.ExitOK || !strings.Contains(out, "no executor holds it") || !strings.Contains(out, "provider timeout") ||
		!strings.Contains(out, testdb.FlowStep(t, ctx, pool, scope, "k", "charge").ProviderKey) || !strings.Contains(out, "input") ||
		strings.Contains(out, "{}") {
		t.Fatalf("inspect -flow: exit %d\n%s", code, out)
	}
	// Without -flow, inspect says that the key has a flow rather than no
	// record.
	if code, out := runCommand(t, url, "inspect", scope, "k"); code != cli.ExitOK || !strings.Contains(out, "but a flow") ||
		!strings.Contains(out, "inspect -flow") {
		t.Fatalf("inspect of a key with a flow: exit %d\n%s", code, out)
	}
	if code, out := runCommand(t, url, "inspect", "-flow", "-show-response", scope, "k"); code != cli.ExitOK || !strings.Contains(out, "{}") {
		t.Fatalf("inspect -flow -show-response: exit %d\n%s", code, out)
	}
	if code, out := runCommand(t, url, "flow-end", scope, "k"); code != cli.ExitUsage {
		t.Fatalf("flow-end without a reason: exit %d\n%s", code, out)
	}
	if code, out := runCommand(t, url, "flow-end", scope, "k", "refunded by hand"); code != cli.ExitOK || !strings.Contains(out, "ended") {
		t.Fatalf("flow-end: exit %d\n%s", code, out)
	}
	if code, out := runCommand(t, url, "flow-end", scope, "k", "again"); code != cli.ExitFailure {
		t.Fatalf("flow-end of an ended flow: exit %d\n%s", code, out)
	}
	if _, err := flow.Run(ctx, pool, scope, "k", nil, struct{}{}); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("a run of the ended flow: %v, want ErrFlowStopped", err)
	}
	if code, out := runCommand(t, url, "stats"); code != cli.ExitOK || !strings.Contains(out, "flows needing attention") {
		t.Fatalf("stats: exit %d\n%s", code, out)
	}
}
