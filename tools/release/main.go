// Command release does the parts of a release that need the module
// system's own formats, for .ci/release (docs/development.md, "Releasing"):
//
//	release require VERSION DIR...
//
// sets, in the go.mod of each module DIR of the repository, every
// requirement on a module of this repository to VERSION, drops any replace
// of one, and writes the go.sum lines of those modules at VERSION, their
// hashes taken from zips of the working tree as the module proxy will make
// them from the tagged commit: the nested modules of a release require the
// library as released, as `go install pkg@version` and an application's
// `go get` need them to. It moves go.work's replace of the library with
// the checkout to VERSION too, for the workspace.
//
//	release proxy OUT TAG...
//
// writes, in the directory OUT, the files a module proxy serves
// (GOPROXY=file://OUT) for each module a git tag of the repository
// releases: the library for vX.Y.Z, the module in DIR for DIR/vX.Y.Z.
//
// Both act on the git repository in the current directory.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
	"golang.org/x/mod/sumdb/dirhash"
	"golang.org/x/mod/zip"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	root, err := os.Getwd()
	if err != nil {
		return err
	}
	switch {
	case len(args) >= 3 && args[0] == "require":
		return require(root, args[1], args[2:])
	case len(args) >= 3 && args[0] == "proxy":
		return proxy(root, args[1], args[2:])
	}
	return errors.New("usage: release require VERSION DIR [DIR ...], or release proxy OUT TAG [TAG ...]")
}

