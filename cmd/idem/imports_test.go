package main

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestCommandUsesOnlyTheLibrarysPublicAPI checks that no package of the
// command (this one and those under cmd/idem/internal) imports a package
// under the library's internal/ directory outside its tests: the command
// then builds against any version of the library with the same public
// API, as an application's own tool would, instead of only against the
// library's exact commit. (The library's public packages import their own
// internal packages, so go list -deps shows some; none is the command's
// doing.)
func TestCommandUsesOnlyTheLibrarysPublicAPI(t *testing.T) {
	t.Parallel()
	const internal = "github.com/pgidem/idem/internal/"
	files := 0
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if d.Name() == "testdata" {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		files++
		for _, imp := range f.Imports {
			p, err := strconv.Unquote(imp.Path.Value)
			if err != nil {
				return err
			}
			if strings.HasPrefix(p, internal) {
				t.Errorf("%s imports %s, the library's internal package: use its public API", path, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 5 {
		t.Fatalf("looked at %d files: not the command's directory?", files)
	}
}
