package idemconsole

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/outbox"
)

// page is what every page's template gets: the console's settings, the
// forms' token, the page's title and tab, a notice or a problem to show,
// and the page's own data.
type page struct {
	Title, Tab      string
	ReadOnly        bool
	Token           string
	Notice, Problem string
	Data            any
}

// render writes the page named name with data, with status.
func (c *console) render(w http.ResponseWriter, r *http.Request, status int, name string, p page) {
	p.ReadOnly, p.Token = c.cfg.ReadOnly, c.token(w, r)
	if p.Notice == "" {
		p.Notice = notices[r.URL.Query().Get("done")]
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	if err := c.pages[name].Execute(w, p); err != nil {
		c.log.Error("idem console: render", "page", name, "error", err)
	}
}

// notices are what a page says after an action (?done=...).
var notices = map[string]string{
	"applied":     "Resolved: the call is recorded as applied, with its result. The flow's next run (the client's retry, or Resume) continues it from the step after.",
	"not_applied": "Resolved: the call is recorded as not applied. The flow's next run makes it again, with the same provider key.",
	"ended":       "Ended: every retry of the key is told the operation was stopped.",
	"requeued":    "Requeued: a relay delivers the message again, from its first attempt.",
}

// problem writes a page that says what went wrong, with status.
func (c *console) problem(w http.ResponseWriter, r *http.Request, status int, why string) {
	c.render(w, r, status, "problem", page{Title: http.StatusText(status), Problem: why})
}

// failed writes the problem of a read that failed: the database's
// errors are logged, not shown.
func (c *console) failed(w http.ResponseWriter, r *http.Request, what string, err error) {
	if errors.Is(err, idem.ErrInvalidOption) || errors.Is(err, idem.ErrInvalidScope) || errors.Is(err, idem.ErrInvalidKey) {
		c.problem(w, r, http.StatusBadRequest, err.Error())
		return
	}
	c.log.Error("idem console: "+what, "error", err)
	c.problem(w, r, http.StatusInternalServerError, what+" failed: the console's log says why")
}

func (c *console) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	stats, err := idem.ReadStats(ctx, c.cfg.DB)
	if err != nil {
		c.failed(w, r, "reading the stats", err)
		return
	}
	attention, err := idem.ListFlows(ctx, c.cfg.DB, idem.FlowFilter{State: "attention", Limit: 10})
	if err != nil {
		c.failed(w, r, "listing the flows", err)
		return
	}
	running, err := idem.ListFlows(ctx, c.cfg.DB, idem.FlowFilter{State: "running", Limit: 10})
	if err != nil {
		c.failed(w, r, "listing the flows", err)
		return
	}
	c.render(w, r, http.StatusOK, "overview", page{Title: "Overview", Tab: "overview", Data: struct {
		Stats              idem.Stats
		Attention, Running idem.FlowPage
	}{stats, attention, running}})
}

func (c *console) flows(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := idem.FlowFilter{State: q.Get("state"), Name: q.Get("name"), Scope: q.Get("scope"), After: q.Get("after")}
	if f.State == "" {
		f.State = "attention"
	}
	list, err := idem.ListFlows(r.Context(), c.cfg.DB, f)
	if err != nil {
		c.failed(w, r, "listing the flows", err)
		return
	}
	next := ""
	if list.Next != "" {
		v := url.Values{"state": {f.State}, "after": {list.Next}}
		if f.Name != "" {
			v.Set("name", f.Name)
		}
		if f.Scope != "" {
			v.Set("scope", f.Scope)
		}
		next = c.path("/flows?" + v.Encode())
	}
	titles := map[string]string{"attention": "Needing attention", "running": "Running and stalled", "ended": "Ended"}
	c.render(w, r, http.StatusOK, "flows", page{Title: titles[f.State], Tab: f.State, Data: struct {
		Filter idem.FlowFilter
		Page   idem.FlowPage
		Next   string
	}{f, list, next}})
}

// flowData is what the flow page shows: the flow, and the call it
// stopped at, which the resolve forms settle.
type flowData struct {
	Scope, Key string
	Info       idem.FlowInfo
	// Stopped is the call the flow stopped at, if it waits for its
	// outcome; Sealed is set when the flow's records are sealed.
	Stopped *idem.FlowStep
	Sealed  bool
	// Result, Reason and Outcome are the form's, kept when an action was
	// refused.
	Result, Reason string
}

func (c *console) flow(w http.ResponseWriter, r *http.Request) {
	c.flowPage(w, r, http.StatusOK, flowData{Scope: r.URL.Query().Get("scope"), Key: r.URL.Query().Get("key")}, "")
}

