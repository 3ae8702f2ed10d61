package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// A definite failure after an earlier call succeeded is undone by more
// steps: compensationFlow holds stock at a warehouse, charges the card,
// and when the card is declined releases the stock and cancels the order.
// Each call has its provider key, so each is applied once however often a
// crash makes it run again. (ExampleCall_compensation is the same pattern
// in a program of its own.)

// Where the compensation child kills itself.
const (
	crashAfterRelease = "after-release" // the warehouse released the stock; the release is not recorded
	// crashAfterDecline: the decline is recorded (it commits with the
	// release's intent); the release was not made.
	crashAfterDecline = "after-decline"
)

// warehouse is the warehouse of compensationFlow, over HTTP: it holds and
// releases stock once per provider key, and counts the operations it
// applied.
type warehouse struct {
	mu      sync.Mutex
	applied map[string]string // provider key → what it did
	held    int
	calls   int
}

func (w *warehouse) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls++
	key, op := r.URL.Query().Get("key"), r.URL.Path
	if done, ok := w.applied[key]; ok {
		_ = json.NewEncoder(rw).Encode(done) // replayed
		return
	}
	switch op {
	case "/hold":
		w.held++
	case "/release":
		w.held--
	}
	w.applied[key] = op
	_ = json.NewEncoder(rw).Encode(op)
}

// compensationFlow is the flow of the compensation tests, whose calls go
// to the server at base (a warehouse at /hold and /release, a provider at
// / that declines 402). at names the point where the process kills
// itself, if any.
func compensationFlow(name, base, at string) *idem.Flow[Order, Receipt] {
	kill := func(point string) {
		if at == point {
			self, _ := os.FindProcess(os.Getpid())
			_ = self.Kill()
			select {}
		}
	}
	post := func(ctx context.Context, path string, q url.Values) (string, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path+"?"+q.Encode(), nil)
		if err != nil {
			return "", err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return "", fmt.Errorf("%s: %s", path, resp.Status)
		}
		var out string
		return out, json.NewDecoder(resp.Body).Decode(&out)
	}
	return idem.MustNewFlow(name, func(ctx context.Context, s *idem.Steps, in Order) (Receipt, error) {
		orderID, err := idem.Local(s, "order", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.AmountCents).Scan(&id)
			return id, err
		})
		if err != nil {
			return Receipt{}, err
		}
		if _, err := idem.Call(s, "hold-stock", func(ctx context.Context, key string) (string, error) {
			return post(ctx, "/hold", url.Values{"key": {key}})
		}); err != nil {
			return Receipt{}, err
		}
		charge, err := idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			return post(ctx, "/", url.Values{"key": {key}, "amount": {strconv.FormatInt(in.AmountCents, 10)}})
		})
		if err != nil {
			return Receipt{}, err // uncertain: the next attempt charges again, same key
		}
		if charge != "declined" {
			return Receipt{OrderID: orderID, ChargeID: charge}, nil
		}
		// Declined: a definite failure, recorded with the call. Undo the
		// hold, exactly once, with a provider key of its own.
		if _, err := idem.Call(s, "release-stock", func(ctx context.Context, key string) (string, error) {
			kill(crashAfterDecline)
			out, err := post(ctx, "/release", url.Values{"key": {key}})
			if err == nil {
				kill(crashAfterRelease)
			}
			return out, err
		}); err != nil {
			return Receipt{}, err
		}
		_, err = idem.Local(s, "cancel", func(ctx context.Context, tx pgx.Tx) (bool, error) {
			_, err := tx.Exec(ctx, `UPDATE payment SET amount_cents = 0 WHERE id = $1`, orderID)
			return true, err
		})
		return Receipt{OrderID: orderID, Declined: true}, err
	}, idem.WithLease(crashLease))
}

func TestFlowCompensationRunsOnceThroughCrashes(t *testing.T) {
	for _, at := range []string{crashAfterDecline, crashAfterRelease} {
		t.Run(at, func(t *testing.T) {
			ctx, pool, scope, p := setupFlow(t)
			w := &warehouse{applied: make(map[string]string)}
			mux := http.NewServeMux()
			mux.Handle("/hold", w)
			mux.Handle("/release", w)
			mux.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
				amount, _ := strconv.ParseInt(r.URL.Query().Get("amount"), 10, 64)
				id, declined, err := p.charge(r.Context(), r.URL.Query().Get("key"), amount)
				switch {
				case err != nil:
					http.Error(rw, err.Error(), http.StatusServiceUnavailable)
				case declined:
					_ = json.NewEncoder(rw).Encode("declined")
				default:
					_ = json.NewEncoder(rw).Encode(id)
				}
			})
			srv := httptest.NewServer(mux)
			defer srv.Close()
			name := testdb.Name("compensate")
			job, _ := json.Marshal(crashJob{URL: env.URL(t), Flow: name, Scope: scope, Key: "k", Provider: srv.URL, At: at, Compensate: true})
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), crashEnv+"="+string(job))
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != -1 {
				t.Fatalf("the child was not killed: %v\n%s", err, out)
			}
			flow := compensationFlow(name, srv.URL, "")
			res, err := flow.Run(ctx, pool, scope, "k", nil, Order{AmountCents: 402}, idem.WithWait(time.Minute))
			if err != nil || !res.Value.Declined {
				t.Fatalf("the retry: %+v, %v; want the order declined", res, err)
			}
			again, err := flow.Run(ctx, pool, scope, "k", nil, Order{AmountCents: 402})
			if err != nil || !again.Replayed || again.Value != res.Value {
				t.Fatalf("a later retry: %+v, %v; want %+v replayed", again, err, res.Value)
			}
			w.mu.Lock()
			defer w.mu.Unlock()
			// One hold and one release, each under a key of its own, and the
			// card charged once (declined, never called again).
			if w.held != 0 || len(w.applied) != 2 || p.calls.Load() != 1 || countPayments(t, pool, scope) != 1 {
				t.Fatalf("stock held %d, warehouse operations %v, provider calls %d, orders %d; want 0, hold and release, 1, 1",
					w.held, w.applied, p.calls.Load(), countPayments(t, pool, scope))
			}
		})
	}
}
