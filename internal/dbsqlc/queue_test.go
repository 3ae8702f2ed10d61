package dbsqlc

import (
	"context"
	"fmt"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// TestQueuedScansMatchTheGeneratedRows guards the hand-written scans in
// queue.go: when a query's columns change, sqlc regenerates its row type,
// and this fails until the scan that fills it is changed too.
func TestQueuedScansMatchTheGeneratedRows(t *testing.T) {
	for _, c := range []struct {
		row     any
		scanned int
	}{{KeyLockRow{}, 5}, {KeyGetRow{}, 5}, {KeyClaimWaitRow{}, 2},
		{FlowAdoptRow{}, 3}, {FlowGetRow{}, 8}, {FlowStepsRow{}, 4}, {FlowStepRowsRow{}, 2}, {FlowStepRowsUpdateRow{}, 2}, {FlowCallIntentRow{}, 3},
		{FlowStartRow{}, 2}, {FlowStartHeldRow{}, 4}, {FlowRestartRow{}, 2}, {FlowTakeOverRow{}, 3}} {
		if n := reflect.TypeOf(c.row).NumField(); n != c.scanned {
			t.Errorf("%T has %d columns; queue.go scans %d", c.row, n, c.scanned)
		}
	}
}

// TestBatchLayoutIsKnown fails when pgconn.Batch no longer has the fields
// reuseBatch empties: every round trip of Wire's would then allocate its
// buffers anew (correct, but the allocations per call would be back).
func TestBatchLayoutIsKnown(t *testing.T) {
	if !batchLayout.ok {
		t.Fatal("pgconn.Batch's fields changed: reuseBatch cannot empty it; update batchreuse.go")
	}
}

// TestQueuedArgumentsMatchTheGeneratedMethods guards the hand-written
// argument lists of the flows' Queue functions: each must queue sqlc's
// statement with the arguments sqlc's method passes, in its order, as
// pointers. Every field of the parameters gets a value of its own, so that
// two arguments swapped are caught.
func TestQueuedArgumentsMatchTheGeneratedMethods(t *testing.T) {
	var (
		row1      FlowStartRow
		row2      FlowRestartRow
		row3      FlowTakeOverRow
		row4      FlowGetRow
		row5      FlowStartHeldRow
		row6      FlowCallIntentRow
		namespace pgtype.UUID
		until     pgtype.Timestamptz
		written   []FlowStepRowsRow
		steps     []FlowStepsRow
		ok        bool
		n         int64
	)
	for _, c := range []struct {
		name      string
		params    any
		queue     func(b *pgx.Batch, arg any)
		generated func(q *Queries, arg any)
	}{
		{"FlowStart", &FlowStartParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStart(b, *arg.(*FlowStartParams), &row1, &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowStart(context.Background(), *arg.(*FlowStartParams)) }},
		{"FlowRestart", &FlowRestartParams{},
			func(b *pgx.Batch, arg any) { QueueFlowRestart(b, *arg.(*FlowRestartParams), &row2, &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowRestart(context.Background(), *arg.(*FlowRestartParams)) }},
		{"FlowTakeOver", &FlowTakeOverParams{},
			func(b *pgx.Batch, arg any) { QueueFlowTakeOver(b, *arg.(*FlowTakeOverParams), &row3, &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowTakeOver(context.Background(), *arg.(*FlowTakeOverParams)) }},
		{"FlowGet", &FlowGetParams{},
			func(b *pgx.Batch, arg any) { QueueFlowGet(b, nil, *arg.(*FlowGetParams), &row4, &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowGet(context.Background(), *arg.(*FlowGetParams)) }},
		{"FlowSteps", &FlowStepsParams{},
			func(b *pgx.Batch, arg any) { QueueFlowSteps(b, *arg.(*FlowStepsParams), &steps) },
			func(q *Queries, arg any) { _, _ = q.FlowSteps(context.Background(), *arg.(*FlowStepsParams)) }},
		{"FlowLease", &FlowLeaseParams{},
			func(b *pgx.Batch, arg any) { QueueFlowLease(b, *arg.(*FlowLeaseParams), &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowLease(context.Background(), *arg.(*FlowLeaseParams)) }},
		{"FlowStepRecord", &FlowStepRecordParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStepRecord(b, *arg.(*FlowStepRecordParams)) },
			func(q *Queries, arg any) { _ = q.FlowStepRecord(context.Background(), *arg.(*FlowStepRecordParams)) }},
		{"FlowStartHeld", &FlowStartHeldParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStartHeld(b, *arg.(*FlowStartHeldParams), &row5, &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowStartHeld(context.Background(), *arg.(*FlowStartHeldParams)) }},
		{"FlowStartLock", &lockID{},
			func(b *pgx.Batch, arg any) { QueueFlowStartLock(b, nil, arg.(*lockID).LockID, &namespace) },
			func(q *Queries, arg any) { _, _ = q.FlowStartLock(context.Background(), arg.(*lockID).LockID) }},
		{"FlowStartFree", &FlowStartFreeParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStartFree(b, nil, *arg.(*FlowStartFreeParams)) },
			func(q *Queries, arg any) { _ = q.FlowStartFree(context.Background(), *arg.(*FlowStartFreeParams)) }},
		{"FlowLock", &FlowLockParams{},
			func(b *pgx.Batch, arg any) { QueueFlowLock(b, *arg.(*FlowLockParams)) },
			func(q *Queries, arg any) { _ = q.FlowLock(context.Background(), *arg.(*FlowLockParams)) }},
		{"FlowCallIntent", &FlowCallIntentParams{},
			func(b *pgx.Batch, arg any) { QueueFlowCallIntent(b, *arg.(*FlowCallIntentParams), &row6, &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowCallIntent(context.Background(), *arg.(*FlowCallIntentParams)) }},
		{"FlowCompleteBare", &FlowCompleteBareParams{},
			func(b *pgx.Batch, arg any) { QueueFlowCompleteBare(b, *arg.(*FlowCompleteBareParams), &n) },
			func(q *Queries, arg any) {
				_, _ = q.FlowCompleteBare(context.Background(), *arg.(*FlowCompleteBareParams))
			}},
		{"FlowReleaseBare", &FlowReleaseBareParams{},
			func(b *pgx.Batch, arg any) { QueueFlowReleaseBare(b, *arg.(*FlowReleaseBareParams), &n) },
			func(q *Queries, arg any) {
				_, _ = q.FlowReleaseBare(context.Background(), *arg.(*FlowReleaseBareParams))
			}},
		{"FlowStopBare", &FlowStopBareParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStopBare(b, *arg.(*FlowStopBareParams), &n) },
			func(q *Queries, arg any) { _, _ = q.FlowStopBare(context.Background(), *arg.(*FlowStopBareParams)) }},
		{"FlowLeaseUntil", &FlowLeaseUntilParams{},
			func(b *pgx.Batch, arg any) { QueueFlowLeaseUntil(b, *arg.(*FlowLeaseUntilParams), &until, &ok) },
			func(q *Queries, arg any) { _, _ = q.FlowLeaseUntil(context.Background(), *arg.(*FlowLeaseUntilParams)) }},
		{"FlowStepRows", &FlowStepRowsParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStepRows(b, *arg.(*FlowStepRowsParams), &written) },
			func(q *Queries, arg any) { _, _ = q.FlowStepRows(context.Background(), *arg.(*FlowStepRowsParams)) }},
		{"FlowStepRowsUpdate", &FlowStepRowsUpdateParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStepRowsUpdate(b, *arg.(*FlowStepRowsUpdateParams), &written) },
			func(q *Queries, arg any) {
				_, _ = q.FlowStepRowsUpdate(context.Background(), *arg.(*FlowStepRowsUpdateParams))
			}},
		{"FlowComplete", &FlowCompleteParams{},
			func(b *pgx.Batch, arg any) { QueueFlowComplete(b, *arg.(*FlowCompleteParams), &n) },
			func(q *Queries, arg any) { _, _ = q.FlowComplete(context.Background(), *arg.(*FlowCompleteParams)) }},
		{"FlowRelease", &FlowReleaseParams{},
			func(b *pgx.Batch, arg any) { QueueFlowRelease(b, *arg.(*FlowReleaseParams), &n) },
			func(q *Queries, arg any) { _, _ = q.FlowRelease(context.Background(), *arg.(*FlowReleaseParams)) }},
		{"FlowStop", &FlowStopParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStop(b, *arg.(*FlowStopParams), &n) },
			func(q *Queries, arg any) { _, _ = q.FlowStop(context.Background(), *arg.(*FlowStopParams)) }},
	} {
		fillDistinct(t, reflect.ValueOf(c.params).Elem())
		var want captured
		c.generated(New(&want), c.params)
		b := &pgx.Batch{}
		c.queue(b, c.params)
		if len(b.QueuedQueries) != 1 {
			t.Fatalf("%s queued %d statements, want 1", c.name, len(b.QueuedQueries))
		}
		qq := b.QueuedQueries[0]
		if qq.SQL != want.sql {
			t.Errorf("%s queued another statement than sqlc's method runs", c.name)
		}
		if len(qq.Arguments) != len(want.args) {
			t.Errorf("%s queued %d arguments; sqlc's method passes %d", c.name, len(qq.Arguments), len(want.args))
			continue
		}
		for i, arg := range qq.Arguments {
			v := reflect.ValueOf(arg)
			if v.Kind() != reflect.Pointer {
				t.Errorf("%s: argument %d is a %T, not a pointer", c.name, i+1, arg)
				continue
			}
			if got := v.Elem().Interface(); !reflect.DeepEqual(got, want.args[i]) {
				t.Errorf("%s: argument %d is %#v; sqlc's method passes %#v", c.name, i+1, got, want.args[i])
			}
		}
	}
}

