//go:build citus

package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/citustemp"
	"github.com/pgidem/idem/internal/testdb"
)

// nodePools returns a pool on every node of c that takes queries (with
// Citus's metadata on the workers, its default since Citus 11): the
// coordinator's, pool, first, then one per worker, closed when the test
// ends.
func nodePools(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) []*pgxpool.Pool {
	t.Helper()
	nodes := []*pgxpool.Pool{pool}
	for i := range c.Workers {
		cfg, err := pgxpool.ParseConfig(c.WorkerURL(i, "idem_citus"))
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 20
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		nodes = append(nodes, p)
	}
	return nodes
}

// counts counts something per logical operation (a scope and key).
type counts struct{ m sync.Map }

func (c *counts) add(op string) { c.of(op).Add(1) }

func (c *counts) of(op string) *atomic.Int64 {
	n, _ := c.m.LoadOrStore(op, new(atomic.Int64))
	return n.(*atomic.Int64)
}

// citusAnyNode sends every logical operation through every node of the
// cluster at once, its duplicates spread over the coordinator and the
// workers: a storm of Run, and one of flows with the resumer running
// through a worker. Each key's lock is taken on the node of its scope's
// shard, whichever node a call came in through, so each operation's
// function runs once (Run), each flow's function runs once but for the
// runs that continue a flow whose call failed, every effect happens once,
// and every duplicate gets the same answer.
func citusAnyNode(t *testing.T, ctx context.Context, c *citustemp.Cluster, pool *pgxpool.Pool) {
	nodes := nodePools(t, ctx, c, pool)
	t.Run("Run", func(t *testing.T) { anyNodeRun(t, ctx, nodes) })
	t.Run("Flows", func(t *testing.T) { anyNodeFlows(t, ctx, nodes) })
}

