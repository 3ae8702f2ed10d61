// Package browsertest drives idem's web console (idemconsole) in a real
// browser, headless Chromium, from Go (chromedp): a module of its own, so
// that no user of idem downloads chromedp. CI runs it in a stage of its
// own (.ci/console), with Debian's chromium; it fails, never skips,
// without one. IDEM_CONSOLE_SCREENSHOTS names a directory to write the
// pages' screenshots to (docs/console).
package browsertest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemconsole"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// chromiumPath is Debian's chromium, which CI installs (.ci/console).
const chromiumPath = "/usr/bin/chromium"

// browser starts headless Chromium for the test, with a profile of its
// own, and returns a context to drive it with.
func browser(t *testing.T) context.Context {
	t.Helper()
	if _, err := os.Stat(chromiumPath); err != nil {
		t.Fatalf("no Chromium at %s (%v): install Debian's package, apt-get install chromium", chromiumPath, err)
	}
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromiumPath), chromedp.UserDataDir(t.TempDir()),
		chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun, chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.WindowSize(1280, 860),
	}
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	ctx, cancelTimeout := context.WithTimeout(ctx, 90*time.Second)
	t.Cleanup(func() {
		cancelTimeout()
		cancel()
		cancelAlloc()
	})
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	return ctx
}

// screenshot saves the page as name.png in IDEM_CONSOLE_SCREENSHOTS, if
// set.
func screenshot(name string) chromedp.Action[chromedp.Void] {
	dir := os.Getenv("IDEM_CONSOLE_SCREENSHOTS")
	return chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		if dir == "" {
			return nil
		}
		png, err := chromedp.FullScreenshot(100)(ctx, t) // the whole page, as PNG
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644)
	})
}

// text reads the text of what the CSS selector sel finds.
func text(t *testing.T, b context.Context, sel string) string {
	t.Helper()
	s, err := chromedp.Run(b, chromedp.Text(chromedp.CSS(sel)))
	if err != nil {
		t.Fatalf("the text of %s: %v", sel, err)
	}
	return s
}

// do runs steps in the browser, failing the test on an error.
func do(t *testing.T, b context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if err := chromedp.Do(b, steps...); err != nil {
		t.Fatal(err)
	}
}

// shop is the application of the tests: a checkout that reserves, charges
// and texts the customer at most once, over a payment provider and an SMS
// gateway that lose the answers the tests tell them to.
type shop struct {
	pool              *pgxpool.Pool
	checkout          *idem.Flow[order, receipt]
	charges, texts    atomic.Int64
	loseText, failPay atomic.Bool
}

type order struct {
	Amount int64  `json:"amount"`
	Phone  string `json:"phone"`
}

type receipt struct {
	OrderID  int64  `json:"order_id"`
	ChargeID string `json:"charge_id"`
	SMS      string `json:"sms"`
}