// lockID is FlowStartLock's one parameter, as a struct for fillDistinct.
type lockID struct{ LockID int64 }

// fillDistinct gives each field of the struct v a value no other field of
// it has.
func fillDistinct(t *testing.T, v reflect.Value) {
	for i := range v.NumField() {
		f := v.Field(i)
		n := int64(1000 + i)
		switch x := f.Addr().Interface().(type) {
		case *string:
			*x = fmt.Sprintf("field %d", i)
		case *[]byte:
			*x = []byte(fmt.Sprintf("field %d", i))
		case *int64:
			*x = n
		case *int32:
			*x = int32(n)
		case *pgtype.Interval:
			*x = pgtype.Interval{Microseconds: n, Valid: true}
		case *pgtype.Text:
			*x = pgtype.Text{String: fmt.Sprintf("field %d", i), Valid: true}
		case *bool:
			*x = true
		case *pgtype.UUID:
			*x = pgtype.UUID{Bytes: [16]byte{byte(i), 1}, Valid: true}
		default:
			t.Fatalf("%s.%s: a %s; fillDistinct knows no distinct value for it", v.Type().Name(), v.Type().Field(i).Name, f.Type())
		}
	}
}

// TestFlatParamsEncodeAsPgxDoes encodes the flows' arguments both ways:
// flatParams's and pgx's type map's, which must send the same values (the
// same bytes in the same format, or, for text, the same text).
func TestFlatParamsEncodeAsPgxDoes(t *testing.T) {
	s, fp, i8, i4 := "a text", []byte{0, 1, 0xff}, int64(-1)<<40, int32(-7)
	txt, null := pgtype.Text{String: "b", Valid: true}, pgtype.Text{String: "not sent", Valid: false}
	iv := pgtype.Interval{Microseconds: 90_000_000, Days: 2, Months: 3, Valid: true}
	var nilBytes []byte
	id, noID := pgtype.UUID{Bytes: [16]byte{1, 2, 3, 0xfe}, Valid: true}, pgtype.UUID{}
	sd := &pgconn.StatementDescription{ParamOIDs: []uint32{pgtype.TextOID, pgtype.TextOID, pgtype.TextOID, pgtype.Int8OID,
		pgtype.Int4OID, pgtype.ByteaOID, pgtype.IntervalOID, pgtype.ByteaOID, pgtype.JSONBOID, pgtype.UUIDOID, pgtype.UUIDOID}}
	args := []any{&s, &txt, &null, &i8, &i4, &fp, &iv, &nilBytes, &s, &id, &noID}
	var p flatParams
	if !p.encode(sd, args) {
		t.Fatal("flatParams refused the flows' arguments")
	}
	var eqb pgx.ExtendedQueryBuilder
	m := pgtype.NewMap()
	if err := eqb.Build(m, sd, args); err != nil {
		t.Fatal(err)
	}
	for i := range args {
		got, want := p.values[i], eqb.ParamValues[i]
		if (got == nil) != (want == nil) {
			t.Errorf("argument %d: NULL %v, pgx's %v", i+1, got == nil, want == nil)
			continue
		}
		if p.formats[i] == eqb.ParamFormats[i] {
			if string(got) != string(want) {
				t.Errorf("argument %d: %x, pgx's %x", i+1, got, want)
			}
			continue
		}
		// Sent as text where pgx sends binary: the text of pgx's value.
		var v any
		if err := m.Scan(sd.ParamOIDs[i], eqb.ParamFormats[i], want, &v); err != nil {
			t.Fatal(err)
		}
		var text string
		switch x := v.(type) {
		case string:
			text = x
		case map[string]any, []any:
			text = s // JSONB: the string sent as the JSON's text
		default:
			t.Fatalf("argument %d: pgx's %T", i+1, v)
		}
		if string(got) != text {
			t.Errorf("argument %d: %q, pgx's %q", i+1, got, text)
		}
	}
	// A parameter of another type than its pointer's: pgx's type map.
	if p.encode(&pgconn.StatementDescription{ParamOIDs: []uint32{pgtype.Int4OID}}, []any{&i8}) {
		t.Error("flatParams encoded an int64 for an int4")
	}
}
