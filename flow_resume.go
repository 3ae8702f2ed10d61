package idem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/pgtime"
)

// resumeBatch is the most flows one pass of Resume takes.
const resumeBatch = 100

// Resume is one pass of the flow's completer: it takes over up to 100 of
// the flow's operations whose lease ran out at least [WithGrace] ago,
// longest abandoned first, and runs each to its end with the input its
// first run recorded, up to four at a time, as [Flow.Run] would for a
// client's retry, so that one whose call hangs (until [WithCallTimeout])
// holds up no other. It returns how many it completed, and the errors of
// the others, joined (each names the operation's scope and a hash of its
// key, as an [Observer]'s logs do). An operation whose run failed again
// waits longer before the next pass takes it, 2^(runs-1) - 1 seconds past
// its lease and grace (0, 1, 3, 7, 15 and so on, up to an hour; a client's
// takeover counts as a run too), so that one that keeps failing does not
// take every pass. It skips, rather than waits for, an operation whose
// executor's local step is still open.
//
// A flow that completed is replayed to its client's retry, which then
// gets the answer the completer recorded. Run it periodically, from every
// replica if you like (each operation goes to one of them), or start a
// [Resumer] ([StartResumer]), which does, for every flow of a service.
func (f *Flow[In, Out]) Resume(ctx context.Context, db TxBeginner) (resumed int, err error) {
	return f.resume(ctx, db, defaultResumeConcurrency)
}

// defaultResumeConcurrency is how many operations a pass of Resume runs at
// once unless ResumerConfig.Concurrency says otherwise.
const defaultResumeConcurrency = 4

// resume is Resume, running up to concurrency operations at once.
func (f *Flow[In, Out]) resume(ctx context.Context, db TxBeginner, concurrency int) (resumed int, err error) {
	o, err := f.options(nil)
	if err != nil {
		return 0, err
	}
	if err := dberr.CheckIdle(db, "a flow commits transactions of its own: pass the pool or an idle connection"); err != nil {
		return 0, err
	}
	var abandoned []dbsqlc.FlowAbandonedRow
	err = onDB(ctx, db, func(q *dbsqlc.Queries) (err error) {
		abandoned, err = q.FlowAbandoned(ctx, dbsqlc.FlowAbandonedParams{FlowName: f.name, Grace: pgtime.Interval(o.grace), MaxRows: resumeBatch})
		return err
	})
	if err != nil {
		return 0, translate(fmt.Sprintf("idem: flow %q: resume", f.name), err)
	}
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	slots := make(chan struct{}, concurrency)
	for _, a := range abandoned {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			mu.Lock()
			errs = append(errs, ctx.Err())
			mu.Unlock()
			break
		}
		wg.Go(func() {
			defer func() { <-slots }()
			completed, err := f.resumeOne(ctx, db, a.Scope, a.Key, &o)
			mu.Lock()
			defer mu.Unlock()
			if completed {
				resumed++
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("scope %q, key %s: %w", a.Scope, o.observer.loggedKey(a.Key), err))
			}
		})
	}
	wg.Wait()
	return resumed, errors.Join(errs...)
}

// resumeOne takes the operation (scope, key) over (FlowAdopt, FlowSteps in
// one round trip) and runs it to its end. It reports false with no error
// when another executor took it first.
func (f *Flow[In, Out]) resumeOne(ctx context.Context, db TxBeginner, scope, key string, o *options) (completed bool, err error) {
	ctx, obs := o.observer.observeFlow(ctx, "idem.Flow.Resume", f.name)
	defer func() { obs.end(scope, key, err) }()
	var adopted dbsqlc.FlowAdoptRow
	var ok bool
	var steps []dbsqlc.FlowStepsRow
	epoch := newEpoch()
	b := &pgx.Batch{}
	dbbatch.QueueFlowAdopt(b, dbsqlc.FlowAdoptParams{Epoch: epoch, Lease: pgtime.Interval(o.lease), Scope: scope, Key: key, FlowName: f.name,
		Grace: pgtime.Interval(o.grace)}, &adopted, &ok)
	dbbatch.QueueFlowSteps(b, dbsqlc.FlowStepsParams{Scope: scope, Key: key}, &steps)
	sent := time.Now()
	if err := sendBatch(ctx, db, b); err != nil {
		return false, translate("idem: flow: take over", err)
	}
	if !ok {
		return false, nil
	}
	obs.claimDone(outcomeResumed)
	// The keys in the table were checked when they were written; the
	// fingerprint is the record's own.
	k := keyRef{scope: scope, key: key}
	keys := providerKeys{namespace: adopted.ProviderNamespace, operation: adopted.Operation}
	r := newFlowRun(db, k, f.name, keys, epoch, adopted.Input, sent, steps, o, obs)
	in, err := replayed[In](adopted.Input, scope, o)
	if err != nil {
		r.release(ctx, err.Error())
		return false, fmt.Errorf("idem: flow %q: recorded input: %w", f.name, err)
	}
	if _, err := f.execute(ctx, r, in.Value); err != nil {
		return false, err
	}
	return true, nil
}

