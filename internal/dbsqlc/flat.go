// This file is written by hand, not generated: it sends a pgx.Batch of
// sqlc's statements through pgconn's batch, beneath pgx's, as statements
// prepared once per connection. pgx sends a batch in pipeline mode, whose
// bookkeeping (a list element, and boxed values, for each request and
// each statement) is most of what a flow's round trip allocates; pgconn's
// batch does without it, and sends the same messages: Bind and Execute
// for each statement, then one Sync, in one round trip.

package dbsqlc

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// flat is what SendFlat keeps on a connection, in its CustomData: the
// statements it prepared there, by their SQL, and what it reuses from one
// round trip to the next.
type flat struct {
	pc    *pgconn.PgConn
	stmts map[string]*flatStmt
	// foreign is the SQL of the statements SendFlatOpen prepared for its
	// caller (see maxForeign), in stmts or not (forget drops them from
	// stmts, not from the server): each is prepared under a name of its
	// SQL's, so the server holds at most these.
	foreign map[string]struct{}
	// gen counts SendFlatOpen's round trips: an Open's rows and row are
	// of one of them.
	gen     uint64
	batch   pgconn.Batch
	eqb     pgx.ExtendedQueryBuilder
	params  flatParams
	results flatResults
	open    Open
	missing []string
}

// flatStmt is a statement prepared on the connection, with the formats of
// its result columns, which are the same each time.
type flatStmt struct {
	sd            *pgconn.StatementDescription
	resultFormats []int16
}

const flatKey = "idem.flat"

// flatFor returns conn's flat, when conn runs its statements the way
// SendFlat does (pgx's default execution mode, statements prepared and
// cached on the connection) and traces no batch, which pgx's batch would
// tell a BatchTracer about; otherwise nil.
func flatFor(conn *pgx.Conn) *flat {
	pc := conn.PgConn()
	data := pc.CustomData()
	if data == nil {
		return nil
	}
	// A nil *flat records a connection SendFlat cannot use: its
	// configuration does not change.
	if f, ok := data[flatKey].(*flat); ok {
		return f
	}
	cfg := conn.Config()
	if _, traced := cfg.Tracer.(pgx.BatchTracer); traced || cfg.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		data[flatKey] = (*flat)(nil)
		return nil
	}
	f := &flat{pc: pc, stmts: make(map[string]*flatStmt)}
	data[flatKey] = f
	return f
}

// CanSendFlat reports whether SendFlat sends batches on conn (see
// flatFor).
func CanSendFlat(conn *pgx.Conn) bool { return flatFor(conn) != nil }

// CanBeginLate reports whether a batch sent on conn may begin its
// transaction after other statements, which then run in it (the round
// trip's implicit transaction, which BEGIN makes explicit): a plain
// BEGIN, or one at the isolation level that the session's transactions
// have anyway. It is true until BeganTooLate says otherwise.
func CanBeginLate(conn *pgx.Conn) bool {
	data := conn.PgConn().CustomData()
	return data != nil && data[beginFirstKey] == nil
}

const beginFirstKey = "idem.beginFirst"

// BeganTooLate reports whether err is that of a BEGIN sent after other
// statements at an isolation level other than the session's (25001,
// "SET TRANSACTION ISOLATION LEVEL must be called before any query"), and
// if so notes that batches on conn begin first from now on (CanBeginLate).
// Nothing of the round trip ran: the statements before it were in the
// round trip's implicit transaction, rolled back, and those after it were
// skipped.
func BeganTooLate(conn *pgx.Conn, err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25001" {
		return false
	}
	if data := conn.PgConn().CustomData(); data != nil {
		data[beginFirstKey] = true
	}
	return true
}

// SendFlat sends b on conn, as conn.SendBatch(ctx, b).Close() would, in
// one round trip (and one more the first time a statement is sent on the
// connection, to prepare it): the statements' callbacks (QueuedQuery's
// Exec, Query, QueryRow) are called as pgx calls them, and it returns the
// first error. When conn cannot send it so (see flatFor), or a statement
// has options (a QueryRewriter), sent is false and nothing was sent: send
// it through pgx. A batch that begins a transaction (Batch.BeginTx)
// begins it with its first statement, as any other, but nothing makes a
// pgx.Tx of it (see idem's sendBeginBatch).
func SendFlat(ctx context.Context, conn *pgx.Conn, b *pgx.Batch) (sent bool, err error) {
	f := flatFor(conn)
	if f == nil || len(b.QueuedQueries) == 0 || !BelowPgx.Load() {
		return false, nil
	}
	mrr, sent, err := f.send(ctx, conn, b, false)
	if !sent || err != nil {
		return sent, err
	}
	br := &f.results
	*br = flatResults{conn: conn, mrr: mrr, b: b}
	err = br.Close()
	*br = flatResults{}
	if err != nil {
		f.forget(err)
	}
	return true, err
}

