//go:build webhookoracle

// The interop tests against the Standard Webhooks reference
// implementation: the standardwebhooks npm package, pinned in
// testdata/oracle/package-lock.json, and Node's own ed25519. They need
// node and that package installed, which the README's test command does
// not have, so they are built only with the tag webhookoracle, which
// .ci/webhooks sets after installing the package (npm ci, its integrity
// checked against the lockfile) into a temporary directory that it names
// in WEBHOOK_ORACLE. Built with the tag and without WEBHOOK_ORACLE, they
// fail: they never pass by skipping.
//
//	bash .ci/webhooks
package webhook_test

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem/idemhttp/webhook"
	"github.com/pgidem/idem/outbox"
)

// node is the oracle process, shared by the tests.
type node struct {
	mu  sync.Mutex
	in  io.WriteCloser
	out *bufio.Scanner
}

var (
	oracleOnce sync.Once
	oracleNode *node
	oracleErr  error
)

// oracle returns the running oracle, starting it once; it fails the test
// when WEBHOOK_ORACLE does not name the directory where .ci/webhooks
// installed the reference package.
func oracle(t *testing.T) *node {
	t.Helper()
	oracleOnce.Do(func() {
		dir := os.Getenv("WEBHOOK_ORACLE")
		if dir == "" {
			oracleErr = fmt.Errorf("WEBHOOK_ORACLE is not set: these tests run with the reference package that bash .ci/webhooks installs")
			return
		}
		cmd := exec.Command("node", filepath.Join("testdata", "oracle", "oracle.js"))
		cmd.Env = append(os.Environ(), "NODE_PATH="+filepath.Join(dir, "node_modules"))
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			oracleErr = err
			return
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			oracleErr = err
			return
		}
		if err := cmd.Start(); err != nil {
			oracleErr = fmt.Errorf("start node: %w", err)
			return
		}
		scanner := bufio.NewScanner(out)
		scanner.Buffer(make([]byte, 1<<20), 16<<20)
		oracleNode = &node{in: in, out: scanner}
	})
	if oracleErr != nil {
		t.Fatal(oracleErr)
	}
	return oracleNode
}

// call sends one request and decodes its answer into answer. An answer
// with an error and no verdict ("ok") is the oracle's own failure.
func (n *node) call(t *testing.T, req map[string]any, answer any) {
	t.Helper()
	line, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, err := n.in.Write(append(line, '\n')); err != nil {
		t.Fatal(err)
	}
	if !n.out.Scan() {
		t.Fatalf("the oracle stopped: %v", n.out.Err())
	}
	var verdict struct {
		OK    *bool
		Error string
	}
	if err := json.Unmarshal(n.out.Bytes(), &verdict); err != nil {
		t.Fatal(err)
	}
	if verdict.OK == nil && verdict.Error != "" {
		t.Fatalf("the oracle failed: %s", verdict.Error)
	}
	if err := json.Unmarshal(n.out.Bytes(), answer); err != nil {
		t.Fatal(err)
	}
}

// sign has the reference package sign a delivery with a whsec_ secret.
func (n *node) sign(t *testing.T, secret, id string, ts int64, payload []byte) string {
	var a struct{ Signature string }
	n.call(t, map[string]any{"op": "sign", "secret": secret, "id": id, "timestamp": ts, "payload_b64": base64.StdEncoding.EncodeToString(payload)}, &a)
	return a.Signature
}

// verify has the reference package verify a delivery's headers with a
// whsec_ secret, on its own clock and tolerance.
func (n *node) verify(t *testing.T, secret string, h http.Header, payload []byte) (bool, string) {
	var a struct {
		OK    bool
		Error string
	}
	headers := map[string]string{}
	for name := range h {
		headers[name] = h.Get(name) // the package lower-cases names itself
	}
	n.call(t, map[string]any{"op": "verify", "secret": secret, "headers": headers, "payload_b64": base64.StdEncoding.EncodeToString(payload)}, &a)
	return a.OK, a.Error
}

// signV1a has Node's crypto sign a delivery with an ed25519 seed.
func (n *node) signV1a(t *testing.T, seed []byte, id string, ts int64, payload []byte) string {
	var a struct{ Signature string }
	n.call(t, map[string]any{"op": "sign-v1a", "seed_b64": base64.StdEncoding.EncodeToString(seed), "id": id, "timestamp": ts,
		"payload_b64": base64.StdEncoding.EncodeToString(payload)}, &a)
	return a.Signature
}

