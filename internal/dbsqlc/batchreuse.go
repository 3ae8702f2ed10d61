// This file is written by hand, not generated.

package dbsqlc

import (
	"reflect"
	"unsafe"

	"github.com/jackc/pgx/v5/pgconn"
)

// pgconn.Batch has no way to be emptied for reuse: a new one grows its
// buffers again, message by message, for every round trip, which is most
// of what a claim allocates. reuseBatch empties one in place, keeping its
// buffers, when pgconn.Batch is laid out as this file knows it (its fields
// and their types are checked once, through reflect, and their offsets read
// from it); otherwise it reports false, and the caller makes a new batch.
func reuseBatch(b *pgconn.Batch) bool {
	if !batchLayout.ok {
		return false
	}
	p := unsafe.Pointer(b)
	buf := (*[]byte)(unsafe.Add(p, batchLayout.buf))
	*buf = (*buf)[:0]
	sds := (*[]*pgconn.StatementDescription)(unsafe.Add(p, batchLayout.sds))
	clear(*sds)
	*sds = (*sds)[:0]
	formats := (*[][]int16)(unsafe.Add(p, batchLayout.formats))
	clear(*formats)
	*formats = (*formats)[:0]
	*(*error)(unsafe.Add(p, batchLayout.err)) = nil
	return true
}

// batchLayout is where pgconn.Batch keeps its fields, if it has the ones
// reuseBatch empties, and only those.
var batchLayout = func() (l struct {
	ok                     bool
	buf, sds, formats, err uintptr
}) {
	t := reflect.TypeOf(pgconn.Batch{})
	want := []struct {
		name string
		typ  reflect.Type
		off  *uintptr
	}{
		{"buf", reflect.TypeOf([]byte(nil)), &l.buf},
		{"statementDescriptions", reflect.TypeOf([]*pgconn.StatementDescription(nil)), &l.sds},
		{"resultFormats", reflect.TypeOf([][]int16(nil)), &l.formats},
		{"err", reflect.TypeOf((*error)(nil)).Elem(), &l.err},
	}
	if t.NumField() != len(want) {
		return l
	}
	for i, w := range want {
		f := t.Field(i)
		if f.Name != w.name || f.Type != w.typ {
			return l
		}
		*w.off = f.Offset
	}
	l.ok = true
	return l
}()