// errBuild is the error of a statement whose arguments could not be
// encoded: nothing was sent.
var errBuild = errors.New("dbsqlc: build statement")

// send sends b on conn, its statements prepared first if they are not yet,
// and returns its results to read; sent is false, and nothing was sent,
// when a statement has options (a QueryRewriter), and err wraps errBuild
// when a statement's arguments could not be encoded. A last statement that
// is the caller's (foreignLast) has its arguments encoded by pgx, as pgx
// would encode them; flatParams only knows sqlc's.
func (f *flat) send(ctx context.Context, conn *pgx.Conn, b *pgx.Batch, foreignLast bool) (mrr *pgconn.MultiResultReader, sent bool, err error) {
	f.missing = f.missing[:0]
	for _, qq := range b.QueuedQueries {
		if len(qq.Arguments) > 0 {
			switch qq.Arguments[0].(type) {
			case pgx.QueryRewriter, pgx.QueryExecMode:
				return nil, false, nil
			}
		}
		if _, ok := f.stmts[qq.SQL]; !ok && !slices.Contains(f.missing, qq.SQL) {
			f.missing = append(f.missing, qq.SQL)
		}
	}
	if len(f.missing) > 0 {
		if err := f.prepare(ctx); err != nil {
			return nil, true, err
		}
	}
	batch := &f.batch
	if !reuseBatch(batch) {
		batch = &pgconn.Batch{}
	}
	typeMap := conn.TypeMap()
	for i, qq := range b.QueuedQueries {
		st := f.stmts[qq.SQL]
		if st.resultFormats == nil {
			st.resultFormats = make([]int16, len(st.sd.Fields))
			for i, fd := range st.sd.Fields {
				st.resultFormats[i] = typeMap.FormatCodeForOID(fd.DataTypeOID)
			}
		}
		if (!foreignLast || i < len(b.QueuedQueries)-1) && f.params.encode(st.sd, qq.Arguments) {
			batch.ExecStatement(st.sd, f.params.values, f.params.formats, st.resultFormats)
			continue
		}
		if err := f.eqb.Build(typeMap, st.sd, qq.Arguments); err != nil {
			return nil, true, fmt.Errorf("%w %q: %w", errBuild, firstLine(qq.SQL), err)
		}
		batch.ExecStatement(st.sd, f.eqb.ParamValues, f.eqb.ParamFormats, st.resultFormats)
	}
	return f.pc.ExecBatch(ctx, batch), true, nil
}

// prepare prepares the statements f.missing names, in one round trip
// (pipelined), or one by one when that fails. Each is deallocated first
// (which is no error when it is not there): a statement forgotten because
// it went stale (forget) is still prepared on the server, and preparing it
// again under its name would fail, and with it the transaction the round
// trip may be in.
func (f *flat) prepare(ctx context.Context) error {
	p := f.pc.StartPipeline(ctx)
	for _, sql := range f.missing {
		p.SendDeallocate(flatName(sql))
		p.SendPrepare(flatName(sql), sql, nil)
	}
	err := p.Sync()
	sds := make([]*pgconn.StatementDescription, 0, len(f.missing))
	for range f.missing {
		if err != nil {
			break
		}
		if _, err = p.GetResults(); err != nil { // the deallocation
			break
		}
		var res any
		if res, err = p.GetResults(); err == nil {
			// The pipeline's description has the statement's parameters
			// and columns, not its name.
			got, ok := res.(*pgconn.StatementDescription)
			if !ok {
				err = fmt.Errorf("dbsqlc: a prepare's result is a %T", res)
				break
			}
			sql := f.missing[len(sds)]
			sds = append(sds, &pgconn.StatementDescription{Name: flatName(sql), SQL: sql, ParamOIDs: got.ParamOIDs, Fields: got.Fields})
		}
	}
	if err == nil {
		_, err = p.GetResults() // the Sync
	}
	if closeErr := p.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || f.pc.IsClosed() {
			return err
		}
		sds = sds[:0]
		for _, sql := range f.missing {
			sd, err := prepare(ctx, f.pc, flatName(sql), sql)
			if err != nil {
				return err
			}
			sds = append(sds, sd)
		}
	}
	for i, sql := range f.missing {
		f.stmts[sql] = &flatStmt{sd: sds[i]}
	}
	return nil
}