func anyNodeRun(t *testing.T, ctx context.Context, nodes []*pgxpool.Pool) {
	const tenants, keys = 10, 10
	prefix := testdb.Name("anynode")
	var calls counts
	var answers sync.Map // op -> payment ID of the first answer
	var wg sync.WaitGroup
	for tn := range tenants {
		scope := fmt.Sprintf("%s-%d", prefix, tn)
		for k := range keys {
			key := fmt.Sprintf("k%d", k)
			op := scope + "/" + key
			for d := range nodes {
				node := nodes[(tn+k+d)%len(nodes)]
				wg.Go(func() {
					res, err := idem.Run(ctx, node, scope, key, fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
						calls.add(op)
						var p payment
						err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, 1) RETURNING id`,
							scope, key).Scan(&p.ID)
						return p, err
					}, idem.WithWait(time.Minute))
					if err != nil {
						t.Errorf("%s: %v", op, err)
						return
					}
					if first, loaded := answers.LoadOrStore(op, res.Value.ID); loaded && first != res.Value.ID {
						t.Errorf("%s: answered payment %d, and %d to a duplicate", op, res.Value.ID, first)
					}
				})
			}
		}
	}
	wg.Wait()
	for tn := range tenants {
		scope := fmt.Sprintf("%s-%d", prefix, tn)
		for k := range keys {
			op := fmt.Sprintf("%s/k%d", scope, k)
			if n := calls.of(op).Load(); n != 1 {
				t.Errorf("%s: fn ran %d times through %d nodes, want 1", op, n, len(nodes))
			}
		}
		if n := countPayments(t, nodes[0], scope); n != keys {
			t.Errorf("%s: %d payments, want %d", scope, n, keys)
		}
	}
}

func anyNodeFlows(t *testing.T, ctx context.Context, nodes []*pgxpool.Pool) {
	const flows = 30
	scope := testdb.Name("anynodeflow")
	var entries, attempts counts
	// The provider applies a charge once per provider key, as a keyed
	// provider does; keysOf is the provider keys each flow charged with,
	// calls how often each key was called.
	var keysOf, calls sync.Map
	// Every fifth flow's first call fails: its run gives the flow up to
	// the resumer, or to its client's next try.
	flaky := func(key string) bool {
		i, _ := strconv.Atoi(strings.TrimPrefix(key, "f"))
		return i%5 == 0
	}
	flow := idem.MustNewFlow(testdb.Name("anynode"), func(ctx context.Context, s *idem.Steps, amount int64) (string, error) {
		entries.add(s.Key())
		if _, err := idem.Local(s, "reserve", func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
				s.Scope(), s.Key(), amount).Scan(&id)
			return id, err
		}); err != nil {
			return "", err
		}
		key := s.Key()
		return idem.Call(s, "charge", func(ctx context.Context, providerKey string) (string, error) {
			if attempts.of(key).Add(1) == 1 && flaky(key) {
				return "", fmt.Errorf("the provider is down: %w", idem.ErrNotSent)
			}
			keys, _ := keysOf.LoadOrStore(key, &sync.Map{})
			keys.(*sync.Map).Store(providerKey, true)
			n, _ := calls.LoadOrStore(providerKey, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			return "ch-" + providerKey[:12], nil
		})
		// A lease of 20s, and so an idle timeout of 6.7s: a loaded machine
		// does not make the server end an executor's session mid-run. (On
		// a machine loaded enough, a failed run's release of its lease can
		// outlast its bound, cleanupTimeout, and its flow then waits out
		// its lease: its clients' retries wait up to 20s.)
	}, idem.WithLease(20*time.Second))
	resumer, err := idem.StartResumer(ctx, nodes[len(nodes)-1], idem.ResumerConfig{Interval: 100 * time.Millisecond}, flow)
	if err != nil {
		t.Fatal(err)
	}
	var answers sync.Map
	var retried atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(3 * time.Minute)
	for f := range flows {
		key := fmt.Sprintf("f%d", f)
		for d := range nodes {
			node := nodes[(f+d)%len(nodes)]
			wg.Go(func() {
				for {
					res, err := flow.Run(ctx, node, scope, key, fpA, int64(100+f), idem.WithWait(time.Minute))
					if err == nil {
						if first, loaded := answers.LoadOrStore(key, res.Value); loaded && first != res.Value {
							t.Errorf("%s: answered %q, and %q to a duplicate", key, res.Value, first)
						}
						return
					}
					if !flaky(key) && !errors.Is(err, idem.ErrInProgress) || time.Now().After(deadline) {
						t.Errorf("%s: %v", key, err)
						return
					}
					retried.Add(1)
					t.Logf("%s: %v; again", key, err)
					time.Sleep(50 * time.Millisecond)
				}
			})
		}
	}
	wg.Wait()
	resumer.Stop()
	var repeated int
	for f := range flows {
		key := fmt.Sprintf("f%d", f)
		info, err := idem.InspectFlow(ctx, nodes[0], scope, key)
		if err != nil || info.State != "done" {
			t.Errorf("%s: %+v, %v; want done", key, info, err)
			continue
		}
		// Each entry of the flow's function is a run the flow's row
		// counts: its first, or one that continued it (a flaky flow's,
		// or one that took it over). A duplicate that ran the function
		// without holding the flow would be an entry more.
		if n := entries.of(key).Load(); n != int64(info.Runs) {
			t.Errorf("%s: the flow's function ran %d times through %d nodes, for %d runs of the flow", key, n, len(nodes), info.Runs)
		}
		if n := testdb.Count(t, nodes[0], `SELECT count(*) FROM payment WHERE scope = $1 AND key = $2`, scope, key); n != 1 {
			t.Errorf("%s: %d payments, want 1", key, n)
		}
		keys, ok := keysOf.Load(key)
		if !ok {
			t.Errorf("%s: never charged", key)
			continue
		}
		var charged []string
		keys.(*sync.Map).Range(func(k, _ any) bool {
			charged = append(charged, k.(string))
			return true
		})
		if len(charged) != 1 {
			t.Errorf("%s: charged under %d provider keys (%v), want 1", key, len(charged), charged)
		}
		for _, k := range charged {
			n, _ := calls.Load(k)
			if n.(*atomic.Int64).Load() > 1 {
				// A run that took the flow over makes the call again,
				// with its key: the provider applies it once.
				repeated++
			}
		}
	}
	t.Logf("%d flows through %d nodes: %d client retries, %d resumed by the resumer, %d calls repeated with their key",
		flows, len(nodes), retried.Load(), resumer.Resumed(), repeated)
}
