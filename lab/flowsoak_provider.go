package main

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// The flow soak's payment provider: an HTTP server on 127.0.0.1 that
// honours idempotency keys as Stripe does (a charge made again with a key
// it knows is answered from its records and not applied again; the same
// key with another amount is refused), and counts what it applied per key.
// It injects the soak's provider faults, and kills the calling worker for
// operations marked to die in the call.

// Headers of a worker's call: which worker calls, and the point at which
// the provider is to kill it, if any.
const (
	flowSoakWorkerHeader = "X-Flowsoak-Worker"
	flowSoakKillHeader   = "X-Flowsoak-Kill"
)

// flowSoakCharged is what the provider holds for a key it applied.
type flowSoakCharged struct {
	Amount int64
	flowSoakCharge
}

// flowSoakProvider is the fake provider.
type flowSoakProvider struct {
	cfg      flowSoakConfig
	listener net.Listener
	srv      *http.Server
	closing  chan struct{}
	// workers kills the callers of calls marked to die; set before the
	// workers start.
	workers *flowSoakWorkers

	mu sync.Mutex
	// charges are the charges applied, by key: the provider's effects.
	charges map[string]*flowSoakCharged
	// calls counts the calls by key, applied or not.
	calls map[string]int
	// conflicts counts calls that reused a key with another amount.
	conflicts int
	// The faults injected.
	failedBefore, timedOutAfter, cutAfter int64
}

func startFlowSoakProvider(cfg flowSoakConfig) (*flowSoakProvider, error) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fake provider: %w", err)
	}
	p := &flowSoakProvider{cfg: cfg, listener: listener, closing: make(chan struct{}),
		charges: make(map[string]*flowSoakCharged), calls: make(map[string]int)}
	p.srv = &http.Server{Handler: http.HandlerFunc(p.serve), ReadHeaderTimeout: time.Minute}
	go func() { _ = p.srv.Serve(listener) }()
	return p, nil
}

func (p *flowSoakProvider) url() string { return "http://" + p.listener.Addr().String() }

func (p *flowSoakProvider) close() {
	close(p.closing)
	_ = p.srv.Close()
}

// The provider's faults.
const (
	noProviderFault = iota
	failBeforeApply
	timeoutAfterApply
	cutAfterApply
)

// fault draws the fault a call meets.
func (p *flowSoakProvider) fault() int {
	x := rand.Float64()
	switch {
	case x < p.cfg.FailBeforeApply:
		return failBeforeApply
	case x < p.cfg.FailBeforeApply+p.cfg.TimeoutAfterApply:
		return timeoutAfterApply
	case x < p.cfg.FailBeforeApply+p.cfg.TimeoutAfterApply+p.cfg.CutAfterApply:
		return cutAfterApply
	}
	return noProviderFault
}

// serve is POST /charges: charge the body's amount once per
// Idempotency-Key.
func (p *flowSoakProvider) serve(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	var body flowSoakInput
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || key == "" || r.Method != http.MethodPost {
		http.Error(w, "POST a JSON amount with an Idempotency-Key", http.StatusBadRequest)
		return
	}
	worker, _ := strconv.Atoi(r.Header.Get(flowSoakWorkerHeader))
	kill := r.Header.Get(flowSoakKillHeader)
	fault := noProviderFault
	if kill == "" {
		fault = p.fault()
	}
	p.mu.Lock()
	p.calls[key]++
	p.mu.Unlock()

	if kill == killBeforeApply && p.workers.kill(worker, kill) {
		return // to a caller that is gone
	}
	if fault == failBeforeApply {
		p.count(&p.failedBefore)
		http.Error(w, "temporarily unavailable", http.StatusServiceUnavailable)
		return
	}
	charge, ok := p.apply(key, body.Amount)
	if !ok {
		http.Error(w, "Idempotency-Key reused with another amount", http.StatusConflict)
		return
	}
	if kill == killAfterApply && p.workers.kill(worker, kill) {
		return
	}
	switch fault {
	case timeoutAfterApply:
		// Applied; the answer never comes, and the caller times out.
		p.count(&p.timedOutAfter)
		select {
		case <-r.Context().Done():
		case <-p.closing:
		}
		return
	case cutAfterApply:
		if hj, ok := w.(http.Hijacker); ok {
			if conn, _, err := hj.Hijack(); err == nil {
				p.count(&p.cutAfter)
				_ = conn.Close()
				return
			}
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(charge)
}

// apply charges amount under key, once: a key it knows gets its charge
// back. It reports false for a key known with another amount.
func (p *flowSoakProvider) apply(key string, amount int64) (flowSoakCharge, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.charges[key]; ok {
		if c.Amount != amount {
			p.conflicts++
			return flowSoakCharge{}, false
		}
		return c.flowSoakCharge, true
	}
	// A twentieth of the amounts are declined: a definite outcome, which
	// the provider records under the key as Stripe records a failed charge.
	status := "charged"
	if amount%20 == 0 {
		status = "declined"
	}
	c := &flowSoakCharged{Amount: amount, flowSoakCharge: flowSoakCharge{ID: fmt.Sprintf("ch_%d", len(p.charges)+1), Status: status}}
	p.charges[key] = c
	return c.flowSoakCharge, true
}

func (p *flowSoakProvider) count(n *int64) {
	p.mu.Lock()
	*n++
	p.mu.Unlock()
}

// snapshot returns copies of the provider's charges and calls by key.
func (p *flowSoakProvider) snapshot() (map[string]flowSoakCharged, map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	charges := make(map[string]flowSoakCharged, len(p.charges))
	for k, c := range p.charges {
		charges[k] = *c
	}
	calls := make(map[string]int, len(p.calls))
	for k, n := range p.calls {
		calls[k] = n
	}
	return charges, calls
}
