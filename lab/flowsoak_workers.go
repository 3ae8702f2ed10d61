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
	"time"
)

// The flow soak's worker processes, as the soak sees them: started, killed
// with SIGKILL, restarted at once, and stopped at the end.

// flowSoakStartTimeout bounds a worker's start, from exec to its ready
// line: past it the start counts as failed. It only keeps a broken worker
// from hanging the soak.
const flowSoakStartTimeout = 2 * time.Minute

// flowSoakMaxStartFailures is how many failed starts in a row end a slot.
const flowSoakMaxStartFailures = 3

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
	// started after the first of each slot.
	kills    map[string]int64
	restarts int64
	// problems are the exits that no kill explains, and failed starts.
	problems []string
}

// flowSoakSlot is one worker, run again each time it dies.
type flowSoakSlot struct {
	id   int
	gen  int
	proc *os.Process
	// addr is where it serves; empty when it does not.
	addr  string
	stdin io.Closer
	// exited is closed when the current process has exited.
	exited chan struct{}
	// killing is the point at which the soak killed it, or it said it
	// killed itself.
	killing string
	logs    *flowSoakTail
}

func newFlowSoakWorkers(exe string, spec flowSoakWorkerSpec, verbose bool, stdout io.Writer) *flowSoakWorkers {
	return &flowSoakWorkers{exe: exe, spec: spec, verbose: verbose, stdout: stdout,
		changed: make(chan struct{}), kills: make(map[string]int64)}
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
// soak stops. ready gets the first start's outcome.
func (ws *flowSoakWorkers) keep(ctx context.Context, slot *flowSoakSlot, ready chan<- error) {
	failures := 0
	for gen := 1; ; gen++ {
		if gen > 1 {
			ws.mu.Lock()
			ws.restarts++
			ws.mu.Unlock()
		}
		err := ws.run(ctx, slot, gen, ready)
		ready = nil
		ws.mu.Lock()
		stopping := ws.stopping
		if err != nil {
			failures++
			ws.problems = append(ws.problems, fmt.Sprintf("worker %d (start %d): %v", slot.id, gen, err))
		} else {
			failures = 0
		}
		ws.mu.Unlock()
		if stopping || ctx.Err() != nil || failures >= flowSoakMaxStartFailures {
			return
		}
	}
}

// run runs one process of slot to its end. It returns an error when the
// process failed to start or ended in a way that no kill explains.
func (ws *flowSoakWorkers) run(ctx context.Context, slot *flowSoakSlot, gen int, ready chan<- error) error {
	spec := ws.spec
	spec.Slot, spec.Gen = slot.id, gen
	specJSON, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	// Not CommandContext: the soak kills its workers itself, and stops
	// them by closing their input.
	cmd := exec.Command(ws.exe, "flowsoak")
	cmd.Env = append(os.Environ(), flowSoakWorkerEnv+"="+string(specJSON))
	cmd.Stderr = slot.logs
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	fail := func(err error) error {
		if ready != nil {
			ready <- fmt.Errorf("start worker %d: %w\n%s", slot.id, err, slot.logs)
		}
		return err
	}
	if err := cmd.Start(); err != nil {
		return fail(err)
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
	}
	waitErr := cmd.Wait()

	ws.mu.Lock()
	defer ws.mu.Unlock()
	slot.addr, slot.proc = "", nil
	close(exited)
	ws.notify()
	switch {
	case startErr != nil && ws.stopping:
		return nil // stopped while it was starting: its input was closed
	case startErr != nil:
		return fail(fmt.Errorf("%w (%v)\n%s", startErr, waitErr, slot.logs))
	case slot.killing != "":
		ws.kills[slot.killing]++
		return nil
	case ws.stopping && waitErr == nil:
		return nil
	}
	return fmt.Errorf("exited unexpectedly (%v):\n%s", waitErr, slot.logs)
}

// serving marks slot as serving at addr.
func (ws *flowSoakWorkers) serving(slot *flowSoakSlot, addr string) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	slot.addr = addr
	ws.notify()
}

// notify wakes those waiting for a worker. ws.mu is held.
func (ws *flowSoakWorkers) notify() {
	close(ws.changed)
	ws.changed = make(chan struct{})
}

// pick returns the address of a worker that serves, at random, waiting for
// one if none does.
func (ws *flowSoakWorkers) pick(ctx context.Context) (string, error) {
	for {
		ws.mu.Lock()
		var addrs []string
		for _, s := range ws.slots {
			if s.addr != "" {
				addrs = append(addrs, s.addr)
			}
		}
		changed := ws.changed
		ws.mu.Unlock()
		if len(addrs) > 0 {
			return addrs[rand.IntN(len(addrs))], nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("no worker serves: %w", ctx.Err())
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

// killAny kills a worker that serves, chosen at random, and reports
// whether there was one.
func (ws *flowSoakWorkers) killAny(point string) bool {
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
	return ws.kill(serving[rand.IntN(len(serving))], point)
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
