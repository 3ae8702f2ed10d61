package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The flow soak's worker processes, as the soak sees them: started, killed
// with SIGKILL and restarted at once, frozen with SIGSTOP and woken with
// SIGCONT once other executors have taken their flows over, and stopped at
// the end.

// flowSoakStartTimeout bounds a worker's start, from exec to its ready
// line: past it the start counts as failed. It only keeps a broken worker
// from hanging the soak.
const flowSoakStartTimeout = 2 * time.Minute

// flowSoakRestartDelayMax caps the pause between a slot's failed start
// and its next: a start that failed (the server out of connection slots,
// the machine too loaded to start a process in time) is tried again, with
// a pause that doubles from 10ms, for as long as the soak runs. A slot
// never gives up: with one worker frozen, a slot that gave up would leave
// the soak without a worker to serve, or to take the frozen one's flows
// over, until the freeze's limit.
const flowSoakRestartDelayMax = time.Second

// flowSoakWorkers runs the worker processes.
type flowSoakWorkers struct {
	exe     string
	spec    flowSoakWorkerSpec
	verbose bool
	stdout  io.Writer

	mu       sync.Mutex
	slots    []*flowSoakSlot
	changed  chan struct{} // closed and replaced when a slot starts or stops serving
	stopping bool
	wg       sync.WaitGroup
	// kills counts workers killed, by point; restarts, the processes
	// started after the first of each slot; failedStarts, the starts that
	// failed and were tried again.
	kills        map[string]int64
	restarts     int64
	failedStarts int64
	// lastStartFailure says why the last failed start failed.
	lastStartFailure string
	// problems are the exits that no kill explains.
	problems []string

	// admin reads the flows' state for the freezes; lease is the flows'
	// lease, limit the longest a worker stays frozen.
	admin        *pgxpool.Pool
	lease, limit time.Duration
	// freezes counts the workers frozen and woken, by point; frozen, those
	// frozen now; wokenEarly, those woken at limit, before every flow they
	// may have held was taken over or ended; overlapping, the freezes
	// undone at once because another worker was frozen; longestFrozen, the
	// longest freeze.
	freezes     map[string]int64
	frozen      int
	wokenEarly  int64
	overlapping int64
	// frozenWhat is the last freeze, for the report of one undone.
	frozenWhat string
	// frozenSpans are the times each process (flowSoakProcess) was
	// frozen, from the freeze to the SIGCONT.
	frozenSpans   map[string][][2]time.Time
	longestFrozen time.Duration
}

// flowSoakSlot is one worker, run again each time it dies.
type flowSoakSlot struct {
	id   int
	gen  int
	proc *os.Process
	// addr is where it serves; empty when it does not. lastAddr is where
	// its process served last.
	addr, lastAddr string
	stdin          io.Closer
	// exited is closed when the current process has exited.
	exited chan struct{}
	// killing is the point at which the soak killed it, or it said it
	// killed itself.
	killing string
	logs    *flowSoakTail
	// attempts ends when the worker is frozen, ending the clients'
	// attempts that it runs; cancelAttempts ends it.
	attempts       context.Context
	cancelAttempts context.CancelFunc
	// frozen is set while the worker is frozen; it then does not serve.
	frozen bool
}

func newFlowSoakWorkers(exe string, spec flowSoakWorkerSpec, verbose bool, stdout io.Writer) *flowSoakWorkers {
	return &flowSoakWorkers{exe: exe, spec: spec, verbose: verbose, stdout: stdout,
		changed: make(chan struct{}), kills: make(map[string]int64), freezes: make(map[string]int64),
		frozenSpans: make(map[string][][2]time.Time)}
}

// start starts n workers and waits until each serves.
func (ws *flowSoakWorkers) start(ctx context.Context, n int) error {
	for i := range n {
		slot := &flowSoakSlot{id: i, logs: &flowSoakTail{tag: fmt.Sprintf("worker %d:", i)}}
		if ws.verbose {
			slot.logs.echo = ws.stdout
		}
		ws.slots = append(ws.slots, slot)
		ready := make(chan error, 1)
		ws.wg.Go(func() { ws.keep(ctx, slot, ready) })
		if err := <-ready; err != nil {
			return err
		}
	}
	return nil
}

