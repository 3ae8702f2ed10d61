package idem_test

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// quickstartProgram turns the whole-file example quickstart_example_test.go
// into the program the README shows: package main, with Example as main
// and without the test's expected output.
func quickstartProgram(t *testing.T) string {
	t.Helper()
	src, err := os.ReadFile("quickstart_example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(src), "package idem_test\n", "package main\n", 1)
	s = strings.Replace(s, "\nfunc Example() {\n", "\nfunc main() {\n", 1)
	s = regexp.MustCompile(`(?m)^\t// Output:\n(^\t//.*\n)*`).ReplaceAllString(s, "")
	return s
}

// TestREADMEQuickstartIsTheCompiledExample keeps the README's quickstart
// the program that the tests compile and run as Example.
func TestREADMEQuickstartIsTheCompiledExample(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "\n## Quickstart\n")
	if !ok {
		t.Fatal("README.md has no Quickstart section")
	}
	_, block, ok := strings.Cut(section, "```go\n")
	block, _, closed := strings.Cut(block, "```\n")
	if !ok || !closed {
		t.Fatal("the Quickstart section has no go block")
	}
	if want := quickstartProgram(t); block != want {
		t.Fatalf("README.md's quickstart is not quickstart_example_test.go; write this into it:\n%s", want)
	}
}
