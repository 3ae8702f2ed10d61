package idem_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// The documents whose links and test names the tests below check: the
// README, the changelog and every page of docs/.
func documents(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{"README.md", "CHANGELOG.md"}, pages...)
}

// linkHosts are the hosts (and their subdomains) that the documents may
// link to. Links are not fetched: the list keeps them to sites that keep
// their addresses, and a new host is a deliberate addition here.
var linkHosts = []string{
	"pkg.go.dev",
	"go.dev",
	"github.com",
	"postgresql.org",
	"ietf.org",
	"rfc-editor.org",
	"pgbouncer.org",
	"opentelemetry.io",
	"stripe.com",
	// Vendors' documentation of engines that look like PostgreSQL
	// (docs/large-deployments.md).
	"aws.amazon.com",
	"cockroachlabs.com",
	"yugabyte.com",
	"cloud.google.com",
	"neon.com",
	// The forms the changelog follows.
	"keepachangelog.com",
	"semver.org",
	// Reserved for examples (RFC 2606): an example's own address.
	"example.com",
}

// TestDocLinksResolve checks every link of the documents: a relative link
// must name a file or directory of the repository, and its #anchor a
// heading of that Markdown file (as GitHub spells heading anchors); an
// absolute link must be http(s) to a host of linkHosts.
func TestDocLinksResolve(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]map[string]bool{} // by path from the root
	anchorsOf := func(path string) (map[string]bool, error) {
		if a, ok := anchors[path]; ok {
			return a, nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		a := headingAnchors(string(src))
		anchors[path] = a
		return a, nil
	}
	for _, doc := range documents(t) {
		src, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range markdownLinks(string(src)) {
			where := fmt.Sprintf("%s:%d: %s", doc, l.line, l.target)
			u, err := url.Parse(l.target)
			if err != nil {
				t.Errorf("%s: not a URL: %v", where, err)
				continue
			}
			if u.Scheme != "" || u.Host != "" {
				if u.Scheme != "https" && u.Scheme != "http" {
					t.Errorf("%s: only http(s) links are allowed", where)
				} else if !allowedHost(u.Hostname()) {
					t.Errorf("%s: host %q is not one the documents may link to (linkHosts in docs_test.go)", where, u.Hostname())
				}
				continue
			}
			target := doc
			if u.Path != "" {
				target = filepath.Join(filepath.Dir(doc), filepath.FromSlash(u.Path))
				abs, err := filepath.Abs(target)
				if err != nil || (abs != root && !strings.HasPrefix(abs, root+string(filepath.Separator))) {
					t.Errorf("%s: points outside the repository", where)
					continue
				}
				if _, err := os.Stat(target); err != nil {
					t.Errorf("%s: no such file or directory in the repository", where)
					continue
				}
			}
			if u.Fragment == "" {
				continue
			}
			if !strings.HasSuffix(target, ".md") {
				t.Errorf("%s: an anchor into a file that is not Markdown cannot be checked", where)
				continue
			}
			a, err := anchorsOf(filepath.Clean(target))
			if err != nil {
				t.Errorf("%s: %v", where, err)
				continue
			}
			if !a[u.Fragment] {
				t.Errorf("%s: %s has no heading with the anchor #%s (it has: %s)", where, target, u.Fragment, strings.Join(slices.Sorted(maps.Keys(a)), ", "))
			}
		}
	}
}

