package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// The flow soak's payment provider: an HTTP server on 127.0.0.1 that
// charges amounts and counts what it applied per operation. Keyed, it
// honours idempotency keys as Stripe does (a charge made again with a key
// it knows is answered from its records and not applied again; the same
// key with another amount is refused); keyless, it applies every request
// it gets. Either way it keeps each charge's reference (the call's
// provider key, sent as metadata), by which a lookup finds it. Keyless, it
// keeps the contract idem.Reconcile asks of a lookup: it answers that a
// charge is not there only once no earlier attempt can be applied any
// more. A request whose caller began the call more than expiry earlier is
// refused, not applied, and a lookup that finds nothing waits expiry
// before it looks again and answers: an attempt begun before the lookup
// was sent, still on its way (sent by a caller that timed out, or died,
// and not yet served), is then applied and found, or refused. It injects
// the soak's provider faults, kills or freezes the calling worker for
// operations marked to die or freeze in the call, and keeps when each
// call arrived, for the count of calls that arrived for an operation whose
// flow was already done: calls that a fenced executor made.

// The provider's modes.
const (
	providerKeyed   = "keyed"
	providerKeyless = "keyless"
)

// Headers of a worker's call: which worker calls, and the point at which
// the provider is to kill or freeze it, if any.
const (
	flowSoakWorkerHeader = "X-Flowsoak-Worker"
	flowSoakKillHeader   = "X-Flowsoak-Kill"
	flowSoakFreezeHeader = "X-Flowsoak-Freeze"
	// flowSoakWokeHeader is on a call made after its worker froze and
	// woke in the same run of the operation: the point of the freeze.
	flowSoakWokeHeader = "X-Flowsoak-Woke"
	// flowSoakProcessHeader names the calling process (slot/gen), and
	// flowSoakStartedHeader says when it entered the call's function, in
	// Unix nanoseconds.
	flowSoakProcessHeader = "X-Flowsoak-Process"
	flowSoakStartedHeader = "X-Flowsoak-Started"
)

// flowSoakProcess names a worker process: its slot and its start.
func flowSoakProcess(slot, gen int) string { return strconv.Itoa(slot) + "/" + strconv.Itoa(gen) }

// flowSoakChargeRequest is the body of a charge: the amount, and the
// metadata the provider keeps with it: the call's provider key as the
// charge's reference, and the operation it is for.
type flowSoakChargeRequest struct {
	Amount    int64  `json:"amount"`
	Reference string `json:"reference"`
	Scope     string `json:"scope"`
	Key       string `json:"key"`
}

// flowSoakArrival is a call that reached the provider's charging.
type flowSoakArrival struct {
	key     string
	at      time.Time
	applied bool
	// proc is the calling process, started when it entered the call's
	// function.
	proc    string
	started time.Time
}

// flowSoakCharged is a charge the provider applied.
type flowSoakCharged struct {
	Amount int64
	Key    string // the operation's key, from the metadata
	// Woke is the point at which the calling worker froze and woke before
	// it sent the call, in the same run of the operation, if it did.
	Woke string
	flowSoakCharge
}

// flowSoakProvider is the fake provider.
type flowSoakProvider struct {
	cfg      flowSoakConfig
	listener net.Listener
	srv      *http.Server
	closing  chan struct{}
	// workers kills and freezes the callers of calls marked to; set before
	// the workers start.
	workers *flowSoakWorkers

	mu sync.Mutex
	// charges are the charges applied, by reference: the provider's
	// effects. Keyed, there is at most one per reference.
	charges map[string][]*flowSoakCharged
	applied int
	// calls counts the calls by reference, applied or not; entered, the
	// calls' functions entered (flowSoakWorker.enter), sent or not.
	calls, entered map[string]int
	// lookups counts the lookups, and found those that found a charge.
	lookups, found int
	// arrivals are the calls that got past the faults to be applied: the
	// operation, when, and whether the provider applied it as a new
	// charge. The final check compares them with when each flow was done.
	arrivals []flowSoakArrival
	// conflicts counts calls that reused a key with another amount;
	// expired, those refused as begun more than expiry earlier (keyless:
	// see above; 0 for none).
	conflicts, expired int
	expiry             time.Duration
	// The faults injected.
	failedBefore, timedOutAfter, cutAfter int64
}

