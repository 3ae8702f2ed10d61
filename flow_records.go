package idem

import (
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// A flow's steps are recorded in its own row (idem_flow.steps): one JSON
// object by place, each step's record a small object written whole, in
// the write of the flow's row that the executor's statement makes anyway
// (see FlowLeaseSteps in queries/flow.sql for the fields). Only the executor
// that holds the flow writes them, so it knows each record, and writes it
// whole; a step's times are the server's, written in by the statement
// (stampNow).

// stepRecord is a step's record, as idem_flow.steps holds it.
type stepRecord struct {
	Name string `json:"n"`
	// State is a call's while it has no result: stepCalling or
	// stepUnsent; empty once the step is done.
	State string `json:"s,omitempty"`
	// Result is the step's result, JSON; nil while a call has none.
	Result json.RawMessage `json:"r,omitempty"`
	// Attempts is a call's (never 0 for a call), 0 for a local step.
	Attempts int32 `json:"a,omitempty"`
	// FirstCalled and Completed are microseconds since 1970, 0 when not
	// set, stampNow for the statement that writes them to set.
	FirstCalled int64 `json:"f,omitempty"`
	Completed   int64 `json:"c,omitempty"`
	// Reconciles and LastReconcile are a call's lookups and what the last
	// found.
	Reconciles    int32  `json:"x,omitempty"`
	LastReconcile string `json:"l,omitempty"`
}

// The states of a call without a result, as a step's record spells them.
const (
	stepCalling = "calling"
	stepUnsent  = "unsent"
)

// stampNow is a time for the statement that writes the record to set to
// its now() (the byte 0x01 in its JSON, which the statement replaces).
const stampNow = -1

// kind is the step's kind: a call has attempts.
func (s *stepRecord) kind() string {
	if s.Attempts > 0 {
		return stepCall
	}
	return stepLocal
}

// done reports whether the step's result is recorded.
func (s *stepRecord) done() bool { return s.State == "" }

// appendJSON appends the record's JSON to b.
func (s *stepRecord) appendJSON(b []byte) []byte {
	b = append(b, `{"n":`...)
	b = appendJSONString(b, s.Name)
	if s.State != "" {
		b = append(b, `,"s":`...)
		b = appendJSONString(b, s.State)
	}
	if s.Result != nil {
		b = append(b, `,"r":`...)
		b = append(b, s.Result...)
	}
	if s.Attempts != 0 {
		b = append(b, `,"a":`...)
		b = strconv.AppendInt(b, int64(s.Attempts), 10)
	}
	b = appendStamp(b, `,"f":`, s.FirstCalled)
	b = appendStamp(b, `,"c":`, s.Completed)
	if s.Reconciles != 0 {
		b = append(b, `,"x":`...)
		b = strconv.AppendInt(b, int64(s.Reconciles), 10)
	}
	if s.LastReconcile != "" {
		b = append(b, `,"l":`...)
		b = appendJSONString(b, s.LastReconcile)
	}
	return append(b, '}')
}

func appendStamp(b []byte, field string, t int64) []byte {
	switch t {
	case 0:
		return b
	case stampNow:
		return append(append(b, field...), 1)
	}
	return strconv.AppendInt(append(b, field...), t, 10)
}

// appendJSONString appends s as a JSON string. Step names and lookup
// outcomes are valid UTF-8 (ident.Check, sealText).
func appendJSONString(b []byte, s string) []byte {
	q, err := json.Marshal(s)
	if err != nil { // a string always marshals
		panic(err)
	}
	return append(b, q...)
}

// stepPatch is the records a statement writes into the flow's row, by
// place: the JSON object FlowLeaseSteps and the others take as @steps.
type stepPatch struct {
	b []byte
	// at is the local step whose record it holds, for the statements that
	// note the step the flow is at (FlowRelease, FlowStop): FlowLock,
	// which began the step, did not.
	at string
	// starting is set when the flow's row is still to be written, by the
	// open step's transaction that carries the patch (FlowStartHeld): a
	// statement that would only write the row again, with the records,
	// lets the row carry them instead (carry), at step. start is then
	// what that row's statement found.
	starting, carried bool
	step              string
	start             *starting
}

// carry lets the flow's row, still to be written, carry the records, at
// step (see stepPatch.starting).
func (p *stepPatch) carry(step string) { p.carried, p.step = true, step }

// atText is at as those statements take it: NULL when empty.
func (p *stepPatch) atText() pgtype.Text { return pgtype.Text{String: p.at, Valid: p.at != ""} }

// add adds the record of the step at seq.
func (p *stepPatch) add(seq int32, rec *stepRecord) {
	if len(p.b) == 0 {
		p.b = append(p.b, '{')
	} else {
		p.b = append(p.b, ',')
	}
	p.b = append(p.b, '"')
	p.b = strconv.AppendInt(p.b, int64(seq), 10)
	p.b = append(p.b, `":`...)
	p.b = rec.appendJSON(p.b)
}

// text is the patch as the statements take it: NULL when empty.
func (p *stepPatch) text() pgtype.Text {
	if len(p.b) == 0 {
		return pgtype.Text{}
	}
	return pgtype.Text{String: string(p.b) + "}", Valid: true}
}

// pendingStep is a step's record not yet sent: a local step's, or a
// call's result. row is set for a local step recorded as a row of
// idem_flow_step_row instead (FlowStepRecord: see maxInlineSteps).
type pendingStep struct {
	seq int32
	rec stepRecord
	row bool
}

// maxInlineSteps bounds the JSON of the steps a flow's row records, as
// far as its executor knows (what it read and wrote): past it, a local
// step is recorded as a row of its own (FlowStepRecord), as idem did
// before migration 00008, so that a flow of many steps, or of large
// results, does not copy them all again at each write of its row (past
// about 2 kB, in TOAST). Calls are always recorded in the row.
const maxInlineSteps = 1024

// rowParams are the arguments of FlowStepRecord for a local step recorded
// as a row.
func (p *pendingStep) rowParams(k keyRef) dbsqlc.FlowStepRecordParams {
	return dbsqlc.FlowStepRecordParams{Scope: k.scope, Key: k.key, Seq: p.seq, Step: p.rec.Name,
		Result: pgtype.Text{String: string(p.rec.Result), Valid: true}}
}

// inlined counts rec, written into the flow's row, against
// maxInlineSteps.
func (r *flowRun) inlined(rec *stepRecord) { r.inline += len(rec.appendJSON(nil)) }

// spills reports whether a local step's record, rec, goes to a row of its
// own rather than the flow's row (see maxInlineSteps), counting it if not.
func (r *flowRun) spills(rec *stepRecord) bool {
	n := len(rec.appendJSON(nil))
	if r.inline+n > maxInlineSteps {
		return true
	}
	r.inline += n
	return false
}

// setRecorded notes rec as the record of the step at seq, making the map
// of records first for a flow that had none (newFlowRun leaves it nil,
// which saves an allocation for a new flow).
func (r *flowRun) setRecorded(seq int32, rec stepRecord) {
	if r.recorded == nil {
		r.recorded = make(map[int32]stepRecord)
	}
	r.recorded[seq] = rec
}

// recordedSteps decodes the records FlowSteps read, and returns their
// size, counted against maxInlineSteps; the map is nil when there are
// none.
func recordedSteps(rows []dbsqlc.FlowStepsRow) (map[int32]stepRecord, int, error) {
	if len(rows) == 0 {
		return nil, 0, nil
	}
	recorded := make(map[int32]stepRecord, len(rows))
	size := 0
	for _, row := range rows {
		size += len(row.Rec)
		var rec stepRecord
		if err := json.Unmarshal(row.Rec, &rec); err != nil {
			return nil, 0, fmt.Errorf("idem: flow: step %d's record: %w", row.Seq, err)
		}
		if !rec.done() {
			rec.Result = nil // a call's, read from idem_flow_step_row: null
		}
		recorded[row.Seq] = rec
	}
	return recorded, size, nil
}
