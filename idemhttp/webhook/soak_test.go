package webhook_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/internal/faultproxy"
	"github.com/pgidem/idem/internal/otelrec"
	"github.com/pgidem/idem/internal/testserver"
	"github.com/pgidem/idem/outbox"
)

// The soak's size: the README's test command runs the CI-sized default;
// docs/webhooks.md gives the numbers of a larger run and its command.
var (
	soakEntities = flag.Int("webhook.soak.entities", 40, "TestWebhookSoak: entities, each with -webhook.soak.versions events")
	soakVersions = flag.Int("webhook.soak.versions", 5, "TestWebhookSoak: events (versions) per entity")
)

// soakTally counts what the soak's senders saw.
type soakTally struct {
	deliveries   atomic.Int64 // requests sent, by either sender
	acknowledged atomic.Int64 // 2xx
	replayed     atomic.Int64 // 2xx with Idempotent-Replayed
	cut          atomic.Int64 // the connection broke: no answer
	inProgress   atomic.Int64 // 409
	unavailable  atomic.Int64 // 503
	failed       atomic.Int64 // other 5xx
	refused      atomic.Int64 // 4xx other than 409: a valid delivery refused
}

// TestWebhookSoak delivers every event of a run many times over, as
// providers do, through a proxy that cuts connections before the receiver
// gets a delivery and after it committed one, while the receiver's
// database connections are terminated under it, and checks that each
// event took effect exactly once and that no valid delivery was refused.
//
// Each event is an entity's version. Two senders deliver it: the outbox's
// relay with its webhook handler (retrying what fails with its backoff),
// and a provider-like sender that delivers it as 1 to 3 concurrent twins,
// in an order shuffled across entities, retrying until acknowledged, and
// delivers a third of the events once more later. The receiver's handler
// writes one effect row per event, and applies the entity's version with
// idem.Advance, so that versions arriving out of order leave the newest.
func TestWebhookSoak(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	pool := env.Pool(t)
	run := testserver.RandomHex(6)
	effects, entities := "webhook_soak_effect_"+run, "webhook_soak_entity_"+run
	if _, err := pool.Exec(ctx, `CREATE TABLE `+effects+` (event_id text NOT NULL, entity text NOT NULL, version bigint NOT NULL);
		CREATE TABLE `+entities+` (entity text PRIMARY KEY, version bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP TABLE `+effects+`, `+entities) })

	// The receiver, on a pool of its own whose connections the soak
	// terminates.
	secret := "whsec_" + base64.StdEncoding.EncodeToString([]byte(testserver.RandomHex(16)))
	scheme, err := webhook.NewStandardWebhooks(secret)
	if err != nil {
		t.Fatal(err)
	}
	appName := "webhook-soak-" + run
	rcfg, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	rcfg.ConnConfig.RuntimeParams["application_name"] = appName
	rcfg.MaxConns = 8
	rpool, err := pgxpool.NewWithConfig(ctx, rcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer rpool.Close()
	rec := otelrec.New()
	observer, _ := idem.NewObserver(idem.ObserverConfig{MeterProvider: rec, Logger: quiet})
	scope := "webhook:soak-" + run
	recv, err := webhook.NewReceiver(rpool, func(ctx context.Context, tx pgx.Tx, ev webhook.Event) error {
		var p soakPayload
		if err := json.Unmarshal(ev.Body, &p); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+effects+` (event_id, entity, version) VALUES ($1, $2, $3)`, ev.ID, p.Entity, p.Version); err != nil {
			return err
		}
		applied, err := idem.Advance(ctx, tx, ev.Scope, p.Entity, p.Version)
		if err != nil || !applied {
			return err // an older version, arrived late: nothing to change
		}
		_, err = tx.Exec(ctx, `INSERT INTO `+entities+` (entity, version) VALUES ($1, $2)
			ON CONFLICT (entity) DO UPDATE SET version = excluded.version`, p.Entity, p.Version)
		return err
	}, webhook.Config{Scheme: scheme, Scope: func(*http.Request) (string, error) { return scope, nil },
		Observer: observer, Logger: quiet, Wait: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var served atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		recv.ServeHTTP(w, r)
	}))
	defer srv.Close()
	var cutBefore, cutAfter atomic.Int64
	proxy, err := faultproxy.Start(faultproxy.Config{
		Address: srv.Listener.Addr().String(),
		Pipes: func() (toServer, toClient faultproxy.Pipe) {
			return cutFirst(0.1, &cutBefore), cutFirst(0.1, &cutAfter)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	url := "http://" + proxy.Addr().String() + "/webhooks"

	// The events, and their messages in the outbox.
	dest := "soak-" + run
	var events []soakEvent
	var entries []outbox.Entry
	for e := range *soakEntities {
		for v := 1; v <= *soakVersions; v++ {
			p := soakPayload{Type: "subscription.updated", Entity: fmt.Sprintf("sub_%d", e), Version: int64(v)}
			body, _ := json.Marshal(p)
			key := fmt.Sprintf("%s/v%d", p.Entity, v)
			events = append(events, soakEvent{id: outbox.IdempotencyKey(dest, key, dest), body: body})
			entries = append(entries, outbox.Entry{Scope: dest, Key: key, Destination: dest, Payload: body})
		}
	}
	for chunk := range slicesChunk(entries, 500) {
		if err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := outbox.EnqueueMany(ctx, tx, chunk)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}

	tally := &soakTally{}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: time.Minute}

	// Database faults, tied to progress: every 25 requests served, one of
	// the receiver's connections is terminated, whatever it is doing.
	var kills atomic.Int64
	faultCtx, stopFaults := context.WithCancel(ctx)
	var faults sync.WaitGroup
	faults.Go(func() {
		next := int64(25)
		for faultCtx.Err() == nil {
			if served.Load() < next {
				time.Sleep(2 * time.Millisecond)
				continue
			}
			next += 25
			var n int64
			_ = pool.QueryRow(faultCtx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name = $1 ORDER BY random() LIMIT 1) k`, appName).Scan(&n)
			kills.Add(n)
		}
	})

	// The outbox's relays, with the webhook handler, through the proxy.
	deliver, err := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: url, Secrets: []string{secret}, Client: client})
	if err != nil {
		t.Fatal(err)
	}
	relayCtx, stopRelays := context.WithCancel(ctx)
	var relays sync.WaitGroup
	for range 2 {
		relay, err := outbox.StartRelay(relayCtx, pool, func(ctx context.Context, msg outbox.Message) error {
			tally.deliveries.Add(1)
			err := deliver(ctx, msg)
			tally.count(err)
			return err
		}, &outbox.Config{Destinations: []string{dest}, BatchSize: 20, MaxAttempts: 1000,
			RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 200 * time.Millisecond, PollInterval: 50 * time.Millisecond, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		relays.Go(func() { <-relayCtx.Done(); relay.Stop() })
	}

	// The provider-like sender: twins, shuffled order, and later
	// redeliveries.
	order := rand.Perm(len(events))
	var later []soakEvent
	var laterMu sync.Mutex
	work := make(chan soakEvent)
	var senders sync.WaitGroup
	for range 8 {
		senders.Go(func() {
			for ev := range work {
				var twins sync.WaitGroup
				for range 1 + rand.IntN(3) {
					twins.Go(func() { sendUntilAcknowledged(t, ctx, client, url, scheme, ev, tally) })
				}
				twins.Wait()
				if rand.IntN(3) == 0 {
					laterMu.Lock()
					later = append(later, ev)
					laterMu.Unlock()
				}
			}
		})
	}
	for _, i := range order {
		work <- events[i]
	}
	close(work)
	senders.Wait()
	rand.Shuffle(len(later), func(i, j int) { later[i], later[j] = later[j], later[i] })
	for _, ev := range later {
		sendUntilAcknowledged(t, ctx, client, url, scheme, ev, tally)
	}

	// The relays finish their messages.
	for {
		var pending int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE destination = $1 AND state <> 'delivered'`, dest).Scan(&pending); err != nil {
			t.Fatal(err)
		}
		if pending == 0 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("%d messages not delivered", pending)
		}
		time.Sleep(50 * time.Millisecond)
	}
	stopRelays()
	relays.Wait()
	stopFaults()
	faults.Wait()
	proxy.Close()

	var rows, distinct, doubled, wrongState int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM `+effects).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+effects+` GROUP BY event_id HAVING count(*) > 1) d`).Scan(&doubled); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT $1::int - count(*) FILTER (WHERE version = $2) FROM `+entities, *soakEntities, *soakVersions).Scan(&wrongState); err != nil {
		t.Fatal(err)
	}
	counts := rec.Count("idem.webhook.deliveries")
	t.Logf("events: %d (%d entities × %d versions), delivered by the relays and by a sender of twins and redeliveries, out of order", len(events), *soakEntities, *soakVersions)
	t.Logf("deliveries sent: %d; acknowledged %d (%d as redeliveries); cut by the proxy %d (before the receiver got them %d, after it answered %d); 409 %d; 503 %d; other 5xx %d",
		tally.deliveries.Load(), tally.acknowledged.Load(), tally.replayed.Load(), tally.cut.Load(),
		cutBefore.Load(), cutAfter.Load(), tally.inProgress.Load(), tally.unavailable.Load(), tally.failed.Load())
	t.Logf("receiver's connections terminated: %d; receiver counted %v", kills.Load(), counts)
	t.Logf("effects: %d for %d events (%d distinct); doubled: %d; valid deliveries refused: %d; entities not at their newest version: %d",
		rows, len(events), distinct, doubled, tally.refused.Load(), wrongState)

	if rows != len(events) || distinct != len(events) || doubled != 0 {
		t.Errorf("effects %d (%d distinct, %d doubled), want %d, each once", rows, distinct, doubled, len(events))
	}
	if n := tally.refused.Load(); n != 0 {
		t.Errorf("%d valid deliveries refused", n)
	}
	for k, v := range counts {
		if strings.HasPrefix(k, "refused") && v != 0 {
			t.Errorf("the receiver refused %v deliveries as %s", v, k)
		}
	}
	if wrongState != 0 {
		t.Errorf("%d entities not at their newest version", wrongState)
	}
	if cutAfter.Load() == 0 || cutBefore.Load() == 0 || tally.replayed.Load() == 0 {
		t.Errorf("the soak injected too little: %d cuts after, %d before, %d redeliveries acknowledged",
			cutAfter.Load(), cutBefore.Load(), tally.replayed.Load())
	}
}

