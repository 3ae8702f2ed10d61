package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// abandon runs flow for key so that its call fails after the provider
// applied it: the flow is left in progress, its lease given up.
func abandon(t *testing.T, ctx context.Context, pool *pgxpool.Pool, flow *idem.Flow[chargeIn, chargeOut], p *provider, scope, key string) {
	t.Helper()
	after := p.after
	p.after = func(string, int) error { return errors.New("connection reset by peer") }
	defer func() { p.after = after }()
	if _, err := flow.Run(ctx, pool, scope, key, fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatalf("%s: the run meant to fail succeeded", key)
	}
}

func TestFlowResumeCompletesItsAbandonedFlowsOnly(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	abandon(t, ctx, pool, flow, p, scope, "abandoned")
	if _, err := flow.Run(ctx, pool, scope, "done", fpCharge, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	other := chargeFlow(p, &steps)
	abandon(t, ctx, pool, other, p, scope, "other-flow")
	// One held by an executor whose call is still running.
	calling, answer := make(chan struct{}), make(chan struct{})
	p.before = func(key string, _ int) error {
		if key == providerKeyOf(t, ctx, pool, scope, "held", "charge") {
			close(calling)
			<-answer
		}
		return nil
	}
	held := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, pool, scope, "held", fpCharge, chargeIn{Amount: 2500})
		held <- err
	}()
	<-calling

	resumed, err := flow.Resume(ctx, pool)
	if err != nil || resumed != 1 {
		t.Fatalf("Resume = %d, %v; want 1", resumed, err)
	}
	close(answer)
	if err := <-held; err != nil {
		t.Fatalf("the held flow's own executor: %v", err)
	}
	res, err := flow.Run(ctx, pool, scope, "abandoned", fpCharge, chargeIn{Amount: 2500})
	if err != nil || !res.Replayed || res.Value.ChargeID == "" {
		t.Fatalf("the client's retry after Resume: %+v, %v; want Resume's answer replayed", res, err)
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, "other-flow"); err != nil || info.State != "running" {
		t.Fatalf("the other flow's operation: %+v, %v; want it left running", info, err)
	}
	if again, err := flow.Resume(ctx, pool); err != nil || again != 0 {
		t.Fatalf("a second pass = %d, %v; want nothing left", again, err)
	}
}

func TestFlowResumeLeavesAFlowToItsClientForTheGrace(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	name := chargeFlow(p, &steps, idem.WithGrace(time.Hour))
	abandon(t, ctx, pool, name, p, scope, "k")
	if resumed, err := name.Resume(ctx, pool); err != nil || resumed != 0 {
		t.Fatalf("within the grace: Resume = %d, %v; want 0", resumed, err)
	}
	setLease(t, ctx, pool, scope, "k", "-2 hours", 1)
	if resumed, err := name.Resume(ctx, pool); err != nil || resumed != 1 {
		t.Fatalf("past the grace: Resume = %d, %v; want 1", resumed, err)
	}
}

func TestFlowResumeBacksOffAFlowThatKeepsFailing(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	abandon(t, ctx, pool, flow, p, scope, "k")
	// Five runs failed: the next waits 2^4 - 1 = 15s past its lease.
	setLease(t, ctx, pool, scope, "k", "-10 seconds", 5)
	if resumed, err := flow.Resume(ctx, pool); err != nil || resumed != 0 {
		t.Fatalf("10s after the fifth failure: Resume = %d, %v; want 0", resumed, err)
	}
	setLease(t, ctx, pool, scope, "k", "-20 seconds", 5)
	if resumed, err := flow.Resume(ctx, pool); err != nil || resumed != 1 {
		t.Fatalf("20s after it: Resume = %d, %v; want 1", resumed, err)
	}
	// A client's retry does not wait for the backoff.
	abandon(t, ctx, pool, flow, p, scope, "k2")
	setLease(t, ctx, pool, scope, "k2", "0 seconds", 5)
	if _, err := flow.Run(ctx, pool, scope, "k2", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(0)); err != nil {
		t.Fatalf("a client's retry: %v", err)
	}
}

func TestFlowResumeReportsFailuresAndCompletesTheRest(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	abandon(t, ctx, pool, flow, p, scope, "ok")
	abandon(t, ctx, pool, flow, p, scope, "failing")
	failing := providerKeyOf(t, ctx, pool, scope, "failing", "charge")
	p.before = func(key string, _ int) error {
		if key == failing {
			return errors.New("provider still down")
		}
		return nil
	}
	resumed, err := flow.Resume(ctx, pool)
	if resumed != 1 || err == nil || !strings.Contains(err.Error(), "provider still down") || strings.Contains(err.Error(), "failing") {
		t.Fatalf("Resume = %d, %v; want 1, and the failure, without the key in clear", resumed, err)
	}
}

