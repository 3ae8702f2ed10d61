package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgtemp"
	"github.com/pgidem/idem/internal/testdb"
)

// PostgreSQL keeps every lock that is not a backend's fast-path relation
// lock in one table in shared memory, shared by all the server's databases
// and sized by max_locks_per_transaction × (max_connections +
// max_prepared_transactions). A transaction that fills it makes sessions in
// every database fail with "out of shared memory": new connections, a
// query on more relations than the fast path holds, CREATE TEMP TABLE, an
// INSERT. These tests fill it the ways a busy application would, on a
// throwaway server at the defaults, while probes in another database check
// that the rest of the server keeps working.

// maxLocksHeld is the most advisory locks a transaction of idem's may hold
// at once, whatever number of keys it claims: idem.MaxKeyLocks, which must
// stay well under max_locks_per_transaction (64 by default), a
// transaction's share of the lock table.
const maxLocksHeld = idem.MaxKeyLocks

// probeRelations is how many relations the probe's query touches: one more
// than a backend's fast-path slots (16), so that it needs the lock table.
const probeRelations = 17

// lockServer is a throwaway server at PostgreSQL's defaults, with idem's
// database and the probes' database.
type lockServer struct {
	ctx context.Context
	// work is the pool of the database migrated with idem.Migrate.
	work *pgxpool.Pool
	// admin is a connection, made before any load, to the postgres
	// database, for reading pg_locks.
	admin *pgx.Conn
	// probeDB and adminDB connect to the probes' database and to the
	// postgres database.
	probeDB, adminDB *pgx.ConnConfig
}

// startLockServer starts the throwaway server of one test, stopped when it
// ends, and marks the test parallel.
func startLockServer(t *testing.T) *lockServer {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: database tests are skipped")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)

	// PostgreSQL's own max_connections, which sizes the lock table.
	srv, err := pgtemp.Start(ctx, pgtemp.Config{MaxConnections: 100})
	if err != nil {
		t.Fatalf("this test needs a throwaway PostgreSQL server at the defaults, started from a local installation: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Stop(); err != nil {
			t.Errorf("stop the throwaway server: %v", err)
		}
	})

	adminDB, err := pgx.ParseConfig(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := pgx.ConnectConfig(ctx, adminDB.Copy())
	if err != nil {
		t.Fatalf("connect to the throwaway server: %v", err)
	}
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	// The test is about the lock table of a default server: say so if this
	// one is not.
	for setting, want := range map[string]string{
		"max_connections":           "100",
		"max_locks_per_transaction": "64",
		"max_prepared_transactions": "0",
	} {
		var got string
		if err := admin.QueryRow(ctx, "SELECT current_setting($1)", setting).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("the throwaway server has %s = %s, want PostgreSQL's default %s", setting, got, want)
		}
	}
	for _, db := range []string{"idem_work", "idem_probe"} {
		if _, err := admin.Exec(ctx, "CREATE DATABASE "+db); err != nil {
			t.Fatal(err)
		}
	}

	cfg, err := pgxpool.ParseConfig(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Database = "idem_work"
	// The most a test uses at once; with the probes' and the admin's it
	// stays well within max_connections.
	cfg.MaxConns = 45
	work, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(work.Close)
	sqlDB := stdlib.OpenDBFromPool(work)
	err = idem.Migrate(ctx, sqlDB)
	_ = sqlDB.Close()
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}

	probeDB := adminDB.Copy()
	probeDB.Database = "idem_probe"
	probe, err := pgx.ConnectConfig(ctx, probeDB.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close(ctx)
	var schema strings.Builder
	for i := 1; i <= probeRelations; i++ {
		fmt.Fprintf(&schema, "CREATE TABLE probe_%02d (n int NOT NULL); INSERT INTO probe_%02d VALUES (1);\n", i, i)
	}
	schema.WriteString("CREATE TABLE probe_log (at timestamptz NOT NULL DEFAULT now());\n")
	if _, err := probe.Exec(ctx, schema.String()); err != nil {
		t.Fatalf("create the probes' tables: %v", err)
	}
	return &lockServer{ctx: ctx, work: work, admin: admin, probeDB: probeDB, adminDB: adminDB}
}