// ResumerConfig configures [StartResumer]. The zero value is usable.
type ResumerConfig struct {
	// Interval is how long the resumer sleeps after a pass of a flow that
	// found fewer operations than a pass takes; after a full pass it
	// starts the flow's next at once. It must not be negative. Defaults
	// to 10s.
	Interval time.Duration

	// Concurrency is how many operations of each flow a pass runs at
	// once: a call that hangs holds up one of them only. It must not be
	// negative. Defaults to 4.
	Concurrency int

	// Logger receives a line per pass that completed operations and per
	// one that failed. Defaults to slog.Default().
	Logger *slog.Logger
}

// Resumable is a flow that a [Resumer] completes: any [*Flow]. Its methods
// are idem's own.
type Resumable interface {
	resume(ctx context.Context, db TxBeginner, concurrency int) (resumed int, err error)
	flowName() string
}

func (f *Flow[In, Out]) flowName() string { return f.name }

// Resumer runs the completers of flows in the background until stopped.
// Create it with [StartResumer].
type Resumer struct {
	cancel  context.CancelFunc
	done    sync.WaitGroup
	resumed atomic.Int64
	once    sync.Once
}

// StartResumer starts completing the abandoned operations of flows in the
// background ([Flow.Resume], pass after pass), on db (a pool), until ctx
// is cancelled or Stop is called: one resumer per replica for every flow
// a service has. Each flow's passes run on their own, so that a flow
// whose calls hang holds up no other. Several resumers of one flow can run
// at once, one per replica: each operation goes to one of them. It
// refuses an invalid cfg, no flow, a nil one, or two flows of one name
// (which would take each other's operations), with a [*FieldError] that
// names the field and wraps [ErrInvalidOption].
func StartResumer(ctx context.Context, db TxBeginner, cfg ResumerConfig, flows ...Resumable) (*Resumer, error) {
	refuse := func(field, format string, args ...any) (*Resumer, error) {
		return nil, &FieldError{Package: "idem", Field: field, Problem: fmt.Sprintf(format, args...)}
	}
	switch {
	case cfg.Interval < 0:
		return refuse("ResumerConfig.Interval", "must not be negative (0 means the default, 10s), got %s", cfg.Interval)
	case cfg.Concurrency < 0:
		return refuse("ResumerConfig.Concurrency", "must not be negative (0 means the default, 4), got %d", cfg.Concurrency)
	case db == nil:
		return refuse("StartResumer", "needs a database, got nil")
	case len(flows) == 0:
		return refuse("StartResumer", "needs the flows to resume, got none")
	}
	names := make(map[string]bool, len(flows))
	for i, f := range flows {
		if f == nil || reflect.ValueOf(f).IsNil() {
			return refuse("StartResumer", "flow %d is nil", i)
		}
		if names[f.flowName()] {
			return refuse("StartResumer", "two flows are named %q: each would take the other's operations", f.flowName())
		}
		names[f.flowName()] = true
	}
	if err := dberr.CheckIdle(db, "a resumer commits transactions of its own: pass the pool"); err != nil {
		return nil, err
	}
	interval := cmp.Or(cfg.Interval, 10*time.Second)
	concurrency := cmp.Or(cfg.Concurrency, defaultResumeConcurrency)
	logger := cmp.Or(cfg.Logger, slog.Default())
	ctx, cancel := context.WithCancel(ctx)
	r := &Resumer{cancel: cancel}
	for _, f := range flows {
		r.done.Go(func() {
			for {
				resumed, err := f.resume(ctx, db, concurrency)
				r.resumed.Add(int64(resumed))
				if resumed > 0 {
					logger.LogAttrs(ctx, slog.LevelInfo, "idem: resumed abandoned flows",
						slog.String("flow", f.flowName()), slog.Int("completed", resumed))
				}
				if err != nil && ctx.Err() == nil {
					logger.LogAttrs(ctx, slog.LevelWarn, "idem: resuming abandoned flows failed",
						slog.String("flow", f.flowName()), slog.Any("error", err))
				}
				if resumed+countErrors(err) >= resumeBatch {
					continue
				}
				if backoff.Sleep(ctx, interval) != nil {
					return
				}
			}
		})
	}
	return r, nil
}

// countErrors counts the errors that errors.Join joined into err.
func countErrors(err error) int {
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		return len(joined.Unwrap())
	}
	if err != nil {
		return 1
	}
	return 0
}

// Stop stops the resumer and waits for the passes running to end.
func (r *Resumer) Stop() {
	r.once.Do(r.cancel)
	r.done.Wait()
}

// Resumed returns how many operations the resumer has completed so far,
// of all its flows.
func (r *Resumer) Resumed() int64 { return r.resumed.Load() }