// keep runs slot's worker, starting it again each time it dies, until the
// soak stops. ready gets the first start's outcome: a soak whose workers
// cannot start at all fails at once. Later failed starts are tried again
// (see flowSoakRestartDelayMax), and counted.
func (ws *flowSoakWorkers) keep(ctx context.Context, slot *flowSoakSlot, ready chan<- error) {
	delay := 10 * time.Millisecond
	for gen := 1; ; gen++ {
		if gen > 1 {
			ws.mu.Lock()
			ws.restarts++
			ws.mu.Unlock()
		}
		started, err := ws.run(ctx, slot, gen, ready)
		first := ready != nil
		ready = nil
		ws.mu.Lock()
		stopping := ws.stopping
		switch {
		case started && err != nil:
			ws.problems = append(ws.problems, fmt.Sprintf("worker %d (start %d): %v", slot.id, gen, err))
		case !started && err != nil && !stopping:
			ws.failedStarts++
		}
		ws.mu.Unlock()
		if stopping || ctx.Err() != nil || (first && !started) {
			return
		}
		if started {
			delay = 10 * time.Millisecond
			continue
		}
		if sleep(ctx, delay) != nil {
			return
		}
		delay = min(2*delay, flowSoakRestartDelayMax)
	}
}

// run runs one process of slot to its end. It reports whether the process
// served, and returns an error when the process failed to start or ended
// in a way that no kill explains.
func (ws *flowSoakWorkers) run(ctx context.Context, slot *flowSoakSlot, gen int, ready chan<- error) (bool, error) {
	spec := ws.spec
	spec.Slot, spec.Gen = slot.id, gen
	specJSON, err := json.Marshal(spec)
	if err != nil {
		return false, err
	}
	// Not CommandContext: the soak kills its workers itself, and stops
	// them by closing their input.
	cmd := exec.Command(ws.exe, "flowsoak")
	cmd.Env = append(os.Environ(), flowSoakWorkerEnv+"="+string(specJSON))
	cmd.Stderr = slot.logs
	dieWithParent(cmd)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return false, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return false, err
	}
	fail := func(err error) error {
		if ready != nil {
			ready <- fmt.Errorf("start worker %d: %w\n%s", slot.id, err, slot.logs)
		}
		return err
	}
	if err := cmd.Start(); err != nil {
		return false, fail(err)
	}
	exited := make(chan struct{})
	ws.mu.Lock()
	slot.gen, slot.proc, slot.stdin, slot.exited, slot.killing = gen, cmd.Process, stdin, exited, ""
	ws.mu.Unlock()

	lines := bufio.NewScanner(stdout)
	addr := make(chan string, 1)
	go func() {
		if lines.Scan() && strings.HasPrefix(lines.Text(), flowSoakReadyLine) {
			addr <- strings.TrimPrefix(lines.Text(), flowSoakReadyLine)
		}
		close(addr)
	}()
	timer := time.NewTimer(flowSoakStartTimeout)
	var startErr error
	select {
	case a, ok := <-addr:
		if ok {
			ws.serving(slot, a)
		} else {
			startErr = errors.New("it exited before serving")
		}
	case <-timer.C:
		startErr = fmt.Errorf("it did not serve within %s", flowSoakStartTimeout)
		_ = cmd.Process.Kill()
		<-addr
	}
	timer.Stop()
	if startErr == nil && ready != nil {
		ready <- nil
	}
	for lines.Scan() {
		if point, ok := strings.CutPrefix(lines.Text(), flowSoakKillLine); ok {
			ws.mu.Lock()
			slot.killing = point
			ws.mu.Unlock()
		}
		if rest, ok := strings.CutPrefix(lines.Text(), flowSoakFreezeLine); ok {
			// It stops itself: the soak wakes it.
			point, op, _ := strings.Cut(rest, " ")
			ws.frozeItself(slot, cmd.Process, point, op)
		}
	}
	waitErr := cmd.Wait()

	ws.mu.Lock()
	defer ws.mu.Unlock()
	slot.addr, slot.proc = "", nil
	close(exited)
	ws.notify()
	switch {
	case startErr != nil && ws.stopping:
		return false, nil // stopped while it was starting: its input was closed
	case startErr != nil:
		ws.lastStartFailure = fmt.Sprintf("worker %d (start %d): %v (%v)", slot.id, gen, startErr, waitErr)
		return false, fail(fmt.Errorf("%w (%v)\n%s", startErr, waitErr, slot.logs))
	case slot.killing != "":
		ws.kills[slot.killing]++
		return true, nil
	case ws.stopping && waitErr == nil:
		return true, nil
	}
	return true, fmt.Errorf("exited unexpectedly (%v):\n%s", waitErr, slot.logs)
}

