package main

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// offline is the go command's environment for a module of the test's own:
// no workspace, nothing fetched, modules from the local cache.
func offline() []string {
	return append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod", "GOPROXY=off", "GOSUMDB=off")
}

// check runs apicheck with args and returns its exit code and its output.
func check(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var out bytes.Buffer
	code := run(args, offline(), &out, &out)
	return code, out.String()
}

func write(t *testing.T, dir, name, text string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

const fixtureV1 = `package p

import "context"

const Limit = 10

var ErrGone error

type Config struct {
	Wait int
	Name string
}

type Store interface {
	Get(ctx context.Context, key string) ([]byte, error)
}

type Option interface{ apply() }

type Flow[T any] struct{}

func (f *Flow[T]) Run(ctx context.Context, in T) error { return nil }

func Do(ctx context.Context, key string, opts ...Option) error { return nil }

func Old() {}
`

// fixtureV2 breaks fixtureV1 five ways (Limit's value, Config.Wait, a
// method added to Store, which others implement, Flow.Run's and Do's
// signatures, Old removed) and adds what breaks no one (a field, a
// function, a parameter's new name).
const fixtureV2 = `package p

import "context"

const Limit = 20

var ErrGone error

type Config struct {
	Wait  int64
	Name  string
	Extra bool
}

type Store interface {
	Get(ctx context.Context, key string) ([]byte, error)
	Put(ctx context.Context, key string, value []byte) error
}

type Option interface{ apply() }

type Flow[T any] struct{}

func (f Flow[T]) Run(ctx context.Context, input T) error { return nil }

func Do(ctx context.Context, key string, wait int, opts ...Option) error { return nil }

func New() {}
`

// TestCheckFailsOnEachBreakingChangeUntilItIsAnnounced: a module's API
// recorded, then broken; the check names each change that breaks a
// caller, and none that does not, and passes once CHANGELOG.md's
// Unreleased section names them all, not before, nor when a released
// section does.
func TestCheckFailsOnEachBreakingChangeUntilItIsAnnounced(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "go.mod", "module example.com/p\n\ngo 1.24\n")
	write(t, dir, "p.go", fixtureV1)
	write(t, dir, "CHANGELOG.md", "# Changelog\n\n## [Unreleased]\n\n## [0.1.0] - 2026-01-01\n")
	args := []string{"-dir", dir, "-pkgs", "example.com/p", "-listing", filepath.Join(dir, "api.txt"), "-changelog", filepath.Join(dir, "CHANGELOG.md")}
	if code, out := check(t, append(args, "-w")...); code != 0 {
		t.Fatalf("recording: exit %d\n%s", code, out)
	}
	if code, out := check(t, args...); code != 0 {
		t.Fatalf("the API as recorded: exit %d\n%s", code, out)
	}

	write(t, dir, "p.go", fixtureV2)
	code, out := check(t, args...)
	if code != 1 {
		t.Fatalf("the broken API: exit %d, want 1\n%s", code, out)
	}
	breaking := []string{"p.Limit", "p.Config.Wait", "p.Store", "p.Flow.Run", "p.Do", "p.Old"}
	for _, name := range breaking {
		if !strings.Contains(out, "\n"+name+": a breaking change") {
			t.Errorf("the check does not name %s:\n%s", name, out)
		}
	}
	for _, name := range []string{"p.Config.Extra", "p.New", "p.ErrGone", "p.Option", "p.Config.Name"} {
		if strings.Contains(out, name+":") {
			t.Errorf("the check names %s, which breaks no one:\n%s", name, out)
		}
	}
	if !strings.Contains(out, "6 breaking change(s) not announced") {
		t.Errorf("the check does not count 6:\n%s", out)
	}

	// Announced in a released section: not enough.
	write(t, dir, "CHANGELOG.md", "# Changelog\n\n## [Unreleased]\n\n## [0.1.0] - 2026-01-01\n\n- `p.Limit`, `p.Config.Wait`, `p.Store`, `p.Flow`, `p.Do`, `p.Old`\n")
	if code, out := check(t, args...); code != 1 {
		t.Fatalf("announced in a released section only: exit %d, want 1\n%s", code, out)
	}
	// All but one: still fails, on that one. `p.Flow` covers its method.
	write(t, dir, "CHANGELOG.md", "# Changelog\n\n## [Unreleased]\n\n### Changed\n\n- `p.Limit` is 20, `p.Config.Wait` an int64, `p.Store` has Put, `p.Flow` a value receiver, `p.Do(ctx, key, wait)`.\n\n## [0.1.0] - 2026-01-01\n")
	code, out = check(t, args...)
	if code != 1 || !strings.Contains(out, "\np.Old: a breaking change") || strings.Contains(out, "\np.Do:") {
		t.Fatalf("all announced but p.Old: exit %d, want 1, naming p.Old alone\n%s", code, out)
	}
	write(t, dir, "CHANGELOG.md", "# Changelog\n\n## [Unreleased]\n\n### Changed\n\n- `p.Limit` is 20, `p.Config.Wait` an int64, `p.Store` has Put, `p.Flow` a value receiver, `p.Do(ctx, key, wait)`.\n\n### Removed\n\n- `p.Old`: use `p.New`.\n\n## [0.1.0] - 2026-01-01\n")
	if code, out := check(t, args...); code != 0 {
		t.Fatalf("every break announced: exit %d, want 0\n%s", code, out)
	}
}

