package idem_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// TestFlowAfterAnAsynchronousFailoverCallsTheProviderWithTheSameKey loses a
// completed flow in an asynchronous failover: the standby streams from the
// primary through a proxy that stops forwarding before the flow runs, so
// that the flow's rows, committed and answered on the primary, never reach
// the standby; the primary dies and the standby is promoted. The client's
// retry, on the new primary, finds no flow and starts it again: its call
// reaches the provider with the key the lost run sent, so the provider
// answers it with the charge it already made.
func TestFlowAfterAnAsynchronousFailoverCallsTheProviderWithTheSameKey(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pair := testdb.StartPair(t, ctx)

	// The standby streams through a freezer.
	f := testdb.StartFreezer(t, "127.0.0.1", uint16(pair.Primary.Port))
	var conninfo string
	if err := pair.StandbyPool.QueryRow(ctx, `SHOW primary_conninfo`).Scan(&conninfo); err != nil {
		t.Fatal(err)
	}
	proxyPort := f.Addr().Port
	conninfo = regexp.MustCompile(`port=\d+`).ReplaceAllString(conninfo, "port="+strconv.Itoa(proxyPort))
	for _, stmt := range []string{fmt.Sprintf(`ALTER SYSTEM SET primary_conninfo = '%s'`, conninfo), `SELECT pg_reload_conf()`} {
		if _, err := pair.StandbyPool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	for {
		var port int
		err := pair.StandbyPool.QueryRow(ctx, `SELECT coalesce(max(sender_port), 0) FROM pg_stat_wal_receiver WHERE status = 'streaming'`).Scan(&port)
		if err != nil {
			t.Fatal(err)
		}
		if port == proxyPort {
			break
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			t.Fatal("the standby did not stream through the proxy")
		}
	}
	// A flow of earlier, which the standby has.
	scope := testdb.Name("failover")
	p := newProvider()
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	if _, err := flow.Run(ctx, pair.PrimaryPool, scope, "earlier", fpCharge, chargeIn{Amount: 100}); err != nil {
		t.Fatal(err)
	}
	pair.WaitForReplay(t, ctx)
	f.Freeze()

	// The flow completes on the primary, and its answer is lost.
	first, err := flow.Run(ctx, pair.PrimaryPool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	if err := pair.Primary.Kill(syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	pair.Promote(t, ctx)
	for {
		var inRecovery bool
		if err := pair.StandbyPool.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery); err == nil && !inRecovery {
			break
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			t.Fatal("the standby was not promoted")
		}
	}
	if info, err := idem.InspectFlow(ctx, pair.StandbyPool, scope, "k"); err != nil || info.Found {
		t.Fatalf("the promoted standby has the flow (%+v, %v): the failover lost nothing", info, err)
	}

	// The client's retry, on the new primary.
	retry, err := flow.Run(ctx, pair.StandbyPool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || retry.Replayed {
		t.Fatalf("the retry on the new primary: %+v, %v", retry, err)
	}
	charges, keys := p.effects()
	if charges != 2 || len(keys) != 2 || p.calls.Load() != 3 || retry.Value.ChargeID != first.Value.ChargeID {
		t.Fatalf("charges %d, keys %v, calls %d, charge ids %s and %s; want the earlier charge and 1 for the operation, called twice with one key",
			charges, keys, p.calls.Load(), first.Value.ChargeID, retry.Value.ChargeID)
	}
}
