package idem

import (
	"context"
	"errors"
	"hash/fnv"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// What idem keeps on a connection, in pgconn's CustomData, between the
// statements of one transaction: the key locks it holds, and the keys
// whose functions are running on it. A connection serves one goroutine at
// a time, so neither needs a lock.

// heldKey is where a connection keeps its count of the key locks its
// current transaction holds, in pgconn's CustomData.
const heldKey = "idem.held"

// held counts the key locks of one transaction, by the start of the
// transaction that took them (KeyLock's tx_start, its now()). On
// PostgreSQL there is one start, and another one is a new transaction,
// which starts its count again. On a Citus coordinator, KeyLock runs on the
// worker of the scope's shard, and each worker's part of the distributed
// transaction has a start of its own: the transaction has a count per
// worker, each bounding the locks in that worker's lock table (a count of
// a transaction that ended is never matched again, and is dropped when
// maxCounts newer ones are kept). A count only grows until its
// transaction ends: locks that a ROLLBACK TO SAVEPOINT released are still
// counted, which errs on the side of fewer locks.
type held struct {
	counts []lockCount
	// tx is the transaction whose claims were counted last: until
	// KeyLock reads the start of the next transaction on the connection,
	// the count is the previous one's (see of).
	tx pgx.Tx
	// full is fullSince's answer, its slice reused from call to call.
	full []pgtype.Timestamptz
	// clock orders the counts by their last use, for the one to drop.
	clock uint64
}

// lockCount is the number of key locks taken in the transaction, or the
// worker's part of it, that started at since.
type lockCount struct {
	since time.Time
	n     int
	used  uint64
}

// maxCounts is the most counts a connection keeps: the workers one Citus
// transaction claims keys on, beyond which the least recently used count
// starts again.
const maxCounts = 16

// txData is a pgx.Tx with no *pgx.Conn under it (idemsql's, over
// database/sql) that keeps, for its own transaction, what idem keeps on a
// connection.
type txData interface{ IdemData() map[string]any }

// stateOf returns where idem keeps its state for tx's transaction: the
// connection's CustomData, or, with conn nil, the map tx keeps itself, if
// it keeps one.
func stateOf(tx pgx.Tx, conn *pgx.Conn) map[string]any {
	if conn != nil {
		return conn.PgConn().CustomData()
	}
	if d, ok := tx.(txData); ok {
		return d.IdemData()
	}
	return nil
}

// heldLocks returns the count kept in data, or a count of its own when
// there is no data to keep it in.
func heldLocks(data map[string]any) *held {
	if data == nil {
		return &held{}
	}
	h, ok := data[heldKey].(*held)
	if !ok {
		h = &held{}
		data[heldKey] = h
	}
	return h
}

// fullSince is KeyLock's @full_since: the starts whose counts are full,
// none (empty) when no count is. The slice is reused by the next call.
func (h *held) fullSince() []pgtype.Timestamptz {
	h.full = h.full[:0]
	for _, c := range h.counts {
		if c.n >= MaxKeyLocks {
			h.full = append(h.full, pgtype.Timestamptz{Time: c.since, Valid: true})
		}
	}
	return h.full
}

// of reports whether the count is tx's own before KeyLock has read its
// transaction's start: a count kept per transaction (conn nil, idemsql's)
// always is; a connection's is when its last claim came through the same
// pgx.Tx. A count left from the connection's previous transaction would
// otherwise send KeyClaimIfFull, whose INSERT a read-only transaction
// refuses even where it would write nothing. A caller that wraps one
// transaction in a new pgx.Tx for each call gets the claim's round trip
// of its own past MaxKeyLocks (KeyLock skips the lock all the same).
func (h *held) of(tx pgx.Tx, conn *pgx.Conn) bool {
	if conn == nil {
		return true
	}
	// Interfaces compare their dynamic types first; == panics only on
	// two values of one type that is not comparable.
	return h.tx != nil && tx != nil && reflect.TypeOf(tx).Comparable() && h.tx == tx
}

// count adds what KeyLock did to the count of its start, in tx, on a
// database that has Citus when citus is set. A lock that was busy is
// counted too: the claim waits for it, and then holds it.
func (h *held) count(lock dbsqlc.KeyLockRow, tx pgx.Tx, citus bool) {
	h.tx = tx
	i := slices.IndexFunc(h.counts, func(c lockCount) bool { return c.since.Equal(lock.TxStart.Time) })
	if i < 0 {
		switch {
		case !citus:
			// One server: another start is another transaction.
			h.counts = h.counts[:0]
		case len(h.counts) >= maxCounts:
			oldest := 0
			for j, c := range h.counts {
				if c.used < h.counts[oldest].used {
					oldest = j
				}
			}
			h.counts = slices.Delete(h.counts, oldest, oldest+1)
		}
		h.counts = append(h.counts, lockCount{since: lock.TxStart.Time})
		i = len(h.counts) - 1
	}
	h.clock++
	h.counts[i].used = h.clock
	if lock.Lock != lockSkipped {
		h.counts[i].n++
	}
}

// runningKey is where a connection keeps the keys whose functions are
// running on it, in pgconn's CustomData: a connection serves one goroutine
// at a time, and a function runs inside its call, so the list is exact, and
// it goes with the connection.
const runningKey = "idem.running"

// runningKeys is the list kept under runningKey.
type runningKeys struct{ keys []keyRef }

func runningOn(data map[string]any, create bool) *runningKeys {
	if data == nil {
		return nil
	}
	r, _ := data[runningKey].(*runningKeys)
	if r == nil && create {
		r = &runningKeys{}
		data[runningKey] = r
	}
	return r
}

// running reports whether k's function is running on tx's connection: a
// nested call on the same key.
func running(tx pgx.Tx, k keyRef) bool {
	r := runningOn(stateOf(tx, tx.Conn()), false)
	return r != nil && slices.ContainsFunc(r.keys, k.same)
}

// enter records that k's function runs on tx's connection, until leave is
// called with what enter returned.
func enter(tx pgx.Tx, k keyRef) *runningKeys {
	r := runningOn(stateOf(tx, tx.Conn()), true)
	if r != nil {
		r.keys = append(r.keys, k)
	}
	return r
}

func (r *runningKeys) leave(k keyRef) {
	if r == nil {
		return
	}
	if i := slices.IndexFunc(r.keys, k.same); i >= 0 {
		r.keys = slices.Delete(r.keys, i, i+1)
	}
}

// citusKey is where a connection keeps whether its database has Citus, in
// pgconn's CustomData, as its last claim's KeyLock read it (or OnceEach's
// CitusInstalled): a statement that waits for a key's record then takes
// its wait budget from KeyWaitBudgetCitus (see queueWaiting).
const citusKey = "idem.citus"

// citusOf reports what data says of whether the database has Citus;
// known is false before a claim read it.
func citusOf(data map[string]any) (citus, known bool) {
	citus, known = data[citusKey].(bool)
	return citus, known
}

// setCitus records in data whether the database has Citus.
func setCitus(data map[string]any, citus bool) {
	if data != nil {
		data[citusKey] = citus
	}
}

// namedStatements is the pgx.QueryRewriter of the statements that a
// round trip may fail on purpose (the claim's: see flow_claim.go), given
// as their first argument. In pgx's default exec mode (cache_statement),
// pgx drops every statement of a batch that failed from its statement
// cache, and prepares it again, after deallocating it, the next time it
// is sent: two round trips more for whatever next uses the connection,
// after each replay. So there they are prepared once per connection under
// names of idem's (conn.Prepare, a round trip the first time, a lookup in
// pgx's map after) and sent by name, which pgx's cache leaves alone. In
// the other modes, which prepare nothing or behind a pooler must not,
// they are sent as they are.
type namedStatements struct{}

func (namedStatements) RewriteQuery(ctx context.Context, conn *pgx.Conn, sql string, args []any) (string, []any, error) {
	if conn.Config().DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		return sql, args, nil
	}
	name := statementName(sql)
	_, err := conn.Prepare(ctx, name, sql)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P05" {
		// The session has a statement of that name that pgx does not know
		// of (one a pooler's earlier client left there): replaced.
		if err = conn.Deallocate(ctx, name); err == nil {
			_, err = conn.Prepare(ctx, name, sql)
		}
	}
	if err != nil {
		return "", nil, err
	}
	return name, args, nil
}