type soakPayload struct {
	Type    string `json:"type"`
	Entity  string `json:"entity"`
	Version int64  `json:"version"`
}

type soakEvent struct {
	id   string
	body []byte
}

// count tallies an attempt of the outbox's webhook handler by its error.
func (s *soakTally) count(err error) {
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	switch {
	case err == nil:
		s.acknowledged.Add(1)
	case strings.Contains(msg, ": 409 "):
		s.inProgress.Add(1)
	case strings.Contains(msg, ": 503 "):
		s.unavailable.Add(1)
	case strings.Contains(msg, ": 5"):
		s.failed.Add(1)
	case strings.Contains(msg, ": 4"):
		s.refused.Add(1)
	default:
		s.cut.Add(1)
	}
}

// sendUntilAcknowledged delivers ev, signed anew on each attempt, until it
// gets a 2xx, as a provider does; a 4xx other than 409 is a valid delivery
// refused, tallied, and not sent again.
func sendUntilAcknowledged(t *testing.T, ctx context.Context, client *http.Client, url string, scheme *webhook.StandardWebhooks, ev soakEvent, tally *soakTally) {
	for attempt := 1; ; attempt++ {
		if ctx.Err() != nil || attempt > 1000 {
			t.Errorf("event %s: not acknowledged after %d attempts", ev.id, attempt-1)
			return
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(string(ev.body)))
		_ = scheme.Sign(req.Header, ev.id, time.Now(), ev.body)
		tally.deliveries.Add(1)
		res, err := client.Do(req)
		if err != nil {
			tally.cut.Add(1)
			time.Sleep(time.Duration(1+rand.IntN(10)) * time.Millisecond)
			continue
		}
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		switch {
		case res.StatusCode >= 200 && res.StatusCode < 300:
			tally.acknowledged.Add(1)
			if res.Header.Get("Idempotent-Replayed") == "true" {
				tally.replayed.Add(1)
			}
			return
		case res.StatusCode == http.StatusConflict:
			tally.inProgress.Add(1)
		case res.StatusCode == http.StatusServiceUnavailable:
			tally.unavailable.Add(1)
		case res.StatusCode >= 500:
			tally.failed.Add(1)
		default:
			tally.refused.Add(1)
			t.Errorf("event %s: a valid delivery refused: %d", ev.id, res.StatusCode)
			return
		}
		time.Sleep(time.Duration(1+rand.IntN(10)) * time.Millisecond)
	}
}

func slicesChunk[T any](s []T, n int) func(func([]T) bool) {
	return func(yield func([]T) bool) {
		for i := 0; i < len(s); i += n {
			if !yield(s[i:min(i+n, len(s))]) {
				return
			}
		}
	}
}

// cutFirst is a faultproxy.Pipe for connections that each carry one HTTP
// request (the senders disable keep-alive): with the given chance, it cuts
// the connection when its first bytes arrive, before forwarding them, and
// counts the cut. Toward the receiver that is before it gets the delivery;
// toward the sender, since the receiver answers only after its commit,
// after the delivery was applied, which the sender cannot know.
func cutFirst(chance float64, cuts *atomic.Int64) faultproxy.Pipe {
	return func(dst, src net.Conn) {
		buf := make([]byte, 32<<10)
		n, err := src.Read(buf)
		if n > 0 && rand.Float64() < chance {
			cuts.Add(1)
			return // the proxy closes both ends
		}
		if n > 0 {
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err == nil {
			faultproxy.Copy(dst, src)
		}
	}
}
