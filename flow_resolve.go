package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
)

// CallOutcome is what a person found out about a call a flow stopped at: see
// [Resolution].
type CallOutcome string

const (
	// Applied: the other system applied the call. Its result, as the
	// person found it there, is recorded as the call's, and the flow goes
	// on from the step after it.
	Applied CallOutcome = "applied"
	// NotApplied: the other system did not apply the call. The next run
	// makes it again, with the same provider key, as if for the first
	// time: once, for an [AtMostOnce] call, whose next uncertain attempt
	// stops the flow again.
	NotApplied CallOutcome = "not_applied"
)

// Resolution is what a person found out, at the other system, about the
// call a flow stopped at (see [ResolveFlow]).
type Resolution struct {
	// Step is the name of the call the flow stopped at ([FlowInfo].Step):
	// a resolution of another step is refused ([ErrStepMismatch]).
	Step string
	// Outcome is Applied or NotApplied.
	Outcome CallOutcome
	// Result is the call's result, for Applied only: the value its
	// function would have returned, which json.Marshal encodes (a
	// json.RawMessage is taken as it is). The flow's function gets it
	// from [Call], decoded into the call's type, as any recorded result:
	// give what that type decodes, or every run of the flow fails on it
	// (end it then, [EndFlow]).
	Result any
	// By is who resolved it, and Reason what they found out and where (a
	// ticket, the provider's reference): both required, recorded with the
	// flow and shown by [InspectFlow].
	By, Reason string
}

// FlowResolution is a resolution as the flow records it ([FlowInfo]).
type FlowResolution struct {
	Step    string
	Outcome CallOutcome
	By      string
	Reason  string
	// Stopped is why the flow had stopped: its last error then, sealed as
	// it was when the flow has a [Codec].
	Stopped string
	// At is when it was resolved.
	At time.Time
}

// ResolveFlow settles the call that the flow operation (scope, key)
// stopped at for a person ([ErrFlowStopped]: an [AtMostOnce] call whose
// attempt may have reached the other system, a call past the provider's
// window, a result that could not be stored), with what r says the person
// found out at the other system: [Applied], with its result, or
// [NotApplied]. The flow is running again, with no executor: its next run,
// a client's retry (which answers the client) or [Flow.Resume], continues
// it, from the step after the call, or from the call, made again. To end
// the flow instead, call [EndFlow].
//
// It is fenced like every write of a flow: the flow goes on under a new
// epoch, so that an executor that held it before it stopped, and wakes
// late, commits nothing ([ErrLeaseLost]). A flow that is not stopped for
// attention (running, done, ended, resolved already, or none for the key)
// gives [ErrFlowNotStopped]; a resolution of a step other than the call
// it stopped at gives [ErrStepMismatch]; of two resolutions at once, or a
// resolution and [EndFlow], the first wins and the other gets
// ErrFlowNotStopped. Who resolved it and why are recorded, and shown by
// [InspectFlow].
//
// A flow with a [Codec] stores its results sealed: resolve one as Applied
// with [Flow.Resolve], which seals the result with the flow's codec;
// ResolveFlow refuses it ([ErrFlowSealed]). A resolution that cannot work
// (a step, outcome or result missing, or given where it has no place) is
// refused with a [*FieldError] before anything is sent.
func ResolveFlow(ctx context.Context, db TxBeginner, scope, key string, r Resolution) error {
	o, err := newOptions[FlowOption](nil)
	if err != nil {
		return err
	}
	return resolveFlow(ctx, db, scope, key, "", r, &o)
}

// Resolve is [ResolveFlow] for an operation of this flow, whose result,
// for [Applied], it stores as the flow stores its calls' results: sealed
// with the flow's [Codec], within its [WithMaxResponseSize]. An operation
// of another flow gives [ErrFlowNotStopped].
func (f *Flow[In, Out]) Resolve(ctx context.Context, db TxBeginner, scope, key string, r Resolution) error {
	o, err := f.options(nil)
	if err != nil {
		return err
	}
	return resolveFlow(ctx, db, scope, key, f.name, r, &o)
}