func newShop(t *testing.T, ctx context.Context, pool *pgxpool.Pool) *shop {
	t.Helper()
	if _, err := pool.Exec(ctx, `CREATE TABLE shop_order (id bigserial PRIMARY KEY, scope text, key text, amount bigint)`); err != nil {
		t.Fatal(err)
	}
	s := &shop{pool: pool}
	s.checkout = idem.MustNewFlow("checkout", func(ctx context.Context, st *idem.Steps, in order) (receipt, error) {
		id, err := idem.Local(st, "order", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO shop_order (scope, key, amount) VALUES ($1, $2, $3) RETURNING id`,
				st.Scope(), st.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return receipt{}, err
		}
		charge, err := idem.Call(st, "charge", func(ctx context.Context, key string) (string, error) {
			if s.failPay.Load() {
				return "", errors.New("the provider answered 503")
			}
			return fmt.Sprintf("ch_%d", s.charges.Add(1)), nil
		})
		if err != nil {
			return receipt{}, err
		}
		sms, err := idem.Call(st, "sms", func(ctx context.Context, key string) (string, error) {
			n := s.texts.Add(1)
			if s.loseText.Load() {
				return "", errors.New("read tcp 10.0.0.7:443: i/o timeout")
			}
			return fmt.Sprintf("sms_%d", n), nil
		}, idem.AtMostOnce())
		if err != nil {
			return receipt{}, err
		}
		return receipt{OrderID: id, ChargeID: charge, SMS: sms}, nil
	})
	return s
}

func (s *shop) buy(ctx context.Context, key string) (idem.Result[receipt], error) {
	return s.checkout.Run(ctx, s.pool, "tenant-42", key, nil, order{Amount: 2500, Phone: "+15550100"})
}

// stop leaves the order key stopped at its text, an at-most-once call
// whose answer was lost: its client gets 409 operation-stopped.
func (s *shop) stop(t *testing.T, ctx context.Context, key string) {
	t.Helper()
	s.loseText.Store(true)
	defer s.loseText.Store(false)
	if _, err := s.buy(ctx, key); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("%s: the first attempt: %v", key, err)
	}
	if _, err := s.buy(ctx, key); !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("%s: the client's retry: %v, want ErrFlowStopped", key, err)
	}
}

// serve serves the console under /ops/idem on 127.0.0.1 and returns its
// address.
func serve(t *testing.T, cfg idemconsole.Config) string {
	t.Helper()
	h, err := idemconsole.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/idem/", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL + "/ops/idem"
}

func TestConsoleInABrowser(t *testing.T) {
	ctx, pool, _ := env.Setup(t, "browser")
	s := newShop(t, ctx, pool)
	for _, key := range []string{"order-1001", "order-1002", "order-1003"} {
		s.stop(t, ctx, key)
	}
	if _, err := s.buy(ctx, "order-1004"); err != nil {
		t.Fatal(err)
	}
	s.failPay.Store(true)
	if _, err := s.buy(ctx, "order-1005"); !errors.Is(err, idem.ErrFlowIncomplete) {
		t.Fatalf("a charge that failed: %v", err)
	}
	s.failPay.Store(false)
	park(t, ctx, pool)

	base := serve(t, idemconsole.Config{DB: pool, Prefix: "/ops/idem", Operator: func(*http.Request) string { return "alice@example.com" }})
	b := browser(t)

	t.Run("a stopped flow is listed, resolved as applied on its page, and its client's retry gets the answer", func(t *testing.T) {
		css := func(sel string) chromedp.CSS { return chromedp.CSS(sel) }
		do(t, b,
			chromedp.Navigate(base+"/"),
			chromedp.WaitVisible(css(`section.cards`)),
			screenshot("overview"),
			chromedp.Click(css(`nav a[href$="state=attention"]`)),
			chromedp.WaitVisible(css(`table tbody`)),
			screenshot("attention"),
		)
		listed := text(t, b, `table tbody`)
		do(t, b,
			chromedp.Click(chromedp.Search(`//a[text()="order-1002"]`)),
			chromedp.WaitVisible(css(`form.action textarea[name=result]`)),
		)
		stoppedAt := text(t, b, `tr.stopped`)
		do(t, b,
			chromedp.SendKeys(css(`textarea[name=result]`), `"sms_2"`),
			chromedp.SendKeys(css(`form.action:has(textarea) input[name=reason]`), "the gateway's log shows sms_2 delivered (ticket OPS-77)"),
			screenshot("flow"),
			chromedp.Click(css(`button[value=applied]`)),
			chromedp.WaitVisible(css(`p.notice`)),
			screenshot("resolved"),
		)
		notice := text(t, b, `p.notice`)
		for _, key := range []string{"order-1001", "order-1002", "order-1003"} {
			if !strings.Contains(listed, key) {
				t.Errorf("the list of flows needing attention lacks %s:\n%s", key, listed)
			}
		}
		if strings.Contains(listed, "order-1004") || !strings.Contains(listed, "at most once") {
			t.Errorf("the list of flows needing attention:\n%s", listed)
		}
		if !strings.Contains(stoppedAt, "sms") || !strings.Contains(stoppedAt, "calling") || !strings.Contains(notice, "applied") {
			t.Errorf("the stopped step %q, the notice %q", stoppedAt, notice)
		}
		res, err := s.buy(ctx, "order-1002")
		if err != nil || res.Value.SMS != "sms_2" || res.Value.ChargeID == "" {
			t.Fatalf("the client's retry: %+v, %v; want the order's receipt", res, err)
		}
		info, err := idem.InspectFlow(ctx, pool, "tenant-42", "order-1002")
		if err != nil || info.State != "done" || len(info.Resolutions) != 1 || info.Resolutions[0].By != "alice@example.com" {
			t.Fatalf("the flow: %+v, %v", info, err)
		}
		if n := s.texts.Load(); n != 4 {
			t.Fatalf("%d texts sent, want one per order: the resolved one was not sent again", n)
		}
	})

	t.Run("a dead letter is requeued from the outbox's page", func(t *testing.T) {
		do(t, b,
			chromedp.Navigate(base+"/outbox"),
			chromedp.WaitVisible(chromedp.CSS(`table tbody`)),
			screenshot("outbox"),
			chromedp.Click(chromedp.CSS(`table tbody button`)),
			chromedp.WaitVisible(chromedp.CSS(`p.notice`)),
		)
		notice := text(t, b, `p.notice`)
		var state string
		if err := pool.QueryRow(ctx, `SELECT state FROM outbox_message`).Scan(&state); err != nil || state != "pending" || !strings.Contains(notice, "Requeued") {
			t.Fatalf("the message %s (%v), the notice %q; want it pending again", state, err, notice)
		}
	})

	t.Run("a POST from another site is refused", func(t *testing.T) {
		// A page of another site (localhost is another site than
		// 127.0.0.1) that posts the console's end form, with what it can
		// guess, to the flow the operator is looking at.
		evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/html")
			fmt.Fprintf(w, `<form method="post" action="%s/flow/end"><input name="scope" value="tenant-42">
<input name="key" value="order-1003"><input name="reason" value="gotcha"><input name="token" value="x">
<button id="go">Claim your prize</button></form>`, base)
		}))
		defer evil.Close()
		evilURL := strings.Replace(evil.URL, "127.0.0.1", "localhost", 1)
		do(t, b,
			chromedp.Navigate(base+"/flow?"+url.Values{"scope": {"tenant-42"}, "key": {"order-1003"}}.Encode()),
			chromedp.WaitVisible(chromedp.CSS(`form.end`)),
			chromedp.Navigate(evilURL),
			chromedp.Click(chromedp.ID("go")),
			chromedp.WaitVisible(chromedp.CSS(`p.problem`)),
		)
		body := text(t, b, `main`)
		if !strings.Contains(body, "another site") {
			t.Fatalf("the console's answer to a cross-site POST:\n%s", body)
		}
		if info, _ := idem.InspectFlow(ctx, pool, "tenant-42", "order-1003"); info.State != "attention" {
			t.Fatalf("a cross-site POST ended the flow: %+v", info)
		}
	})

	t.Run("a read-only console offers no action", func(t *testing.T) {
		readOnly := serve(t, idemconsole.Config{DB: pool, Prefix: "/ops/idem", ReadOnly: true})
		do(t, b,
			chromedp.Navigate(readOnly+"/flow?"+url.Values{"scope": {"tenant-42"}, "key": {"order-1001"}}.Encode()),
			chromedp.WaitVisible(chromedp.CSS(`table.facts`)),
			screenshot("read-only"),
		)
		forms, err := chromedp.Run(b, chromedp.Nodes(chromedp.CSSAll(`form[method=post]`), chromedp.AtLeast(0)))
		if err != nil {
			t.Fatal(err)
		}
		buttons, err := chromedp.Run(b, chromedp.Nodes(chromedp.CSSAll(`button`), chromedp.AtLeast(0)))
		if err != nil {
			t.Fatal(err)
		}
		page := text(t, b, `body`)
		if len(forms) != 0 || len(buttons) != 0 || !strings.Contains(page, "read-only") || !strings.Contains(page, "order-1001") {
			t.Fatalf("the read-only console's flow page has %d forms that post, %d buttons:\n%s", len(forms), len(buttons), page)
		}
	})
}

// park leaves a message of the outbox parked: a webhook its relay gave up
// on.
func park(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	t.Helper()
	err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := outbox.Enqueue(ctx, tx, outbox.Entry{Scope: "tenant-42", Key: "order-1004", Destination: "webhook:erp",
			Payload: []byte(`{"order":1004}`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// As a relay parks a message whose handler gave up (outbox.Park).
	if _, err := pool.Exec(ctx, `UPDATE outbox_message SET state = 'parked', attempts = 8,
		last_error = 'POST https://erp.example/hooks: 410 Gone (endpoint removed)'`); err != nil {
		t.Fatal(err)
	}
}