// serving marks slot as serving at addr.
func (ws *flowSoakWorkers) serving(slot *flowSoakSlot, addr string) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	slot.addr, slot.lastAddr = addr, addr
	slot.attempts, slot.cancelAttempts = context.WithCancel(context.Background())
	ws.notify()
}

// notify wakes those waiting for a worker. ws.mu is held.
func (ws *flowSoakWorkers) notify() {
	close(ws.changed)
	ws.changed = make(chan struct{})
}

// pick returns the address of a worker that serves, at random, waiting for
// one if none does, and a context that ends if that worker is frozen.
func (ws *flowSoakWorkers) pick(ctx context.Context) (string, context.Context, error) {
	for {
		ws.mu.Lock()
		var serving []*flowSoakSlot
		for _, s := range ws.slots {
			if s.addr != "" {
				serving = append(serving, s)
			}
		}
		changed := ws.changed
		var addr string
		var attempts context.Context
		if len(serving) > 0 {
			s := serving[rand.IntN(len(serving))]
			addr, attempts = s.addr, s.attempts
		}
		ws.mu.Unlock()
		if addr != "" {
			return addr, attempts, nil
		}
		select {
		case <-ctx.Done():
			return "", nil, fmt.Errorf("no worker serves: %w", ctx.Err())
		case <-changed:
		}
	}
}

// kill kills the worker of slot id with SIGKILL, as for point, and waits
// until it has exited. It reports false when that worker is not serving.
func (ws *flowSoakWorkers) kill(id int, point string) bool {
	ws.mu.Lock()
	if id < 0 || id >= len(ws.slots) || ws.slots[id].addr == "" || ws.stopping {
		ws.mu.Unlock()
		return false
	}
	slot := ws.slots[id]
	slot.killing = point
	slot.addr = "" // no new attempts go to it
	proc, exited := slot.proc, slot.exited
	ws.mu.Unlock()
	_ = proc.Kill()
	<-exited
	return true
}

// killAny kills, or with freeze freezes, a worker that serves, chosen at
// random, and reports whether there was one.
func (ws *flowSoakWorkers) killAny(point string, freeze bool) bool {
	ws.mu.Lock()
	var serving []int
	for _, s := range ws.slots {
		if s.addr != "" {
			serving = append(serving, s.id)
		}
	}
	ws.mu.Unlock()
	if len(serving) == 0 {
		return false
	}
	id := serving[rand.IntN(len(serving))]
	if freeze {
		return ws.freeze(id, point, "")
	}
	return ws.kill(id, point)
}

// freeze freezes the worker of slot id with SIGSTOP, as for point during
// operation op (scope/key, or "" for none), and wakes it later (see
// frozeItself). It reports false when that worker is not serving, or
// another is frozen.
func (ws *flowSoakWorkers) freeze(id int, point, op string) bool {
	ws.mu.Lock()
	if id < 0 || id >= len(ws.slots) || ws.slots[id].addr == "" || ws.stopping || ws.frozen > 0 {
		ws.mu.Unlock()
		return false
	}
	slot := ws.slots[id]
	proc := slot.proc
	ws.mu.Unlock()
	if err := proc.Signal(syscall.SIGSTOP); err != nil {
		return false
	}
	ws.frozeItself(slot, proc, point, op)
	return true
}

