package idem

import (
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// A flow's steps are recorded in its own row (idem_flow.steps): one JSON
// object by place, each step's record a short string of its compact form
// (appendInline) written whole, in the write of the flow's row that the
// executor's statement makes anyway (see FlowLeaseSteps in
// queries/flow.sql). Only the executor that holds the flow writes them, so
// it knows each record, and writes it whole; a step's times are the
// server's, written in by the statement (stampNow), as microseconds after
// the flow's created_at. Records that versions before this one wrote, JSON
// objects of the fields of stepRecord with times since 1970, are read as
// they are (decodeRecord). Past maxInlineSteps, the records go to rows of
// their own instead (FlowStepRows), as JSON objects (appendJSON).

// stepRecord is a step's record, as idem_flow.steps holds it.
type stepRecord struct {
	Name string `json:"n"`
	// State is a call's while it has no result: stepCalling or
	// stepUnsent, or stepUnknown for a BestEffort call that will have
	// none; empty once the step is done.
	State string `json:"s,omitempty"`
	// Result is the step's result, JSON; nil while a call has none.
	Result json.RawMessage `json:"r,omitempty"`
	// Attempts counts a call's attempts that may have reached the other
	// system (its function called, and not failing with ErrNotSent), 0
	// for a local step.
	Attempts int32 `json:"a,omitempty"`
	// FirstCalled and Completed are microseconds since 1970, 0 when not
	// set, stampNow for the statement that writes them to set (as
	// microseconds after the flow's created_at in the flow's row).
	FirstCalled int64 `json:"f,omitempty"`
	Completed   int64 `json:"c,omitempty"`
	// Reconciles and LastReconcile are a call's lookups and what the last
	// found.
	Reconciles    int32  `json:"x,omitempty"`
	LastReconcile string `json:"l,omitempty"`
	// inRow is set for a step recorded as a row of its own
	// (idem_flow_step_row), where its further records go too.
	inRow bool
}

// The states of a call without a result, as a step's record spells them.
const (
	stepCalling = "calling"
	stepUnsent  = "unsent"
	stepUnknown = "unknown" // a BestEffort call's, for good (migration 00010)
)

// stampNow is a time for the statement that writes the record to set to
// its now() (the byte 0x01 in its JSON, which the statement replaces: by
// microseconds since 1970 in a row's record, by microseconds after the
// flow's created_at in the flow's row).
const stampNow = -1

// kind is the step's kind: a call has attempts.
func (s *stepRecord) kind() string {
	if s.Attempts > 0 || s.State != "" { // a call none of whose attempts was sent has none
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
// outcomes are valid UTF-8 (ident.Check, sealText). Printable ASCII
// without a quote or backslash, as step names mostly are, is appended as
// it is (encoding/json would allocate).
func appendJSONString(b []byte, s string) []byte {
	plain := true
	for i := range len(s) {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' {
			plain = false
			break
		}
	}
	if plain {
		b = append(b, '"')
		b = append(b, s...)
		return append(b, '"')
	}
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
	// base is the flow's created_at, in microseconds since 1970, that
	// the records' times in the flow's row count from (flowRun.base).
	base int64
	// rows are the records that go to rows of their own, as b without its
	// closing brace: of steps without a row yet (FlowStepRows), and over
	// their rows (updates, FlowStepRowsUpdate); written is what those
	// wrote.
	rows, updates []byte
	written       []dbsqlc.FlowStepRowsRow
}

// carry lets the flow's row, still to be written, carry the records, at
// step (see stepPatch.starting).
func (p *stepPatch) carry(step string) { p.carried, p.step = true, step }

// atText is at as those statements take it: NULL when empty.
func (p *stepPatch) atText() pgtype.Text { return pgtype.Text{String: p.at, Valid: p.at != ""} }

// add adds the record of the step at seq, for the flow's row, after the
// form's mark (formMark) for the first.
func (p *stepPatch) add(seq int32, rec *stepRecord) {
	if len(p.b) == 0 {
		p.b = append(p.b, formMark...)
	}
	p.b = appendPlace(p.b, seq)
	p.b = rec.appendInline(p.b, p.base)
}

// put adds the record of the step at seq: for a row of its own when row
// is set (FlowStepRows, see maxInlineSteps), else for the flow's row.
// A record goes over the step's row when the step has one (rec.inRow, as
// recorded before).
func (p *stepPatch) put(seq int32, rec *stepRecord, row bool) {
	switch {
	case row && rec.inRow:
		p.updates = appendRecord(p.updates, seq, rec)
	case row:
		p.rows = appendRecord(p.rows, seq, rec)
	default:
		p.add(seq, rec)
	}
}

// appendRecord appends to b, a JSON object being written, the record of
// the step at seq, for a row of its own.
func appendRecord(b []byte, seq int32, rec *stepRecord) []byte {
	return rec.appendJSON(appendPlace(b, seq))
}

// formMark begins every write of records into the flow's row: a key
// that is no place ("v", the form of migration 00009), so that the claim
// of an executor of the version before, which reads every key of the
// flow's steps as a place, fails (22P02) before it runs anything of a
// flow whose records it cannot read; the statements that read the
// records leave it out.
const formMark = `{"v":9`

// appendPlace appends to b, a JSON object being written, the key of the
// step at seq.
func appendPlace(b []byte, seq int32) []byte {
	if len(b) == 0 {
		b = append(b, '{')
	} else {
		b = append(b, ',')
	}
	b = append(b, '"')
	b = strconv.AppendInt(b, int64(seq), 10)
	return append(b, `":`...)
}

// empty reports whether the patch holds no record for the flow's row: the
// statement that writes the row then leaves its steps as they are (the
// Bare statements, FlowLease), rather than write them again.
func (p *stepPatch) empty() bool { return len(p.b) == 0 }

// queueStepRows queues on b, before the statement that writes the flow's
// row, FlowStepRows and FlowStepRowsUpdate for the records that go to rows
// of their own, if any, and returns how many statements it queued. It
// empties them: what it queued is sent.
func (r *flowRun) queueStepRows(b *pgx.Batch, p *stepPatch) int {
	n := 0
	if len(p.rows) > 0 {
		dbbatch.QueueFlowStepRows(b, dbsqlc.FlowStepRowsParams{Steps: string(p.rows) + "}", Scope: r.k.scope, Key: r.k.key,
			Epoch: r.epoch}, &p.written)
		n++
	}
	if len(p.updates) > 0 {
		dbbatch.QueueFlowStepRowsUpdate(b, dbsqlc.FlowStepRowsUpdateParams{Steps: string(p.updates) + "}", Scope: r.k.scope,
			Key: r.k.key, Epoch: r.epoch}, &p.written)
		n++
	}
	p.rows, p.updates = p.rows[:0], p.updates[:0]
	return n
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
// far as its executor knows (what it read and wrote, in bytes): a new
// step whose record would take it past the bound is recorded as a row of
// its own (FlowStepRecord for a local step, FlowStepRows for a call), as
// idem did before migration 00008, and so are its further records (a
// call's result after its intent). So once a flow's row records that
// much, or a large result, every further step goes to rows, and the
// flow's row, whose later writes leave its steps as they are (FlowLease,
// the Bare statements), is not copied again and again: the WAL of a long
// flow grows with its steps, not with their square.
const maxInlineSteps = 256

// rowParams are the arguments of FlowStepRecord for a local step recorded
// as a row.
func (p *pendingStep) rowParams(k keyRef) dbsqlc.FlowStepRecordParams {
	return dbsqlc.FlowStepRecordParams{Scope: k.scope, Key: k.key, Seq: p.seq, Step: p.rec.Name,
		Result: pgtype.Text{String: string(p.rec.Result), Valid: true}}
}

// inRow reports whether a record of the step at seq, rec, goes to a row
// of its own (see maxInlineSteps): where the step's earlier records went;
// for a new step, when the flow's row would record more than
// maxInlineSteps with it, or an earlier step went to a row (r.spilled): the
// flow's row then records no new step again. A record for the flow's row
// is counted.
func (r *flowRun) inRow(seq int32, rec *stepRecord) bool {
	if earlier, ok := r.recorded[seq]; ok && earlier.inRow {
		return true
	}
	r.scratch = rec.appendInline(r.scratch[:0], r.base.Load())
	n := len(r.scratch)
	if _, ok := r.recorded[seq]; !ok && (r.spilled || r.inline+n > maxInlineSteps) {
		r.spilled = true
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

// recordedSteps decodes the records FlowSteps read, and returns the size
// of those in the flow's row, counted against maxInlineSteps, and whether
// new steps go to rows (flowRun.spilled); the map is nil when there are
// none. base is the flow's created_at (flowRun.base), 0 when there are
// none in the flow's row.
func recordedSteps(rows []dbsqlc.FlowStepsRow) (recorded map[int32]stepRecord, size int, spilled bool, base int64, err error) {
	if len(rows) == 0 {
		return nil, 0, false, 0, nil
	}
	recorded = make(map[int32]stepRecord, len(rows))
	for _, row := range rows {
		if !row.InRow {
			size += len(row.Rec)
			base = row.Base.Time.UnixMicro()
		}
		rec, err := decodeRecord(row.Rec, row.Base.Time.UnixMicro())
		if err != nil {
			return nil, 0, false, 0, fmt.Errorf("idem: flow: step %d's record: %w", row.Seq, err)
		}
		if !rec.done() {
			rec.Result = nil // a call's, read from idem_flow_step_row: null
		}
		rec.inRow = row.InRow
		recorded[row.Seq] = rec
		spilled = spilled || row.InRow
	}
	return recorded, size, spilled || size > maxInlineSteps, base, nil
}

// queueLease queues lease on b: FlowLeaseSteps with the records of steps
// for the flow's row, or FlowLease when there are none, which leaves the
// flow's steps as they are.
func queueLease(b *pgx.Batch, lease dbsqlc.FlowLeaseStepsParams, steps *stepPatch, leased *bool) {
	if steps.empty() {
		dbbatch.QueueFlowLease(b, bareLease(lease), leased)
		return
	}
	lease.Steps = steps.text()
	dbbatch.QueueFlowLeaseSteps(b, lease, leased)
}

// bareLease is lease without records: FlowLease's.
func bareLease(lease dbsqlc.FlowLeaseStepsParams) dbsqlc.FlowLeaseParams {
	return dbsqlc.FlowLeaseParams{Lease: lease.Lease, Step: lease.Step, Scope: lease.Scope, Key: lease.Key, Epoch: lease.Epoch}
}
