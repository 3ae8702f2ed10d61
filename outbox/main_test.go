package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/pgidem/idem/outbox"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// setup marks the test parallel and returns a context, the pool of the
// throwaway database, a scope and a destination no other test uses. Relays
// in the tests deliver only their test's destination, since every test
// shares one outbox table.
func setup(t *testing.T) (ctx context.Context, pool *pgxpool.Pool, scope, dest string) {
	t.Helper()
	t.Parallel()
	pool = env.Pool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx, pool, testdb.Name("s"), testdb.Name("dest")
}

// testLogger shows the relay's warnings and errors in the test's output.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// enqueue commits one transaction per entry and returns the ids in order.
func enqueue(t *testing.T, ctx context.Context, pool *pgxpool.Pool, entries ...outbox.Entry) []int64 {
	t.Helper()
	ids := make([]int64, len(entries))
	for i, e := range entries {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			ids[i], err = outbox.Enqueue(ctx, tx, e)
			return err
		})
		if err != nil {
			t.Fatalf("enqueue %+v: %v", e, err)
		}
	}
	return ids
}

// entries returns n entries for dest, with keys k0, k1, ... and payloads
// naming them.
func entries(scope, dest string, n int) []outbox.Entry {
	out := make([]outbox.Entry, n)
	for i := range out {
		key := fmt.Sprintf("k%d", i)
		out[i] = outbox.Entry{Scope: scope, Key: key, Destination: dest, Payload: []byte("payload of " + key)}
	}
	return out
}

// startRelay builds a relay with config, shortens its background intervals
// (maintenance, probe wait, probe retry) when given, and runs it until the
// returned stop is called or the test ends. stop checks that Run returned
// nil.
func startRelay(t *testing.T, ctx context.Context, db idem.TxBeginner, handler outbox.Handler, config outbox.Config, intervals ...time.Duration) (stop func()) {
	t.Helper()
	if config.Logger == nil {
		config.Logger = testLogger(t)
	}
	listenDirectly(t, db, &config)
	relay, err := outbox.NewRelay(db, handler, &config)
	if err != nil {
		t.Fatal(err)
	}
	if len(intervals) == 3 {
		outbox.SetIntervals(relay, intervals[0], intervals[1], intervals[2])
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// directListen returns the connection settings a relay in the tests
// listens for notifications with: the throwaway database reached directly,
// not through the transaction pooler the tests may run behind
// (TEST_PGBOUNCER=1), as docs/pgbouncer.md advises.
func directListen(t *testing.T) *pgx.ConnConfig {
	t.Helper()
	return env.DirectPool(t).Config().ConnConfig
}

// listenDirectly gives a relay on a pool, when the tests run behind a
// transaction pooler, the direct connection to listen on that production
// gives it (docs/pgbouncer.md), unless config names one
// already. A relay that listened through the pooler would leave LISTEN on
// the pooler's server connections, whose notifications then reach clients
// that did not ask for them, and PgBouncer 1.18 exits when one arrives on
// a server connection that it is cancelling a query on.
func listenDirectly(t *testing.T, db idem.TxBeginner, config *outbox.Config) {
	t.Helper()
	if _, ok := db.(*pgxpool.Pool); ok && config.ListenConnConfig == nil && testdb.BehindPooler() {
		config.ListenConnConfig = directListen(t)
	}
}

// waitFor polls cond until it holds, or fails the test after a minute.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitWithin polls cond until it holds, or fails the test after limit: for
// conditions that a working relay meets at once, so that a broken one
// fails the test quickly.
func waitWithin(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s not done within %s", what, limit)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// calls counts a handler's calls per message.
type calls struct {
	mu    sync.Mutex
	byID  map[int64]int
	times map[int64][]time.Time
}

func newCalls() *calls {
	return &calls{byID: map[int64]int{}, times: map[int64][]time.Time{}}
}

func (c *calls) add(msg outbox.Message) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.byID[msg.ID]++
	c.times[msg.ID] = append(c.times[msg.ID], time.Now())
	return c.byID[msg.ID]
}

func (c *calls) count(id int64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byID[id]
}

// row is a message's bookkeeping, read straight from the table.
type row struct {
	ID             int64
	State          string
	Attempts       int32
	IdempotencyKey string
	Leased         bool
	LastError      string
}

func rows(t *testing.T, pool *pgxpool.Pool, dest string) []row {
	t.Helper()
	rs, err := pool.Query(context.Background(), `
		SELECT id, state, attempts, idempotency_key, leased_until IS NOT NULL, coalesce(last_error, '')
		FROM outbox_message WHERE destination = $1 ORDER BY id`, dest)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rs, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// countState counts dest's messages in state.
func countState(t *testing.T, pool *pgxpool.Pool, dest, state string) int {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(),
		`SELECT count(*) FROM outbox_message WHERE destination = $1 AND state = $2`, dest, state).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// crashable is a relay's database that dies on demand, as the relay's
// process would: once crashed, nothing more the relay sends reaches the
// database, so whatever it leased stays leased.
type crashable struct {
	pool *pgxpool.Pool
	dead atomic.Bool
}

var errCrashed = errors.New("the relay's process has crashed")

func (c *crashable) BeginTx(ctx context.Context, o pgx.TxOptions) (pgx.Tx, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.pool.BeginTx(ctx, o)
}

// panicTx is a transaction that fails the test on any use: passing it proves
// that a call was rejected before it reached the database.
type panicTx struct{ pgx.Tx }

var countPayments = testdb.CountPayments

// enqueueAndAwait enqueues each entry in a transaction of its own that
// notifies the relays, and waits up to timeout for delivered to report it
// before the next; why says what a missing delivery means.
func enqueueAndAwait(t *testing.T, ctx context.Context, pool *pgxpool.Pool, delivered <-chan string, all []outbox.Entry, timeout time.Duration, why string) {
	t.Helper()
	for _, e := range all {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := outbox.Enqueue(ctx, tx, e); err != nil {
				return err
			}
			return outbox.Notify(ctx, tx)
		})
		if err != nil {
			t.Fatal(err)
		}
		select {
		case key := <-delivered:
			if key != e.Key {
				t.Fatalf("delivered %s, want %s", key, e.Key)
			}
		case <-time.After(timeout):
			t.Fatalf("%s not delivered: %s", e.Key, why)
		}
	}
}

// migratedDatabase returns a pool, through the pooler, on a database of the
// test's own with idem's migrations applied, closed and dropped when the
// test ends.
func migratedDatabase(t *testing.T, ctx context.Context) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(ctx, env.EmptyDatabase(t)) // dropped after the pool closed
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		t.Fatal(err)
	}
	return pool
}