// TestDocsNameOnlyTestsThatExist checks that every Test, Benchmark and
// Fuzz name in the documents (as the proof of a claim, or in a
// -run pattern) is a test function of the repository, or the start of
// one's name.
func TestDocsNameOnlyTestsThatExist(t *testing.T) {
	t.Parallel()
	var funcs []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil {
				funcs = append(funcs, fn.Name.Name)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	name := regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z]\w*`)
	for _, doc := range documents(t) {
		src, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(src), "\n") {
			for _, n := range name.FindAllString(line, -1) {
				if !slices.ContainsFunc(funcs, func(f string) bool { return strings.HasPrefix(f, n) }) {
					t.Errorf("%s:%d: names %s, which is no test, benchmark or fuzz function of the repository", doc, i+1, n)
				}
			}
		}
	}
}

func allowedHost(host string) bool {
	host = strings.ToLower(host)
	return slices.ContainsFunc(linkHosts, func(h string) bool { return host == h || strings.HasSuffix(host, "."+h) })
}

// link is a link of a Markdown document, with its line.
type link struct {
	line   int
	target string
}

var (
	fence      = regexp.MustCompile("^\\s*(```|~~~)")
	codeSpan   = regexp.MustCompile("(`+)[^`].*?`+")
	inlineLink = regexp.MustCompile(`!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	refDef     = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$`)
	bareURL    = regexp.MustCompile(`https?://[^\s<>()\[\]"'` + "`" + `]*[^\s<>()\[\]"'` + "`" + `.,;:!?]`)
	heading    = regexp.MustCompile(`^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$`)
)

// markdownLinks returns the links of a Markdown document outside code
// blocks and code spans: inline links and images, reference definitions,
// and bare URLs, which GitHub renders as links too.
func markdownLinks(src string) []link {
	var links []link
	inFence := false
	for i, line := range strings.Split(src, "\n") {
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		if inFence {
			continue
		}
		line = codeSpan.ReplaceAllString(line, "")
		rest := line
		if m := refDef.FindStringSubmatch(line); m != nil {
			links = append(links, link{i + 1, m[1]})
			rest = ""
		}
		for _, m := range inlineLink.FindAllStringSubmatch(rest, -1) {
			links = append(links, link{i + 1, m[1]})
		}
		// Bare URLs, but not those already taken as a link's target.
		rest = inlineLink.ReplaceAllString(rest, "")
		for _, u := range bareURL.FindAllString(rest, -1) {
			links = append(links, link{i + 1, u})
		}
	}
	return links
}

// headingAnchors returns the anchors GitHub gives the headings of a
// Markdown document: the heading's text in lower case, without
// punctuation other than hyphens and underscores, spaces made hyphens; a
// repeated anchor gets -1, -2, ... appended.
func headingAnchors(src string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	inFence := false
	for _, line := range strings.Split(src, "\n") {
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		m := heading.FindStringSubmatch(line)
		if inFence || m == nil {
			continue
		}
		slug := githubSlug(m[2])
		if n := seen[slug]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", slug, n)] = true
		} else {
			anchors[slug] = true
		}
		seen[slug]++
	}
	return anchors
}

func githubSlug(text string) string {
	// A link in a heading counts by its text.
	text = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`).ReplaceAllString(text, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// TestLinkAnchorsAreSpeltAsGitHubDoes pins the anchor spelling of a few headings of the kinds
// the documents have.
func TestLinkAnchorsAreSpeltAsGitHubDoes(t *testing.T) {
	t.Parallel()
	for heading, want := range map[string]string{
		"What each request gets":                 "what-each-request-gets",
		"Behind PgBouncer":                       "behind-pgbouncer",
		"The `idem` command":                     "the-idem-command",
		"Many keys in one transaction: the lock": "many-keys-in-one-transaction-the-lock",
		"REPEATABLE READ and SERIALIZABLE":       "repeatable-read-and-serializable",
		"What pg_locks shows":                    "what-pg_locks-shows",
		"Errors, and what they leave":            "errors-and-what-they-leave",
		"[Links](x.md) in a heading":             "links-in-a-heading",
	} {
		if got := githubSlug(heading); got != want {
			t.Errorf("githubSlug(%q) = %q, want %q", heading, got, want)
		}
	}
	a := headingAnchors("# A\n## A\n```\n# not a heading\n```\n### A\n")
	for _, want := range []string{"a", "a-1", "a-2"} {
		if !a[want] {
			t.Errorf("headingAnchors: no %q in %v", want, a)
		}
	}
	if a["not-a-heading"] {
		t.Error("headingAnchors took a line of a code block for a heading")
	}
}

