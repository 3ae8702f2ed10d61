package dbbatch

import (
	"context"
	"fmt"
	"reflect"
	"testing"

	"github.com/pgidem/idem/internal/dbsqlc"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// TestQueuedScansMatchTheGeneratedRows guards the hand-written scans in
// queue.go: when a query's columns change, sqlc regenerates its row type,
// and this fails until the scan that fills it is changed too.
func TestQueuedScansMatchTheGeneratedRows(t *testing.T) {
	for _, c := range []struct {
		row     any
		scanned int
	}{{dbsqlc.KeyLockRow{}, 5}, {dbsqlc.KeyGetRow{}, 5}, {dbsqlc.KeyClaimWaitRow{}, 2},
		{dbsqlc.FlowAdoptRow{}, 3}, {dbsqlc.FlowGetRow{}, 8}, {dbsqlc.FlowStepsRow{}, 4}, {dbsqlc.FlowStepRowsRow{}, 2}, {dbsqlc.FlowStepRowsUpdateRow{}, 2}, {dbsqlc.FlowCallIntentRow{}, 3},
		{dbsqlc.FlowStartRow{}, 2}, {dbsqlc.FlowStartHeldRow{}, 4}, {dbsqlc.FlowRestartRow{}, 2}, {dbsqlc.FlowTakeOverRow{}, 3}} {
		if n := reflect.TypeOf(c.row).NumField(); n != c.scanned {
			t.Errorf("%T has %d columns; queue.go scans %d", c.row, n, c.scanned)
		}
	}
}

// TestQueuedArgumentsMatchTheGeneratedMethods guards the hand-written
// argument lists of the flows' Queue functions: each must queue sqlc's
// statement with the arguments sqlc's method passes, in its order (or
// pointers to them). Every field of the parameters gets a value of its own, so that
// two arguments swapped are caught.
func TestQueuedArgumentsMatchTheGeneratedMethods(t *testing.T) {
	var (
		row1      dbsqlc.FlowStartRow
		row2      dbsqlc.FlowRestartRow
		row3      dbsqlc.FlowTakeOverRow
		row4      dbsqlc.FlowGetRow
		row5      dbsqlc.FlowStartHeldRow
		row6      dbsqlc.FlowCallIntentRow
		namespace pgtype.UUID
		until     pgtype.Timestamptz
		written   []dbsqlc.FlowStepRowsRow
		steps     []dbsqlc.FlowStepsRow
		ok        bool
		n         int64
	)
	for _, c := range []struct {
		name      string
		params    any
		queue     func(b *pgx.Batch, arg any)
		generated func(q *dbsqlc.Queries, arg any)
	}{
		{"FlowStart", &dbsqlc.FlowStartParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStart(b, *arg.(*dbsqlc.FlowStartParams), &row1, &ok) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowStart(context.Background(), *arg.(*dbsqlc.FlowStartParams))
			}},
		{"FlowRestart", &dbsqlc.FlowRestartParams{},
			func(b *pgx.Batch, arg any) { QueueFlowRestart(b, *arg.(*dbsqlc.FlowRestartParams), &row2, &ok) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowRestart(context.Background(), *arg.(*dbsqlc.FlowRestartParams))
			}},
		{"FlowTakeOver", &dbsqlc.FlowTakeOverParams{},
			func(b *pgx.Batch, arg any) { QueueFlowTakeOver(b, *arg.(*dbsqlc.FlowTakeOverParams), &row3, &ok) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowTakeOver(context.Background(), *arg.(*dbsqlc.FlowTakeOverParams))
			}},
		{"FlowGet", &dbsqlc.FlowGetParams{},
			func(b *pgx.Batch, arg any) { QueueFlowGet(b, nil, *arg.(*dbsqlc.FlowGetParams), &row4, &ok) },
			func(q *dbsqlc.Queries, arg any) { _, _ = q.FlowGet(context.Background(), *arg.(*dbsqlc.FlowGetParams)) }},
		{"FlowSteps", &dbsqlc.FlowStepsParams{},
			func(b *pgx.Batch, arg any) { QueueFlowSteps(b, *arg.(*dbsqlc.FlowStepsParams), &steps) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowSteps(context.Background(), *arg.(*dbsqlc.FlowStepsParams))
			}},
		{"FlowLease", &dbsqlc.FlowLeaseParams{},
			func(b *pgx.Batch, arg any) { QueueFlowLease(b, *arg.(*dbsqlc.FlowLeaseParams), &ok) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowLease(context.Background(), *arg.(*dbsqlc.FlowLeaseParams))
			}},
		{"FlowStepRecord", &dbsqlc.FlowStepRecordParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStepRecord(b, *arg.(*dbsqlc.FlowStepRecordParams)) },
			func(q *dbsqlc.Queries, arg any) {
				_ = q.FlowStepRecord(context.Background(), *arg.(*dbsqlc.FlowStepRecordParams))
			}},
		{"FlowStartHeld", &dbsqlc.FlowStartHeldParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStartHeld(b, *arg.(*dbsqlc.FlowStartHeldParams), &row5, &ok) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowStartHeld(context.Background(), *arg.(*dbsqlc.FlowStartHeldParams))
			}},
		{"FlowStartLock", &dbsqlc.FlowStartLockParams{},
			func(b *pgx.Batch, arg any) {
				QueueFlowStartLock(b, nil, *arg.(*dbsqlc.FlowStartLockParams), &namespace)
			},
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowStartLock(context.Background(), *arg.(*dbsqlc.FlowStartLockParams))
			}},
		{"FlowStartFree", &dbsqlc.FlowStartFreeParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStartFree(b, nil, *arg.(*dbsqlc.FlowStartFreeParams)) },
			func(q *dbsqlc.Queries, arg any) {
				_ = q.FlowStartFree(context.Background(), *arg.(*dbsqlc.FlowStartFreeParams))
			}},
		{"FlowLock", &dbsqlc.FlowLockParams{},
			func(b *pgx.Batch, arg any) { QueueFlowLock(b, *arg.(*dbsqlc.FlowLockParams)) },
			func(q *dbsqlc.Queries, arg any) { _ = q.FlowLock(context.Background(), *arg.(*dbsqlc.FlowLockParams)) }},
		{"FlowCallIntent", &dbsqlc.FlowCallIntentParams{},
			func(b *pgx.Batch, arg any) { QueueFlowCallIntent(b, *arg.(*dbsqlc.FlowCallIntentParams), &row6, &ok) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowCallIntent(context.Background(), *arg.(*dbsqlc.FlowCallIntentParams))
			}},
		{"FlowCompleteBare", &dbsqlc.FlowCompleteBareParams{},
			func(b *pgx.Batch, arg any) { QueueFlowCompleteBare(b, *arg.(*dbsqlc.FlowCompleteBareParams), &n) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowCompleteBare(context.Background(), *arg.(*dbsqlc.FlowCompleteBareParams))
			}},
		{"FlowReleaseBare", &dbsqlc.FlowReleaseBareParams{},
			func(b *pgx.Batch, arg any) { QueueFlowReleaseBare(b, *arg.(*dbsqlc.FlowReleaseBareParams), &n) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowReleaseBare(context.Background(), *arg.(*dbsqlc.FlowReleaseBareParams))
			}},
		{"FlowStopBare", &dbsqlc.FlowStopBareParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStopBare(b, *arg.(*dbsqlc.FlowStopBareParams), &n) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowStopBare(context.Background(), *arg.(*dbsqlc.FlowStopBareParams))
			}},
		{"FlowLeaseUntil", &dbsqlc.FlowLeaseUntilParams{},
			func(b *pgx.Batch, arg any) { QueueFlowLeaseUntil(b, *arg.(*dbsqlc.FlowLeaseUntilParams), &until, &ok) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowLeaseUntil(context.Background(), *arg.(*dbsqlc.FlowLeaseUntilParams))
			}},
		{"FlowStepRows", &dbsqlc.FlowStepRowsParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStepRows(b, *arg.(*dbsqlc.FlowStepRowsParams), &written) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowStepRows(context.Background(), *arg.(*dbsqlc.FlowStepRowsParams))
			}},
		{"FlowStepRowsUpdate", &dbsqlc.FlowStepRowsUpdateParams{},
			func(b *pgx.Batch, arg any) {
				QueueFlowStepRowsUpdate(b, *arg.(*dbsqlc.FlowStepRowsUpdateParams), &written)
			},
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowStepRowsUpdate(context.Background(), *arg.(*dbsqlc.FlowStepRowsUpdateParams))
			}},
		{"FlowComplete", &dbsqlc.FlowCompleteParams{},
			func(b *pgx.Batch, arg any) { QueueFlowComplete(b, *arg.(*dbsqlc.FlowCompleteParams), &n) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowComplete(context.Background(), *arg.(*dbsqlc.FlowCompleteParams))
			}},
		{"FlowRelease", &dbsqlc.FlowReleaseParams{},
			func(b *pgx.Batch, arg any) { QueueFlowRelease(b, *arg.(*dbsqlc.FlowReleaseParams), &n) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowRelease(context.Background(), *arg.(*dbsqlc.FlowReleaseParams))
			}},
		{"FlowStop", &dbsqlc.FlowStopParams{},
			func(b *pgx.Batch, arg any) { QueueFlowStop(b, *arg.(*dbsqlc.FlowStopParams), &n) },
			func(q *dbsqlc.Queries, arg any) {
				_, _ = q.FlowStop(context.Background(), *arg.(*dbsqlc.FlowStopParams))
			}},
	} {
		fillDistinct(t, reflect.ValueOf(c.params).Elem())
		var want captured
		c.generated(dbsqlc.New(&want), c.params)
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
			if v.Kind() == reflect.Pointer {
				v = v.Elem()
			}
			if got := v.Interface(); !reflect.DeepEqual(got, want.args[i]) {
				t.Errorf("%s: argument %d is %#v; sqlc's method passes %#v", c.name, i+1, got, want.args[i])
			}
		}
	}
}

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
