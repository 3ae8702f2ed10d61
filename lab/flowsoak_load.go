package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// The flow soak's clients: each operation is sent to a worker picked at
// random and retried with the same key, on any worker, until it is
// answered; some are sent by two clients at once, and some clients give
// up after a failure and come back only at the end.

const (
	// flowSoakAttemptTimeout bounds one attempt. No fault stalls an
	// attempt (a killed worker fails it at once), so it only keeps a bug
	// from hanging the soak.
	flowSoakAttemptTimeout = time.Minute
	// flowSoakRetryDelayMax caps the backoff between an operation's
	// attempts.
	flowSoakRetryDelayMax = 250 * time.Millisecond
	// flowSoakProgressEvery is how often a running soak says how far it got.
	flowSoakProgressEvery = 10 * time.Second
	// flowSoakWorkerGone is the failure of an attempt whose worker died
	// while it ran it; flowSoakWorkerFrozen, of one whose worker was
	// frozen, which its client gave up on.
	flowSoakWorkerGone   = "worker died during the attempt"
	flowSoakWorkerFrozen = "worker frozen during the attempt"
)

// flowSoakOp is one logical operation, and what its clients got.
type flowSoakOp struct {
	i      int
	key    string
	amount int64
	// kill is the point at which a worker dies during the operation, or
	// freezes when freeze is set.
	kill   string
	freeze bool
	// twin sends the operation from two clients at once; abandon has its
	// client give up after a failed attempt.
	twin, abandon bool

	mu      sync.Mutex
	answers []flowSoakAnswer
	// abandoned is set when the client gave up; it came back at the end,
	// and found the operation completed (completedAway) or not.
	abandoned, completedAway bool
	// stopped is set when the flow stopped for a person's decision (410),
	// which an AtMostOnce call does when its outcome is unknown.
	stopped bool
	// faulted is set once an attempt's worker died or froze during it.
	faulted bool
	err     error
}

// flowSoakLoad is the clients of one soak.
type flowSoakLoad struct {
	cfg     flowSoakConfig
	scope   string
	workers *flowSoakWorkers
	client  *http.Client
	// freezeTurn lets one operation at a time freeze a worker, and holds
	// the next until the worker is woken: a freeze waits for other
	// executors to take the frozen worker's flows over, which needs one
	// that is not frozen.
	freezeTurn chan struct{}

	attempts, executed, replayed atomic.Int64
	mu                           sync.Mutex
	failures                     map[string]int64
	samples                      map[string]string
	// killing counts the operations running now that are to kill a
	// worker, by point.
	killing map[string]int64
}

// leastHit returns the first point, in the order of flowKillPoints, that
// was hit the fewest times (hits, plus pending), and that count. The
// faults go to the points that have had the fewest, not to each in turn:
// a fault that missed (its worker was killed by another operation's fault
// before it got to the point, or its flow was done elsewhere first) is
// made again, so that a run of any length meets every point, each as
// often as the others, within one.
func leastHit(hits, pending map[string]int64) (string, int64) {
	point, least := "", int64(-1)
	for _, p := range flowKillPoints {
		if n := hits[p] + pending[p]; least < 0 || n < least {
			point, least = p, n
		}
	}
	return point, least
}

// claimKillPoint picks the point at which an operation that is to kill a
// worker kills it (see leastHit), and whether its client gives up once
// the worker died: every other time at each point. releaseKillPoint is
// called when the operation is over.
func (l *flowSoakLoad) claimKillPoint() (string, bool) {
	kills, _ := l.workers.counts()
	l.mu.Lock()
	defer l.mu.Unlock()
	point, n := leastHit(kills, l.killing)
	l.killing[point]++
	return point, n%2 == 1
}

func (l *flowSoakLoad) releaseKillPoint(point string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.killing[point]--
}

func newFlowSoakClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 256}}
}

// plan lays the operations out: one in KillEvery has a worker killed
// during it, at the point that has had the fewest kills when it starts,
// and every other time at a point its client gives up once the worker
// died, leaving the flow to the resumers; of the others, some are twins,
// some abandoned after a failure. The freezes are laid out as the
// operations start (freezeDue).
func (l *flowSoakLoad) plan() []*flowSoakOp {
	ops := make([]*flowSoakOp, l.cfg.Ops)
	for i := range ops {
		op := &flowSoakOp{i: i, key: fmt.Sprintf("op-%d", i), amount: int64(100 + i)}
		if n := l.cfg.KillEvery; n > 0 && i%n == n-1 {
			op.kill = killPending
		} else {
			op.twin = rand.Float64() < l.cfg.Twin
			op.abandon = !op.twin && rand.Float64() < l.cfg.Abandon
		}
		ops[i] = op
	}
	return ops
}