// verifyV1a has Node's crypto verify the v1a signatures of a header.
func (n *node) verifyV1a(t *testing.T, public []byte, id string, ts int64, header string, payload []byte) bool {
	var a struct{ OK bool }
	n.call(t, map[string]any{"op": "verify-v1a", "public_b64": base64.StdEncoding.EncodeToString(public), "id": id, "timestamp": ts,
		"header": header, "payload_b64": base64.StdEncoding.EncodeToString(payload)}, &a)
	return a.OK
}

// The specification's vectors, signed by the reference package and by
// Node's ed25519: the oracle is what it claims to be.
func TestOracleSignsTheSpecificationsVectors(t *testing.T) {
	t.Parallel()
	n := oracle(t)
	payload := []byte(`{"test": 2432232314}`)
	if got := n.sign(t, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, payload); got != "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=" {
		t.Errorf("v1 vector: %s", got)
	}
	seed, _ := base64.StdEncoding.DecodeString("VEVTVFNJR05JTkdLRVlET05PVFVTRVRISVNGT1JBTlk=")
	if got := n.signV1a(t, seed, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, payload); got != "v1a,tQ9V2XOqn7jL/DQenEFpqIugdBVtiMmER5mhSkXBNwM0mkATuDe6KYYUuxqtaiHeYGb7KaaBRdM5WqyeFiL8Ag==" {
		t.Errorf("v1a vector: %s", got)
	}
}

// oracleCase is a random delivery: secrets of random length, an id of
// printable ASCII, and a payload of valid UTF-8 (the reference package
// reads a payload as a string) of random length, empty included.
type oracleCase struct {
	secrets []string // two whsec_ secrets, the old and the new
	seed    []byte
	id      string
	payload []byte
}

