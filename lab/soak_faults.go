package main

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The soak's faults: those tied to the payments' writes, injected inside
// their transactions, and the loops that terminate backends, cut
// connections and restart the server by the clock.

// soakFault is a fault tied to writes.
type soakFault int

const (
	noFault soakFault = iota
	terminateFault
	cutFault
)

// dueFault counts write as one more business write, and returns the fault
// it is to meet: one that the count made due, now or at an earlier write
// that was spared, unless this one is spared too. A write meets at most
// one.
func (r *soakRun) dueFault(write int64, spare bool) soakFault {
	if n := int64(r.cfg.TerminateEveryWrites); n > 0 && write%n == 0 {
		r.terminatesDue.Add(1)
	}
	if n := int64(r.cfg.CutEveryWrites); n > 0 && write%n == 0 {
		r.cutsDue.Add(1)
	}
	switch {
	case spare:
		return noFault
	case takeOne(&r.terminatesDue):
		return terminateFault
	case takeOne(&r.cutsDue):
		return cutFault
	}
	return noFault
}

// takeOne takes one from due, and reports whether there was one.
func takeOne(due *atomic.Int64) bool {
	for {
		n := due.Load()
		if n <= 0 {
			return false
		}
		if due.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// inject injects fault into tx's transaction: it terminates the backend
// through the unproxied pool, or has the proxy cut the connection. It
// reports whether the fault hit; one that did not stays due.
func (r *soakRun) inject(ctx context.Context, tx pgx.Tx, fault soakFault) bool {
	conn := tx.Conn().PgConn()
	switch fault {
	case terminateFault:
		var ok bool
		err := r.admin.QueryRow(ctx, `
			SELECT pg_terminate_backend(pid)
			FROM pg_stat_activity
			WHERE pid = $1 AND application_name = $2`, int64(conn.PID()), r.appName).Scan(&ok)
		if err == nil && ok {
			r.terminatedInWrite.Add(1)
			return true
		}
		r.terminatesDue.Add(1)
	case cutFault:
		if r.proxy.CutClient(conn.Conn().LocalAddr()) {
			r.cutInWrite.Add(1)
			return true
		}
		r.cutsDue.Add(1)
	}
	return false
}

// clockGate holds back a fault paced by the clock until an attempt has
// been answered since the last one it let through. A machine too slow to
// answer between two ticks, which would otherwise have every attempt hit,
// then meets at most one such fault per answer. It belongs to one
// goroutine.
type clockGate struct {
	answered func() int64
	last     int64
}

// progressGate returns a gate that counts the run's answered attempts.
func (r *soakRun) progressGate() *clockGate {
	return &clockGate{answered: func() int64 { return r.executed.Load() + r.replayed.Load() }, last: -1}
}

// open reports whether an attempt was answered since the last fault.
func (g *clockGate) open() bool { return g.answered() > g.last }

// passed records that a fault went through.
func (g *clockGate) passed() { g.last = g.answered() }

// terminateLoop terminates, every interval that gate lets through, one of
// the backends named appName that is inside a transaction, and returns how
// many it terminated. Backends of other applications, of other databases
// and the loop's own are never chosen.
func terminateLoop(ctx context.Context, admin *pgxpool.Pool, appName string, interval time.Duration, gate *clockGate) int64 {
	var terminated int64
	every(ctx, interval, func() {
		if !gate.open() {
			return
		}
		var ok bool
		err := admin.QueryRow(ctx, `
			SELECT pg_terminate_backend(pid)
			FROM pg_stat_activity
			WHERE application_name = $1
			  AND datname = current_database()
			  AND backend_type = 'client backend'
			  AND pid <> pg_backend_pid()
			  AND xact_start IS NOT NULL
			ORDER BY random()
			LIMIT 1`, appName).Scan(&ok)
		// No backend in a transaction right now, or the server is
		// restarting: try again at the next tick.
		if err == nil && ok {
			terminated++
			gate.passed()
		}
	})
	return terminated
}

// restartLoop runs command every interval until ctx ends, counting the
// runs in restarts. It returns the first failure of the command.
func restartLoop(ctx context.Context, command string, interval time.Duration, restarts *atomic.Int64, stdout io.Writer) error {
	var failed error
	every(ctx, interval, func() {
		if failed != nil {
			return
		}
		// A restart cut short when the soak ends could leave the server
		// stopped: let it finish, within its own bound.
		runCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), soakRestartTimeout)
		defer cancel()
		started := time.Now()
		out, err := exec.CommandContext(runCtx, "sh", "-c", command).CombinedOutput()
		if err != nil {
			failed = fmt.Errorf("restart command %q failed: %w: %s", command, err, strings.TrimSpace(string(out)))
			return
		}
		restarts.Add(1)
		fmt.Fprintf(stdout, "  restarted PostgreSQL in %s\n", time.Since(started).Round(time.Millisecond))
	})
	return failed
}

// every calls fn every interval until ctx ends.
func every(ctx context.Context, interval time.Duration, fn func()) {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			fn()
		}
	}
}

// waitForServer pings until the server answers, for after a restart.
func waitForServer(ctx context.Context, admin *pgxpool.Pool) error {
	ctx, cancel := context.WithTimeout(ctx, soakRecoveryTimeout)
	defer cancel()
	for {
		err := admin.Ping(ctx)
		if err == nil {
			return nil
		}
		if sleep(ctx, 100*time.Millisecond) != nil {
			return err
		}
	}
}
