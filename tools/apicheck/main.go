// Command apicheck keeps idem's API compatible between releases, or says
// where it is not: it compares the API of the public packages in the tree
// with the listing recorded at the last release (api.txt, beside it), and
// fails on every recorded feature the tree has removed or changed that
// CHANGELOG.md's Unreleased section (or, as a release is made, its
// version's section: -section) does not name, in backquotes
// (`idem.NewFlow`, `idemhttp.Config.Wait`). With -w it records the tree's
// API instead, as the release procedure does (docs/development.md,
// "Releasing").
//
// Run it from the repository's root, in the workspace:
//
//	bin=$(mktemp -d) && (cd tools && GOWORK=off go build -o "$bin/" ./apicheck) && "$bin/apicheck"
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
)

func main() {
	os.Exit(run(os.Args[1:], os.Environ(), os.Stdout, os.Stderr))
}

// run runs the command with args, env as the go command's environment,
// and returns its exit code.
func run(args, env []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("apicheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	write := fs.Bool("w", false, "record the tree's API in the listing instead of checking it")
	listing := fs.String("listing", "tools/apicheck/api.txt", "the recorded API")
	changelog := fs.String("changelog", "CHANGELOG.md", "the changelog whose section -section announces breaking changes")
	dir := fs.String("dir", ".", "the repository's root")
	pkgs := fs.String("pkgs", strings.Join(publicPackages, ","), "the packages to check, by import path")
	section := fs.String("section", "Unreleased", "the changelog's section that announces breaking changes: Unreleased, or the version being released (0.2.0)")
	verbose := fs.Bool("v", false, "list the features added since the listing too")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	paths := strings.Split(*pkgs, ",")
	current, err := Listing(*dir, env, paths)
	if err != nil {
		fmt.Fprintln(stderr, "apicheck:", err)
		return 1
	}
	if *write {
		if err := WriteListing(*listing, current); err != nil {
			fmt.Fprintln(stderr, "apicheck:", err)
			return 1
		}
		fmt.Fprintf(stdout, "apicheck: recorded %d features of %d packages in %s\n", len(current), len(paths), *listing)
		return 0
	}
	f, err := os.Open(*listing)
	if err != nil {
		fmt.Fprintln(stderr, "apicheck:", err)
		return 1
	}
	recorded, err := ReadListing(f)
	f.Close()
	if err != nil {
		fmt.Fprintln(stderr, "apicheck:", err)
		return 1
	}
	text, err := os.ReadFile(*changelog)
	if err != nil {
		fmt.Fprintln(stderr, "apicheck:", err)
		return 1
	}
	announcing := Section(string(text), *section)
	var names []string
	for _, p := range paths {
		names = append(names, path.Base(p))
	}
	breaks, added := Compare(recorded, current, names)
	if *verbose {
		for _, line := range added {
			fmt.Fprintln(stdout, "added:", line)
		}
	}
	var unannounced []Break
	for _, b := range breaks {
		if !Announced(announcing, b.Name) {
			unannounced = append(unannounced, b)
		}
	}
	fmt.Fprintf(stdout, "apicheck: %d features recorded, %d now; %d removed or changed (%d announced in %s's section %s), %d added\n",
		len(recorded), len(current), len(breaks), len(breaks)-len(unannounced), *changelog, *section, len(added))
	if len(unannounced) == 0 {
		return 0
	}
	for _, b := range unannounced {
		fmt.Fprintf(stderr, "\n%s: a breaking change not in %s's section %s\n  was: %s\n", b.Name, *changelog, *section, b.Was)
		if len(b.Now) == 0 {
			fmt.Fprintf(stderr, "  now: (gone)\n")
		}
		for _, line := range b.Now {
			fmt.Fprintf(stderr, "  now: %s\n", line)
		}
	}
	fmt.Fprintf(stderr, "\napicheck: %d breaking change(s) not announced: name each, in backquotes, in %s's section %s (Changed or Removed), with how to upgrade\n",
		len(unannounced), *changelog, *section)
	return 1
}
