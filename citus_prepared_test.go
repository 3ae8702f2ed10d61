//go:build citus

package idem_test

// Which of idem's calls Citus commits with two-phase commit, and Citus's
// recovery of their prepared transactions after a node stopped the hard
// way while they committed (TestCitusFaults/PreparedTransactions).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

// remoteCommands is a connection whose session logs the commands Citus
// sends to other nodes (citus.log_remote_commands), as notices, counted.
type remoteCommands struct {
	conn             *pgx.Conn
	mu               sync.Mutex
	prepare, commits int
}

func connectLoggingRemote(t *testing.T, ctx context.Context, url string) *remoteCommands {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["citus.log_remote_commands"] = "on"
	r := &remoteCommands{}
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		r.mu.Lock()
		defer r.mu.Unlock()
		switch {
		case strings.HasPrefix(n.Message, "issuing PREPARE TRANSACTION"):
			r.prepare++
		case strings.HasPrefix(n.Message, "issuing COMMIT PREPARED"):
			r.commits++
		}
	}
	r.conn, err = pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.conn.Close(context.Background()) })
	return r
}

// count returns the PREPARE TRANSACTION and COMMIT PREPARED that Citus
// sent for this session since the last count.
func (r *remoteCommands) count() (prepared, committed int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	prepared, committed = r.prepare, r.commits
	r.prepare, r.commits = 0, 0
	return prepared, committed
}

// scopesOnWorkers returns a scope of prefix's whose shard is on each
// worker, by worker.
func scopesOnWorkers(t *testing.T, ctx context.Context, fc *faultCluster, prefix string) []string {
	t.Helper()
	scopes := make([]string, len(fc.c.Workers))
	for i, found := 0, 0; found < len(scopes); i++ {
		s := fmt.Sprintf("%s-%d", prefix, i)
		var port int
		if err := fc.coord().QueryRow(ctx, `SELECT nodeport FROM citus_shards
			WHERE shardid = get_shard_id_for_distribution_column('idempotency_key', $1::text)`, s).Scan(&port); err != nil {
			t.Fatal(err)
		}
		for w, node := range fc.c.Workers {
			if node.Port == port && scopes[w] == "" {
				scopes[w] = s
				found++
			}
		}
	}
	return scopes
}

