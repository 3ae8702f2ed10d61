package dbsqlc

import (
	"reflect"
	"testing"
)

// TestQueuedScansMatchTheGeneratedRows guards the hand-written scans in
// queue.go: when a query's columns change, sqlc regenerates its row type,
// and this fails until the scan that fills it is changed too.
func TestQueuedScansMatchTheGeneratedRows(t *testing.T) {
	for row, scanned := range map[any]int{KeyLockRow{}: 2, KeyGetRow{}: 4} {
		if n := reflect.TypeOf(row).NumField(); n != scanned {
			t.Errorf("%T has %d columns; queue.go scans %d", row, n, scanned)
		}
	}
}
