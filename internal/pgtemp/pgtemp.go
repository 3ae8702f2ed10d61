//go:build unix

// Package pgtemp starts a throwaway PostgreSQL server from an installation
// already on the machine: its initdb and postgres found on PATH or in the
// usual install directories, or else in the directory [BinDirEnv] names.
// The server lives in a temporary directory, listens on 127.0.0.1 and a
// Unix socket in that directory only, and is stopped and removed by Stop,
// or when the process that started it dies (on Linux; elsewhere, the next
// Start removes the directories of servers whose process is gone).
//
// PostgreSQL refuses to run as root. Started by root, the server runs as an
// unprivileged OS user (nobody, or else postgres), which owns the directory.
//
// A server can also be started as a streaming standby of another
// ([Config.StandbyOf]), promoted, stopped the hard way ([Server.Kill]) and
// started again on its data ([Server.Restart]), for tests of what a client
// sees when its primary fails over or crashes and comes back.
//
// It is the last of the servers [github.com/pgidem/idem/idemtest] tries,
// and the one the lab's demo, bench and soaks start when no database is
// configured. It needs nothing but the standard library, pgx and idem, so
// that a program using it links neither the testing package nor
// testcontainers-go.
package pgtemp

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// Server is a running throwaway server.
type Server struct {
	// URL connects to the server's postgres database as its superuser,
	// postgres, over TCP on 127.0.0.1.
	URL string
	// Port is the server's TCP port on 127.0.0.1.
	Port int
	// Version is the server's major version, from the installation.
	Version string
	// BinDir is the directory of the installation's programs.
	BinDir string
	// Dir is the temporary directory holding the data and the socket.
	Dir string
	// User is the OS user the server runs as.
	User string

	// password is the postgres role's: a standby's is its primary's.
	password string
	// cfg and cred are what the server was started with, for Restart.
	cfg      Config
	cred     *syscall.Credential
	cmd      *exec.Cmd
	exited   chan struct{}
	stopOnce sync.Once
	stopped  bool
	stopErr  error
}

// searchDirs returns the directories searched for initdb, after PATH.
func searchDirs() []string {
	var dirs []string
	for _, pattern := range []string{
		"/usr/lib/postgresql/*/bin",         // Debian, Ubuntu
		"/usr/pgsql-*/bin",                  // Red Hat, Fedora (PGDG)
		"/usr/local/pgsql/bin",              // built from source
		"/opt/homebrew/opt/postgresql*/bin", // Homebrew, Apple silicon
		"/usr/local/opt/postgresql*/bin",    // Homebrew, Intel
		"/Applications/Postgres.app/Contents/Versions/*/bin",
	} {
		matches, _ := filepath.Glob(pattern)
		// The newest version first: sort by the number in the path.
		slices.SortFunc(matches, func(a, b string) int { return versionOf(b) - versionOf(a) })
		dirs = append(dirs, matches...)
	}
	return dirs
}

func versionOf(path string) int {
	for _, part := range strings.FieldsFunc(path, func(r rune) bool { return r < '0' || r > '9' }) {
		if n, err := strconv.Atoi(part); err == nil {
			return n
		}
	}
	return 0
}

// where describes where find looks, for error messages.
const where = "initdb and postgres on PATH, or in /usr/lib/postgresql/<version>/bin, /usr/pgsql-<version>/bin, /usr/local/pgsql/bin or Homebrew's postgresql"

// find returns the directory of an installation's initdb and postgres.
func find() (string, error) {
	if dir := os.Getenv(BinDirEnv); dir != "" {
		if isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "postgres")) {
			return dir, nil
		}
		return "", fmt.Errorf("%s=%s: no initdb and postgres there", BinDirEnv, dir)
	}
	if path, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(path); err == nil {
			path = real
		}
		dir := filepath.Dir(path)
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
	}
	for _, dir := range searchDirs() {
		if isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "postgres")) {
			return dir, nil
		}
	}
	return "", fmt.Errorf("no PostgreSQL installation found (looked for %s)", where)
}

func isExecutable(path string) bool {
	info, err := os.Stat(path)
	return err == nil && !info.IsDir() && info.Mode()&0o111 != 0
}

