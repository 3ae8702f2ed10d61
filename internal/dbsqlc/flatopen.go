// This file is written by hand, not generated: it sends a batch of sqlc's
// statements followed by one of the caller's, through SendFlat's
// machinery, and leaves the caller's result to read.

package dbsqlc

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// maxForeign bounds how many statements that are not sqlc's SendFlatOpen
// prepares on a connection: a program's own statements are as many as its
// code has, but one that builds its SQL as it goes would have more each
// time. Past it, SendFlatOpen sends nothing, and the caller sends the
// statement through pgx, whose statement cache is bounded.
const maxForeign = 64

// Open is the last statement of a batch that SendFlatOpen sent, its result
// still to read: by one of Exec, Query or QueryRow, once, which ends the
// round trip (for Query, when its rows are closed). It is the connection's,
// reused for its next round trip.
type Open struct {
	f    *flat
	conn *pgx.Conn
	mrr  *pgconn.MultiResultReader
	// over is told once the round trip is over, with its error.
	over     Over
	finished bool
	row      openRow
	// sql is the caller's statement; gen the round trip's (flat.gen).
	sql string
	gen uint64
}

// Over is told when the round trip of SendFlatOpen is over, with its
// error: the connection is free again, and its transaction status known.
type Over interface{ RoundTripOver(err error) }

// SendFlatOpen sends b on conn as SendFlat does, in one round trip, reads
// the results of its statements but the last, calling their callbacks,
// and returns the last's result to read. The last statement may be any SQL
// of one statement, the caller's: the first time a connection sends it, it
// is prepared there, as pgx's statement cache would (up to maxForeign such
// statements per connection). err is the error of the statements before
// the last (the round trip is then over, the last's statement not run, and
// open nil). When conn cannot send b so (see flatFor), a statement has
// options, or the last statement's arguments cannot be encoded, or it
// cannot be prepared, or it would be one too many, sent is false and
// nothing of b was sent: send it otherwise. over is told once the round
// trip is over.
func SendFlatOpen(ctx context.Context, conn *pgx.Conn, b *pgx.Batch, over Over) (open *Open, sent bool, err error) {
	f := flatFor(conn)
	n := len(b.QueuedQueries)
	if f == nil || n == 0 {
		return nil, false, nil
	}
	last := b.QueuedQueries[n-1]
	if _, ok := f.stmts[last.SQL]; !ok {
		if _, known := f.foreign[last.SQL]; !known && len(f.foreign) >= maxForeign {
			return nil, false, nil
		}
		if len(last.Arguments) > 0 {
			switch last.Arguments[0].(type) {
			case pgx.QueryRewriter, pgx.QueryExecMode:
				return nil, false, nil
			}
		}
		sd, err := prepare(ctx, f.pc, flatName(last.SQL), last.SQL)
		if err != nil {
			if f.pc.IsClosed() || ctx.Err() != nil {
				return nil, true, err
			}
			return nil, false, nil
		}
		f.stmts[last.SQL] = &flatStmt{sd: sd}
		if f.foreign == nil {
			f.foreign = make(map[string]struct{})
		}
		f.foreign[last.SQL] = struct{}{}
	}
	mrr, sent, err := f.send(ctx, conn, b, true)
	if errors.Is(err, errBuild) {
		// Nothing was sent: pgx reports it as it would.
		return nil, false, nil
	}
	if !sent || err != nil {
		return nil, sent, err
	}
	br := &f.results
	*br = flatResults{conn: conn, mrr: mrr, b: b}
	for br.err == nil && br.next < n-1 {
		if fn := b.QueuedQueries[br.next].Fn; fn != nil {
			if err := fn(br); err != nil {
				br.err = err // the callback's, as in Close
			}
		} else {
			_, _ = br.Exec()
		}
	}
	err = br.err
	*br = flatResults{}
	f.gen++
	f.open = Open{f: f, conn: conn, mrr: mrr, over: over, gen: f.gen}
	if err != nil {
		return nil, true, f.open.finish(err) // the caller's statement did not run
	}
	f.open.sql = last.SQL
	return &f.open, true, nil
}

// finish ends the round trip: what is left of its results, and its Sync.
func (o *Open) finish(err error) error {
	if o.finished {
		return err
	}
	o.finished = true
	if closeErr := o.mrr.Close(); err == nil {
		err = closeErr
	}
	if o.f.stmts[o.sql] != nil && staleness(err) == "0A000" {
		// The caller's statement went stale (its table changed): it
		// alone, prepared again, deallocated first, the next time.
		delete(o.f.stmts, o.sql)
	} else {
		o.f.forget(err)
	}
	o.over.RoundTripOver(err)
	return err
}

// Close ends the round trip if the statement's result has not ended it:
// its rows left open, its row not scanned.
func (o *Open) Close() { _ = o.finish(nil) }

// next is the last statement's result, or the error that there is none.
func (o *Open) next() (*pgconn.ResultReader, error) {
	if !o.mrr.NextResult() {
		err := o.finish(nil)
		if err == nil {
			err = errNoMoreResults
		}
		return nil, err
	}
	return o.mrr.ResultReader(), nil
}

// Exec reads the statement's result as pgx's Exec would.
func (o *Open) Exec() (pgconn.CommandTag, error) {
	rr, err := o.next()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := rr.Close()
	return tag, o.finish(err)
}

// Query reads the statement's result as pgx's Query would: its rows, which
// end the round trip as they close.
func (o *Open) Query() (pgx.Rows, error) {
	rr, err := o.next()
	if err != nil {
		return &errRows{err: err}, err
	}
	return &openRows{Rows: pgx.RowsFromResultReader(o.conn.TypeMap(), rr), open: o, gen: o.gen}, nil
}

// QueryRow reads the statement's result as pgx's QueryRow would.
func (o *Open) QueryRow() pgx.Row {
	rr, err := o.next()
	if err != nil {
		return errRow{err}
	}
	o.row = openRow{flatRow: flatRow{rr: rr, m: o.conn.TypeMap()}, open: o, gen: o.gen}
	return &o.row
}

// openRows are the rows of Open's statement: closing them ends the round
// trip.
type openRows struct {
	pgx.Rows
	open *Open
	gen  uint64
	err  error
	done bool
}

func (r *openRows) end() {
	if r.done {
		return
	}
	r.done = true
	if r.open.gen != r.gen || r.open.finished {
		// Ended already (Open.Close), and the connection's Open may be
		// another round trip's by now.
		r.err = errors.New("dbsqlc: the round trip of these rows is over")
		return
	}
	r.Rows.Close()
	r.err = r.open.finish(r.Rows.Err())
}

func (r *openRows) Next() bool {
	if r.done {
		return false
	}
	if r.open.gen != r.gen || r.open.finished {
		r.end()
		return false
	}
	if r.Rows.Next() {
		return true
	}
	r.end()
	return false
}

func (r *openRows) Close() { r.end() }

func (r *openRows) Err() error {
	if r.done {
		return r.err
	}
	return r.Rows.Err()
}

// openRow is the row of Open's statement: scanning it ends the round trip.
type openRow struct {
	flatRow
	open *Open
	gen  uint64
}

func (r *openRow) Scan(dest ...any) error {
	if r.open.gen != r.gen || r.open.finished {
		return errors.New("dbsqlc: the round trip of this row is over")
	}
	err := r.flatRow.Scan(dest...)
	statementErr := err
	if errors.Is(err, pgx.ErrNoRows) {
		statementErr = nil
	}
	if finishErr := r.open.finish(statementErr); err == nil {
		err = finishErr
	}
	return err
}