// git runs git in dir and returns its output.
func git(dir string, args ...string) (string, error) {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// modules maps the path of each module of the repository, at rev, to its
// directory ("" for the root).
func modules(root, rev string) (map[string]string, error) {
	out, err := git(root, "ls-tree", "-r", "--name-only", rev)
	if err != nil {
		return nil, err
	}
	mods := make(map[string]string)
	for _, name := range strings.Split(strings.TrimSpace(out), "\n") {
		if name != "go.mod" && !strings.HasSuffix(name, "/go.mod") {
			continue
		}
		data, err := git(root, "show", rev+":"+name)
		if err != nil {
			return nil, err
		}
		path := modfile.ModulePath([]byte(data))
		if path == "" {
			return nil, fmt.Errorf("%s at %s names no module", name, rev)
		}
		mods[path] = strings.TrimSuffix(strings.TrimSuffix(name, "go.mod"), "/")
	}
	return mods, nil
}

// require is "release require".
func require(root, version string, dirs []string) error {
	if !semver.IsValid(version) || semver.Build(version) != "" || version != semver.Canonical(version) {
		return fmt.Errorf("%s is not a semantic version as Go's modules take one (vX.Y.Z, or vX.Y.Z-pre)", version)
	}
	mods, err := modules(root, "HEAD")
	if err != nil {
		return err
	}
	if err := pinWork(root, mods, version); err != nil {
		return err
	}
	// A module's go.sum names the zip of the modules it requires, which
	// holds their go.mod and go.sum: so each is done after those of the
	// others it requires.
	files := make(map[string]*modfile.File)
	for _, dir := range dirs {
		dir = filepath.ToSlash(filepath.Clean(dir))
		data, err := os.ReadFile(filepath.Join(root, dir, "go.mod"))
		if err != nil {
			return err
		}
		f, err := modfile.Parse(dir+"/go.mod", data, nil)
		if err != nil {
			return err
		}
		files[dir] = f
	}
	done := make(map[string]bool)
	for len(done) < len(files) {
		progress := false
		for _, dir := range dirs {
			dir = filepath.ToSlash(filepath.Clean(dir))
			f := files[dir]
			if done[dir] || !ready(f, mods, files, done) {
				continue
			}
			if err := pin(root, dir, f, mods, version); err != nil {
				return err
			}
			done[dir], progress = true, true
		}
		if !progress {
			return errors.New("the modules require each other in a cycle")
		}
	}
	return nil
}

// pinWork moves go.work's replace of a module of the repository with its
// checkout, if any, to version: the go command reads the go.mod of the
// version a workspace's module requires, even of a module in the
// workspace, so that a version not published, or not reachable, needs a
// replace there.
func pinWork(root string, mods map[string]string, version string) error {
	path := filepath.Join(root, "go.work")
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	f, err := modfile.ParseWork("go.work", data, nil)
	if err != nil {
		return err
	}
	for _, r := range f.Replace {
		if _, ours := mods[r.Old.Path]; !ours || r.Old.Version == "" || r.Old.Version == version {
			continue
		}
		i := slices.Index(r.Syntax.Token, r.Old.Version)
		if i < 0 {
			return fmt.Errorf("go.work: cannot find the version of the replace of %s", r.Old.Path)
		}
		r.Syntax.Token[i] = version
		r.Old.Version = version
		fmt.Printf("go.work replaces %s@%s with %s\n", r.Old.Path, version, r.New.Path)
	}
	return os.WriteFile(path, modfile.Format(f.Syntax), 0o644)
}

// ready reports whether every module of the repository that f requires,
// among those being pinned, is done.
func ready(f *modfile.File, mods map[string]string, files map[string]*modfile.File, done map[string]bool) bool {
	for _, r := range f.Require {
		if dir, ok := mods[r.Mod.Path]; ok && files[dir] != nil && !done[dir] {
			return false
		}
	}
	return true
}

// pin sets f's requirements on the repository's modules to version, and
// its go.sum lines for them.
func pin(root, dir string, f *modfile.File, mods map[string]string, version string) error {
	var pinned []module.Version
	for _, r := range f.Require {
		if _, ok := mods[r.Mod.Path]; ok {
			pinned = append(pinned, module.Version{Path: r.Mod.Path, Version: version})
		}
	}
	for _, m := range pinned {
		if err := f.AddRequire(m.Path, m.Version); err != nil {
			return err
		}
	}
	for _, r := range slices.Clone(f.Replace) {
		if _, ok := mods[r.Old.Path]; ok {
			if err := f.DropReplace(r.Old.Path, r.Old.Version); err != nil {
				return err
			}
		}
	}
	f.Cleanup()
	data, err := f.Format()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(root, dir, "go.mod"), data, 0o644); err != nil {
		return err
	}
	// The hashes of the tree as it is now, with the go.mod files of the
	// modules done before: a commit of the working tree, made aside.
	rev, err := git(root, "stash", "create")
	if err != nil {
		return err
	}
	if rev = strings.TrimSpace(rev); rev == "" {
		rev = "HEAD"
	}
	var lines []string
	for _, m := range pinned {
		l, err := sumLines(root, rev, mods[m.Path], m)
		if err != nil {
			return err
		}
		lines = append(lines, l...)
	}
	sumPath := filepath.Join(root, dir, "go.sum")
	old, err := os.ReadFile(sumPath)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for _, line := range strings.Split(string(old), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		if _, ours := mods[fields[0]]; ours {
			continue // the repository's modules at another version
		}
		lines = append(lines, line)
	}
	sortSum(lines)
	lines = slices.Compact(lines)
	if err := os.WriteFile(sumPath, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Printf("%s requires %s\n", dir, strings.Join(versions(pinned), ", "))
	return nil
}

// sortSum sorts go.sum lines as the go command writes them: by module
// path, then version, a module's line before its go.mod's.
func sortSum(lines []string) {
	key := func(line string) (path, version string, gomod bool) {
		f := strings.Fields(line)
		version, gomod = strings.CutSuffix(f[1], "/go.mod")
		return f[0], version, gomod
	}
	slices.SortStableFunc(lines, func(a, b string) int {
		pa, va, ma := key(a)
		pb, vb, mb := key(b)
		if c := strings.Compare(pa, pb); c != 0 {
			return c
		}
		if c := semver.Compare(va, vb); c != 0 {
			return c
		}
		if c := strings.Compare(va, vb); c != 0 {
			return c
		}
		switch {
		case ma == mb:
			return 0
		case mb:
			return -1
		}
		return 1
	})
}

func versions(ms []module.Version) []string {
	var s []string
	for _, m := range ms {
		s = append(s, m.String())
	}
	return s
}

// zipModule writes the zip of module m, in dir at rev, to the file out,
// and returns the module's go.mod.
func zipModule(root, rev, dir string, m module.Version, out string) (gomod []byte, err error) {
	f, err := os.Create(out)
	if err != nil {
		return nil, err
	}
	if err := zip.CreateFromVCS(f, m, root, rev, dir); err != nil {
		f.Close()
		return nil, err
	}
	if err := f.Close(); err != nil {
		return nil, err
	}
	name := "go.mod"
	if dir != "" {
		name = dir + "/go.mod"
	}
	s, err := git(root, "show", rev+":"+name)
	return []byte(s), err
}

// sumLines returns the go.sum lines of m, the module in dir at rev.
func sumLines(root, rev, dir string, m module.Version) ([]string, error) {
	tmp, err := os.MkdirTemp("", "release-zip-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	zipFile := filepath.Join(tmp, "m.zip")
	gomod, err := zipModule(root, rev, dir, m, zipFile)
	if err != nil {
		return nil, err
	}
	h, err := dirhash.HashZip(zipFile, dirhash.Hash1)
	if err != nil {
		return nil, err
	}
	hmod, err := dirhash.Hash1([]string{"go.mod"}, func(string) (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(gomod)), nil
	})
	if err != nil {
		return nil, err
	}
	return []string{m.Path + " " + m.Version + " " + h, m.Path + " " + m.Version + "/go.mod " + hmod}, nil
}

// proxy is "release proxy".
func proxy(root, out string, tags []string) error {
	for _, tag := range tags {
		dir, version := "", tag
		if i := strings.LastIndex(tag, "/"); i >= 0 {
			dir, version = tag[:i], tag[i+1:]
		}
		if !semver.IsValid(version) {
			return fmt.Errorf("tag %s names no version", tag)
		}
		rev := "refs/tags/" + tag
		mods, err := modules(root, rev)
		if err != nil {
			return err
		}
		path := ""
		for p, d := range mods {
			if d == dir {
				path = p
			}
		}
		if path == "" {
			return fmt.Errorf("tag %s: no module in %q", tag, dir)
		}
		m := module.Version{Path: path, Version: version}
		escaped, err := module.EscapePath(path)
		if err != nil {
			return err
		}
		at := filepath.Join(out, filepath.FromSlash(escaped), "@v")
		if err := os.MkdirAll(at, 0o755); err != nil {
			return err
		}
		gomod, err := zipModule(root, rev, dir, m, filepath.Join(at, version+".zip"))
		if err != nil {
			return fmt.Errorf("tag %s: %w", tag, err)
		}
		if err := os.WriteFile(filepath.Join(at, version+".mod"), gomod, 0o644); err != nil {
			return err
		}
		when, err := git(root, "log", "-1", "--format=%cI", rev)
		if err != nil {
			return err
		}
		t, err := time.Parse(time.RFC3339, strings.TrimSpace(when))
		if err != nil {
			return err
		}
		info, err := json.Marshal(struct {
			Version string
			Time    time.Time
		}{version, t.UTC()})
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(at, version+".info"), info, 0o644); err != nil {
			return err
		}
		list, err := os.ReadFile(filepath.Join(at, "list"))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		listed := strings.Fields(string(list))
		if !slices.Contains(listed, version) {
			listed = append(listed, version)
		}
		semver.Sort(listed)
		if err := os.WriteFile(filepath.Join(at, "list"), []byte(strings.Join(listed, "\n")+"\n"), 0o644); err != nil {
			return err
		}
		fmt.Printf("proxy: %s\n", m)
	}
	return nil
}