// frozeItself takes note that the worker of slot, proc, is frozen at
// point during operation op (or freezes itself right now): it serves no
// more, the clients' attempts that it runs end, as a client's timeout
// would end them, and a goroutine wakes it once op's flow has been taken
// over by another executor (a new epoch) or has ended, and every other
// flow that was running has been too, or could have been (its lease ran
// out a lease ago), or after ws.limit.
func (ws *flowSoakWorkers) frozeItself(slot *flowSoakSlot, proc *os.Process, point, op string) {
	frozenAt := time.Now()
	ws.mu.Lock()
	name := flowSoakProcess(slot.id, slot.gen)
	if ws.stopping || ws.frozen > 0 {
		// One frozen worker at a time: a frozen worker is woken once
		// another has taken its flows over, which one frozen beside it
		// cannot do, and with two workers none would serve until the
		// limit. The soak freezes one at a time (freezeTurn), and a fault
		// fires once per attempt (flowSoakFault.fire), so this does not
		// happen; if it does, this one goes on at once, the point counts
		// no freeze, and the report says so.
		if !ws.stopping {
			ws.overlapping++
			fmt.Fprintf(ws.stdout, "  a freeze undone at once: worker %d at %s during %s, while %s was frozen\n", slot.id, point, op, ws.frozenWhat)
		}
		ws.mu.Unlock()
		waitStopped(proc, frozenAt.Add(ws.limit))
		_ = proc.Signal(syscall.SIGCONT)
		ws.mu.Lock()
		ws.frozenSpans[name] = append(ws.frozenSpans[name], [2]time.Time{frozenAt, time.Now()})
		ws.mu.Unlock()
		return
	}
	slot.addr, slot.frozen = "", true
	ws.frozen++
	ws.frozenWhat = fmt.Sprintf("worker %d at %s during %s", slot.id, point, op)
	if slot.cancelAttempts != nil {
		slot.cancelAttempts()
	}
	ws.notify()
	ws.mu.Unlock()
	// The flows the frozen worker may hold: those running now.
	running, err := ws.runningFlows()
	go func() {
		early := err != nil || !ws.waitTakenOver(running, op, frozenAt.Add(ws.limit))
		waitStopped(proc, frozenAt.Add(ws.limit))
		_ = proc.Signal(syscall.SIGCONT)
		ws.mu.Lock()
		defer ws.mu.Unlock()
		ws.frozenSpans[name] = append(ws.frozenSpans[name], [2]time.Time{frozenAt, time.Now()})
		ws.freezes[point]++
		ws.frozen--
		ws.longestFrozen = max(ws.longestFrozen, time.Since(frozenAt))
		if early {
			ws.wokenEarly++
			ws.problems = append(ws.problems, fmt.Sprintf("worker %d frozen at %s during %s woken after %s, before its flows were taken over",
				slot.id, point, op, ws.limit))
		}
		slot.frozen = false
		if slot.proc == proc && !ws.stopping {
			// It serves again, at the address it had.
			slot.addr = slot.lastAddr
			slot.attempts, slot.cancelAttempts = context.WithCancel(context.Background())
		}
		ws.notify()
	}()
}

// flowSoakHeld is a running flow's epoch, and whether its lease ran out
// at least a lease ago.
type flowSoakHeld struct {
	epoch int64
	stale bool
}

// runningFlows returns each running flow of the soak, by scope/key.
func (ws *flowSoakWorkers) runningFlows() (map[string]flowSoakHeld, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := ws.admin.Query(ctx, `SELECT scope || '/' || key, epoch, leased_until < now() - make_interval(secs => $2)
		FROM idem_flow WHERE name = $1 AND state = 'running'`, ws.spec.Flow, ws.lease.Seconds())
	if err != nil {
		return nil, err
	}
	running := make(map[string]flowSoakHeld)
	for rows.Next() {
		var key string
		var h flowSoakHeld
		if err := rows.Scan(&key, &h.epoch, &h.stale); err != nil {
			return nil, err
		}
		running[key] = h
	}
	return running, rows.Err()
}

