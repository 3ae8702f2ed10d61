package idem

import (
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// What idem keeps on a connection, in pgconn's CustomData, between the
// statements of one transaction: the key locks it holds, and the keys
// whose functions are running on it. A connection serves one goroutine at
// a time, so neither needs a lock.

// heldKey is where a connection keeps its count of the key locks its
// current transaction holds, in pgconn's CustomData.
const heldKey = "idem.held"

// held counts the key locks of one transaction: the one that started at
// since (its now()). The count only grows until the transaction ends:
// locks that a ROLLBACK TO SAVEPOINT released are still counted, which
// errs on the side of fewer locks.
type held struct {
	since time.Time
	n     int
}

// heldLocks returns conn's count, or a count of its own for a connection
// that keeps none.
func heldLocks(conn *pgx.Conn) *held {
	if conn == nil || conn.PgConn().CustomData() == nil {
		return &held{}
	}
	data := conn.PgConn().CustomData()
	h, ok := data[heldKey].(*held)
	if !ok {
		h = &held{}
		data[heldKey] = h
	}
	return h
}

// fullSince is KeyLock's @full_since: the start of the transaction whose
// count is full, or a time no transaction starts at.
func (h *held) fullSince() pgtype.Timestamptz {
	if h.n < MaxKeyLocks {
		return pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	}
	return pgtype.Timestamptz{Time: h.since, Valid: true}
}

// count adds what KeyLock did to the count of its transaction. A lock that
// was busy is counted too: the claim waits for it, and then holds it.
func (h *held) count(lock dbsqlc.KeyLockRow) {
	if !lock.TxStart.Time.Equal(h.since) {
		h.since, h.n = lock.TxStart.Time, 0
	}
	if lock.Lock != lockSkipped {
		h.n++
	}
}

// runningKey is where a connection keeps the keys whose functions are
// running on it, in pgconn's CustomData: a connection serves one goroutine
// at a time, and a function runs inside its call, so the list is exact, and
// it goes with the connection.
const runningKey = "idem.running"

// runningKeys is the list kept under runningKey.
type runningKeys struct{ keys []keyRef }

func runningOn(c *pgx.Conn, create bool) *runningKeys {
	if c == nil || c.PgConn().CustomData() == nil {
		return nil
	}
	data := c.PgConn().CustomData()
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
	r := runningOn(tx.Conn(), false)
	return r != nil && slices.ContainsFunc(r.keys, k.same)
}

// enter records that k's function runs on tx's connection, until leave is
// called with what enter returned.
func enter(tx pgx.Tx, k keyRef) *runningKeys {
	r := runningOn(tx.Conn(), true)
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