// Config configures Start. The zero value is a server as durable as
// PostgreSQL's defaults make it, taking 300 connections.
type Config struct {
	// Fast turns off fsync, full-page writes and synchronous commit: for
	// tests, whose data nobody needs after a crash. Benchmarks want the
	// defaults. Defaults to false: PostgreSQL's durable settings.
	Fast bool

	// MaxConnections is the server's max_connections. It sizes the shared
	// lock table too, with max_locks_per_transaction: a test of what fills
	// the table sets PostgreSQL's own default, 100. Defaults to 300, which
	// lets the packages of a module test in parallel, each with pools of
	// its own. A standby's must be at least its primary's.
	MaxConnections int

	// Port is the server's TCP port on 127.0.0.1, for a server that takes
	// the place of one that was stopped: a connection string that names
	// it, as a list of a primary and its standbys does, reaches the new
	// server. Defaults to a port that was free when the server started.
	Port int

	// Settings are server settings (name to value) passed to postgres
	// at start, after Start's own, which they override: for example
	// shared_preload_libraries, to load an extension such as Citus that
	// the installation holds. Defaults to none.
	Settings map[string]string

	// StandbyOf, when set, makes the server a streaming standby of that
	// running server instead of a new one: its data is a base backup of
	// it (pg_basebackup), it replays what that server writes, and it is
	// read-only until promoted (SELECT pg_promote()). Its URL has the
	// same password. Replication is asynchronous unless the primary sets
	// synchronous_standby_names. Defaults to nil: a new server, from
	// initdb.
	StandbyOf *Server
}

// defaultMaxConnections is Config.MaxConnections's default.
const defaultMaxConnections = 300

// Start initializes and starts a server. It gives up when ctx ends; the
// returned Server must be stopped with Stop. A negative
// Config.MaxConnections is refused with an error wrapping
// [idem.ErrInvalidOption], before anything is started.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.MaxConnections < 0 {
		return nil, fmt.Errorf("%w: pgtemp: Config.MaxConnections: must not be negative, got %d", idem.ErrInvalidOption, cfg.MaxConnections)
	}
	if cfg.Port < 0 || cfg.Port > 65535 {
		return nil, fmt.Errorf("%w: pgtemp: Config.Port: must be between 0 and 65535, got %d", idem.ErrInvalidOption, cfg.Port)
	}
	if cfg.StandbyOf != nil && !cfg.StandbyOf.running() {
		return nil, fmt.Errorf("%w: pgtemp: Config.StandbyOf: the server is not running", idem.ErrInvalidOption)
	}
	if cfg.MaxConnections == 0 {
		cfg.MaxConnections = defaultMaxConnections
	}
	removeStale(os.TempDir(), time.Minute)
	binDir, err := find()
	if err != nil {
		return nil, err
	}
	s := &Server{BinDir: binDir}
	cred, owner, err := serverUser()
	if err != nil {
		return nil, err
	}
	s.User = owner
	s.cfg, s.cred = cfg, cred

	s.Dir, err = os.MkdirTemp("", "idem-pg-")
	if err != nil {
		return nil, err
	}
	// The process that made the directory owns it while it lives: another
	// one's removeStale leaves it alone, however long initdb takes.
	if err := os.WriteFile(filepath.Join(s.Dir, ownerFile), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			s.Stop()
		}
	}()
	if cred != nil {
		if err := os.Chown(s.Dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, fmt.Errorf("give %s to %s: %w", s.Dir, owner, err)
		}
		// The user must reach the directory through its parents.
		if !reachable(s.Dir) {
			return nil, fmt.Errorf("%s cannot reach %s: set TMPDIR to a directory every user can enter", owner, s.Dir)
		}
	}
	data := filepath.Join(s.Dir, "data")
	if cfg.StandbyOf != nil {
		s.password = cfg.StandbyOf.password
		if err := s.baseBackup(ctx, data, cred, cfg.StandbyOf); err != nil {
			return nil, err
		}
	} else if err := s.initdb(ctx, data, cred); err != nil {
		return nil, err
	}
	s.Version = readVersion(data)

	if cfg.Port != 0 {
		if err := s.run(ctx, data, cfg.Port, cred, cfg); err != nil {
			return nil, err
		}
		ok = true
		return s, nil
	}
	// A port that was free a moment ago; another process may take it
	// first, so try a few.
	var lastErr error
	for range 3 {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		lastErr = s.run(ctx, data, port, cred, cfg)
		if lastErr == nil {
			ok = true
			return s, nil
		}
		// Only a server that exited (most often: the port was taken) is
		// worth another try.
		if !errors.Is(lastErr, errExited) {
			break
		}
	}
	return nil, lastErr
}

