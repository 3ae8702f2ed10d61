// This file is written by hand, not generated: it sends the claim's and the
// record's statements through pgconn, beneath pgx's batches, as statements
// prepared once per connection with their arguments encoded in place. It is
// the same SQL as sqlc's; what it saves is pgx's bookkeeping per queued
// statement, most of a call's allocations.

package dbsqlc

import (
	"context"
	"encoding/binary"
	"errors"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The statements Wire sends, by index.
const (
	wireKeyLock = iota
	wireKeyGet
	wireKeyInsert
	wireKeyReplace
	wireKeyStoreResponse
	wireStatements
)

var wireSQL = [wireStatements]string{keyLock, keyGet, keyInsert, keyReplace, keyStoreResponse}

// wireNames are the names the statements are prepared under: a
// connection's own statement cache (pgx's) names its statements by a hash
// of their text, so these cannot collide with them.
var wireNames = [wireStatements]string{
	"idem_key_lock_3", "idem_key_get_2", "idem_key_insert_2", "idem_key_replace_2", "idem_key_store_response_1",
}

// Formats: every argument and every result column is sent in binary, but
// text arguments, which are sent as their bytes (text's binary form).
var (
	formatsBinary = []int16{1}
	// KeyLock: full_since timestamptz[], scope text, key text, lock_id int8.
	formatsKeyLock = []int16{1, 0, 0, 1}
	// KeyGet: scope, key.
	formatsKeyGet = []int16{0, 0}
	// KeyInsert, KeyReplace: lock_timeout text, scope, key, fingerprint
	// bytea, response text, retention interval.
	formatsKeyInsert = []int16{0, 0, 0, 1, 0, 1}
	// KeyStoreResponse: response, scope, key.
	formatsKeyStore = []int16{0, 0, 0}
)

// Wire sends statements on one connection's pgconn. It lives in the
// connection's CustomData, with the statements it prepared there.
type Wire struct {
	pc *pgconn.PgConn
	sd [wireStatements]*pgconn.StatementDescription
	// batch, a and args are reused for each round trip (see reuseBatch).
	batch pgconn.Batch
	a     args
	args  [][]byte
}

// newBatch returns the batch to fill for a round trip: w's own, emptied,
// or a new one.
func (w *Wire) newBatch() *pgconn.Batch {
	if reuseBatch(&w.batch) {
		return &w.batch
	}
	return &pgconn.Batch{}
}

const wireKey = "idem.wire"

// BelowPgx switches the layers below pgx on (Wire, SendFlat), for the
// benchmark that measures them against pgx's own batches
// (lab/bench, BenchmarkLayersBelowPgx). It is on unless switched off.
var BelowPgx atomic.Bool

func init() { BelowPgx.Store(true) }

// WireFor returns conn's Wire, preparing its statements on first use, when
// conn runs its queries the way Wire does: pgx's default execution mode,
// statements prepared and cached on the connection, and no tracer to tell.
// Otherwise ok is false, and the caller sends through pgx.
func WireFor(ctx context.Context, conn *pgx.Conn) (w *Wire, ok bool, err error) {
	if conn == nil || !BelowPgx.Load() {
		return nil, false, nil
	}
	pc := conn.PgConn()
	data := pc.CustomData()
	if data == nil {
		return nil, false, nil
	}
	// A nil *Wire records a connection Wire cannot use: its configuration
	// does not change, and reading it copies it.
	if w, ok := data[wireKey].(*Wire); ok {
		return w, w != nil, nil
	}
	cfg := conn.Config()
	if cfg.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement || cfg.Tracer != nil {
		data[wireKey] = (*Wire)(nil)
		return nil, false, nil
	}
	w = &Wire{pc: pc}
	for i, sql := range wireSQL {
		sd, err := prepare(ctx, pc, wireNames[i], sql)
		if err != nil {
			return nil, false, err
		}
		w.sd[i] = sd
	}
	data[wireKey] = w
	return w, true, nil
}

// prepare prepares sql as name on pc. A statement of that name may be
// there already: one prepared before a failure stopped WireFor half-way,
// or one made stale by a change to the table (see forget). It is
// deallocated and prepared again.
func prepare(ctx context.Context, pc *pgconn.PgConn, name, sql string) (*pgconn.StatementDescription, error) {
	sd, err := pc.Prepare(ctx, name, sql, nil)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P05" {
		if err := pc.Deallocate(ctx, name); err != nil {
			return nil, err
		}
		sd, err = pc.Prepare(ctx, name, sql, nil)
	}
	return sd, err
}

// forget drops conn's Wire when err says its prepared statements are gone
// or stale (DISCARD ALL, DEALLOCATE, a change to the table), so that the
// next call prepares them again.
func (w *Wire) forget(err error) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "0A000") {
		delete(w.pc.CustomData(), wireKey)
	}
}

// args encodes a statement's arguments into one buffer, reused from call
// to call: text as its bytes, the rest in binary.
type args struct {
	buf  []byte
	ends [8]int
	null [8]bool
	n    int
}

