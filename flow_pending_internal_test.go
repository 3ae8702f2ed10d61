package idem

import (
	"testing"
	"time"
)

// TestAnOpenStepCommitsWellWithinItsIdleTimeout checks how long a local
// step's transaction waits, at most, for the flow's next step: a third of
// the lease, 100ms at most, and never as long as the idle timeout, past
// which the server would end the session and the step with it.
func TestAnOpenStepCommitsWellWithinItsIdleTimeout(t *testing.T) {
	flow, err := newOptions([]FlowOption{})
	if err != nil {
		t.Fatal(err)
	}
	if flow.idleTimeout != DefaultLease/3 {
		t.Fatalf("a flow's idle timeout is %s by default, want a third of its lease, %s", flow.idleTimeout, DefaultLease/3)
	}
	if long, err := newOptions([]FlowOption{WithLease(time.Hour)}); err != nil || long.idleTimeout != DefaultFlowIdleTimeout {
		t.Fatalf("with a lease of an hour, a flow's idle timeout is %s (%v), want %s", long.idleTimeout, err, DefaultFlowIdleTimeout)
	}
	for _, c := range []struct {
		lease, idle, want time.Duration
	}{
		{DefaultLease, DefaultFlowIdleTimeout, maxOpenStep},
		{30 * time.Millisecond, DefaultFlowIdleTimeout, 10 * time.Millisecond},
		{DefaultLease, 0, maxOpenStep},
		{DefaultLease, 150 * time.Millisecond, 50 * time.Millisecond},
		{30 * time.Millisecond, 60 * time.Millisecond, 10 * time.Millisecond},
		{DefaultLease, time.Millisecond, time.Millisecond / 3},
	} {
		o := flow
		o.lease, o.idleTimeout = c.lease, c.idle
		got := openStepWait(&o)
		if got != c.want {
			t.Errorf("lease %s, idle timeout %s: the open step waits %s, want %s", c.lease, c.idle, got, c.want)
		}
		if c.idle > 0 && got >= c.idle {
			t.Errorf("lease %s, idle timeout %s: the open step waits %s, as long as the idle timeout", c.lease, c.idle, got)
		}
	}
	call, err := newOptions([]Option{})
	if err != nil {
		t.Fatal(err)
	}
	if call.idleTimeout != 0 {
		t.Errorf("a call's idle timeout is %s by default, want none", call.idleTimeout)
	}
}
