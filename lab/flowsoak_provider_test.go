package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"
)

// postCharge charges at p for reference ref, as a worker whose call began
// at started, and returns the answer's status.
func postCharge(t *testing.T, p *flowSoakProvider, ref string, started time.Time) int {
	t.Helper()
	body, _ := json.Marshal(flowSoakChargeRequest{Amount: 2501, Reference: ref, Scope: "s", Key: ref})
	req, err := http.NewRequest(http.MethodPost, p.url()+"/charges", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(flowSoakStartedHeader, strconv.FormatInt(started.UnixNano(), 10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestKeylessProviderKeepsTheLookupsContract: the soak's keyless provider
// answers a lookup "not found" only once no attempt begun before it can be
// applied any more (idem.Reconcile's contract): an attempt still on its
// way when the lookup arrives, applied while the lookup waits, is found;
// one that arrives later than the provider's expiry after its call began
// is refused, not applied.
func TestKeylessProviderKeepsTheLookupsContract(t *testing.T) {
	cfg := defaultFlowSoakConfig()
	cfg.Provider, cfg.FailBeforeApply, cfg.TimeoutAfterApply, cfg.CutAfterApply = providerKeyless, 0, 0, 0
	p, err := startFlowSoakProvider(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	begun := time.Now()
	found := make(chan int, 1)
	go func() {
		resp, err := http.Get(p.url() + "/charges?reference=" + url.QueryEscape("on-its-way"))
		if err != nil {
			found <- 0
			return
		}
		resp.Body.Close()
		found <- resp.StatusCode
	}()
	// Once the lookup has looked, and found nothing, the attempt arrives.
	for {
		p.mu.Lock()
		n := p.lookups
		p.mu.Unlock()
		if n == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if status := postCharge(t, p, "on-its-way", begun); status != http.StatusOK {
		t.Fatalf("the attempt on its way: %d; want it applied", status)
	}
	if status := <-found; status != http.StatusOK {
		t.Fatalf("the lookup: %d; want the attempt that arrived while it waited found", status)
	}
	if status := postCharge(t, p, "late", time.Now().Add(-p.expiry-time.Second)); status != http.StatusServiceUnavailable {
		t.Fatalf("an attempt begun more than the expiry before: %d; want it refused", status)
	}
	p.mu.Lock()
	expired := p.expired
	p.mu.Unlock()
	if cs := p.snapshot()["late"]; len(cs) != 0 || expired != 1 {
		t.Fatalf("the late attempt: %d charges, %d refused; want it refused, not applied", len(cs), expired)
	}
}
