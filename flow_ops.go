package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// FlowInfo is what idem holds for one flow operation: see [InspectFlow].
type FlowInfo struct {
	// Found reports whether (scope, key) has a flow. When it has none, the
	// other fields are zero.
	Found bool
	// Name is the flow's name (see [NewFlow]).
	Name string
	// State is "running" (in progress, held by an executor or waiting for
	// one), "done" (its answer is recorded), "attention" (stopped for a
	// person's decision: see [ErrFlowStopped]) or "ended" (by [EndFlow]).
	State string
	// Step is the step a running flow's executor is at, or was at when it
	// stopped. It lags while a local step runs: the step's BEGIN only
	// locks the flow's row, and the step is noted as its record is
	// written, when its transaction commits: until then Step names the
	// step before.
	Step string
	// Runs counts the runs that took the flow on: its first, and every
	// takeover after an executor failed or vanished.
	Runs int
	// LastError is the error of the last run that failed, the reason a
	// flow needs attention, or the reason an operator gave for ending it:
	// sealed, as Input and Output are, when the flow has a [Codec] ("sealed:"
	// and the base64 of the sealed bytes).
	LastError string
	// LeasedUntil is when the executor's lease runs out; Leased reports
	// whether it holds now. A local step's BEGIN locks the flow's row
	// without renewing the lease (its one write renews it), so a flow in
	// a long local step may show Leased false while nobody can take it
	// over: the row stays locked until the step's transaction ends.
	LeasedUntil time.Time
	Leased      bool
	// Fingerprint is the fingerprint of the request that started the flow.
	Fingerprint []byte
	// Input and Output are the stored input and answer, as stored: JSON,
	// sealed when the flow has a [Codec]. They may hold personal data.
	Input, Output []byte
	// CreatedAt, CompletedAt and ExpiresAt are when the flow started, when
	// it finished, and when its retention ends.
	CreatedAt, CompletedAt, ExpiresAt time.Time
	// Expired reports whether the retention has passed: the key counts as
	// absent, and its next run starts the flow again.
	Expired bool
	// Steps are the steps the flow recorded, in order.
	Steps []FlowStep
	// Resolutions are what people found out about the calls the flow
	// stopped at ([ResolveFlow]), in order.
	Resolutions []FlowResolution
}

// FlowStep is a step of a flow, as [InspectFlow] shows it.
type FlowStep struct {
	// Name is the step's name, Kind "local" or "call".
	Name, Kind string
	// State is "done" once its result is recorded. A call whose intent is
	// recorded without a result is "calling" when an attempt may have
	// reached the other system (a run of the flow resolves it first: see
	// [Call]), "unsent" when every attempt surely did not; a
	// [BestEffort] call's is "unknown" once recorded so.
	State string
	// Attempts counts a call's attempts that may have reached the other
	// system: its function was called and did not return an error
	// wrapping [ErrNotSent] (1 for a local step). An attempt whose
	// function was never called (the run's context ended, its lease ran
	// out) is not one.
	Attempts int
	// Result is the step's result as stored, JSON or sealed.
	Result []byte
	// ProviderKey is a call's provider key (see [Call]).
	ProviderKey string
	// FirstCalledAt is when a call's first attempt was made; CompletedAt
	// is when the step's result was recorded.
	FirstCalledAt, CompletedAt time.Time
	// Reconciles counts the lookups made for a call whose outcome was not
	// known ([Reconcile]); LastReconcile is the last one's outcome:
	// "found", "not_found", or "failed: " and its error (sealed when the
	// flow has a [Codec], as LastError is).
	Reconciles    int
	LastReconcile string
}

