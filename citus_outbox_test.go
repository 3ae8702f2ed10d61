//go:build citus

package idem_test

// The outbox on Citus, where docs/citus.sql makes outbox_message a Citus
// local table (TestCitus/OutboxCommitsWithTheWorker and Outbox): a
// transaction that writes a distributed table and enqueues a message
// commits both with two-phase commit, even when the coordinator's own
// commit fails, and the relay's statements run on the table's shard.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/citustemp"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

// remoteLog is a connection whose session logs the transaction commands
// Citus sends other nodes (citus.log_remote_commands), as notices, kept
// in order without the prepared transactions' names.
type remoteLog struct {
	conn *pgx.Conn
	mu   sync.Mutex
	cmds []string
}

func connectRemoteLog(t *testing.T, ctx context.Context, url string) *remoteLog {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["citus.log_remote_commands"] = "on"
	r := &remoteLog{}
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		cmd, ok := strings.CutPrefix(n.Message, "issuing ")
		if !ok {
			return
		}
		for _, kind := range []string{"PREPARE TRANSACTION", "COMMIT PREPARED", "ROLLBACK PREPARED", "COMMIT", "ROLLBACK"} {
			if cmd == kind || strings.HasPrefix(cmd, kind+" ") {
				r.mu.Lock()
				r.cmds = append(r.cmds, kind)
				r.mu.Unlock()
				return
			}
		}
	}
	r.conn, err = pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.conn.Close(context.Background()) })
	return r
}

// take returns the transaction commands Citus sent since the last take.
func (r *remoteLog) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	cmds := r.cmds
	r.cmds = nil
	return cmds
}

// countCmds returns how many of cmds are kind.
func countCmds(cmds []string, kind string) int {
	n := 0
	for _, c := range cmds {
		if c == kind {
			n++
		}
	}
	return n
}

// payAndEnqueue is a Run's fn that writes a payment and enqueues a
// message of the same scope and key, in the call's transaction.
func payAndEnqueue(scope, key string, calls *atomic.Int64) func(context.Context, pgx.Tx) (payment, error) {
	return func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, key, 1, calls)(ctx, tx)
		if err != nil {
			return p, err
		}
		_, err = outbox.Enqueue(ctx, tx, outbox.Entry{Scope: scope, Key: key, Destination: "ledger", Payload: []byte(`{}`)})
		return p, err
	}
}