// probeQuery touches each of the probe's relations once.
var probeQuery = func() string {
	parts := make([]string, probeRelations)
	for i := range parts {
		parts[i] = fmt.Sprintf("SELECT n FROM probe_%02d", i+1)
	}
	return "SELECT sum(n) FROM (" + strings.Join(parts, " UNION ALL ") + ") AS p"
}()

// probe is what an unrelated application does on the same server: a new
// connection to another database, a query on more relations than the fast
// path holds, CREATE TEMP TABLE, an INSERT. It returns an error that says
// which step failed.
func (s *lockServer) probe(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, s.probeDB.Copy())
	if err != nil {
		return fmt.Errorf("new connection: %w", err)
	}
	defer conn.Close(context.Background())
	var sum int
	if err := conn.QueryRow(ctx, probeQuery).Scan(&sum); err != nil {
		return fmt.Errorf("%d-relation query: %w", probeRelations, err)
	}
	if sum != probeRelations {
		return fmt.Errorf("%d-relation query: sum %d, want %d", probeRelations, sum, probeRelations)
	}
	if _, err := conn.Exec(ctx, "CREATE TEMP TABLE probe_temp (n int)"); err != nil {
		return fmt.Errorf("CREATE TEMP TABLE: %w", err)
	}
	if _, err := conn.Exec(ctx, "INSERT INTO probe_log DEFAULT VALUES"); err != nil {
		return fmt.Errorf("INSERT: %w", err)
	}
	return nil
}

// probes runs probe rounds and keeps what they found.
type probes struct {
	s      *lockServer
	mu     sync.Mutex
	rounds int
	failed int
	errs   []string
	stop   chan struct{}
	done   chan struct{}
}

// startProbes runs probe rounds in a loop until the returned probes'
// finish is called.
func (s *lockServer) startProbes() *probes {
	p := &probes{s: s, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		for {
			p.round("during the load")
			select {
			case <-p.stop:
				return
			case <-time.After(25 * time.Millisecond):
			}
		}
	}()
	return p
}

// round runs one probe and records its outcome.
func (p *probes) round(when string) {
	err := p.s.probe(p.s.ctx)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rounds++
	if err != nil {
		p.failed++
		if len(p.errs) < 5 {
			p.errs = append(p.errs, fmt.Sprintf("%s: %v", when, err))
		}
	}
}

// finish stops the loop and fails the test if any probe failed.
func (p *probes) finish(t *testing.T) {
	t.Helper()
	close(p.stop)
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	t.Logf("probes in another database: %d rounds, %d failed", p.rounds, p.failed)
	if p.failed > 0 {
		t.Errorf("%d of %d probes in another database of the server failed; the first:\n\t%s",
			p.failed, p.rounds, strings.Join(p.errs, "\n\t"))
	}
}

// advisoryLocks returns the advisory locks each backend of pids holds.
func (s *lockServer) advisoryLocks(t *testing.T, pids ...uint32) []int {
	t.Helper()
	counts := make([]int, len(pids))
	for i, pid := range pids {
		if err := s.admin.QueryRow(s.ctx,
			`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1`, int64(pid)).Scan(&counts[i]); err != nil {
			t.Fatalf("read pg_locks: %v", err)
		}
	}
	return counts
}

// lockWatch samples pg_locks while a load runs, for the most advisory
// locks one backend held and the most all of them held.
type lockWatch struct {
	maxBackend, maxTotal atomic.Int64
	stop, done           chan struct{}
}

