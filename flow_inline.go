package idem

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// The compact form of a step's record, as the flow's row holds it (one
// JSON string per step in idem_flow.steps): a header of comma-separated
// fields, a semicolon, then the step's name, the last lookup's outcome and
// the result (JSON), one after the other:
//
//	name length,completed,state,attempts,first called,reconciles,outcome length;name outcome result
//
// Lengths count characters (so that SQL's substr cuts the same); a state
// is empty for a step done, c for a call calling, u for one unsent, ? for
// one whose outcome is unknown (BestEffort, migration 00010); times
// are microseconds after the flow's created_at, or since 1970 after an @;
// empty fields are 0 or not set, and empty fields at the header's end are
// left out; an empty result is none. A local step done reads
// "7,0;reserve1", where its JSON object took 50 bytes with a time since
// 1970: the flow's row, written twice by a flow of three steps, writes a
// third of the bytes it did (migration 00009 documents the form, and its
// Down turns the records back into objects for the version before).

// appendInline appends to b, a JSON text being written, the record as a
// JSON string of its compact form, its times after base (the flow's
// created_at in microseconds since 1970, 0 when the executor does not
// know it: times since 1970 then).
func (s *stepRecord) appendInline(b []byte, base int64) []byte {
	b = append(b, '"')
	b = strconv.AppendInt(b, int64(utf8.RuneCountInString(s.Name)), 10)
	var h header
	b = h.time(b, s.Completed, base)
	b = h.text(b, inlineState(s.State))
	b = h.int(b, int64(s.Attempts))
	b = h.time(b, s.FirstCalled, base)
	b = h.int(b, int64(s.Reconciles))
	b = h.int(b, int64(utf8.RuneCountInString(s.LastReconcile)))
	b = append(b, ';')
	b = appendJSONContent(b, s.Name)
	b = appendJSONContent(b, s.LastReconcile)
	b = appendJSONContent(b, s.Result)
	return append(b, '"')
}

// header writes a compact record's fields after the first, each after a
// comma, leaving the commas of empty fields out until a field follows.
type header struct{ owed int }

func (h *header) put(b []byte) []byte {
	for ; h.owed > 0; h.owed-- {
		b = append(b, ',')
	}
	return b
}

func (h *header) text(b []byte, v string) []byte {
	h.owed++
	if v == "" {
		return b
	}
	return append(h.put(b), v...)
}

func (h *header) int(b []byte, v int64) []byte {
	h.owed++
	if v == 0 {
		return b
	}
	return strconv.AppendInt(h.put(b), v, 10)
}

// time writes t (see stepRecord) after base: stampNow as the byte that
// the statement replaces by its now(), after the flow's created_at.
func (h *header) time(b []byte, t, base int64) []byte {
	h.owed++
	switch {
	case t == 0:
		return b
	case t == stampNow:
		return append(h.put(b), 1)
	case base == 0:
		return strconv.AppendInt(append(h.put(b), '@'), t, 10)
	}
	return strconv.AppendInt(h.put(b), t-base, 10)
}

func inlineState(state string) string {
	switch state {
	case stepCalling:
		return "c"
	case stepUnsent:
		return "u"
	case stepUnknown:
		return "?"
	}
	return state
}

// appendJSONContent appends s as the content of a JSON string, without
// its quotes (see appendJSONString).
func appendJSONContent[S ~string | ~[]byte](b []byte, s S) []byte {
	for i := range len(s) {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, `\u00`...)
			b = append(b, "0123456789abcdef"[c>>4], "0123456789abcdef"[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return b
}

// errRecord is the error of a record that cannot be read.
var errRecord = errors.New("not a step's record")

// decodeRecord reads a step's record as FlowSteps returns it (JSON): the
// compact form in a JSON string, its times after base, or the JSON object
// of the versions before (and of a step recorded as a row).
func decodeRecord(js []byte, base int64) (stepRecord, error) {
	var rec stepRecord
	if len(js) > 0 && js[0] == '{' {
		err := json.Unmarshal(js, &rec)
		return rec, err
	}
	var s string
	if err := json.Unmarshal(js, &s); err != nil {
		return rec, err
	}
	return parseInline(s, base)
}

// parseInline reads the compact form of a record (see appendInline).
func parseInline(s string, base int64) (stepRecord, error) {
	var rec stepRecord
	head, rest, ok := strings.Cut(s, ";")
	if !ok {
		return rec, fmt.Errorf("%w: no header", errRecord)
	}
	var f [7]string
	for i := range f {
		if i == len(f)-1 {
			f[i], head = head, ""
			break
		}
		f[i], head, _ = strings.Cut(head, ",")
	}
	if strings.Contains(f[6], ",") {
		return rec, fmt.Errorf("%w: too many fields", errRecord)
	}
	nameLen, err1 := atoi(f[0])
	attempts, err2 := atoi(f[3])
	reconciles, err3 := atoi(f[5])
	outcomeLen, err4 := atoi(f[6])
	completed, err5 := inlineTime(f[1], base)
	first, err6 := inlineTime(f[4], base)
	if err := errors.Join(err1, err2, err3, err4, err5, err6); err != nil {
		return rec, fmt.Errorf("%w: %w", errRecord, err)
	}
	switch f[2] {
	case "":
	case "c":
		rec.State = stepCalling
	case "u":
		rec.State = stepUnsent
	case "?":
		rec.State = stepUnknown
	default:
		return rec, fmt.Errorf("%w: state %q", errRecord, f[2])
	}
	name, rest, ok1 := cutRunes(rest, nameLen)
	outcome, rest, ok2 := cutRunes(rest, outcomeLen)
	if !ok1 || !ok2 || name == "" {
		return rec, fmt.Errorf("%w: shorter than its lengths", errRecord)
	}
	rec.Name, rec.LastReconcile = name, outcome
	rec.Attempts, rec.Reconciles = int32(attempts), int32(reconciles)
	rec.Completed, rec.FirstCalled = completed, first
	if rest != "" {
		rec.Result = json.RawMessage(rest)
	}
	return rec, nil
}

// atoi reads a header's number: empty is 0.
func atoi(s string) (int, error) {
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(s, 10, 32)
	if err == nil && n < 0 {
		err = fmt.Errorf("%d is negative", n)
	}
	return int(n), err
}

// inlineTime reads a header's time (see appendInline): empty is 0.
func inlineTime(s string, base int64) (int64, error) {
	switch {
	case s == "":
		return 0, nil
	case s[0] == '@':
		return strconv.ParseInt(s[1:], 10, 64)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return base + n, err
}

// cutRunes cuts s after n characters.
func cutRunes(s string, n int) (before, after string, ok bool) {
	i := 0
	for range n {
		if i >= len(s) {
			return "", "", false
		}
		_, size := utf8.DecodeRuneInString(s[i:])
		i += size
	}
	return s[:i], s[i:], true
}