// countOutboxMessages counts the outbox's messages of scope and key.
func countOutboxMessages(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE scope = $1 AND key = $2`, scope, key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// citusOutboxTwoPhase shows, with the commands Citus sends the workers,
// that Run with outbox.Enqueue commits with two-phase commit, through the
// coordinator and through a worker, where Run without it commits the
// worker's part with a plain COMMIT.
func citusOutboxTwoPhase(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	scope := testdb.Name("outbox-2pc")
	coord := connectRemoteLog(t, ctx, c.URL("idem_citus"))
	var calls atomic.Int64
	if _, err := idem.Run(ctx, coord.conn, scope, "pay", fpA, pay(scope, "pay", 1, &calls)); err != nil {
		t.Fatal(err)
	}
	if got := coord.take(); countCmds(got, "PREPARE TRANSACTION") != 0 || countCmds(got, "COMMIT") != 1 {
		t.Fatalf("Run (a payment) through the coordinator: %v, want one COMMIT and no PREPARE TRANSACTION", got)
	}
	if _, err := idem.Run(ctx, coord.conn, scope, "outbox", fpA, payAndEnqueue(scope, "outbox", &calls)); err != nil {
		t.Fatal(err)
	}
	got := coord.take()
	t.Logf("Run (a payment and outbox.Enqueue) through the coordinator: %v", got)
	if countCmds(got, "PREPARE TRANSACTION") != 1 || countCmds(got, "COMMIT PREPARED") != 1 || countCmds(got, "COMMIT") != 0 {
		t.Fatalf("Run (a payment and outbox.Enqueue) through the coordinator: %v, want one PREPARE TRANSACTION and one COMMIT PREPARED", got)
	}
	if n := countOutboxMessages(t, ctx, pool, scope, "outbox"); n != 1 {
		t.Fatalf("%d messages, want 1", n)
	}

	// Through worker 0, with the scope's shard on worker 1: two remote
	// participants, worker 1 and the coordinator's outbox shard.
	var w0 int
	if err := pool.QueryRow(ctx, `SELECT nodeport FROM pg_dist_node WHERE groupid <> 0 ORDER BY nodeid LIMIT 1`).Scan(&w0); err != nil {
		t.Fatal(err)
	}
	other := ""
	for i := 0; other == ""; i++ {
		s := fmt.Sprintf("%s-%d", scope, i)
		var port int
		if err := pool.QueryRow(ctx, `SELECT nodeport FROM citus_shards
			WHERE shardid = get_shard_id_for_distribution_column('idempotency_key', $1::text)`, s).Scan(&port); err != nil {
			t.Fatal(err)
		}
		if port != w0 {
			other = s
		}
	}
	worker := -1
	for i, w := range c.Workers {
		if w.Port == w0 {
			worker = i
		}
	}
	wlog := connectRemoteLog(t, ctx, c.WorkerURL(worker, "idem_citus"))
	if _, err := idem.Run(ctx, wlog.conn, other, "outbox", fpA, payAndEnqueue(other, "outbox", &calls)); err != nil {
		t.Fatal(err)
	}
	got = wlog.take()
	t.Logf("Run (a payment and outbox.Enqueue) through worker 0, its shard on worker 1: %v", got)
	if countCmds(got, "PREPARE TRANSACTION") != 2 || countCmds(got, "COMMIT PREPARED") != 2 || countCmds(got, "COMMIT") != 0 {
		t.Fatalf("through worker 0: %v, want two PREPARE TRANSACTIONs and two COMMIT PREPAREDs", got)
	}
	if n := countOutboxMessages(t, ctx, pool, other, "outbox"); n != 1 {
		t.Fatalf("%d messages, want 1", n)
	}
}

// citusOutboxWriteSkew fails the coordinator's commit of Run with
// outbox.Enqueue, at SERIALIZABLE, by a write skew with another
// SERIALIZABLE transaction on outbox_message: it reads the messages of
// Run's scope before Run enqueues one, Run reads those of another scope,
// and it enqueues one there and commits while Run's transaction is open.
// PostgreSQL then fails Run's transaction when it commits, after the
// worker's part was written: with two-phase commit, at Citus's first
// write of the commit (its record of the transaction to prepare, in
// pg_dist_transaction, before any PREPARE TRANSACTION), so Citus rolls
// the worker's part back, and Run retries the whole transaction. Either
// the payment, the key's record and the message all committed, and Run
// answered with the committed payment, or none did and Run failed. When
// outbox_message was a plain table of the coordinator's, Citus committed
// the worker's part on its own (COMMIT) before the coordinator's commit
// failed, and Run answered a replay of a payment whose message was lost.
func citusOutboxWriteSkew(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	coord := connectRemoteLog(t, ctx, c.URL("idem_citus"))
	serializable := pgx.TxOptions{IsoLevel: pgx.Serializable}
	for round := range 3 {
		scope := testdb.Name("skew")
		other := scope + "-other"
		key := fmt.Sprint("k", round)
		b, err := pool.BeginTx(ctx, serializable)
		if err != nil {
			t.Fatal(err)
		}
		var seen int
		if err := b.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE scope = $1`, scope).Scan(&seen); err != nil {
			t.Fatal(err)
		}
		var calls, attempts atomic.Int64
		var bErr error
		res, err := idem.Run(ctx, coord.conn, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			p, err := pay(scope, key, 1, &calls)(ctx, tx)
			if err != nil {
				return p, err
			}
			var n int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE scope = $1`, other).Scan(&n); err != nil {
				return p, err
			}
			if _, err := outbox.Enqueue(ctx, tx, outbox.Entry{Scope: scope, Key: key, Destination: "ledger", Payload: []byte(`{}`)}); err != nil {
				return p, err
			}
			if attempts.Add(1) == 1 {
				_, bErr = outbox.Enqueue(ctx, b, outbox.Entry{Scope: other, Key: key, Destination: "ledger", Payload: []byte(`{}`)})
				if bErr == nil {
					bErr = b.Commit(ctx)
				}
			}
			return p, nil
		}, idem.WithTxOptions(serializable))
		_ = b.Rollback(ctx)
		cmds := coord.take()
		t.Logf("round %d: Run: %+v, %v; the other transaction: %v; fn ran %d times; Citus sent %v", round, res, err, bErr, calls.Load(), cmds)
		if bErr != nil {
			t.Fatalf("the other transaction: %v", bErr)
		}
		payments, records, messages := countPayments(t, pool, scope), countRecords(t, pool, scope), countOutboxMessages(t, ctx, pool, scope, key)
		if payments != records || records != messages || payments > 1 {
			t.Fatalf("round %d: %d payments, %d records, %d messages: want all three or none", round, payments, records, messages)
		}
		switch {
		case err == nil && payments != 1:
			t.Fatalf("round %d: Run answered %+v, and nothing committed", round, res)
		case err == nil:
			var id int64
			if err := pool.QueryRow(ctx, `SELECT id FROM payment WHERE scope = $1`, scope).Scan(&id); err != nil {
				t.Fatal(err)
			}
			if res.Value.ID != id {
				t.Fatalf("round %d: Run answered payment %d (replayed: %v), payment %d committed", round, res.Value.ID, res.Replayed, id)
			}
		case payments != 0:
			t.Fatalf("round %d: Run failed (%v), and its payment committed", round, err)
		}
		// The write skew did fail Run's first transaction, after its
		// worker's part was written; the worker was told to commit only
		// the transaction that committed, and only after its PREPARE.
		if attempts.Load() < 2 {
			t.Fatalf("round %d: Run's first transaction committed: no write skew", round)
		}
		if countCmds(cmds, "COMMIT") != 0 || countCmds(cmds, "COMMIT PREPARED") != payments || countCmds(cmds, "ROLLBACK")+countCmds(cmds, "ROLLBACK PREPARED") == 0 {
			t.Fatalf("round %d: Citus sent %v", round, cmds)
		}
	}
}

// failOnError is a relay's logger that fails the test on the errors a
// relay logs and goes on from (a statement that failed), but for the
// parking of a message, which a test asks for.
type failOnError struct{ t *testing.T }

func (h failOnError) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelError }
func (h failOnError) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h failOnError) WithGroup(string) slog.Handler                { return h }
func (h failOnError) Handle(_ context.Context, r slog.Record) error {
	if !strings.Contains(r.Message, "message parked") {
		var attrs []string
		r.Attrs(func(a slog.Attr) bool { attrs = append(attrs, a.String()); return true })
		h.t.Errorf("a relay logged %q %v", r.Message, attrs)
	}
	return nil
}

// citusOutboxRelay delivers, with two relays through the coordinator,
// messages enqueued beside payments: some in the order of their ordering
// keys, some failing once (retried), one parked and requeued, one whose
// lease the handler extends. Each is delivered once, those with an
// ordering key one at a time and in order, and every message ends
// delivered; enqueued again, one and many, they are found, not added;
// a relay with a short retention purges them. The relays log no error:
// every statement of the outbox runs on Citus's local table.
func citusOutboxRelay(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	scope := testdb.Name("relay")
	dest := testdb.Name("dest")
	const n = 30
	var calls atomic.Int64
	for i := range n {
		key := fmt.Sprintf("k%02d", i)
		e := outbox.Entry{Scope: scope, Key: key, Destination: dest, Payload: []byte(key)}
		if i < 18 {
			e.OrderingKey = fmt.Sprint("o", i%3)
		}
		if _, err := idem.Run(ctx, pool, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			p, err := pay(scope, key, 1, &calls)(ctx, tx)
			if err != nil {
				return p, err
			}
			_, err = outbox.Enqueue(ctx, tx, e)
			return p, err
		}); err != nil {
			t.Fatal(err)
		}
	}
	const parked = "k20"
	var mu sync.Mutex
	delivered := make(map[string]int)   // successful deliveries by key
	inFlight := make(map[string]string) // ordering key to the key being delivered
	order := make(map[string][]int64)   // ordering key to the ids delivered, in order
	failed := make(map[string]bool)
	var done atomic.Int64
	handler := func(ctx context.Context, msg outbox.Message) error {
		mu.Lock()
		if msg.OrderingKey != "" {
			if k, busy := inFlight[msg.OrderingKey]; busy {
				t.Errorf("%s leased while %s, of the same ordering key, is being delivered", msg.Key, k)
			}
			inFlight[msg.OrderingKey] = msg.Key
		}
		mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		if msg.Key == "k03" && msg.Attempt == 1 {
			if err := outbox.ExtendLease(ctx, time.Minute); err != nil {
				t.Errorf("ExtendLease: %v", err)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		delete(inFlight, msg.OrderingKey)
		var i int
		fmt.Sscanf(msg.Key, "k%d", &i)
		switch {
		case msg.Key == parked && !failed[msg.Key]:
			failed[msg.Key] = true
			return outbox.Park(errors.New("refused once"))
		case i%4 == 1 && !failed[msg.Key]:
			failed[msg.Key] = true
			return errors.New("failed once")
		}
		delivered[msg.Key]++
		if delivered[msg.Key] > 1 {
			t.Errorf("%s delivered %d times", msg.Key, delivered[msg.Key])
		}
		if msg.OrderingKey != "" {
			order[msg.OrderingKey] = append(order[msg.OrderingKey], msg.ID)
		}
		done.Add(1)
		return nil
	}
	relayCtx, stop := context.WithCancel(ctx)
	defer stop()
	cfg := &outbox.Config{Destinations: []string{dest}, BatchSize: 4, PollInterval: 20 * time.Millisecond,
		RetryDelay: 20 * time.Millisecond, MaxRetryDelay: 50 * time.Millisecond,
		Logger: slog.New(failOnError{t})}
	var relays []*outbox.Relay
	for range 2 {
		r, err := outbox.StartRelay(relayCtx, pool, handler, cfg)
		if err != nil {
			t.Fatal(err)
		}
		relays = append(relays, r)
	}
	defer func() {
		for _, r := range relays {
			r.Stop()
		}
	}()
	wait := func(what string, cond func() (bool, error)) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			ok, err := cond()
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("waiting for %s: %d of %d delivered", what, done.Load(), n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	var parkedID int64
	wait("all but one delivered and one parked", func() (bool, error) {
		err := pool.QueryRow(ctx, `SELECT coalesce(max(id) FILTER (WHERE state = 'parked'), 0) FROM outbox_message WHERE destination = $1`, dest).Scan(&parkedID)
		return done.Load() == n-1 && parkedID != 0, err
	})
	if err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		ok, err := outbox.Requeue(ctx, tx, parkedID)
		if err == nil && !ok {
			err = errors.New("the parked message was not requeued")
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	wait("every message delivered", func() (bool, error) {
		var left int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE destination = $1 AND state <> 'delivered'`, dest).Scan(&left)
		return done.Load() == n && left == 0, err
	})
	mu.Lock()
	for ok, ids := range order {
		if !slices.IsSorted(ids) || len(ids) != 6 {
			t.Errorf("ordering key %s: delivered %v, want 6 in the order of their ids", ok, ids)
		}
	}
	mu.Unlock()

	// Enqueued again, one and many, the messages are found.
	again := []outbox.Entry{{Scope: scope, Key: "k01", Destination: dest, Payload: []byte("k01"), OrderingKey: "o1"},
		{Scope: scope, Key: "k02", Destination: dest, Payload: []byte("k02"), OrderingKey: "o2"}}
	if err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := outbox.Enqueue(ctx, tx, again[0]); err != nil {
			return err
		}
		_, err := outbox.EnqueueMany(ctx, tx, again)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var total int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE destination = $1`, dest).Scan(&total); err != nil {
		t.Fatal(err)
	}
	if total != n {
		t.Fatalf("%d messages after enqueuing two again, want %d", total, n)
	}

	// A relay that keeps delivered messages a millisecond purges them
	// when it starts.
	purging := *cfg
	purging.DeliveredRetention = time.Millisecond
	r, err := outbox.StartRelay(relayCtx, pool, handler, &purging)
	if err != nil {
		t.Fatal(err)
	}
	relays = append(relays, r)
	wait("the delivered messages purged", func() (bool, error) {
		err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_message WHERE destination = $1`, dest).Scan(&total)
		return total == 0, err
	})
}