// initdb makes a new data directory, whose postgres role has a new
// password.
func (s *Server) initdb(ctx context.Context, data string, cred *syscall.Credential) error {
	pwfile := filepath.Join(s.Dir, "pw")
	s.password = randomHex(16)
	if err := os.WriteFile(pwfile, []byte(s.password+"\n"), 0o600); err != nil {
		return err
	}
	defer os.Remove(pwfile)
	if cred != nil {
		if err := os.Chown(pwfile, int(cred.Uid), int(cred.Gid)); err != nil {
			return err
		}
	}
	initdb := exec.CommandContext(ctx, filepath.Join(s.BinDir, "initdb"),
		"-D", data, "-U", "postgres", "--pwfile", pwfile,
		"--auth-local=trust", "--auth-host=scram-sha-256",
		"-E", "UTF8", "--locale=C", "--no-sync")
	initdb.Env = childEnv()
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb (%s, as %s): %w\n%s", s.BinDir, s.User, err, tail(out))
	}
	return nil
}

func (s *Server) run(ctx context.Context, data string, port int, cred *syscall.Credential, cfg Config) error {
	logPath := filepath.Join(s.Dir, "postgres.log")
	// Appended to: a restarted server's log goes on after the old one's.
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()
	if cred != nil {
		_ = logFile.Chown(int(cred.Uid), int(cred.Gid))
	}
	// postgres itself, not pg_ctl, so that it stays our child: on Linux it
	// is sent SIGQUIT (an immediate shutdown) when this process dies,
	// however it dies.
	args := []string{"-D", data,
		"-c", "listen_addresses=127.0.0.1",
		"-c", "port=" + strconv.Itoa(port),
		"-c", "unix_socket_directories=" + s.Dir,
		"-c", "log_min_messages=warning",
		"-c", "max_connections=" + strconv.Itoa(cfg.MaxConnections),
	}
	if cfg.Fast {
		args = append(args, "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "synchronous_commit=off")
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Settings)) {
		args = append(args, "-c", name+"="+cfg.Settings[name])
	}
	cmd := exec.Command(filepath.Join(s.BinDir, "postgres"), args...)
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	dieWithParent(cmd.SysProcAttr)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	s.cmd = cmd
	s.exited = make(chan struct{})
	go func() { _ = cmd.Wait(); close(s.exited) }()

	s.Port = port
	s.URL = fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d/postgres?sslmode=disable", s.password, port)
	deadline := time.Now().Add(60 * time.Second)
	for {
		connCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgx.Connect(connCtx, s.URL)
		cancel()
		if err == nil {
			_ = conn.Close(ctx)
			return nil
		}
		// A server whose postgres role's password was changed (a Citus
		// worker takes its coordinator's) refuses the URL's: that is an
		// answer, from a server that accepts connections.
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "28P01" {
			return nil
		}
		select {
		case <-s.exited:
			log, _ := os.ReadFile(logPath)
			s.cmd = nil
			return fmt.Errorf("postgres (%s, as %s) %w:\n%s", s.BinDir, s.User, errExited, tail(log))
		case <-ctx.Done():
			s.kill()
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.kill()
			log, _ := os.ReadFile(logPath)
			return fmt.Errorf("postgres did not accept connections within a minute: %v\n%s", err, tail(log))
		}
	}
}

// ownerFile holds the pid of the process that made a server's directory.
const ownerFile = "owner.pid"

// removeStale removes the directories of earlier throwaway servers whose
// process was killed before it could remove them (by SIGKILL, say: the
// server itself dies with it): those whose maker and postmaster are both
// gone, older than minAge so that a directory just made, whose owner file
// is not written yet, is left alone. What this process may not remove it
// leaves.
func removeStale(tmp string, minAge time.Duration) {
	dirs, _ := filepath.Glob(filepath.Join(tmp, "idem-pg-*"))
	for _, dir := range dirs {
		info, err := os.Stat(dir)
		if err != nil || !info.IsDir() || time.Since(info.ModTime()) < minAge {
			continue
		}
		if pid, ok := postmasterPID(filepath.Join(dir, ownerFile)); ok && alive(pid) {
			continue
		}
		if pid, ok := postmasterPID(filepath.Join(dir, "data", "postmaster.pid")); ok && alive(pid) {
			continue
		}
		_ = os.RemoveAll(dir)
	}
}