func (c *console) flowPage(w http.ResponseWriter, r *http.Request, status int, d flowData, problem string) {
	info, err := idem.InspectFlow(r.Context(), c.cfg.DB, d.Scope, d.Key)
	if err != nil {
		c.failed(w, r, "reading the flow", err)
		return
	}
	if !info.Found {
		c.problem(w, r, http.StatusNotFound, fmt.Sprintf("No flow for scope %q, key %q.", d.Scope, d.Key))
		return
	}
	d.Info = info
	d.Sealed = sealed(info.LastError)
	if info.State == "attention" {
		for i, s := range info.Steps {
			if s.Name == info.Step && s.Kind == "call" && s.State == "calling" {
				d.Stopped = &info.Steps[i]
			}
		}
	}
	c.render(w, r, status, "flow", page{Title: "Flow " + info.Name, Tab: "attention", Problem: problem, Data: d})
}

// resolve settles the call a flow stopped at (idem.ResolveFlow).
func (c *console) resolve(w http.ResponseWriter, r *http.Request, operator string) {
	f := r.PostForm
	d := flowData{Scope: f.Get("scope"), Key: f.Get("key"), Result: f.Get("result"), Reason: f.Get("reason")}
	res := idem.Resolution{Step: f.Get("step"), Outcome: idem.CallOutcome(f.Get("outcome")), By: operator, Reason: d.Reason}
	var err error
	if res.Outcome == idem.Applied {
		if !json.Valid([]byte(d.Result)) {
			err = errNotJSON
		}
		res.Result = json.RawMessage(d.Result)
	}
	if err == nil {
		err = idem.ResolveFlow(r.Context(), c.cfg.DB, d.Scope, d.Key, res)
	}
	c.audit(r, operator, "resolve", err, "scope", d.Scope, "key", d.Key, "step", res.Step, "outcome", res.Outcome, "reason", res.Reason)
	if err != nil {
		c.refused(w, r, d, err)
		return
	}
	http.Redirect(w, r, c.flowPath(d.Scope, d.Key, string(res.Outcome)), http.StatusSeeOther)
}

// end ends a flow (idem.EndFlow), recording who in its reason.
func (c *console) end(w http.ResponseWriter, r *http.Request, operator string) {
	f := r.PostForm
	d := flowData{Scope: f.Get("scope"), Key: f.Get("key"), Reason: f.Get("reason")}
	var err error
	if strings.TrimSpace(d.Reason) == "" {
		err = &idem.FieldError{Package: "idemconsole", Field: "reason", Problem: "empty: say why the flow ends"}
	} else {
		var ended bool
		ended, err = idem.EndFlow(r.Context(), c.cfg.DB, d.Scope, d.Key, "ended by "+operator+": "+d.Reason)
		if err == nil && !ended {
			err = fmt.Errorf("%w: it is neither running nor stopped", idem.ErrFlowNotStopped)
		}
	}
	c.audit(r, operator, "end", err, "scope", d.Scope, "key", d.Key, "reason", d.Reason)
	if err != nil {
		c.refused(w, r, d, err)
		return
	}
	http.Redirect(w, r, c.flowPath(d.Scope, d.Key, "ended"), http.StatusSeeOther)
}

func (c *console) flowPath(scope, key, done string) string {
	return c.path("/flow?" + url.Values{"scope": {scope}, "key": {key}, "done": {done}}.Encode())
}

// refused writes the flow page again, with what refused an action: the
// form (400) or the flow's state (409); the database's errors are logged,
// not shown (500).
func (c *console) refused(w http.ResponseWriter, r *http.Request, d flowData, err error) {
	switch {
	case errors.Is(err, idem.ErrInvalidOption), errors.Is(err, idem.ErrInvalidScope), errors.Is(err, idem.ErrInvalidKey),
		errors.Is(err, errNotJSON):
		c.flowPage(w, r, http.StatusBadRequest, d, err.Error())
	case errors.Is(err, idem.ErrFlowNotStopped), errors.Is(err, idem.ErrStepMismatch), errors.Is(err, idem.ErrFlowSealed):
		c.flowPage(w, r, http.StatusConflict, d, err.Error())
	default:
		c.flowPage(w, r, http.StatusInternalServerError, d, "the action failed: the console's log says why")
	}
}

// errNotJSON refuses a result that is not JSON.
var errNotJSON = errors.New("the result is not JSON: give the call's result as its function returns it, encoded")