func (a *args) reset() { a.buf, a.n = a.buf[:0], 0 }

func (a *args) end(null bool) {
	a.ends[a.n], a.null[a.n] = len(a.buf), null
	a.n++
}

func (a *args) text(s string) { a.buf = append(a.buf, s...); a.end(false) }

func (a *args) bytea(b []byte) { a.buf = append(a.buf, b...); a.end(false) }

func (a *args) int8(v int64) {
	a.buf = binary.BigEndian.AppendUint64(a.buf, uint64(v))
	a.end(false)
}

func (a *args) nullableText(t pgtype.Text) {
	if !t.Valid {
		a.end(true)
		return
	}
	a.text(t.String)
}

// timestamptzOID is the type of an array's elements, in its binary form.
const timestamptzOID = 1184

// timestamptzArray encodes ts as a one-dimensional timestamptz[] (an empty
// one has no dimension), in PostgreSQL's binary form of arrays: the number
// of dimensions, whether there are NULLs, the elements' type, each
// dimension's length and lower bound, then each element's length and value.
func (a *args) timestamptzArray(ts []pgtype.Timestamptz) {
	be := binary.BigEndian
	if len(ts) == 0 {
		a.buf = be.AppendUint32(a.buf, 0)
		a.buf = be.AppendUint32(a.buf, 0)
		a.buf = be.AppendUint32(a.buf, timestamptzOID)
		a.end(false)
		return
	}
	a.buf = be.AppendUint32(a.buf, 1)
	a.buf = be.AppendUint32(a.buf, 0)
	a.buf = be.AppendUint32(a.buf, timestamptzOID)
	a.buf = be.AppendUint32(a.buf, uint32(len(ts)))
	a.buf = be.AppendUint32(a.buf, 1)
	for _, t := range ts {
		a.buf = be.AppendUint32(a.buf, 8)
		a.buf = be.AppendUint64(a.buf, uint64(timestamptzMicros(t)))
	}
	a.end(false)
}

// timestamptzMicros is t in PostgreSQL's binary form: microseconds since
// postgresEpochMicros, infinities at the ends of int64.
func timestamptzMicros(t pgtype.Timestamptz) int64 {
	switch t.InfinityModifier {
	case pgtype.NegativeInfinity:
		return -1 << 63
	case pgtype.Infinity:
		return 1<<63 - 1
	}
	return t.Time.UnixMicro() - postgresEpochMicros
}

// postgresEpochMicros is 2000-01-01 UTC, where PostgreSQL's timestamps
// count from, in Unix microseconds.
const postgresEpochMicros = 946684800000000

func (a *args) interval(iv pgtype.Interval) {
	a.buf = binary.BigEndian.AppendUint64(a.buf, uint64(iv.Microseconds))
	a.buf = binary.BigEndian.AppendUint32(a.buf, uint32(iv.Days))
	a.buf = binary.BigEndian.AppendUint32(a.buf, uint32(iv.Months))
	a.end(false)
}

// values appends the arguments to dst, each sliced from the buffer (nil
// for NULL), once the buffer no longer grows.
func (a *args) values(dst [][]byte) [][]byte {
	start := 0
	for i := range a.n {
		end := a.ends[i]
		if a.null[i] {
			dst = append(dst, nil)
		} else {
			dst = append(dst, a.buf[start:end:end])
		}
		start = end
	}
	return dst
}

// Claim is what the claim's round trip read: KeyLock's row, and KeyGet's
// row when found.
type Claim struct {
	Lock  KeyLockRow
	Rec   KeyGetRow
	Found bool
}

// Claim sends, in one round trip, begin (when not empty: the statement
// that begins Run's transaction), KeyLock and KeyGet, and reads their
// results into c.
func (w *Wire) Claim(ctx context.Context, begin string, lock KeyLockParams, c *Claim) error {
	b := w.newBatch()
	if begin != "" {
		b.ExecParams(begin, nil, nil, nil, nil)
	}
	w.reset()
	w.a.timestamptzArray(lock.FullSince)
	w.a.text(lock.Scope)
	w.a.text(lock.Key)
	w.a.int8(lock.LockID)
	w.a.text(lock.Scope)
	w.a.text(lock.Key)
	w.args = w.a.values(w.args)
	b.ExecStatement(w.sd[wireKeyLock], w.args[0:4], formatsKeyLock, formatsBinary)
	b.ExecStatement(w.sd[wireKeyGet], w.args[4:6], formatsKeyGet, formatsBinary)

	mrr := w.pc.ExecBatch(ctx, b)
	if begin != "" && mrr.NextResult() {
		_, _ = mrr.ResultReader().Close()
	}
	c.Found = false
	var decodeErr error
	if mrr.NextResult() {
		rr := mrr.ResultReader()
		for rr.NextRow() {
			decodeErr = errors.Join(decodeErr, decodeKeyLock(rr.Values(), &c.Lock))
		}
		_, _ = rr.Close()
	}
	if mrr.NextResult() {
		rr := mrr.ResultReader()
		for rr.NextRow() {
			c.Found = true
			decodeErr = errors.Join(decodeErr, decodeKeyGet(rr.Values(), &c.Rec))
		}
		_, _ = rr.Close()
	}
	err := mrr.Close()
	if err != nil {
		w.forget(err)
		return err
	}
	return decodeErr
}