// waitTakenOver waits until op (if not "") no longer runs with the epoch
// it had in running, and every other flow in running no longer does
// either or could have been taken over, and reports whether that happened
// before deadline.
func (ws *flowSoakWorkers) waitTakenOver(running map[string]flowSoakHeld, op string, deadline time.Time) bool {
	for time.Now().Before(deadline) {
		now, err := ws.runningFlows()
		if err == nil {
			held := false
			for key, was := range running {
				if h, ok := now[key]; ok && h.epoch == was.epoch && (key == op || !h.stale) {
					held = true
					break
				}
			}
			if h, ok := now[op]; ok && op != "" && running[op].epoch == 0 && !h.stale {
				// Frozen before its flow was started: wait for its lease.
				held = true
			}
			if !held {
				return true
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	return false
}

// waitStopped waits until proc is stopped (a process that signalled itself
// stops a moment later), or deadline, where /proc says so.
func waitStopped(proc *os.Process, deadline time.Time) {
	for time.Now().Before(deadline) {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", proc.Pid))
		if err != nil {
			return
		}
		// pid (comm) state ...: the state follows the last ')'.
		if i := strings.LastIndexByte(string(stat), ')'); i < 0 || i+2 >= len(stat) || stat[i+2] == 'T' || stat[i+2] == 't' {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// waitThawed waits until no worker is frozen.
func (ws *flowSoakWorkers) waitThawed(ctx context.Context) {
	for {
		ws.mu.Lock()
		frozen, changed := ws.frozen, ws.changed
		ws.mu.Unlock()
		if frozen == 0 {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

// stop stops every worker, closing its input, and waits for them; a worker
// that does not exit within a minute is killed. It returns the problems
// met while the workers ran.
func (ws *flowSoakWorkers) stop() error {
	ws.mu.Lock()
	ws.stopping = true
	for _, s := range ws.slots {
		if s.stdin != nil {
			_ = s.stdin.Close()
		}
		if s.frozen && s.proc != nil {
			_ = s.proc.Signal(syscall.SIGCONT)
		}
	}
	ws.mu.Unlock()
	done := make(chan struct{})
	go func() {
		ws.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		ws.mu.Lock()
		for _, s := range ws.slots {
			if s.proc != nil {
				_ = s.proc.Kill()
			}
		}
		ws.problems = append(ws.problems, "a worker did not stop within a minute of its input closing")
		ws.mu.Unlock()
		<-done
	}
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if len(ws.problems) > 0 {
		return fmt.Errorf("workers: %s", strings.Join(ws.problems, "; "))
	}
	return nil
}

// printLogs prints the last lines each worker wrote to stderr.
func (ws *flowSoakWorkers) printLogs(w io.Writer) {
	for _, s := range ws.slots {
		if logs := strings.TrimSpace(s.logs.String()); logs != "" {
			fmt.Fprintf(w, "\nworker %d, last lines:\n%s\n", s.id, logs)
		}
	}
}

// counts returns the kills by point and the restarts.
func (ws *flowSoakWorkers) counts() (map[string]int64, int64) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	kills := make(map[string]int64, len(ws.kills))
	for k, v := range ws.kills {
		kills[k] = v
	}
	return kills, ws.restarts
}

// freezeCounts returns the freezes by point, those woken before their
// flows were taken over, and the longest freeze.
func (ws *flowSoakWorkers) freezeCounts() (map[string]int64, int64, time.Duration) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	freezes := make(map[string]int64, len(ws.freezes))
	for k, v := range ws.freezes {
		freezes[k] = v
	}
	return freezes, ws.wokenEarly, ws.longestFrozen
}

// startCounts returns the starts that failed and were tried again, why the
// last of them failed, and the freezes undone at once because another
// worker was frozen.
func (ws *flowSoakWorkers) startCounts() (int64, string, int64) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return ws.failedStarts, ws.lastStartFailure, ws.overlapping
}

// frozenDuring reports whether process proc (flowSoakProcess) was frozen
// at some time between from and to.
func (ws *flowSoakWorkers) frozenDuring(proc string, from, to time.Time) bool {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	for _, span := range ws.frozenSpans[proc] {
		if span[0].Before(to) && span[1].After(from) {
			return true
		}
	}
	return false
}
