//go:build unix

package pgtemp

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
)

// TestStartRefusesEveryInvalidConfig checks that a Config that cannot work
// is refused, naming its field, before anything starts.
func TestStartRefusesEveryInvalidConfig(t *testing.T) {
	t.Parallel()
	srv, err := Start(context.Background(), Config{MaxConnections: -1})
	if srv != nil || !errors.Is(err, idem.ErrInvalidOption) || !strings.Contains(err.Error(), "Config.MaxConnections") {
		t.Fatalf("MaxConnections -1: %v, %v; want ErrInvalidOption naming the field", srv, err)
	}
}

// TestRemoveStaleRemovesOnlyDeadServersDirectories checks the clean-up of
// directories left by a process killed before it removed its server's.
func TestRemoveStaleRemovesOnlyDeadServersDirectories(t *testing.T) {
	t.Parallel()
	tmp := t.TempDir()
	old := time.Now().Add(-time.Hour)
	mkdir := func(name, pid string, mtime time.Time) string {
		t.Helper()
		dir := filepath.Join(tmp, name)
		if err := os.MkdirAll(filepath.Join(dir, "data"), 0o700); err != nil {
			t.Fatal(err)
		}
		if pid != "" {
			if err := os.WriteFile(filepath.Join(dir, "data", "postmaster.pid"), []byte(pid+"\n/data\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chtimes(dir, mtime, mtime); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	// A pid that is surely not running: a child that has exited and been
	// waited for.
	dead := deadPID(t)
	stale := mkdir("idem-pg-stale", strconv.Itoa(dead), old)
	noPID := mkdir("idem-pg-nopid", "", old)
	live := mkdir("idem-pg-live", strconv.Itoa(os.Getpid()), old)
	young := mkdir("idem-pg-young", "", time.Now())
	other := mkdir("not-ours", "", old)

	removeStale(tmp, time.Minute)

	for dir, want := range map[string]bool{stale: false, noPID: false, live: true, young: true, other: true} {
		_, err := os.Stat(dir)
		if exists := err == nil; exists != want {
			t.Errorf("%s: exists %t, want %t", filepath.Base(dir), exists, want)
		}
	}
}

func deadPID(t *testing.T) int {
	t.Helper()
	p, err := os.StartProcess("/bin/sh", []string{"sh", "-c", "exit 0"}, &os.ProcAttr{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	return p.Pid
}