// resolveFlow is ResolveFlow, for the flow named name (any when empty),
// whose results are stored with o, a flow's options when o.codec is set.
func resolveFlow(ctx context.Context, db TxBeginner, scope, key, name string, r Resolution, o *options) error {
	k, err := newKeyRef(scope, key, nil)
	if err != nil {
		return err
	}
	result, err := r.check(scope, o)
	if err != nil {
		return err
	}
	err = WithTx(ctx, db, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		q := dbsqlc.New(tx)
		var pgErr *pgconn.PgError
		f, err := q.FlowResolveTarget(ctx, dbsqlc.FlowResolveTargetParams{Scope: k.scope, Key: k.key})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("%w: the key has no flow", ErrFlowNotStopped)
		case errors.As(err, &pgErr) && pgErr.Code == "55P03":
			return fmt.Errorf("%w: another transaction holds it (another resolution, or a running flow's step)", ErrFlowNotStopped)
		case err != nil:
			return err
		case f.State != flowAttention || name != "" && f.Name != name:
			return fmt.Errorf("%w: it is %s", ErrFlowNotStopped, describeFlow(f.State, f.Name, name))
		case f.Step.String != r.Step:
			return fmt.Errorf("%w: the flow stopped at step %q, not %q", ErrStepMismatch, f.Step.String, r.Step)
		}
		sealed := strings.HasPrefix(f.LastError.String, sealedTextPrefix) || strings.HasPrefix(f.LastError.String, notSealedText)
		if sealed && r.Outcome == Applied && o.codec == nil {
			return fmt.Errorf("%w: resolve it as applied with the flow's Flow.Resolve, which seals the result with its codec", ErrFlowSealed)
		}
		seq, rec, err := stoppedCall(ctx, q, k, r.Step)
		if err != nil {
			return err
		}
		if r.Outcome == Applied {
			rec.State, rec.Result, rec.Completed = "", result, stampNow
		} else {
			rec.State = stepUnsent
		}
		steps := stepPatch{base: f.CreatedAt.Time.UnixMicro()}
		epoch := newEpoch()
		if rec.inRow {
			steps.put(seq, &rec, true)
		} else {
			steps.add(seq, &rec)
		}
		entry, err := resolutionEntry(r, f.LastError.String)
		if err != nil {
			return err
		}
		n, err := q.FlowResolve(ctx, dbsqlc.FlowResolveParams{Epoch: epoch, Steps: steps.text(), Resolution: entry,
			Scope: k.scope, Key: k.key, StoppedEpoch: f.Epoch})
		switch {
		case err != nil:
			return err
		case n == 0:
			// The row is locked since FlowResolveTarget: only a lock that
			// did not hold (a statement pooler between them) gets here.
			return fmt.Errorf("%w: it was resolved or ended meanwhile", ErrFlowNotStopped)
		case rec.inRow:
			// The call's record is a row of its own (see maxInlineSteps):
			// written over, under the flow's new epoch.
			written, err := q.FlowStepRowsUpdate(ctx, dbsqlc.FlowStepRowsUpdateParams{Steps: string(steps.updates) + "}",
				Scope: k.scope, Key: k.key, Epoch: epoch})
			if err == nil && len(written) != 1 {
				err = fmt.Errorf("the call's row was not written")
			}
			return err
		}
		return nil
	})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrFlowNotStopped) || errors.Is(err, ErrStepMismatch) || errors.Is(err, ErrFlowSealed):
		return fmt.Errorf("idem: resolve flow: %w", err)
	}
	return translate("idem: resolve flow", err)
}

// notSealedText is what sealText stores when the codec failed: a sealed
// flow's too.
const notSealedText = "(not stored: the codec could not seal it)"

// describeFlow says what a flow in state is, for the error of a
// resolution that wanted a flow named want (any when empty) stopped.
func describeFlow(state, name, want string) string {
	switch {
	case want != "" && name != want:
		return fmt.Sprintf("an operation of flow %q, not %q", name, want)
	case state == flowRunning:
		return "running (resolved already, or in progress)"
	}
	return state
}