func postmasterPID(path string) (int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	return pid, err == nil && pid > 0
}

// alive reports whether process pid exists (EPERM: it does, as another user).
func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// errExited is a server that exited while starting.
var errExited = errors.New("exited during start-up")

// kill stops a server that failed to start, at once.
func (s *Server) kill() {
	_ = s.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-s.exited:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
	s.cmd = nil
}

// Stop stops the server (a fast shutdown, an immediate one after ten
// seconds), if Kill did not, and removes its directory. It may be called
// more than once.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		s.stopped = true
		if s.cmd != nil && s.cmd.Process != nil {
			_ = s.cmd.Process.Signal(syscall.SIGINT)
			select {
			case <-s.exited:
			case <-time.After(10 * time.Second):
				_ = s.cmd.Process.Signal(syscall.SIGQUIT)
				select {
				case <-s.exited:
				case <-time.After(5 * time.Second):
					_ = s.cmd.Process.Kill()
					<-s.exited
				}
			}
		}
		if s.Dir != "" {
			s.stopErr = removeAll(s.Dir)
		}
	})
	return s.stopErr
}

// restartTries bounds how many times Restart starts a postmaster that
// exits during start-up.
const restartTries = 50

// Restart starts a server that [Server.Kill] stopped again, on the same
// data directory, port and settings, for tests of a server that fails and
// comes back: PostgreSQL recovers from what the stop left on disk (a
// crash recovery, after SIGQUIT or SIGKILL), and Restart returns once it
// accepts connections, so that clients of the old server's URL reach the
// new one. The old postmaster's processes may hold its shared memory for
// a moment after a SIGKILL: a postmaster that exits during start-up is
// started again, a few times, until ctx ends. The server's log goes on
// after the old one's. A server that is running is refused, and so is one
// that Stop removed; Stop is still to be called. Config.Fast's
// synchronous_commit=off loses the last commits of a server that crashes:
// a test that counts on them sets it back on (Config.Settings).
func (s *Server) Restart(ctx context.Context) error {
	switch {
	case s.stopped || s.Dir == "":
		return errors.New("pgtemp: Restart: the server was stopped and removed")
	case s.running():
		return fmt.Errorf("pgtemp: Restart: the server on port %d is running", s.Port)
	}
	data := filepath.Join(s.Dir, "data")
	var err error
	for range restartTries {
		if err = s.run(ctx, data, s.Port, s.cred, s.cfg); !errors.Is(err, errExited) {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pgtemp: Restart on port %d: %w (last: %w)", s.Port, ctx.Err(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	if err != nil {
		return fmt.Errorf("pgtemp: Restart on port %d: %w", s.Port, err)
	}
	return nil
}

// serverUser returns the credentials to run the server with: none when we
// are not root, else those of an unprivileged user.
func serverUser() (*syscall.Credential, string, error) {
	if os.Geteuid() != 0 {
		name := strconv.Itoa(os.Geteuid())
		if u, err := user.Current(); err == nil {
			name = u.Username
		}
		return nil, name, nil
	}
	for _, name := range []string{"nobody", "postgres"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil || uid == 0 {
			continue
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, name, nil
	}
	return nil, "", errors.New("running as root, and PostgreSQL refuses to: found no unprivileged user (nobody, postgres) to run it as")
}

// reachable reports whether every parent of dir can be entered by anyone.
func reachable(dir string) bool {
	for d := filepath.Dir(dir); ; d = filepath.Dir(d) {
		info, err := os.Stat(d)
		if err != nil || info.Mode().Perm()&0o001 == 0 {
			return false
		}
		if d == filepath.Dir(d) {
			return true
		}
	}
}

// childEnv is this process's environment without the variables that would
// point PostgreSQL's programs elsewhere.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") {
			env = append(env, kv)
		}
	}
	return append(env, "LC_ALL=C")
}

func readVersion(data string) string {
	b, err := os.ReadFile(filepath.Join(data, "PG_VERSION"))
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// tail returns the last lines of a program's output.
func tail(out []byte) string {
	lines := bytes.Split(bytes.TrimSpace(out), []byte("\n"))
	if len(lines) > 15 {
		lines = lines[len(lines)-15:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}