// flatName is the name sql is prepared under: a connection's own
// statement cache (pgx's) names its statements otherwise, and Wire's
// differently again.
func flatName(sql string) string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(sql))
	return "idem_flat_" + strconv.FormatUint(h.Sum64(), 16)
}

// forget drops the statements f prepared when err says that they are gone
// or stale (DISCARD ALL, DEALLOCATE, a change to a table), so that the
// next round trip prepares them again.
func (f *flat) forget(err error) {
	// Gone (26000), or stale and still prepared (0A000: prepare
	// deallocates each first): prepared again as they are sent.
	if staleness(err) != "" {
		clear(f.stmts)
	}
}

// staleness is the SQLSTATE of err when it says that prepared statements
// are gone (26000: DISCARD ALL, DEALLOCATE) or stale (0A000: a table
// changed under one), else "".
func staleness(err error) string {
	if err == nil {
		return ""
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "0A000") {
		return pgErr.Code
	}
	return ""
}

func firstLine(sql string) string {
	for i := range len(sql) {
		if sql[i] == '\n' {
			return sql[:i]
		}
	}
	return sql
}

// flatResults reads a flat batch's results, as pgx's own BatchResults read
// a batch sent with pgconn's (pgx's QueryExecModeExec): its callbacks get
// it.
type flatResults struct {
	conn   *pgx.Conn
	mrr    *pgconn.MultiResultReader
	b      *pgx.Batch
	next   int
	err    error
	closed bool
	// row is the last statement's row (QueryRow), reused.
	row flatRow
}

var errNoMoreResults = errors.New("no more results in batch")

func (br *flatResults) Exec() (pgconn.CommandTag, error) {
	if br.err != nil {
		return pgconn.CommandTag{}, br.err
	}
	if br.closed {
		return pgconn.CommandTag{}, errors.New("batch already closed")
	}
	br.next++
	if !br.mrr.NextResult() {
		// The round trip's error (one that ended its results: a
		// statement of no callback's, SendFlatOpen's loop or Close,
		// stops at it), or none left.
		br.err = br.mrr.Close()
		if br.err == nil {
			br.err = errNoMoreResults
		}
		return pgconn.CommandTag{}, br.err
	}
	tag, err := br.mrr.ResultReader().Close()
	if err != nil {
		br.err = err
		_ = br.mrr.Close()
	}
	return tag, br.err
}

func (br *flatResults) Query() (pgx.Rows, error) {
	if br.err != nil {
		return &errRows{err: br.err}, br.err
	}
	if br.closed {
		err := errors.New("batch already closed")
		return &errRows{err: err}, err
	}
	br.next++
	if !br.mrr.NextResult() {
		err := br.mrr.Close()
		if err == nil {
			err = errNoMoreResults
		}
		return &errRows{err: err}, err
	}
	return pgx.RowsFromResultReader(br.conn.TypeMap(), br.mrr.ResultReader()), nil
}

// QueryRow reads the next statement's result as its row, which flatRow
// decodes itself, with conn's type map, as pgx's rows would.
func (br *flatResults) QueryRow() pgx.Row {
	br.row = flatRow{}
	switch {
	case br.err != nil:
		br.row.err = br.err
	case br.closed:
		br.row.err = errors.New("batch already closed")
	default:
		br.next++
		if !br.mrr.NextResult() {
			br.row.err = br.mrr.Close()
			if br.row.err == nil {
				br.row.err = errNoMoreResults
			}
			break
		}
		br.row.rr, br.row.m = br.mrr.ResultReader(), br.conn.TypeMap()
	}
	return &br.row
}

func (br *flatResults) Close() error {
	if br.err != nil {
		return br.err
	}
	if br.closed {
		return nil
	}
	for br.err == nil && br.next < len(br.b.QueuedQueries) {
		if fn := br.b.QueuedQueries[br.next].Fn; fn != nil {
			// The callback's error is the batch's, as in pgx's batch
			// (it may say more than the statement's, which Exec kept).
			if err := fn(br); err != nil {
				br.err = err
			}
		} else {
			_, _ = br.Exec()
		}
	}
	br.closed = true
	if err := br.mrr.Close(); br.err == nil {
		br.err = err
	}
	return br.err
}