func startFlowSoakProvider(cfg flowSoakConfig) (*flowSoakProvider, error) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fake provider: %w", err)
	}
	p := &flowSoakProvider{cfg: cfg, listener: listener, closing: make(chan struct{}),
		charges: make(map[string][]*flowSoakCharged), calls: make(map[string]int), entered: make(map[string]int)}
	if cfg.Provider == providerKeyless {
		// Half the time a worker waits for an answer, so that a lookup
		// that waits it is answered before its caller gives up.
		p.expiry = cfg.ProviderTimeout / 2
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", p.serve)
	mux.HandleFunc("POST /entered", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.entered[r.URL.Query().Get("reference")]++
		p.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET /charges", p.lookup)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: time.Minute}
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

// serve is POST /charges: charge the body's amount, once per
// Idempotency-Key when keyed.
func (p *flowSoakProvider) serve(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	var body flowSoakChargeRequest
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.Reference == "" ||
		(p.cfg.Provider == providerKeyed && key != body.Reference) {
		http.Error(w, "POST a JSON amount and reference, with the reference as Idempotency-Key", http.StatusBadRequest)
		return
	}
	worker, _ := strconv.Atoi(r.Header.Get(flowSoakWorkerHeader))
	point, freeze := r.Header.Get(flowSoakKillHeader), r.Header.Get(flowSoakFreezeHeader) != ""
	fault := noProviderFault
	if point == "" {
		fault = p.fault()
	}
	arrived := time.Now()
	p.mu.Lock()
	p.calls[body.Reference]++
	p.mu.Unlock()

	op := body.Scope + "/" + body.Key
	if point == killBeforeApply && p.stopWorker(worker, point, op, freeze) {
		// To a caller that is gone, or frozen: a cut connection is what a
		// frozen caller finds when it wakes.
		cut(w)
		return
	}
	if fault == failBeforeApply {
		p.count(&p.failedBefore)
		http.Error(w, "temporarily unavailable", http.StatusServiceUnavailable)
		return
	}
	startedNano, _ := strconv.ParseInt(r.Header.Get(flowSoakStartedHeader), 10, 64)
	arrival := flowSoakArrival{key: body.Key, at: arrived, proc: r.Header.Get(flowSoakProcessHeader), started: time.Unix(0, startedNano)}
	charge, err := p.apply(body, arrival, r.Header.Get(flowSoakWokeHeader))
	switch {
	case errors.Is(err, errChargeExpired):
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	case err != nil:
		http.Error(w, err.Error(), http.StatusConflict)
		return
	}
	if point == killAfterApply && p.stopWorker(worker, point, op, freeze) && !freeze {
		return
	}
	// A frozen caller gets its answer when it wakes, after another
	// executor took its flow over.
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
		if cut(w) {
			p.count(&p.cutAfter)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(charge)
}

// lookup is GET /charges?reference=R: the charge made with reference R,
// 404 when there is none. With several (a keyless provider charged twice),
// the first.
func (p *flowSoakProvider) lookup(w http.ResponseWriter, r *http.Request) {
	ref := r.URL.Query().Get("reference")
	cs := p.charged(ref, true)
	if len(cs) == 0 && p.expiry > 0 {
		// An attempt begun before this lookup is applied by now, or
		// refused from now on.
		select {
		case <-time.After(p.expiry):
		case <-r.Context().Done():
			return
		case <-p.closing:
			return
		}
		cs = p.charged(ref, false)
	}
	if len(cs) == 0 {
		http.Error(w, "no such charge", http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(cs[0].flowSoakCharge)
}

// charged returns the charges made with reference ref, for a lookup,
// counted when first is set, and counted as found when there are some (a
// lookup looks again only when it found none).
func (p *flowSoakProvider) charged(ref string, first bool) []*flowSoakCharged {
	p.mu.Lock()
	defer p.mu.Unlock()
	if first {
		p.lookups++
	}
	cs := p.charges[ref]
	if len(cs) > 0 {
		p.found++
	}
	return cs
}

// stopWorker kills or freezes the calling worker, as the call asks, and
// reports whether it did.
func (p *flowSoakProvider) stopWorker(worker int, point, op string, freeze bool) bool {
	if freeze {
		return p.workers.freeze(worker, point, op)
	}
	return p.workers.kill(worker, point)
}

// cut closes the connection of w without an answer, and reports whether
// it could.
func cut(w http.ResponseWriter) bool {
	if hj, ok := w.(http.Hijacker); ok {
		if conn, _, err := hj.Hijack(); err == nil {
			_ = conn.Close()
			return true
		}
	}
	return false
}

// The provider's refusals.
var (
	errChargeConflict = errors.New("Idempotency-Key reused with another amount")
	errChargeExpired  = errors.New("request expired: the call began too long ago")
)

// apply charges the request's amount: keyed, once per reference (a
// reference it knows gets its charge back, or errChargeConflict when it
// was charged with another amount); keyless, every time, unless its call
// began more than expiry ago (errChargeExpired).
func (p *flowSoakProvider) apply(body flowSoakChargeRequest, arrival flowSoakArrival, woke string) (flowSoakCharge, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.arrivals = append(p.arrivals, arrival)
	if cs := p.charges[body.Reference]; len(cs) > 0 && p.cfg.Provider == providerKeyed {
		if cs[0].Amount != body.Amount {
			p.conflicts++
			return flowSoakCharge{}, errChargeConflict
		}
		return cs[0].flowSoakCharge, nil
	}
	if p.expiry > 0 && !arrival.started.IsZero() && time.Since(arrival.started) > p.expiry {
		p.expired++
		return flowSoakCharge{}, errChargeExpired
	}
	// A twentieth of the amounts are declined: a definite outcome, which
	// the provider records under the key as Stripe records a failed charge.
	status := "charged"
	if body.Amount%20 == 0 {
		status = "declined"
	}
	p.applied++
	p.arrivals[len(p.arrivals)-1].applied = true
	c := &flowSoakCharged{Amount: body.Amount, Key: body.Key, Woke: woke, flowSoakCharge: flowSoakCharge{ID: fmt.Sprintf("ch_%d", p.applied), Status: status}}
	p.charges[body.Reference] = append(p.charges[body.Reference], c)
	return c.flowSoakCharge, nil
}

func (p *flowSoakProvider) count(n *int64) {
	p.mu.Lock()
	*n++
	p.mu.Unlock()
}

// snapshot returns copies of the provider's charges by reference.
func (p *flowSoakProvider) snapshot() map[string][]flowSoakCharged {
	p.mu.Lock()
	defer p.mu.Unlock()
	charges := make(map[string][]flowSoakCharged, len(p.charges))
	for k, cs := range p.charges {
		for _, c := range cs {
			charges[k] = append(charges[k], *c)
		}
	}
	return charges
}