// InspectFlow reads what idem holds for the flow operation (scope, key),
// whatever its state, in a read-only transaction on db, a pool or an idle
// connection. A key without a flow is not an error: FlowInfo.Found is
// false, as it is for a flow whose first step has not committed yet (its
// row commits with that step). Scopes and keys are checked as [Do] checks
// them.
func InspectFlow(ctx context.Context, db TxBeginner, scope, key string) (FlowInfo, error) {
	k, err := newKeyRef(scope, key, nil)
	if err != nil {
		return FlowInfo{}, err
	}
	var info FlowInfo
	err = WithTx(ctx, db, readOnly, func(ctx context.Context, tx pgx.Tx) error {
		q := dbsqlc.New(tx)
		f, err := q.FlowInspect(ctx, dbsqlc.FlowInspectParams{Scope: k.scope, Key: k.key})
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("idem: inspect flow: %w", err)
		}
		info = FlowInfo{Found: true, Name: f.Name, State: f.State, Step: f.Step.String, Runs: int(f.Runs),
			LastError: f.LastError.String, LeasedUntil: timeOf(f.LeasedUntil), Leased: f.Leased,
			Fingerprint: f.Fingerprint, Input: f.Input, Output: f.Output, CreatedAt: timeOf(f.CreatedAt),
			CompletedAt: timeOf(f.CompletedAt), ExpiresAt: timeOf(f.ExpiresAt), Expired: f.Expired}
		steps, err := q.FlowInspectSteps(ctx, dbsqlc.FlowInspectStepsParams{Scope: k.scope, Key: k.key})
		if err != nil {
			return fmt.Errorf("idem: inspect flow: steps: %w", err)
		}
		for _, s := range steps {
			rec, err := decodeRecord(s.Rec, s.Base.Time.UnixMicro())
			if err != nil {
				return fmt.Errorf("idem: inspect flow: step %d's record: %w", s.Seq, err)
			}
			step := FlowStep{Name: rec.Name, Kind: rec.kind(), State: rec.State, Attempts: attemptsOf(&rec),
				Result: rec.Result, FirstCalledAt: microsTime(rec.FirstCalled), CompletedAt: microsTime(rec.Completed),
				Reconciles: int(rec.Reconciles), LastReconcile: rec.LastReconcile}
			if step.State == "" {
				step.State = "done"
			} else {
				step.Result = nil
			}
			if step.Kind == stepCall {
				step.ProviderKey = providerKeys{namespace: f.ProviderNamespace, operation: f.Operation}.of(k.scope, k.key, rec.Name)
			}
			info.Steps = append(info.Steps, step)
		}
		if info.Resolutions, err = flowResolutions(ctx, q, k); err != nil {
			return fmt.Errorf("idem: inspect flow: resolutions: %w", err)
		}
		return nil
	})
	return info, err
}

// microsTime is t, microseconds since 1970, as a time: the zero time for
// 0.
func microsTime(t int64) time.Time {
	if t == 0 {
		return time.Time{}
	}
	return time.UnixMicro(t)
}

// EndFlow ends the flow operation (scope, key), running or stopped for
// attention, for an operator who has settled it by hand (say, refunded or
// confirmed a charge with the provider): nothing runs it again, its
// executor, if one still runs, commits nothing more ([ErrLeaseLost]), and
// until its retention (counted from now) has passed, every run for the key
// gets [ErrFlowStopped] with reason. It reports false when the key has no
// flow that is running or stopped, as for a flow whose first step has not
// committed yet.
func EndFlow(ctx context.Context, db TxBeginner, scope, key, reason string) (ended bool, err error) {
	k, err := newKeyRef(scope, key, nil)
	if err != nil {
		return false, err
	}
	var n int64
	err = onDB(ctx, db, func(q *dbsqlc.Queries) (err error) {
		n, err = q.FlowEnd(ctx, dbsqlc.FlowEndParams{Reason: storableText(reason), Scope: k.scope, Key: k.key})
		return err
	})
	if err != nil {
		return false, translate("idem: end flow", err)
	}
	return n == 1, nil
}

// attemptsOf is what FlowStep.Attempts says of rec: its attempts, for a
// call, and 1 for a local step.
func attemptsOf(rec *stepRecord) int {
	if rec.kind() == stepLocal {
		return 1
	}
	return int(rec.Attempts)
}
