package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// sh runs a command in dir with env added to the test's environment, and
// returns its output and error.
func sh(t *testing.T, dir string, env []string, name string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func put(t *testing.T, dir, name, text string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestARequiredReleaseInstallsFromTheProxy releases a repository of two
// modules as .ci/release does: the nested one, a command, requires the
// library at the version, with the go.sum lines require writes, and the
// workspace still builds it against the checkout, offline; tagged,
// and served by proxy, the command's tree builds outside any workspace
// with its go.sum as it is, and go install takes it at the version. Then
// the library is changed under its tag: the lines require wrote no longer
// match what the proxy serves, and the build fails.
func TestARequiredReleaseInstallsFromTheProxy(t *testing.T) {
	must := func(out string, err error) string {
		t.Helper()
		if err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		return out
	}
	repo := t.TempDir()
	git := func(args ...string) string {
		t.Helper()
		return must(sh(t, repo, nil, "git", args...))
	}
	git("init", "-q")
	git("config", "user.name", "test")
	git("config", "user.email", "test@localhost")
	put(t, repo, "go.mod", "module example.com/lib\n\ngo 1.24\n")
	put(t, repo, "lib.go", "package lib\n\nfunc Hello() string { return \"hello\" }\n")
	put(t, repo, "LICENSE", "MIT\n")
	put(t, repo, "cmd/hello/go.mod", "module example.com/lib/cmd/hello\n\ngo 1.24\n\nrequire example.com/lib v0.0.0-00010101000000-000000000000\n\nreplace example.com/lib => ../..\n")
	put(t, repo, "cmd/hello/main.go", "package main\n\nimport \"example.com/lib\"\n\nfunc main() { println(lib.Hello()) }\n")
	put(t, repo, "go.work", "go 1.24\n\nuse (\n\t.\n\t./cmd/hello\n)\n\n// The checkout, at the version the command requires.\nreplace example.com/lib v0.0.0-00010101000000-000000000000 => ./\n")
	offline := []string{"GOWORK=", "GOPROXY=off", "GOFLAGS=-mod=readonly", "GOTOOLCHAIN=local"}
	must(sh(t, repo, offline, "go", "build", "-o", os.DevNull, "./cmd/hello"))
	git("add", "-A")
	git("commit", "-q", "-m", "first")

	t.Chdir(repo)
	if err := require(repo, "v1.2.3", []string{"cmd/hello"}); err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(repo, "cmd/hello/go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(gomod), "require example.com/lib v1.2.3") || strings.Contains(string(gomod), "replace") {
		t.Fatalf("cmd/hello/go.mod after require:\n%s", gomod)
	}
	work, err := os.ReadFile(filepath.Join(repo, "go.work"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(work), "// The checkout, at the version the command requires.\nreplace example.com/lib v1.2.3 => ./\n") {
		t.Fatalf("go.work after require:\n%s", work)
	}
	// The workspace builds it against the checkout, offline, v1.2.3
	// published nowhere.
	must(sh(t, repo, offline, "go", "build", "-o", os.DevNull, "./cmd/hello"))
	sum, err := os.ReadFile(filepath.Join(repo, "cmd/hello/go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(strings.TrimSpace(string(sum)), "\n"); len(lines) != 2 ||
		!strings.HasPrefix(lines[0], "example.com/lib v1.2.3 h1:") || !strings.HasPrefix(lines[1], "example.com/lib v1.2.3/go.mod h1:") {
		t.Fatalf("cmd/hello/go.sum after require:\n%s", sum)
	}
	git("add", "-A")
	git("commit", "-q", "-m", "release v1.2.3")
	git("tag", "v1.2.3")
	git("tag", "cmd/hello/v1.2.3")

	// serve builds a proxy of the tags and returns the go command's
	// environment for it: offline, no workspace, a module cache of its own.
	serve := func() []string {
		out := t.TempDir()
		if err := proxy(repo, out, []string{"v1.2.3", "cmd/hello/v1.2.3"}); err != nil {
			t.Fatal(err)
		}
		return []string{"GOPROXY=file://" + out, "GOWORK=off", "GOSUMDB=off", "GOFLAGS=-mod=readonly",
			"GOMODCACHE=" + t.TempDir(), "GOTOOLCHAIN=local", "GOBIN=" + t.TempDir()}
	}
	env := serve()
	must(sh(t, filepath.Join(repo, "cmd/hello"), env, "go", "build", "-o", os.DevNull, "."))
	must(sh(t, t.TempDir(), append(env, "GOFLAGS="), "go", "install", "example.com/lib/cmd/hello@v1.2.3"))

	// The library's tag moved to another tree: go.sum no longer matches it.
	put(t, repo, "lib.go", "package lib\n\nfunc Hello() string { return \"changed\" }\n")
	git("commit", "-q", "-a", "-m", "changed under the tag")
	git("tag", "-f", "v1.2.3")
	out, err := sh(t, filepath.Join(repo, "cmd/hello"), serve(), "go", "build", "-o", os.DevNull, ".")
	if err == nil || !strings.Contains(out, "checksum mismatch") {
		t.Fatalf("the build against a library changed under its tag: %v\n%s\nwant a checksum mismatch", err, out)
	}
}