func TestStartResumerResumesEveryFlowInTheBackground(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flows := []*idem.Flow[chargeIn, chargeOut]{chargeFlow(p, &steps), chargeFlow(p, &steps), chargeFlow(p, &steps)}
	for i, flow := range flows {
		abandon(t, ctx, pool, flow, p, scope, fmt.Sprint("k", i))
	}
	resumer, err := idem.StartResumer(ctx, pool, idem.ResumerConfig{Interval: 10 * time.Millisecond}, flows[0], flows[1], flows[2])
	if err != nil {
		t.Fatal(err)
	}
	defer resumer.Stop()
	for resumer.Resumed() < int64(len(flows)) {
		if ctx.Err() != nil {
			t.Fatalf("the resumer resumed %d flows, want %d", resumer.Resumed(), len(flows))
		}
		time.Sleep(10 * time.Millisecond)
	}
	resumer.Stop()
	for i := range flows {
		if info, err := idem.InspectFlow(ctx, pool, scope, fmt.Sprint("k", i)); err != nil || info.State != "done" {
			t.Fatalf("flow %d after the resumer: %+v, %v; want done", i, info, err)
		}
	}
}

// setLease moves the lease of the flow (scope, key) to now plus ago and
// sets its runs.
func setLease(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key, ago string, runs int) {
	t.Helper()
	if _, err := pool.Exec(ctx, `UPDATE idem_flow SET leased_until = now() + $3::interval, runs = $4
		WHERE scope = $1 AND key = $2`, scope, key, ago, runs); err != nil {
		t.Fatal(err)
	}
}

func TestFlowWithACodecSealsWhatItStoresAndResumesWithIt(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithCodec(&reverseCodec{}))
	abandon(t, ctx, pool, flow, p, scope, "k")
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil {
		t.Fatal(err)
	}
	// Sealed values are stored as JSON strings of the sealed bytes.
	if sealed := func(b []byte) bool { return strings.HasPrefix(string(b), `"`) }; !sealed(info.Input) ||
		strings.Contains(string(info.Input), "2500") || !sealed(info.Steps[0].Result) {
		t.Fatalf("stored in clear: input %s, step result %s", info.Input, info.Steps[0].Result)
	}
	if resumed, err := flow.Resume(ctx, pool); err != nil || resumed != 1 {
		t.Fatalf("Resume = %d, %v; want 1", resumed, err)
	}
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || !res.Replayed || res.Value.ChargeID != "ch_1" {
		t.Fatalf("the replay: %+v, %v", res, err)
	}
	info, err = idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || !strings.HasPrefix(string(info.Output), `"`) || strings.Contains(string(info.Output), "ch_1") {
		t.Fatalf("the answer stored in clear: %s, %v", info.Output, err)
	}
}

func TestStartResumerRefusesEveryInvalidField(t *testing.T) {
	ctx, pool, _, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	name := testdb.Name("twin")
	noop := func(context.Context, *idem.Steps, int) (int, error) { return 0, nil }
	one, twin := idem.MustNewFlow(name, noop), idem.MustNewFlow(name, noop)
	for _, c := range []struct {
		name, field string
		db          idem.TxBeginner
		cfg         idem.ResumerConfig
		flows       []idem.Resumable
	}{
		{"negative interval", "ResumerConfig.Interval", pool, idem.ResumerConfig{Interval: -time.Second}, []idem.Resumable{flow}},
		{"negative concurrency", "ResumerConfig.Concurrency", pool, idem.ResumerConfig{Concurrency: -1}, []idem.Resumable{flow}},
		{"no database", "StartResumer", nil, idem.ResumerConfig{}, []idem.Resumable{flow}},
		{"no flow", "StartResumer", pool, idem.ResumerConfig{}, nil},
		{"a nil flow", "StartResumer", pool, idem.ResumerConfig{}, []idem.Resumable{flow, (*idem.Flow[int, int])(nil)}},
		{"two flows of one name", "StartResumer", pool, idem.ResumerConfig{}, []idem.Resumable{one, twin}},
	} {
		r, err := idem.StartResumer(ctx, c.db, c.cfg, c.flows...)
		fe, ok := errors.AsType[*idem.FieldError](err)
		if r != nil || !ok || fe.Package != "idem" || fe.Field != c.field || !errors.Is(err, idem.ErrInvalidOption) {
			t.Errorf("%s: %v; want no resumer and a FieldError naming %s", c.name, err, c.field)
		}
	}
	if steps.Load() != 0 {
		t.Fatal("a step ran")
	}
}