// runAll runs the operations from the clients, and returns them once each
// was answered, abandoned or failed.
func (l *flowSoakLoad) runAll(ctx context.Context, stdout io.Writer) []*flowSoakOp {
	ops := l.plan()
	var next, done atomic.Int64
	progressCtx, stopProgress := context.WithCancel(ctx)
	var progress sync.WaitGroup
	defer progress.Wait()
	defer stopProgress()
	started := time.Now()
	progress.Go(func() {
		every(progressCtx, flowSoakProgressEvery, func() {
			kills, _ := l.workers.counts()
			freezes, _, _ := l.workers.freezeCounts()
			fmt.Fprintf(stdout, "  %s: %d operations done, %d attempts, %d workers killed, %d frozen and woken\n",
				time.Since(started).Round(time.Second), done.Load(), l.attempts.Load(), sum(kills), sum(freezes))
		})
	})
	var clients sync.WaitGroup
	for range l.cfg.Clients {
		clients.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= len(ops) {
					return
				}
				l.do(ctx, ops[i])
				done.Add(1)
			}
		})
	}
	clients.Wait()
	return ops
}

// do runs op until it is answered, abandoned, or fails.
func (l *flowSoakLoad) do(ctx context.Context, op *flowSoakOp) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.OpTimeout)
	defer cancel()
	var pass func()
	if l.freezeDue(ctx, op) {
		// The turn passes on once the worker is woken.
		var once sync.Once
		thawCtx := context.WithoutCancel(ctx)
		pass = func() {
			once.Do(func() {
				go func() {
					l.workers.waitThawed(thawCtx)
					<-l.freezeTurn
				}()
			})
		}
		defer pass()
	}
	if op.kill == killPending {
		var point string
		point, op.abandon = l.claimKillPoint()
		op.kill = point
		defer l.releaseKillPoint(point)
	}
	kill := op.kill
	if kill == killAnywhere {
		// Whatever the workers are doing now.
		l.workers.killAny(killAnywhere, op.freeze)
		kill = ""
		if pass != nil {
			pass()
		}
	}
	if !op.twin {
		l.send(ctx, op, kill, op.abandon, pass)
		return
	}
	var twin sync.WaitGroup
	twin.Go(func() { l.send(ctx, op, "", false, nil) })
	l.send(ctx, op, "", false, nil)
	twin.Wait()
}

// freezeDue reports whether op is to freeze a worker, and if so waits for
// the freezing turn and marks op with the point that has had the fewest
// freezes (see leastHit): one operation in FreezeEvery (neither a twin nor
// marked to kill) freezes a worker, one at a time, so that the others can
// take its flows over. Every other time at a point, the client gives up
// once the worker froze.
func (l *flowSoakLoad) freezeDue(ctx context.Context, op *flowSoakOp) bool {
	n := l.cfg.FreezeEvery
	if n <= 0 || op.i%n != (n-1)/2 || op.kill != "" || op.twin {
		return false
	}
	select {
	case l.freezeTurn <- struct{}{}:
	case <-ctx.Done():
		return false
	}
	// The turn passes on once the last freeze's worker was woken, and
	// counted: the counts are those of every freeze made.
	freezes, _, _ := l.workers.freezeCounts()
	point, hits := leastHit(freezes, nil)
	op.kill, op.freeze, op.abandon = point, true, hits%2 == 1
	return true
}

// comeBack sends again, until answered, the operations whose clients gave
// up, and notes which were completed meanwhile.
func (l *flowSoakLoad) comeBack(ctx context.Context, ops []*flowSoakOp) {
	var away []*flowSoakOp
	for _, op := range ops {
		if op.abandoned {
			away = append(away, op)
		}
	}
	var next atomic.Int64
	var clients sync.WaitGroup
	for range min(l.cfg.Clients, len(away)) {
		clients.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= len(away) {
					return
				}
				opCtx, cancel := context.WithTimeout(ctx, l.cfg.OpTimeout)
				l.send(opCtx, away[i], "", false, nil)
				cancel()
			}
		})
	}
	clients.Wait()
}

