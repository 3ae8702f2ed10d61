//go:build unix

package pgtemp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// baseBackup fills data with a base backup of primary, set up to stream
// from it (pg_basebackup -R), as the server's user; where the installation
// has no pg_basebackup, with copyBackup.
func (s *Server) baseBackup(ctx context.Context, data string, cred *syscall.Credential, primary *Server) error {
	if !isExecutable(filepath.Join(s.BinDir, "pg_basebackup")) {
		return s.copyBackup(ctx, data, cred, primary)
	}
	// The connection settings, the password among them, are written into
	// the standby's postgresql.auto.conf, in the server's own directory.
	backup := exec.CommandContext(ctx, filepath.Join(s.BinDir, "pg_basebackup"),
		"-d", fmt.Sprintf("host=127.0.0.1 port=%d user=postgres sslmode=disable", primary.Port),
		"-D", data, "-R", "-X", "stream", "-c", "fast", "--no-sync")
	backup.Env = append(childEnv(), "PGPASSWORD="+primary.password)
	backup.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := backup.CombinedOutput(); err != nil {
		return fmt.Errorf("pg_basebackup of 127.0.0.1:%d (%s, as %s): %w\n%s", primary.Port, s.BinDir, s.User, err, tail(out))
	}
	return nil
}

// running reports whether the server was started and its postmaster has
// not exited.
func (s *Server) running() bool {
	if s == nil || s.cmd == nil || s.exited == nil {
		return false
	}
	select {
	case <-s.exited:
		return false
	default:
		return true
	}
}

// killWait bounds how long Kill waits for the postmaster to exit before it
// sends SIGKILL.
const killWait = 30 * time.Second

// Kill sends sig to the server's postmaster and waits until it exited, for
// tests of a server that fails: syscall.SIGQUIT is PostgreSQL's immediate
// shutdown (every process of the server exits at once, without a
// checkpoint, and its clients get an error), syscall.SIGKILL kills the
// postmaster alone, as a crash would (its other processes exit as each
// notices, and the server's clients see their connections closed).
// Either way what is on disk is what a crash leaves, and a standby can be
// promoted in the server's place. syscall.SIGINT and syscall.SIGTERM are
// PostgreSQL's fast and smart shutdowns. A postmaster that has not exited
// after 30 seconds is sent SIGKILL: after SIGQUIT that is still the crash
// asked for (a loaded machine may take that long), and Kill returns nil;
// after a shutdown signal it is an error. The directory stays until Stop,
// which is still to be called; a server that is not running is left as it
// is.
func (s *Server) Kill(sig os.Signal) error {
	if !s.running() {
		return nil
	}
	if err := s.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("pgtemp: signal the postmaster (pid %d): %w", s.cmd.Process.Pid, err)
	}
	select {
	case <-s.exited:
	case <-time.After(killWait):
		_ = s.cmd.Process.Kill()
		<-s.exited
		if sig == syscall.SIGQUIT {
			return nil
		}
		return fmt.Errorf("pgtemp: the postmaster (pid %d) had not exited %s after %v: killed", s.cmd.Process.Pid, killWait, sig)
	}
	return nil
}

// removeAll removes dir, trying again for a few seconds while it fails:
// the processes of a postmaster that was killed may still be writing in
// it as they exit.
func removeAll(dir string) error {
	var err error
	for range 50 {
		if err = os.RemoveAll(dir); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}