func (s *lockServer) watchLocks(t *testing.T) *lockWatch {
	t.Helper()
	conn, err := pgx.ConnectConfig(s.ctx, s.adminDB.Copy())
	if err != nil {
		t.Fatal(err)
	}
	w := &lockWatch{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		defer conn.Close(context.Background())
		for {
			var backend, total int64
			// A sample that fails (the lock table is full) is skipped.
			if err := conn.QueryRow(s.ctx, `
				SELECT coalesce(max(n), 0), coalesce(sum(n), 0)
				FROM (SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' GROUP BY pid) AS b`).Scan(&backend, &total); err == nil {
				raise(&w.maxBackend, backend)
				raise(&w.maxTotal, total)
			}
			select {
			case <-w.stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	return w
}

func (w *lockWatch) finish() (maxBackend, maxTotal int64) {
	close(w.stop)
	<-w.done
	return w.maxBackend.Load(), w.maxTotal.Load()
}

func raise(v *atomic.Int64, n int64) {
	for {
		old := v.Load()
		if n <= old || v.CompareAndSwap(old, n) {
			return
		}
	}
}

// records returns the rows of scope in idempotency_key.
func (s *lockServer) records(t *testing.T, scope string) int {
	t.Helper()
	var n int
	if err := s.work.QueryRow(s.ctx, `SELECT count(*) FROM idempotency_key WHERE scope = $1`, scope).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// batchKey is key i of the batch named prefix.
func batchKey(prefix string, i int) string { return fmt.Sprintf("%s-%05d", prefix, i) }

// onceEach runs idem.Once in tx for n fresh keys of scope, those of the
// batch named prefix, with a function that does nothing, and returns how
// many ran. It stops at the first error.
func onceEach(ctx context.Context, tx pgx.Tx, scope, prefix string, n int) (int, error) {
	noop := func(context.Context, pgx.Tx) error { return nil }
	for i := range n {
		ran, err := idem.Once(ctx, tx, scope, batchKey(prefix, i), noop)
		if err != nil {
			return i, fmt.Errorf("Once for key %d of %d (%s): %w", i+1, n, batchKey(prefix, i), err)
		}
		if !ran {
			return i, fmt.Errorf("Once for key %d of %d (%s): a fresh key was replayed", i+1, n, batchKey(prefix, i))
		}
	}
	return n, nil
}

// TestLockTableLargeTransaction runs one transaction that claims 13,000
// keys with idem.Once, more than the lock table of a default server holds
// (about 12,800), at READ COMMITTED and at REPEATABLE READ. The transaction
// must commit, its backend hold at most maxLocksHeld advisory locks
// whenever the test counts them (every 1,000 keys, the last before the
// commit), every key be recorded once, and every probe in another
// database succeed, those run in a loop throughout and those run at each
// count.
func TestLockTableLargeTransaction(t *testing.T) {
	s := startLockServer(t)
	const keys, countEvery = 13000, 1000
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		t.Run(string(iso), func(t *testing.T) {
			scope := testdb.Name("large")
			watch := s.watchLocks(t)
			probes := s.startProbes()

			tx, err := s.work.BeginTx(s.ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			pid := tx.Conn().PgConn().PID()
			ran, mostHeld, heldAt := 0, 0, 0
			var onceErr error
			for ran < keys {
				var n int
				n, onceErr = onceEach(s.ctx, tx, scope, fmt.Sprintf("k%02d", ran/countEvery), min(countEvery, keys-ran))
				ran += n
				if onceErr != nil {
					// The failed statement's abort has released the
					// transaction's locks: nothing left to count.
					break
				}
				// While the transaction holds what it claimed: its locks,
				// and what they leave to the rest of the server.
				if held := s.advisoryLocks(t, pid)[0]; held > mostHeld {
					mostHeld, heldAt = held, ran
				}
				probes.round(fmt.Sprintf("after %d keys", ran))
			}
			var commitErr error
			if onceErr == nil {
				commitErr = tx.Commit(s.ctx)
			} else {
				_ = tx.Rollback(s.ctx)
			}
			probes.finish(t)
			maxBackend, maxTotal := watch.finish()
			t.Logf("%d of %d keys claimed; advisory locks of the transaction: at most %d when counted (after %d keys), at most %d sampled; most sampled in all: %d",
				ran, keys, mostHeld, heldAt, maxBackend, maxTotal)

			if onceErr != nil {
				t.Errorf("the transaction of %d keys failed after %d: %v", keys, ran, onceErr)
			}
			if commitErr != nil {
				t.Errorf("commit the transaction of %d keys: %v", keys, commitErr)
			}
			if mostHeld > maxLocksHeld || maxBackend > maxLocksHeld {
				t.Errorf("the transaction held %d advisory locks after %d keys (%d sampled), want at most %d",
					mostHeld, heldAt, maxBackend, maxLocksHeld)
			}
			if got := s.records(t, scope); got != keys {
				t.Errorf("idempotency_key has %d records of the scope, want %d, one a key", got, keys)
			}
		})
	}
}

// TestLockTableConcurrentTransactions runs 40 transactions at once that
// claim 350 keys each with idem.Once and hold them together, 14,000 in
// all, more than the lock table of a default server holds. Every
// transaction must commit, none hold more than maxLocksHeld advisory
// locks, every key be recorded once, and every probe in another database
// succeed.
func TestLockTableConcurrentTransactions(t *testing.T) {
	s := startLockServer(t)
	const txs, keys = 40, 350
	scope := testdb.Name("concurrent")

	// The connections and transactions first, so that only the claims
	// compete for the lock table.
	open := make([]pgx.Tx, txs)
	pids := make([]uint32, txs)
	for i := range txs {
		c, err := s.work.Acquire(s.ctx)
		if err != nil {
			t.Fatalf("connection %d of %d: %v", i+1, txs, err)
		}
		defer c.Release()
		tx, err := c.Begin(s.ctx)
		if err != nil {
			t.Fatalf("transaction %d of %d: %v", i+1, txs, err)
		}
		open[i] = tx
		pids[i] = c.Conn().PgConn().PID()
	}

	watch := s.watchLocks(t)
	probes := s.startProbes()
	errs := make([]error, txs)
	var wg sync.WaitGroup
	for i, tx := range open {
		wg.Go(func() {
			_, errs[i] = onceEach(s.ctx, tx, scope, fmt.Sprintf("t%d", i), keys)
		})
	}
	wg.Wait()
	// Every transaction holds its claims: the peak.
	held := s.advisoryLocks(t, pids...)
	for range 3 {
		probes.round("before the commits")
	}
	for i, tx := range open {
		if errs[i] == nil {
			if err := tx.Commit(s.ctx); err != nil {
				errs[i] = fmt.Errorf("commit: %w", err)
			}
		} else {
			_ = tx.Rollback(s.ctx)
		}
	}
	probes.finish(t)
	maxBackend, maxTotal := watch.finish()

	var failed []string
	mostHeld, total := 0, 0
	for i := range txs {
		mostHeld = max(mostHeld, held[i])
		total += held[i]
		if errs[i] != nil {
			failed = append(failed, fmt.Sprintf("transaction %d: %v", i+1, errs[i]))
		}
	}
	t.Logf("advisory locks held before the commits: %d in all, at most %d by one transaction (most seen: %d by one backend, %d in all)",
		total, mostHeld, maxBackend, maxTotal)
	if len(failed) > 0 {
		t.Errorf("%d of %d transactions of %d keys failed:\n\t%s", len(failed), txs, keys, strings.Join(failed, "\n\t"))
	}
	if mostHeld > maxLocksHeld || maxBackend > maxLocksHeld {
		t.Errorf("a transaction held %d advisory locks (most seen %d), want at most %d", mostHeld, maxBackend, maxLocksHeld)
	}
	if got, want := s.records(t, scope), txs*keys; got != want {
		t.Errorf("idempotency_key has %d records of the scope, want %d, one a key", got, want)
	}
}

// TestLockTableConsumers runs 8 consumers for 15 seconds, each claiming
// batches of 3,000 fresh keys with idem.Once, one transaction a batch, as
// consumers of a broker would. Every batch must commit, no backend hold
// more than maxLocksHeld advisory locks, every key be recorded once, and
// every probe in another database succeed.
func TestLockTableConsumers(t *testing.T) {
	s := startLockServer(t)
	const consumers, keys = 8, 3000
	const load = 15 * time.Second
	scope := testdb.Name("consumers")

	// Open the consumers' connections before the load.
	var warm []*pgxpool.Conn
	for range consumers {
		c, err := s.work.Acquire(s.ctx)
		if err != nil {
			t.Fatal(err)
		}
		warm = append(warm, c)
	}
	for _, c := range warm {
		c.Release()
	}

	watch := s.watchLocks(t)
	probes := s.startProbes()
	type batch struct {
		consumer, n int
		err         error
	}
	var mu sync.Mutex
	var batches []batch
	end := time.Now().Add(load)
	var wg sync.WaitGroup
	for c := range consumers {
		wg.Go(func() {
			for n := 0; n == 0 || time.Now().Before(end); n++ {
				err := pgx.BeginFunc(s.ctx, s.work, func(tx pgx.Tx) error {
					_, err := onceEach(s.ctx, tx, scope, fmt.Sprintf("c%d-b%d", c, n), keys)
					return err
				})
				mu.Lock()
				batches = append(batches, batch{consumer: c, n: n, err: err})
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	probes.finish(t)
	maxBackend, maxTotal := watch.finish()

	var failed []string
	for _, b := range batches {
		if b.err != nil {
			failed = append(failed, fmt.Sprintf("consumer %d, batch %d: %v", b.consumer+1, b.n+1, b.err))
		}
	}
	t.Logf("%d batches of %d keys, %d failed; most advisory locks seen: %d by one backend, %d in all",
		len(batches), keys, len(failed), maxBackend, maxTotal)
	if len(failed) > 0 {
		shown := failed
		if len(shown) > 5 {
			shown = append(shown[:5:5], "...")
		}
		t.Errorf("%d of %d batches failed:\n\t%s", len(failed), len(batches), strings.Join(shown, "\n\t"))
	}
	if maxBackend > maxLocksHeld {
		t.Errorf("a transaction held %d advisory locks (sampled every 100ms), want at most %d", maxBackend, maxLocksHeld)
	}
	if got, want := s.records(t, scope), len(batches)*keys; got != want {
		t.Errorf("idempotency_key has %d records of the scope, want %d (%d batches of %d keys), one a key",
			got, want, len(batches), keys)
	}
}

// TestLockTableReplaysTakeNoLocks replays a batch of 300 keys, all recorded
// already, with idem.Once in a new transaction, at READ COMMITTED and at
// REPEATABLE READ: the replays must hold no advisory lock before the
// commit.
func TestLockTableReplaysTakeNoLocks(t *testing.T) {
	s := startLockServer(t)
	const keys = 300
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		t.Run(string(iso), func(t *testing.T) {
			scope := testdb.Name("replay")
			opts := pgx.TxOptions{IsoLevel: iso}
			if err := pgx.BeginTxFunc(s.ctx, s.work, opts, func(tx pgx.Tx) error {
				_, err := onceEach(s.ctx, tx, scope, "k", keys)
				return err
			}); err != nil {
				t.Fatalf("record the batch: %v", err)
			}

			tx, err := s.work.BeginTx(s.ctx, opts)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(s.ctx) }()
			ranFn := func(context.Context, pgx.Tx) error { return errors.New("the function of a recorded key ran") }
			for i := range keys {
				ran, err := idem.Once(s.ctx, tx, scope, batchKey("k", i), ranFn)
				if err != nil || ran {
					t.Fatalf("replay of key %d of %d: ran %t, %v", i+1, keys, ran, err)
				}
			}
			if held := s.advisoryLocks(t, tx.Conn().PgConn().PID())[0]; held != 0 {
				t.Errorf("a transaction of %d replays held %d advisory locks before its commit, want 0", keys, held)
			}
			if err := tx.Commit(s.ctx); err != nil {
				t.Fatalf("commit the replays: %v", err)
			}
			if got := s.records(t, scope); got != keys {
				t.Errorf("idempotency_key has %d records of the scope, want %d", got, keys)
			}
		})
	}
}