func (w *Wire) reset() {
	w.a.reset()
	w.args = w.args[:0]
}

// Store sends, in one round trip, the statement that records the operation
// (KeyInsert, KeyReplace or KeyStoreResponse, as st says), then commit
// when it is not empty, and returns COMMIT's tag and each one's error.
func (w *Wire) Store(ctx context.Context, st StoreKind, arg KeyInsertParams, commit string) (tag pgconn.CommandTag, storeErr, commitErr error) {
	b := w.newBatch()
	w.reset()
	if st == StoreResponse {
		w.a.nullableText(arg.Response)
		w.a.text(arg.Scope)
		w.a.text(arg.Key)
		w.args = w.a.values(w.args)
		b.ExecStatement(w.sd[wireKeyStoreResponse], w.args, formatsKeyStore, formatsBinary)
	} else {
		w.a.text(arg.LockTimeout)
		w.a.text(arg.Scope)
		w.a.text(arg.Key)
		w.a.bytea(arg.Fingerprint)
		w.a.nullableText(arg.Response)
		w.a.interval(arg.Retention)
		w.args = w.a.values(w.args)
		sd := w.sd[wireKeyInsert]
		if st == StoreReplace {
			sd = w.sd[wireKeyReplace]
		}
		b.ExecStatement(sd, w.args, formatsKeyInsert, formatsBinary)
	}
	if commit != "" {
		b.ExecParams(commit, nil, nil, nil, nil)
	}
	mrr := w.pc.ExecBatch(ctx, b)
	// A statement that fails before it has a result ends the batch's
	// results (NextResult is false) and leaves its error to Close: it is
	// the store's until the store's result has been read.
	stored := false
	if mrr.NextResult() {
		_, storeErr = mrr.ResultReader().Close()
		stored = storeErr == nil
	}
	if commit != "" && stored && mrr.NextResult() {
		tag, commitErr = mrr.ResultReader().Close()
	}
	if err := mrr.Close(); err != nil && storeErr == nil && commitErr == nil {
		if stored {
			commitErr = err
		} else {
			storeErr = err
		}
	}
	if storeErr != nil {
		w.forget(storeErr)
	}
	return tag, storeErr, commitErr
}

// StoreKind is which statement records an operation.
type StoreKind int

const (
	StoreInsert   StoreKind = iota // KeyInsert
	StoreReplace                   // KeyReplace
	StoreResponse                  // KeyStoreResponse
)

var errWireColumns = errors.New("dbsqlc: unexpected columns in a result")

func decodeKeyLock(v [][]byte, row *KeyLockRow) error {
	if len(v) != 5 || len(v[0]) != 4 || len(v[1]) != 8 || len(v[2]) != 1 || len(v[3]) != 1 || len(v[4]) != 1 {
		return errWireColumns
	}
	row.Lock = int32(binary.BigEndian.Uint32(v[0]))
	row.TxStart = decodeTimestamptz(v[1])
	row.ReadCommitted = v[2][0] != 0
	row.ReadOnly = v[3][0] != 0
	row.Citus = v[4][0] != 0
	return nil
}

func decodeTimestamptz(v []byte) pgtype.Timestamptz {
	micros := int64(binary.BigEndian.Uint64(v))
	switch micros {
	case -1 << 63:
		return pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	case 1<<63 - 1:
		return pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true}
	}
	return pgtype.Timestamptz{Time: time.UnixMicro(micros + postgresEpochMicros), Valid: true}
}

// KeyGet's row: fingerprint bytea, state text, response jsonb (binary:
// a version byte, then the text), expired bool, standby_wait bool.
func decodeKeyGet(v [][]byte, row *KeyGetRow) error {
	if len(v) != 5 || v[0] == nil || v[1] == nil || len(v[3]) != 1 || len(v[4]) != 1 {
		return errWireColumns
	}
	row.Fingerprint = append(row.Fingerprint[:0], v[0]...)
	row.State = internState(v[1])
	row.Response = nil
	if v[2] != nil {
		if len(v[2]) == 0 || v[2][0] != 1 {
			return errWireColumns
		}
		row.Response = append([]byte(nil), v[2][1:]...)
	}
	row.Expired = v[3][0] != 0
	row.StandbyWait = v[4][0] != 0
	return nil
}

// internState returns the record's state without allocating for the two
// states there are.
func internState(b []byte) string {
	switch string(b) {
	case "done":
		return "done"
	case "in_progress":
		return "in_progress"
	}
	return string(b)
}