// namedFor returns namedStatements for a pool or connection of pgx's,
// whose batches take it, and nil for any other TxBeginner.
func namedFor(db TxBeginner) pgx.QueryRewriter {
	switch db.(type) {
	case *pgxpool.Pool, *pgxpool.Conn, *pgx.Conn:
		return namedStatements{}
	}
	return nil
}

// statementNames are the names namedStatements gives statements, by
// their SQL.
var statementNames sync.Map

// statementName returns the name namedStatements prepares sql under.
func statementName(sql string) string {
	if name, ok := statementNames.Load(sql); ok {
		return name.(string)
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(sql))
	name := "idem_" + strconv.FormatUint(h.Sum64(), 36)
	statementNames.Store(sql, name)
	return name
}

// forgetNamed drops the statements namedStatements prepared on conn when
// err says that one of them is stale (a table it reads changed since, or
// a pooler or a DEALLOCATE behind pgx's back dropped it), so that they
// are prepared again the next time they are sent.
func forgetNamed(conn *pgx.Conn, err error) {
	var pgErr *pgconn.PgError
	if conn == nil || !errors.As(err, &pgErr) || (pgErr.Code != "0A000" && pgErr.Code != "26000") ||
		conn.PgConn().TxStatus() != 'I' {
		return
	}
	ctx, cancel := cleanupContext(context.Background())
	defer cancel()
	statementNames.Range(func(_, name any) bool {
		return conn.Deallocate(ctx, name.(string)) == nil
	})
}