func (br *flatResults) Tx() pgx.Tx { return nil }

// flatRow is a statement's row, read as pgx's QueryRow reads it: its
// first row, pgx.ErrNoRows when it has none, and the statement's error.
type flatRow struct {
	rr  *pgconn.ResultReader
	m   *pgtype.Map
	err error
}

func (r *flatRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	rr := r.rr
	if !rr.NextRow() {
		if _, err := rr.Close(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	fields, values := rr.FieldDescriptions(), rr.Values()
	if len(fields) != len(dest) {
		_, _ = rr.Close()
		return fmt.Errorf("number of field descriptions must equal number of destinations, got %d and %d", len(fields), len(dest))
	}
	for i, d := range dest {
		if d == nil {
			continue
		}
		if err := r.m.Scan(fields[i].DataTypeOID, fields[i].Format, values[i], d); err != nil {
			_, _ = rr.Close()
			return pgx.ScanArgError{ColumnIndex: i, FieldName: fields[i].Name, Err: err}
		}
	}
	_, err := rr.Close()
	return err
}

// errRows is the rows of a statement that failed before it had any.
type errRows struct{ err error }

func (r *errRows) Close()                                       {}
func (r *errRows) Err() error                                   { return r.err }
func (r *errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r *errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r *errRows) Next() bool                                   { return false }
func (r *errRows) Scan(...any) error                            { return r.err }
func (r *errRows) Values() ([]any, error)                       { return nil, r.err }
func (r *errRows) RawValues() [][]byte                          { return nil }
func (r *errRows) Conn() *pgx.Conn                              { return nil }
func (r *errRows) TypeMap() *pgtype.Map                         { return nil }

// flatParams encodes a statement's arguments when each is a pointer of a
// kind the flows' Queue functions pass (see queue.go) to a parameter of
// the type it holds: pgx's type map would copy each value out of its
// pointer, an allocation each, to encode it. Strings and texts are sent as
// text, which every type accepts; the rest in binary.
type flatParams struct {
	buf     []byte
	ends    []int
	values  [][]byte
	formats []int16
}

// encode encodes args, the arguments of sd, into p.values and p.formats,
// and reports whether it could: when it could not, pgx's type map encodes
// them.
func (p *flatParams) encode(sd *pgconn.StatementDescription, args []any) bool {
	if len(args) != len(sd.ParamOIDs) {
		return false
	}
	p.buf, p.ends, p.values, p.formats = p.buf[:0], p.ends[:0], p.values[:0], p.formats[:0]
	be := binary.BigEndian
	for i, arg := range args {
		oid := sd.ParamOIDs[i]
		format, null := int16(pgtype.BinaryFormatCode), false
		switch a := arg.(type) {
		case *string:
			format = pgtype.TextFormatCode
			p.buf = append(p.buf, *a...)
		case *pgtype.Text:
			format, null = pgtype.TextFormatCode, !a.Valid
			if !null {
				p.buf = append(p.buf, a.String...)
			}
		case *int64:
			if oid != pgtype.Int8OID {
				return false
			}
			p.buf = be.AppendUint64(p.buf, uint64(*a))
		case *int32:
			if oid != pgtype.Int4OID {
				return false
			}
			p.buf = be.AppendUint32(p.buf, uint32(*a))
		case *[]byte:
			if oid != pgtype.ByteaOID {
				return false
			}
			null = *a == nil
			p.buf = append(p.buf, *a...)
		case *pgtype.Interval:
			if oid != pgtype.IntervalOID {
				return false
			}
			null = !a.Valid
			if !null {
				p.buf = be.AppendUint64(p.buf, uint64(a.Microseconds))
				p.buf = be.AppendUint32(p.buf, uint32(a.Days))
				p.buf = be.AppendUint32(p.buf, uint32(a.Months))
			}
		case *pgtype.UUID:
			if oid != pgtype.UUIDOID {
				return false
			}
			null = !a.Valid
			if !null {
				p.buf = append(p.buf, a.Bytes[:]...)
			}
		default:
			return false
		}
		if null {
			p.ends = append(p.ends, -1)
		} else {
			p.ends = append(p.ends, len(p.buf))
		}
		p.formats = append(p.formats, format)
	}
	start := 0
	for _, end := range p.ends {
		if end < 0 {
			p.values = append(p.values, nil)
			continue
		}
		p.values = append(p.values, p.buf[start:end:end])
		start = end
	}
	return true
}