// TestCheckFailsOnABrokenLibrary breaks a copy of the library itself:
// its API recorded, the check fails on the copy with MustNewFlow renamed
// and EndFlow's reason taken away, naming both, until the changelog's
// Unreleased section names them.
func TestCheckFailsOnABrokenLibrary(t *testing.T) {
	lib := copyLibrary(t)
	listing := filepath.Join(t.TempDir(), "api.txt")
	changelog := filepath.Join(lib, "CHANGELOG.md")
	args := []string{"-dir", lib, "-pkgs", "github.com/pgidem/idem", "-listing", listing, "-changelog", changelog}
	if code, out := check(t, append(args, "-w")...); code != 0 {
		t.Fatalf("recording: exit %d\n%s", code, out)
	}
	write(t, lib, "CHANGELOG.md", "# Changelog\n\n## [Unreleased]\n\n## [0.1.0] - 2026-12-03\n")
	if code, out := check(t, args...); code != 0 {
		t.Fatalf("the library as recorded: exit %d, want 0\n%s", code, out)
	}
	edit(t, filepath.Join(lib, "flow.go"), "func MustNewFlow[", "func MustMakeFlow[")
	edit(t, filepath.Join(lib, "flow_ops.go"), "func EndFlow(ctx context.Context, db TxBeginner, scope, key, reason string)", "func EndFlow(ctx context.Context, db TxBeginner, scope, key string)")
	edit(t, filepath.Join(lib, "flow_ops.go"), "Reason: storableText(reason)", "Reason: storableText(\"\")")
	code, out := check(t, args...)
	if code != 1 {
		t.Fatalf("the broken library: exit %d, want 1\n%s", code, out)
	}
	for _, name := range []string{"idem.MustNewFlow", "idem.EndFlow"} {
		if !strings.Contains(out, "\n"+name+": a breaking change") {
			t.Errorf("the check does not name %s:\n%s", name, out)
		}
	}
	if !strings.Contains(out, "2 breaking change(s) not announced") {
		t.Errorf("the check does not count 2:\n%s", out)
	}
	write(t, lib, "CHANGELOG.md", "# Changelog\n\n## [Unreleased]\n\n### Changed\n\n- `idem.EndFlow` takes no reason.\n\n### Removed\n\n- `idem.MustNewFlow`: use `idem.MustMakeFlow`.\n\n## [0.1.0] - 2026-12-03\n")
	if code, out := check(t, args...); code != 0 {
		t.Fatalf("the broken library, announced: exit %d, want 0\n%s", code, out)
	}
}

// copyLibrary copies the library's module, the repository without the
// modules nested in it, into a directory of the test's own.
func copyLibrary(t *testing.T) string {
	const repoRoot = "../.." // above the tools module
	t.Helper()
	dst := t.TempDir()
	root, err := filepath.Abs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if d.Name() == ".git" {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil && rel != "." {
				return filepath.SkipDir
			}
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

func edit(t *testing.T, path, old, new string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(b, []byte(old)) {
		t.Fatalf("%s has no %q", path, old)
	}
	if err := os.WriteFile(path, bytes.Replace(b, []byte(old), []byte(new), 1), 0o644); err != nil {
		t.Fatal(err)
	}
}