// send sends op until it is answered, or, when abandon is set, until an
// attempt fails. kill, when set, marks the attempts until one fails with
// its worker dead or frozen; pass, when set, passes the freezing turn on
// once a marked attempt is over.
func (l *flowSoakLoad) send(ctx context.Context, op *flowSoakOp, kill string, abandon bool, pass func()) {
	req := flowSoakRequest{Scope: l.scope, Key: op.key, Amount: op.amount, Kill: kill, Freeze: op.freeze && kill != ""}
	var lastErr error
	for attempt := 1; ; attempt++ {
		addr, frozen, err := l.workers.pick(ctx)
		if err != nil {
			op.fail(fmt.Errorf("%s: %w (last error: %v)", op.key, err, lastErr))
			return
		}
		l.attempts.Add(1)
		reply, status, kind, err := l.post(ctx, addr, frozen, req)
		if pass != nil && req.Kill != "" && (err == nil || kind == flowSoakWorkerGone || kind == flowSoakWorkerFrozen) {
			// The marked attempt is over: its worker froze (or died, or
			// it got through).
			pass()
		}
		if err == nil {
			if reply.Replayed {
				l.replayed.Add(1)
			} else {
				l.executed.Add(1)
			}
			op.answered(*reply.Answer, reply.Replayed)
			return
		}
		lastErr = err
		l.recordFailure(kind, err)
		if kind == flowSoakWorkerGone || kind == flowSoakWorkerFrozen {
			op.mu.Lock()
			op.faulted = true
			op.mu.Unlock()
		}
		switch {
		case req.Kill != "" && (kind == flowSoakWorkerGone || kind == flowSoakWorkerFrozen):
			req.Kill, req.Freeze = "", false // the worker died or froze as planned
			if abandon {
				op.away()
				return
			}
		case status == http.StatusGone:
			// Stopped for a person's decision: no retry changes that, and
			// no retry of a marked attempt gets to its point any more.
			op.stop()
			return
		case req.Kill != "":
		case abandon:
			op.away()
			return
		case status != 0 && status != http.StatusConflict && status != http.StatusServiceUnavailable:
			op.fail(fmt.Errorf("%s: %s: %w", op.key, kind, err))
			return
		}
		if ctx.Err() != nil {
			op.fail(fmt.Errorf("%s: no answer within %s, last error: %w", op.key, l.cfg.OpTimeout, err))
			return
		}
		ceiling := min(5*time.Millisecond<<min(attempt-1, 10), flowSoakRetryDelayMax)
		_ = sleep(ctx, rand.N(ceiling)+1)
	}
}

// post sends one attempt to the worker at addr. It returns the reply, or
// the HTTP status (0 when none came), the kind of failure and its error.
func (l *flowSoakLoad) post(ctx context.Context, addr string, frozen context.Context, req flowSoakRequest) (flowSoakReply, int, string, error) {
	var reply flowSoakReply
	body, err := json.Marshal(req)
	if err != nil {
		return reply, 0, "request", err
	}
	ctx, cancel := context.WithTimeout(ctx, flowSoakAttemptTimeout)
	defer cancel()
	// A frozen worker's client gives up on it, as its timeout would.
	defer context.AfterFunc(frozen, cancel)()
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/pay", bytes.NewReader(body))
	if err != nil {
		return reply, 0, "request", err
	}
	resp, err := l.client.Do(hreq)
	if err != nil {
		var opErr *net.OpError
		switch {
		case frozen.Err() != nil:
			return reply, 0, flowSoakWorkerFrozen, err
		case errors.As(err, &opErr) && opErr.Op == "dial":
			return reply, 0, "worker not serving (connection refused)", err
		case ctx.Err() != nil:
			return reply, 0, "attempt or operation timed out", err
		}
		return reply, 0, flowSoakWorkerGone, err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&reply); err != nil {
		if frozen.Err() != nil {
			return reply, resp.StatusCode, flowSoakWorkerFrozen, err
		}
		return reply, resp.StatusCode, flowSoakWorkerGone, err
	}
	if resp.StatusCode == http.StatusOK && reply.Answer != nil {
		return reply, http.StatusOK, "", nil
	}
	return reply, resp.StatusCode, reply.Kind, errors.New(reply.Error)
}

func (l *flowSoakLoad) recordFailure(kind string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failures[kind]++
	if _, ok := l.samples[kind]; !ok {
		l.samples[kind] = err.Error()
	}
}

func (op *flowSoakOp) answered(a flowSoakAnswer, replayed bool) {
	op.mu.Lock()
	defer op.mu.Unlock()
	if op.abandoned && len(op.answers) == 0 {
		op.completedAway = replayed
	}
	op.answers = append(op.answers, a)
}

func (op *flowSoakOp) away() {
	op.mu.Lock()
	defer op.mu.Unlock()
	op.abandoned = true
}

func (op *flowSoakOp) stop() {
	op.mu.Lock()
	defer op.mu.Unlock()
	op.stopped = true
}

// sum adds up counts by kind.
func sum(counts map[string]int64) int64 {
	var n int64
	for _, c := range counts {
		n += c
	}
	return n
}

func (op *flowSoakOp) fail(err error) {
	op.mu.Lock()
	defer op.mu.Unlock()
	if op.err == nil {
		op.err = err
	}
}