// check checks the resolution, and returns its result as the flow stores
// it, for Applied.
func (r *Resolution) check(scope string, o *options) ([]byte, error) {
	invalid := func(field, problem string) error {
		return &FieldError{Package: "idem", Field: "Resolution." + field, Problem: problem}
	}
	if err := ident.Check(r.Step); err != nil {
		return nil, invalid("Step", fmt.Sprintf("%q: %s", r.Step, err))
	}
	if strings.TrimSpace(r.By) == "" {
		return nil, invalid("By", "empty: say who resolved the call")
	}
	if strings.TrimSpace(r.Reason) == "" {
		return nil, invalid("Reason", "empty: say what was found out, and where")
	}
	switch r.Outcome {
	case Applied:
		if r.Result == nil {
			return nil, invalid("Result", "nil: an applied call needs its result (JSON null is json.RawMessage(\"null\"))")
		}
		result, err := encodeResponse(r.Result, scope, o)
		if err != nil {
			return nil, &FieldError{Package: "idem", Field: "Resolution.Result", Problem: err.Error(), Err: err}
		}
		return result, nil
	case NotApplied:
		if r.Result != nil {
			return nil, invalid("Result", "given for a call that was not applied")
		}
		return nil, nil
	}
	return nil, invalid("Outcome", fmt.Sprintf("%q: want idem.Applied or idem.NotApplied", r.Outcome))
}

// stoppedCall returns the place and record of the call named step, which
// must be a call without a result.
func stoppedCall(ctx context.Context, q *dbsqlc.Queries, k keyRef, step string) (int32, stepRecord, error) {
	rows, err := q.FlowInspectSteps(ctx, dbsqlc.FlowInspectStepsParams{Scope: k.scope, Key: k.key})
	if err != nil {
		return 0, stepRecord{}, err
	}
	for _, row := range rows {
		rec, err := decodeRecord(row.Rec, row.Base.Time.UnixMicro())
		if err != nil {
			return 0, stepRecord{}, fmt.Errorf("step %d's record: %w", row.Seq, err)
		}
		if rec.Name != step {
			continue
		}
		if rec.kind() != stepCall || rec.State != stepCalling {
			return 0, stepRecord{}, fmt.Errorf("%w: step %q is no call waiting for its outcome", ErrStepMismatch, step)
		}
		rec.inRow = row.InRow
		return row.Seq, rec, nil
	}
	return 0, stepRecord{}, fmt.Errorf("%w: the flow recorded no step %q", ErrStepMismatch, step)
}

// resolutionEntry is the resolution as FlowResolve appends it: a JSON
// array of one object, its time the byte the statement replaces.
func resolutionEntry(r Resolution, stopped string) (string, error) {
	b, err := json.Marshal(struct {
		Step    string      `json:"step"`
		Outcome CallOutcome `json:"outcome"`
		By      string      `json:"by"`
		Reason  string      `json:"reason"`
		Stopped string      `json:"stopped,omitempty"`
	}{r.Step, r.Outcome, storableText(r.By), storableText(r.Reason), stopped})
	if err != nil {
		return "", err
	}
	return `[{"at":` + "\x01," + string(b[1:]) + "]", nil
}

// flowResolutions reads the resolutions of the operation (scope, key), for
// InspectFlow.
func flowResolutions(ctx context.Context, q *dbsqlc.Queries, k keyRef) ([]FlowResolution, error) {
	row, err := q.FlowResolutions(ctx, dbsqlc.FlowResolutionsParams{Scope: k.scope, Key: k.key})
	if err != nil {
		return nil, err
	}
	var entries []struct {
		At      int64       `json:"at"`
		Step    string      `json:"step"`
		Outcome CallOutcome `json:"outcome"`
		By      string      `json:"by"`
		Reason  string      `json:"reason"`
		Stopped string      `json:"stopped"`
	}
	if err := json.Unmarshal(row.Resolutions, &entries); err != nil {
		return nil, err
	}
	var out []FlowResolution
	for _, e := range entries {
		if e.At < row.CreatedAt.Time.UnixMicro() {
			continue // the key's operation before (see migration 00010)
		}
		out = append(out, FlowResolution{Step: e.Step, Outcome: e.Outcome, By: e.By, Reason: e.Reason, Stopped: e.Stopped,
			At: time.UnixMicro(e.At)})
	}
	return out, nil
}
