package idem

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/ident"
)

// FlowFilter says which flows [ListFlows] lists.
type FlowFilter struct {
	// State is "attention" (stopped for a person: see [ResolveFlow]),
	// "running" (in progress, held by an executor or waiting for one) or
	// "ended" (by an operator, [EndFlow]). Flows that completed are not
	// listed: [InspectFlow] shows one.
	State string
	// Name and Scope, when not empty, list only the flows of that name
	// (see [NewFlow]) or of that scope.
	Name, Scope string
	// After is the cursor of the page before ([FlowPage].Next); empty for
	// the first page.
	After string
	// Limit is the most flows a page holds: 50 when 0, at most 1000.
	Limit int
}

// FlowPage is a page of flows, newest first.
type FlowPage struct {
	Flows []FlowSummary
	// Next is the cursor of the next page (FlowFilter.After), empty when
	// this page is the last.
	Next string
}

// FlowSummary is a flow as [ListFlows] lists it: what [InspectFlow] shows
// of it but its input, answer and steps.
type FlowSummary struct {
	Scope, Key, Name, State string
	// Step is the step the flow is at, or stopped at (see [FlowInfo].Step).
	Step string
	// Runs counts the runs that took the flow on.
	Runs int
	// LastError is why the flow stopped, the error of its last failed run,
	// or why an operator ended it: sealed, when the flow has a [Codec]
	// ("sealed:" and base64).
	LastError string
	// LeasedUntil is when a running flow's lease runs out; Leased reports
	// whether it holds now (see [FlowInfo].Leased).
	LeasedUntil time.Time
	Leased      bool
	// CreatedAt is when the flow started; CompletedAt when an ended flow
	// was ended.
	CreatedAt, CompletedAt time.Time
}

const (
	defaultFlowPage = 50
	maxFlowPage     = 1000
)

// ListFlows lists the flows in filter.State, newest first (by when they
// started), a page at a time, in a read-only transaction on db, a pool or
// an idle connection: for operators, who see every scope's flows, keys in
// the clear, unless filter.Scope names one. A page of flows stopped for
// attention or ended reads only those (an index holds them); running
// flows are read all at once and sorted, since they are the flows in
// progress. A state, scope, name, cursor or limit that cannot work is
// refused with a [*FieldError] before anything is sent.
func ListFlows(ctx context.Context, db TxBeginner, filter FlowFilter) (FlowPage, error) {
	params, err := filter.params()
	if err != nil {
		return FlowPage{}, err
	}
	var rows []dbsqlc.FlowListRow
	err = WithTx(ctx, db, readOnly, func(ctx context.Context, tx pgx.Tx) (err error) {
		rows, err = dbsqlc.New(tx).FlowList(ctx, params)
		return err
	})
	if err != nil {
		return FlowPage{}, translate("idem: list flows", err)
	}
	var page FlowPage
	if limit := int(params.MaxRows) - 1; len(rows) > limit {
		// The row read past the page says that another follows, from the
		// page's last flow on.
		rows = rows[:limit]
		last := rows[limit-1]
		page.Next = flowCursor{Created: last.CreatedAt.Time.UnixMicro(), Scope: last.Scope, Key: last.Key}.String()
	}
	for _, f := range rows {
		page.Flows = append(page.Flows, FlowSummary{Scope: f.Scope, Key: f.Key, Name: f.Name, State: f.State,
			Step: f.Step.String, Runs: int(f.Runs), LastError: f.LastError.String, LeasedUntil: timeOf(f.LeasedUntil),
			Leased: f.Leased, CreatedAt: timeOf(f.CreatedAt), CompletedAt: timeOf(f.CompletedAt)})
	}
	return page, nil
}

// params checks the filter, and returns FlowList's arguments: one row
// more than the page, which says whether another follows.
func (f FlowFilter) params() (dbsqlc.FlowListParams, error) {
	invalid := func(field, problem string) error {
		return &FieldError{Package: "idem", Field: "FlowFilter." + field, Problem: problem}
	}
	p := dbsqlc.FlowListParams{State: f.State, FlowName: f.Name, Scope: f.Scope,
		AfterCreated: pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true}}
	switch f.State {
	case flowAttention, flowRunning, flowEnded:
	default:
		return p, invalid("State", fmt.Sprintf("%q: want attention, running or ended", f.State))
	}
	if f.Name != "" {
		if err := ident.Check(f.Name); err != nil {
			return p, invalid("Name", err.Error())
		}
	}
	if f.Scope != "" {
		if err := ident.Check(f.Scope); err != nil {
			return p, &FieldError{Package: "idem", Field: "FlowFilter.Scope", Problem: err.Error(), Err: ErrInvalidScope}
		}
	}
	switch {
	case f.Limit < 0 || f.Limit > maxFlowPage:
		return p, invalid("Limit", fmt.Sprintf("%d: want 1 to %d, or 0 for %d", f.Limit, maxFlowPage, defaultFlowPage))
	case f.Limit == 0:
		p.MaxRows = defaultFlowPage + 1
	default:
		p.MaxRows = int32(f.Limit) + 1
	}
	if f.After != "" {
		c, err := parseFlowCursor(f.After)
		if err != nil {
			return p, invalid("After", "not a cursor of ListFlows': pass FlowPage.Next as it is")
		}
		p.AfterCreated = pgtype.Timestamptz{Time: time.UnixMicro(c.Created), Valid: true}
		p.AfterScope, p.AfterKey = c.Scope, c.Key
	}
	return p, nil
}

// flowCursor is where a page of ListFlows ended: its last flow, by when
// it started (microseconds since 1970), scope and key.
type flowCursor struct {
	Created int64  `json:"t"`
	Scope   string `json:"s"`
	Key     string `json:"k"`
}

// String is the cursor as FlowPage.Next gives it: base64 (URL-safe,
// unpadded) of its JSON.
func (c flowCursor) String() string {
	b, _ := json.Marshal(c) // strings and a number always encode
	return base64.RawURLEncoding.EncodeToString(b)
}

func parseFlowCursor(s string) (flowCursor, error) {
	var c flowCursor
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err == nil && (ident.Check(c.Scope) != nil || ident.Check(c.Key) != nil) {
		err = fmt.Errorf("scope or key")
	}
	return c, err
}