func (c *console) keyPage(w http.ResponseWriter, r *http.Request) {
	scope, key := r.URL.Query().Get("scope"), r.URL.Query().Get("key")
	d := struct {
		Scope, Key string
		Looked     bool
		Info       idem.KeyInfo
		Flow       bool
	}{Scope: scope, Key: key}
	if scope != "" || key != "" {
		info, err := idem.Inspect(r.Context(), c.cfg.DB, scope, key)
		if err != nil {
			c.failed(w, r, "reading the key", err)
			return
		}
		flow, err := idem.InspectFlow(r.Context(), c.cfg.DB, scope, key)
		if err != nil {
			c.failed(w, r, "reading the key's flow", err)
			return
		}
		d.Looked, d.Info, d.Flow = true, info, flow.Found
	}
	c.render(w, r, http.StatusOK, "key", page{Title: "A key's record", Tab: "key", Data: d})
}

// maxParked is the most parked messages a page of the outbox shows.
const maxParked = 50

func (c *console) outbox(w http.ResponseWriter, r *http.Request) {
	before := int64(1<<63 - 1)
	if b := r.URL.Query().Get("before"); b != "" {
		var err error
		if before, err = strconv.ParseInt(b, 10, 64); err != nil {
			c.problem(w, r, http.StatusBadRequest, "before: not a message's id")
			return
		}
	}
	var rows []dbsqlc.OutboxParkedListRow
	err := idem.WithTx(r.Context(), c.cfg.DB, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(ctx context.Context, tx pgx.Tx) (err error) {
		rows, err = dbsqlc.New(tx).OutboxParkedList(ctx, dbsqlc.OutboxParkedListParams{BeforeID: before, MaxRows: maxParked + 1})
		return err
	})
	if err != nil {
		c.failed(w, r, "listing the parked messages", err)
		return
	}
	stats, err := idem.ReadStats(r.Context(), c.cfg.DB)
	if err != nil {
		c.failed(w, r, "reading the stats", err)
		return
	}
	next := ""
	if len(rows) > maxParked {
		rows = rows[:maxParked]
		next = c.path("/outbox?before=" + strconv.FormatInt(rows[maxParked-1].ID, 10))
	}
	c.render(w, r, http.StatusOK, "outbox", page{Title: "Outbox", Tab: "outbox", Data: struct {
		Stats  idem.Stats
		Parked []dbsqlc.OutboxParkedListRow
		Next   string
	}{stats, rows, next}})
}

// requeue sends a parked message again (outbox.Requeue).
func (c *console) requeue(w http.ResponseWriter, r *http.Request, operator string) {
	id, err := strconv.ParseInt(r.PostForm.Get("id"), 10, 64)
	if err != nil {
		c.problem(w, r, http.StatusBadRequest, "not a message's id")
		return
	}
	var requeued bool
	err = idem.WithTx(r.Context(), c.cfg.DB, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (err error) {
		requeued, err = outbox.Requeue(ctx, tx, id)
		return err
	})
	if err == nil && !requeued {
		err = errNotParked
	}
	c.audit(r, operator, "requeue", err, "message", id)
	switch {
	case errors.Is(err, errNotParked):
		c.problem(w, r, http.StatusConflict, fmt.Sprintf("Message %d: %v", id, err))
		return
	case err != nil:
		c.problem(w, r, http.StatusInternalServerError, "the action failed: the console's log says why")
		return
	}
	http.Redirect(w, r, c.path("/outbox?done=requeued"), http.StatusSeeOther)
}

// errNotParked refuses to requeue a message that is not parked.
var errNotParked = errors.New("the message is not parked: requeued already, or delivered")

// when formats a time for a page: UTC, to the second; "-" for none.
func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// ago says how long ago t was, or how long until it.
func ago(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	d := time.Since(t)
	if d < 0 {
		return "in " + (-d).Round(time.Second).String()
	}
	return d.Round(time.Second).String() + " ago"
}

// stored is a stored value as a page shows it: as stored when the
// console shows them, else its size.
func (c *console) stored(b []byte) string {
	switch {
	case b == nil:
		return "-"
	case c.cfg.ShowStored:
		return string(b)
	}
	return fmt.Sprintf("(%d bytes, not shown)", len(b))
}

// sealed reports whether a flow's text or value is sealed by a codec: its
// texts start with "sealed:", its values are JSON strings of base64.
func sealed(s string) bool { return strings.HasPrefix(s, "sealed:") }

// short cuts s for a table's cell.
func short(s string) string {
	if len(s) <= 160 {
		return s
	}
	return strings.ToValidUTF8(s[:160], "") + "…"
}

func hexOf(b []byte) string { return hex.EncodeToString(b) }