func randomCase(r *rand.Rand) oracleCase {
	secret := func() string {
		b := make([]byte, 24+r.IntN(41))
		for i := range b {
			b[i] = byte(r.UintN(256))
		}
		return "whsec_" + base64.StdEncoding.EncodeToString(b)
	}
	seed := make([]byte, ed25519.SeedSize)
	for i := range seed {
		seed[i] = byte(r.UintN(256))
	}
	const idChars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-:"
	id := make([]byte, 1+r.IntN(80))
	for i := range id {
		id[i] = idChars[r.IntN(len(idChars))]
	}
	var payload strings.Builder
	pieces := []string{`{"type":"invoice.paid","data":{"amount":`, "é", "€", "🙂", " ", "\n", `"`, `\`, ".", "0123456789", "\t", "ü"}
	for range r.IntN(200) {
		payload.WriteString(pieces[r.IntN(len(pieces))])
	}
	if r.IntN(10) == 0 {
		payload.WriteString(strings.Repeat("x", 100_000))
	}
	return oracleCase{secrets: []string{secret(), secret()}, seed: seed, id: string(id), payload: []byte(payload.String())}
}

const oracleCases = 200

// What idem signs, the reference verifies: every delivery signed with two
// secrets (a rotation) and an ed25519 key verifies with either secret in
// the standardwebhooks package, and with the public key in Node's crypto;
// a byte changed anywhere, and another secret, are refused.
func TestOracleVerifiesIdemsSignatures(t *testing.T) {
	t.Parallel()
	n := oracle(t)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range oracleCases {
		c := randomCase(r)
		scheme, err := webhook.NewStandardWebhooks(c.secrets[0], c.secrets[1], "whsk_"+base64.StdEncoding.EncodeToString(c.seed))
		if err != nil {
			t.Fatal(err)
		}
		h := http.Header{}
		now := time.Now()
		if err := scheme.Sign(h, c.id, now, c.payload); err != nil {
			t.Fatal(err)
		}
		for _, secret := range c.secrets {
			if ok, why := n.verify(t, secret, h, c.payload); !ok {
				t.Fatalf("case %d: the reference refuses idem's signature: %s (%s)", i, why, h)
			}
		}
		public := ed25519.NewKeyFromSeed(c.seed).Public().(ed25519.PublicKey)
		if !n.verifyV1a(t, public, c.id, now.Unix(), h.Get("webhook-signature"), c.payload) {
			t.Fatalf("case %d: Node's ed25519 refuses idem's v1a signature (%s)", i, h)
		}
		// The oracle is not a yes-sayer.
		tampered := append([]byte("!"), c.payload...)
		if ok, _ := n.verify(t, c.secrets[0], h, tampered); ok {
			t.Fatalf("case %d: the reference accepts a changed payload", i)
		}
		if ok, _ := n.verify(t, randomCase(r).secrets[0], h, c.payload); ok {
			t.Fatalf("case %d: the reference accepts another secret", i)
		}
		if n.verifyV1a(t, public, c.id+"x", now.Unix(), h.Get("webhook-signature"), c.payload) {
			t.Fatalf("case %d: Node's ed25519 accepts another id", i)
		}
	}
}

// What the reference signs, idem's receiver accepts, end to end over HTTP
// with its record written: v1 by the standardwebhooks package with either
// of the receiver's secrets, v1a by Node's crypto against the public key;
// the same delivery with a changed byte is refused.
func TestOracleSignaturesAreAcceptedByTheReceiver(t *testing.T) {
	n := oracle(t)
	r := rand.New(rand.NewPCG(3, 4))
	base := randomCase(r)
	public := ed25519.NewKeyFromSeed(base.seed).Public().(ed25519.PublicKey)
	scheme, err := webhook.NewStandardWebhooks(base.secrets[0], base.secrets[1], "whpk_"+base64.StdEncoding.EncodeToString(public))
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, webhook.Config{Scheme: scheme, MaxBodyBytes: -1})
	for i := range oracleCases {
		c := randomCase(r)
		c.id = fmt.Sprintf("%s-%d", c.id, i) // each case an event of its own
		ts := time.Now().Unix()
		var sig string
		switch i % 3 {
		case 0, 1:
			sig = n.sign(t, base.secrets[i%2], c.id, ts, c.payload)
		case 2:
			sig = n.signV1a(t, base.seed, c.id, ts, c.payload)
		}
		h := http.Header{"Webhook-Id": {c.id}, "Webhook-Timestamp": {strconv.FormatInt(ts, 10)}, "Webhook-Signature": {sig}}
		if a := f.post(h, append([]byte("!"), c.payload...)); a.status != http.StatusBadRequest || a.code() != webhook.ProblemSignatureInvalid {
			t.Fatalf("case %d: a changed payload: %d %s", i, a.status, a.body)
		}
		if a := f.post(h, c.payload); a.status != http.StatusNoContent {
			t.Fatalf("case %d: the receiver refuses the reference's %s: %d %s", i, sig[:strings.IndexByte(sig, ',')], a.status, a.body)
		}
	}
	if f.runs.Load() != oracleCases || f.payments() != oracleCases {
		t.Errorf("handler ran %d times, %d rows; want %d", f.runs.Load(), f.payments(), oracleCases)
	}
}

// The outbox's sender, through a relay and real HTTP, makes deliveries
// that the reference package verifies as they arrived.
func TestOracleVerifiesTheOutboxSender(t *testing.T) {
	n := oracle(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := env.Pool(t)
	r := rand.New(rand.NewPCG(5, 6))
	c := randomCase(r)
	type arrival struct {
		header http.Header
		body   []byte
	}
	arrivals := make(chan arrival, 100)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		arrivals <- arrival{header: req.Header.Clone(), body: body}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	deliver, err := outbox.NewWebhookHandler(outbox.WebhookConfig{URL: srv.URL, Secrets: c.secrets})
	if err != nil {
		t.Fatal(err)
	}
	scope, dest := fmt.Sprintf("oracle-%d", r.Int64()), fmt.Sprintf("oracle-dest-%d", r.Int64())
	const messages = 50
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range messages {
		if _, err := outbox.Enqueue(ctx, tx, outbox.Entry{Scope: scope, Key: strconv.Itoa(i), Destination: dest, Payload: randomCase(r).payload}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.StartRelay(ctx, pool, deliver, &outbox.Config{Destinations: []string{dest}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer relay.Stop()
	seen := map[string]bool{}
	for len(seen) < messages {
		select {
		case a := <-arrivals:
			for _, secret := range c.secrets {
				if ok, why := n.verify(t, secret, a.header, a.body); !ok {
					t.Fatalf("the reference refuses the outbox's delivery: %s (%s)", why, a.header)
				}
			}
			seen[a.header.Get("webhook-id")] = true
		case <-ctx.Done():
			t.Fatalf("%d of %d deliveries arrived", len(seen), messages)
		}
	}
}