// whichCallsPrepare runs each of idem's calls that writes, once, through
// a session that logs what Citus sends the workers, and counts the
// PREPARE TRANSACTIONs: the transactions that span nodes, which Citus
// commits with two-phase commit.
func whichCallsPrepare(t *testing.T, ctx context.Context, fc *faultCluster) {
	prefix := testdb.Name("prep")
	scopes := scopesOnWorkers(t, ctx, fc, prefix)
	coord := connectLoggingRemote(t, ctx, fc.c.URL(faultsDB))
	w0 := connectLoggingRemote(t, ctx, fc.c.WorkerURL(0, faultsDB))
	var calls atomic.Int64
	prov := newFaultProvider()
	var failCall atomic.Bool
	flow := idem.MustNewFlow(testdb.Name("prep"), func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		ch, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			if failCall.Load() {
				return "", errors.New("provider down")
			}
			return prov.charge(s.Scope()+"/"+s.Key(), providerKey), nil
		})
		return chargeOut{PaymentID: id, ChargeID: ch}, err
	}, idem.WithLease(time.Second), idem.WithGrace(0))

	type measured struct {
		name              string
		prepared, commits int
		// want is the fewest PREPARE TRANSACTIONs: the nodes other than
		// the session's that the transaction writes; 0 for none, when
		// Citus commits without two-phase commit.
		want int
	}
	var got []measured
	measure := func(name string, r *remoteCommands, want int, call func() error) {
		t.Helper()
		r.count()
		if err := call(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		p, c := r.count()
		got = append(got, measured{name, p, c, want})
	}
	s0, s1 := scopes[0], scopes[1]
	measure("Run (a payment) through the coordinator", coord, 0, func() error {
		_, err := idem.Run(ctx, coord.conn, s0, "run", fpA, pay(s0, "run", 1, &calls))
		return err
	})
	measure("Run, replayed, through the coordinator", coord, 0, func() error {
		_, err := idem.Run(ctx, coord.conn, s0, "run", fpA, pay(s0, "run", 1, &calls))
		return err
	})
	measure("Run (a payment) through worker 0, its shard on worker 1", w0, 0, func() error {
		_, err := idem.Run(ctx, w0.conn, s1, "run-w", fpA, pay(s1, "run-w", 1, &calls))
		return err
	})
	// outbox_message is a Citus local table (docs/citus.sql): Citus
	// writes its shard on the coordinator by local execution, which turns
	// on two-phase commit, and prepares the worker's part before the
	// coordinator's own commit: a failure of that commit (the
	// coordinator's crash, or a serialization failure raised at its
	// commit) leaves neither the payment and the record nor the message
	// (TestCitus/Outbox/CoordinatorsCommitFails).
	measure("Run (a payment and outbox.Enqueue) through the coordinator", coord, 1, func() error {
		_, err := idem.Run(ctx, coord.conn, s0, "outbox", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
			p, err := pay(s0, "outbox", 1, &calls)(ctx, tx)
			if err != nil {
				return p, err
			}
			_, err = outbox.Enqueue(ctx, tx, outbox.Entry{Scope: s0, Key: "outbox", Destination: "ledger", Payload: []byte(`{}`)})
			return p, err
		})
		return err
	})
	measure("Once and Advance in a transaction through the coordinator", coord, 0, func() error {
		return idem.WithTx(ctx, coord.conn, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := idem.Once(ctx, tx, s0, "once", func(context.Context, pgx.Tx) error { return nil }); err != nil {
				return err
			}
			_, err := idem.Advance(ctx, tx, s0, "entity", 1)
			return err
		})
	})
	measure("Flow.Run (a local step and a call) through the coordinator", coord, 0, func() error {
		_, err := flow.Run(ctx, coord.conn, s0, "flow", fpCharge, chargeIn{Amount: 1})
		return err
	})
	measure("Flow.Run through worker 0, its shard on worker 1", w0, 0, func() error {
		_, err := flow.Run(ctx, w0.conn, s1, "flow-w", fpCharge, chargeIn{Amount: 1})
		return err
	})
	failCall.Store(true)
	if _, err := flow.Run(ctx, coord.conn, s1, "resumed", fpCharge, chargeIn{Amount: 1}); err == nil {
		t.Fatal("the flow succeeded with its provider down")
	}
	failCall.Store(false)
	// The completer's take-over (FlowAdopt) is an UPDATE whose scope is
	// in a subquery: Citus plans it as an UPDATE of every shard, on every
	// worker, in one transaction.
	measure("Flow.Resume through the coordinator", coord, len(fc.c.Workers), func() error {
		n, err := flow.Resume(ctx, coord.conn)
		if err == nil && n != 1 {
			err = fmt.Errorf("resumed %d flows, want 1", n)
		}
		return err
	})
	measure("EndFlow through the coordinator", coord, 0, func() error {
		_, err := idem.EndFlow(ctx, coord.conn, s0, "flow", "ended")
		return err
	})
	// Expired records and flows on both workers.
	for _, s := range scopes {
		for k := range 5 {
			if _, err := idem.Run(ctx, fc.coord(), s, fmt.Sprint("purged-", k), fpA, pay(s, fmt.Sprint("purged-", k), 1, &calls)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := fc.coord().Exec(ctx, `UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE scope = ANY($1) AND key LIKE 'purged-%'`, scopes); err != nil {
		t.Fatal(err)
	}
	measure("Purge through the coordinator, expired records on both workers", coord, len(fc.c.Workers), func() error {
		n, err := idem.Purge(ctx, coord.conn, 100)
		if err == nil && n < 10 {
			err = fmt.Errorf("purged %d, want at least 10", n)
		}
		return err
	})
	for _, m := range got {
		t.Logf("%-70s PREPARE TRANSACTION ×%d, COMMIT PREPARED ×%d", m.name, m.prepared, m.commits)
	}
	for _, m := range got {
		if m.prepared < m.want || (m.prepared > 0) != (m.want > 0) || m.prepared != m.commits {
			t.Errorf("%s: %d PREPARE TRANSACTION, %d COMMIT PREPARED; want at least %d, as many COMMIT PREPARED", m.name, m.prepared, m.commits, m.want)
		}
	}
}

// countPrepared counts the prepared transactions of the fault tests'
// database on the server at url.
func countPrepared(ctx context.Context, url string) (int, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_xacts WHERE database = $1`, faultsDB).Scan(&n)
	return n, err
}

// waitFor polls cond until it holds, or fails the test when ctx ends.
func waitFor(t *testing.T, ctx context.Context, what string, cond func() (bool, error)) {
	t.Helper()
	for {
		ok, err := cond()
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v (last: %v)", what, ctx.Err(), err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// preparedRecovered stops worker 0 the hard way while transactions that
// span both workers, which Citus commits with two-phase commit, are
// between their PREPARE TRANSACTION on the workers and their COMMIT
// PREPARED: completers' take-overs (Flow.Resume) and a Purge, through the
// coordinator. To hold them there, the coordinator waits for a
// synchronous standby that does not exist (synchronous_standby_names):
// its own commit, which decides the transaction, waits after the workers
// prepared. Worker 0 is stopped; the wait is released (the coordinator
// commits, and its COMMIT PREPARED to worker 0 fails); worker 0 starts
// again with the prepared transactions on its disk. Or the coordinator is
// stopped instead, its commit on its disk and its COMMIT PREPARED never
// sent, and starts again. Either way Citus's recovery
// (recover_prepared_transactions, its maintenance daemon's held off)
// commits the prepared transactions, as the coordinator decided. No
// prepared transaction is left on any worker, every flow finishes with
// one payment and one charge, and Purge deletes every expired record and
// nothing else.
func preparedRecovered(t *testing.T, ctx context.Context, fc *faultCluster, stopCoordinator bool) {
	start := time.Now()
	prefix := testdb.Name("2pc")
	coord := fc.coord()
	admin := func(stmts ...string) {
		t.Helper()
		conn, err := pgx.Connect(ctx, fc.c.Coordinator.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.WithoutCancel(ctx))
		for _, stmt := range append(stmts, `SELECT pg_reload_conf()`) {
			if _, err := conn.Exec(ctx, stmt); err != nil {
				t.Fatalf("%s: %v", stmt, err)
			}
		}
	}
	// The maintenance daemon would recover the transactions once the node
	// is back, before the test counts them: the test calls the recovery.
	admin(`ALTER SYSTEM SET citus.recover_2pc_interval = -1`)
	released := false
	release := func() {
		if !released {
			released = true
			admin(`ALTER SYSTEM RESET synchronous_standby_names`)
		}
	}
	defer func() {
		release()
		admin(`ALTER SYSTEM RESET citus.recover_2pc_interval`)
	}()

	// Flows whose call failed, their payment written, left to completers;
	// and expired records beside live ones, on both workers.
	prov := newFaultProvider()
	var down atomic.Bool
	down.Store(true)
	flow := idem.MustNewFlow(testdb.Name("2pc"), func(ctx context.Context, s *idem.Steps, in chargeIn) (chargeOut, error) {
		id, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), in.Amount).Scan(&id)
			return id, err
		})
		if err != nil {
			return chargeOut{}, err
		}
		op := s.Scope() + "/" + s.Key()
		ch, err := idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			if down.Load() {
				return "", errors.New("provider down")
			}
			return prov.charge(op, providerKey), nil
		})
		return chargeOut{PaymentID: id, ChargeID: ch}, err
	}, idem.WithLease(2*time.Second), idem.WithGrace(0))
	const flows, records = 32, 96
	for op := range flows {
		scope, key := opKey(prefix, op)
		if _, err := flow.Run(ctx, coord, scope, key, fpCharge, chargeIn{Amount: int64(op + 1)}); err == nil {
			t.Fatal("a flow succeeded with its provider down")
		}
	}
	var calls atomic.Int64
	for i := range records {
		scope, key := opKey(prefix+"-rec", i)
		if _, err := idem.Run(ctx, coord, scope, key, fpA, pay(scope, key, 1, &calls)); err != nil {
			t.Fatal(err)
		}
	}
	// Two records in three expire.
	tag, err := coord.Exec(ctx, `UPDATE idempotency_key SET expires_at = now() - interval '1 second'
		WHERE scope LIKE $1 || '-rec-%' AND substr(key, 3)::int % 3 <> 0`, prefix)
	if err != nil {
		t.Fatal(err)
	}
	expired := tag.RowsAffected()
	down.Store(false)

	// The coordinator's commits wait for a standby: a probe, a write of a
	// plain table of the coordinator's, shows when they do.
	if _, err := coord.Exec(ctx, `CREATE TABLE faults_probe (i int)`); err != nil {
		t.Fatal(err)
	}
	defer coord.Exec(context.WithoutCancel(ctx), `DROP TABLE IF EXISTS faults_probe`)
	admin(`ALTER SYSTEM SET synchronous_standby_names = 'idem_faults_nobody'`)
	syncRepWaiters := func() (int, error) {
		var n int
		err := coord.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND datname = $1`, faultsDB).Scan(&n)
		return n, err
	}
	probeDone := make(chan error, 1)
	probing := false
	waitFor(t, ctx, "the coordinator's commits to wait for a standby", func() (bool, error) {
		if !probing {
			probing = true
			go func() { _, err := coord.Exec(ctx, `INSERT INTO faults_probe VALUES (1)`); probeDone <- err }()
		}
		select {
		case err := <-probeDone:
			probing = false // committed without waiting: the setting was not in force yet
			if err != nil {
				return false, err
			}
		default:
		}
		n, err := syncRepWaiters()
		return n > 0, err
	})

	// The completers and a Purge, through the coordinator.
	var wg sync.WaitGroup
	var resumeErrs, purgeErrs atomic.Int64
	for range 2 {
		wg.Go(func() {
			if _, err := flow.Resume(ctx, coord); err != nil {
				resumeErrs.Add(1)
			}
		})
	}
	wg.Go(func() {
		if _, err := idem.Purge(ctx, coord, 16); err != nil {
			purgeErrs.Add(1)
		}
	})
	worker0 := fc.c.WorkerURL(0, faultsDB)
	var preparedAtStop int
	waitFor(t, ctx, "a prepared transaction on worker 0", func() (bool, error) {
		var err error
		preparedAtStop, err = countPrepared(ctx, worker0)
		return preparedAtStop > 0, err
	})
	waiting, _ := syncRepWaiters()
	node := "worker 0"
	if stopCoordinator {
		node = "the coordinator"
		if err := fc.c.Coordinator.Kill(syscall.SIGQUIT); err != nil {
			t.Fatal(err)
		}
		if probing {
			<-probeDone // its session ended with the coordinator
		}
		wg.Wait()
		if err := fc.c.RestartCoordinator(ctx); err != nil {
			t.Fatal(err)
		}
		release() // written in its configuration, it came back with it
	} else {
		if err := fc.c.Workers[0].Kill(syscall.SIGQUIT); err != nil {
			t.Fatal(err)
		}
		release()
		if probing {
			if err := <-probeDone; err != nil {
				t.Errorf("the probe: %v", err)
			}
		}
		wg.Wait()
		if err := fc.c.RestartWorker(ctx, 0); err != nil {
			t.Fatal(err)
		}
	}
	afterRestart := 0
	for i := range fc.c.Workers {
		n, err := countPrepared(ctx, fc.c.WorkerURL(i, faultsDB))
		if err != nil {
			t.Fatal(err)
		}
		afterRestart += n
	}
	var pending int
	if err := coord.QueryRow(ctx, `SELECT count(*) FROM pg_dist_transaction`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	var recovered int
	if err := coord.QueryRow(ctx, `SELECT recover_prepared_transactions()`).Scan(&recovered); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s stopped with %d prepared transactions on worker 0, %d sessions waiting on the coordinator (the probe's among them) (completers failed: %d, purge failed: %d); after its restart %d prepared on the workers, %d in pg_dist_transaction; recover_prepared_transactions() = %d",
		node, preparedAtStop, waiting, resumeErrs.Load(), purgeErrs.Load(), afterRestart, pending, recovered)
	if afterRestart == 0 || recovered < afterRestart {
		t.Fatalf("after %s's restart, %d prepared transactions on the workers, %d recovered; want at least one, each recovered", node, afterRestart, recovered)
	}
	for i := range fc.c.Workers {
		if n, err := countPrepared(ctx, fc.c.WorkerURL(i, faultsDB)); err != nil || n != 0 {
			t.Errorf("worker %d: %d prepared transactions left after the recovery (%v)", i, n, err)
		}
	}

	// The clients of the flows, and the next Purge, finish the work.
	var s faultStorm
	answers := make([]chargeOut, flows)
	for op := range flows {
		wg.Go(func() {
			scope, key := opKey(prefix, op)
			res, err := untilAnswered(ctx, &s, func(ctx context.Context) (idem.Result[chargeOut], error) {
				return flow.Run(ctx, coord, scope, key, fpCharge, chargeIn{Amount: int64(op + 1)}, idem.WithWait(20*time.Second))
			})
			if err != nil {
				t.Errorf("%s/%s: %v", scope, key, err)
			}
			answers[op] = res.Value
		})
	}
	wg.Go(func() {
		if _, err := untilAnswered(ctx, &s, func(ctx context.Context) (int64, error) { return idem.Purge(ctx, coord, 16) }); err != nil {
			t.Errorf("Purge: %v", err)
		}
	})
	wg.Wait()
	s.report(t)
	if _, err := coord.Exec(ctx, `SELECT recover_prepared_transactions()`); err != nil {
		t.Fatal(err)
	}
	if err := coord.QueryRow(ctx, `SELECT count(*) FROM pg_dist_transaction`).Scan(&pending); err != nil || pending != 0 {
		t.Errorf("%d transactions left in pg_dist_transaction (%v)", pending, err)
	}

	payments := paymentsByOp(t, ctx, coord, prefix)
	var lost, doubled int
	for op := range flows {
		scope, key := opKey(prefix, op)
		p := payments[[2]string{scope, key}]
		o := scope + "/" + key
		switch {
		case p[0] == 0 || prov.applied[o] == 0:
			lost++
		case p[0] > 1 || prov.applied[o] > 1 || len(prov.byOp[o]) > 1:
			doubled++
		}
		var charge string
		for k := range prov.byOp[o] {
			charge = prov.charges[k]
		}
		if answers[op].PaymentID != p[1] || answers[op].ChargeID != charge {
			t.Errorf("%s: answered %+v; committed payment %d, charge %s", o, answers[op], p[1], charge)
		}
	}
	var left, live, recPayments int64
	if err := coord.QueryRow(ctx, `SELECT count(*) FILTER (WHERE expires_at <= now()), count(*) FILTER (WHERE expires_at > now())
		FROM idempotency_key WHERE scope LIKE $1 || '-rec-%'`, prefix).Scan(&left, &live); err != nil {
		t.Fatal(err)
	}
	if err := coord.QueryRow(ctx, `SELECT count(*) FROM payment WHERE scope LIKE $1 || '-rec-%'`, prefix).Scan(&recPayments); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d flows: %d lost, %d doubled; records: %d expired, %d left, %d live of %d, %d payments kept; %s",
		flows, lost, doubled, expired, left, live, records-expired, recPayments, time.Since(start).Round(time.Millisecond))
	if lost != 0 || doubled != 0 || left != 0 || live != records-expired || recPayments != records {
		t.Fatalf("%d flows lost, %d doubled; %d expired records left, %d live of %d, %d payments of %d",
			lost, doubled, left, live, records-expired, recPayments, records)
	}
}