// TestDocsRunOnlyPackagesAndCommandsThatExist checks the go commands of
// the documents: every ./path they name (go run, go test, go
// vet, go build) is a directory of the repository, and every "go run
// ./lab X" or "go run ./cmd/idem X" names a command of that program.
func TestDocsRunOnlyPackagesAndCommandsThatExist(t *testing.T) {
	t.Parallel()
	goCommand := regexp.MustCompile(`\bgo (?:run|test|vet|build)\b[^` + "`" + `\n]*`)
	path := regexp.MustCompile(`(?:^|\s)(\./[\w./-]*)`)
	subcommand := regexp.MustCompile(`\bgo run \./(lab|cmd/idem) (\w[\w-]*)`)
	mains := map[string]string{}
	checked := 0
	for _, doc := range documents(t) {
		src, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(src), "\n") {
			for _, cmd := range goCommand.FindAllString(line, -1) {
				for _, m := range path.FindAllStringSubmatch(cmd, -1) {
					dir := strings.TrimSuffix(strings.TrimSuffix(m[1], "..."), "/")
					if info, err := os.Stat(dir); err != nil || !info.IsDir() {
						t.Errorf("%s:%d: %q names %s, which is no directory of the repository", doc, i+1, cmd, m[1])
					}
					checked++
				}
			}
			for _, m := range subcommand.FindAllStringSubmatch(line, -1) {
				program, name := m[1], m[2]
				if _, ok := mains[program]; !ok {
					src, err := os.ReadFile(filepath.Join(program, "main.go"))
					if err != nil {
						t.Fatal(err)
					}
					mains[program] = string(src)
				}
				if !strings.Contains(mains[program], `{Name: "`+name+`", `) {
					t.Errorf("%s:%d: go run ./%s %s: no such command in %s/main.go", doc, i+1, program, name, program)
				}
			}
		}
	}
	if checked < 10 {
		t.Fatalf("checked %d paths: the documents' commands were not found", checked)
	}
}

// TestOperationsListsEveryCommand checks that the command list of
// docs/operations.md names every command of cmd/idem's main.go, and only
// those.
func TestOperationsListsEveryCommand(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	main, err := os.ReadFile("cmd/idem/main.go")
	if err != nil {
		t.Fatal(err)
	}
	_, block, _ := strings.Cut(string(doc), "go install github.com/pgidem/idem/cmd/idem@latest\n")
	block, _, _ = strings.Cut(block, "```")
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^idem ([\w-]+)`).FindAllStringSubmatch(block, -1) {
		listed[m[1]] = true
	}
	commands := regexp.MustCompile(`\{Name: "([\w-]+)", `).FindAllStringSubmatch(string(main), -1)
	if len(commands) < 5 {
		t.Fatalf("found %d commands in cmd/idem/main.go", len(commands))
	}
	known := map[string]bool{}
	for _, m := range commands {
		known[m[1]] = true
		if !listed[m[1]] {
			t.Errorf("docs/operations.md's command list omits idem %s", m[1])
		}
	}
	for name := range listed {
		if !known[name] {
			t.Errorf("docs/operations.md lists idem %s, which cmd/idem does not have", name)
		}
	}
}

// TestPackageDocNamesEverySentinel checks that doc.go, where the package's
// errors are listed, names every exported error variable of the package.
func TestPackageDocNamesEverySentinel(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			gen, ok := decl.(*ast.GenDecl)
			if !ok || gen.Tok != token.VAR {
				continue
			}
			for _, spec := range gen.Specs {
				for _, id := range spec.(*ast.ValueSpec).Names {
					if !id.IsExported() || !strings.HasPrefix(id.Name, "Err") {
						continue
					}
					found++
					if !strings.Contains(string(doc), "["+id.Name+"]") {
						t.Errorf("doc.go does not name %s (%s)", id.Name, name)
					}
				}
			}
		}
	}
	if found < 10 {
		t.Fatalf("found %d sentinels: not the package's directory?", found)
	}
}
