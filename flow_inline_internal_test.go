package idem

import (
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// inlineRecords are records as the flow's row holds them, with names,
// outcomes and results that a compact form could trip on.
var inlineRecords = []stepRecord{
	{Name: "reserve", Result: json.RawMessage(`1`), Completed: 1_796_292_977_097_928},
	{Name: "charge", State: stepCalling, Attempts: 1, FirstCalled: 1_796_292_977_097_928},
	{Name: "charge", Result: json.RawMessage(`"ch_1"`), Attempts: 3, FirstCalled: 1_796_292_977_097_928,
		Completed: 1_796_292_977_103_428, Reconciles: 2, LastReconcile: reconcileNotFound},
	{Name: "lookup", State: stepUnsent, Attempts: 2, FirstCalled: 1_796_292_977_000_000, Reconciles: 1,
		LastReconcile: "sealed:QUJD+/=="},
	{Name: "ünïcödé 日本 ;,@\"\\\t\x01\x7f", Result: json.RawMessage(`{"a":"x;y,z\"\\\u0001","b":null}`),
		Completed: 1_796_292_977_097_929},
	{Name: "n", Result: json.RawMessage(`null`), Completed: 1_796_292_977_097_928},
	{Name: "empty result", Result: json.RawMessage(`{}`), Completed: 1_796_292_977_097_928},
	{Name: "7,0;x", Result: json.RawMessage(`[1,2]`), Completed: 1_796_292_977_097_928},
}

// TestInlineRecordsReadBackAsWritten: each record written in its compact
// form, as a JSON string, reads back as itself, its times counted from the
// flow's created_at, or since 1970 when the executor did not know it.
func TestInlineRecordsReadBackAsWritten(t *testing.T) {
	const base = 1_796_292_977_000_000
	for _, b := range []int64{base, 0} {
		for _, rec := range inlineRecords {
			js := rec.appendInline(nil, b)
			var s string
			if err := json.Unmarshal(js, &s); err != nil {
				t.Fatalf("%+v written as %s: not a JSON string: %v", rec, js, err)
			}
			got, err := decodeRecord(js, base)
			if err != nil || !reflect.DeepEqual(got, rec) {
				t.Errorf("%+v written as %s (base %d): reads back %+v, %v", rec, js, b, got, err)
			}
			if b == base && strings.Contains(s, "@") && !strings.Contains(rec.Name+rec.LastReconcile+string(rec.Result), "@") {
				t.Errorf("%s: a time since 1970 where the executor knew the flow's created_at", s)
			}
		}
	}
}

// TestInlineRecordIsShort: a local step's record is its name, its result
// and when it was done, with little else; a JSON object of the same took
// 50 bytes.
func TestInlineRecordIsShort(t *testing.T) {
	rec := stepRecord{Name: "reserve", Result: json.RawMessage(`1`), Completed: 1_796_292_977_097_928}
	if got := string(rec.appendInline(nil, 1_796_292_977_097_928)); got != `"7,0;reserve1"` {
		t.Errorf("written as %s", got)
	}
	rec.Completed = stampNow
	if got := string(rec.appendInline(nil, 0)); got != "\"7,\x01;reserve1\"" {
		t.Errorf("with the statement's now(): written as %q", got)
	}
	call := stepRecord{Name: "charge", State: stepCalling, Attempts: 1, FirstCalled: stampNow}
	if got := string(call.appendInline(nil, 5)); got != "\"6,,c,1,\x01;charge\"" {
		t.Errorf("a call's intent: written as %q", got)
	}
}

// TestObjectRecordsOfEarlierVersionsAreRead: the records of versions
// before migration 00009 (and of a step recorded as a row) are JSON objects
// with times since 1970; they read as they did.
func TestObjectRecordsOfEarlierVersionsAreRead(t *testing.T) {
	for _, rec := range inlineRecords {
		js := rec.appendJSON(nil)
		got, err := decodeRecord(js, 12345)
		if err != nil || !reflect.DeepEqual(got, rec) {
			t.Errorf("%s: reads back %+v, %v", js, got, err)
		}
	}
}

// TestBrokenInlineRecordsAreRefused: a record that is not one, or is cut
// short, is an error, never a step read wrong.
func TestBrokenInlineRecordsAreRefused(t *testing.T) {
	for _, s := range []string{"", "reserve", "7,0", "9,0;reserve1", "7,0,x;reserve1", "7,0,,,,,3;reserve",
		"0;", "7,zz;reserve", "-1;x", "7,0,,,,,,9;reserve1", "99999999999;x"} {
		js, _ := json.Marshal(s)
		if rec, err := decodeRecord(js, 0); !errors.Is(err, errRecord) {
			t.Errorf("%q reads as %+v, %v; want errRecord", s, rec, err)
		}
	}
	if _, err := decodeRecord([]byte(`7`), 0); err == nil {
		t.Error("a JSON number reads as a record")
	}
}

// FuzzInlineRecord: whatever a step's name, outcome and result, its record
// reads back as written.
func FuzzInlineRecord(f *testing.F) {
	for _, rec := range inlineRecords {
		f.Add(rec.Name, rec.LastReconcile, string(rec.Result), rec.Completed, int32(rec.Attempts))
	}
	f.Fuzz(func(t *testing.T, name, outcome, result string, completed int64, attempts int32) {
		// What idem writes: a name as ident.Check allows, an outcome of
		// valid UTF-8 (sealText), a result of JSON in UTF-8, times and attempts not
		// negative.
		if name == "" || strings.IndexByte(name, 0) >= 0 || !utf8.ValidString(name) || !utf8.ValidString(outcome) || !utf8.ValidString(result) ||
			!json.Valid([]byte(result)) && result != "" || completed < 0 || attempts < 0 {
			return
		}
		rec := stepRecord{Name: name, LastReconcile: outcome, Completed: completed, Attempts: attempts}
		if result != "" {
			rec.Result = json.RawMessage(result)
		}
		js := rec.appendInline(nil, 1000)
		got, err := decodeRecord(js, 1000)
		if !json.Valid(js) {
			t.Fatalf("%s is not JSON", js)
		}
		if err != nil || !reflect.DeepEqual(got, rec) {
			t.Fatalf("%+v written as %s: reads back %+v, %v", rec, strconv.Quote(string(js)), got, err)
		}
	})
}
