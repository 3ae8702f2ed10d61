package dbsqlc

import (
	"reflect"
	"testing"
)

// TestQueuedScansMatchTheGeneratedRows guards the hand-written scans in
// queue.go: when a query's columns change, sqlc regenerates its row type,
// and this fails until the scan that fills it is changed too.
func TestQueuedScansMatchTheGeneratedRows(t *testing.T) {
	for _, c := range []struct {
		row     any
		scanned int
	}{{KeyLockRow{}, 5}, {KeyGetRow{}, 5}, {KeyClaimWaitRow{}, 2},
		{FlowAdoptRow{}, 3}, {FlowGetRow{}, 8}, {FlowStepsRow{}, 2}, {FlowCallIntentRow{}, 2},
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
