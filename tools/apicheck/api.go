package main

import (
	"bufio"
	"fmt"
	"go/types"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"

	"golang.org/x/tools/go/packages"
)

// modulePrefix is the import path every package of this repository's
// modules starts with: types from them are written by package name, others
// by import path.
const modulePrefix = "github.com/pgidem/idem"

// publicPackages are the packages whose API the check covers: the library's
// and idemgrpc's. Not cmd/idem/cli, the commands' own skeleton, which its
// documentation says is not for other programs; not the lab, the examples
// or internal packages.
var publicPackages = []string{
	"github.com/pgidem/idem",
	"github.com/pgidem/idem/idemgrpc",
	"github.com/pgidem/idem/idemhttp",
	"github.com/pgidem/idem/idemhttp/webhook",
	"github.com/pgidem/idem/idemsql",
	"github.com/pgidem/idem/idemtest",
	"github.com/pgidem/idem/outbox",
}

// Listing loads the packages in dir (with env, the go command's
// environment) and returns their API, one feature a line, sorted. A line
// is the feature's name (package.Name, or package.Type.Member), what it is,
// and its type, with no parameter names: a line of a release that is not in
// a later listing is a change that breaks some caller.
func Listing(dir string, env []string, paths []string) ([]string, error) {
	cfg := &packages.Config{
		Mode: packages.NeedName | packages.NeedTypes | packages.NeedImports | packages.NeedDeps,
		Dir:  dir,
		Env:  env,
	}
	pkgs, err := packages.Load(cfg, paths...)
	if err != nil {
		return nil, err
	}
	var lines []string
	var errs []string
	for _, pkg := range pkgs {
		for _, e := range pkg.Errors {
			errs = append(errs, e.Error())
		}
		if pkg.Types == nil {
			continue
		}
		lines = append(lines, features(pkg.Types)...)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("loading %s: %s", strings.Join(paths, " "), strings.Join(errs, "; "))
	}
	if len(pkgs) != len(paths) {
		return nil, fmt.Errorf("loading %s: found %d packages", strings.Join(paths, " "), len(pkgs))
	}
	slices.Sort(lines)
	return slices.Compact(lines), nil
}

// features lists pkg's exported API.
func features(pkg *types.Package) []string {
	w := &writer{pkg: pkg}
	var lines []string
	add := func(name, what string) { lines = append(lines, pkg.Name()+"."+name+" "+what) }
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		switch obj := obj.(type) {
		case *types.Const:
			add(name, "const "+w.typ(obj.Type())+" = "+obj.Val().ExactString())
		case *types.Var:
			add(name, "var "+w.typ(obj.Type()))
		case *types.Func:
			add(name, "func"+w.signature(obj.Type().(*types.Signature)))
		case *types.TypeName:
			if obj.IsAlias() {
				add(name, "type = "+w.typ(types.Unalias(obj.Type())))
				continue
			}
			named := obj.Type().(*types.Named)
			tparams := w.typeParams(named.TypeParams())
			switch u := named.Underlying().(type) {
			case *types.Struct:
				add(name, "type"+tparams+" struct")
				for i := range u.NumFields() {
					f := u.Field(i)
					if !f.Exported() {
						continue
					}
					what := "field " + w.typ(f.Type())
					if f.Embedded() {
						what = "field embedded " + w.typ(f.Type())
					}
					add(name+"."+f.Name(), what)
				}
			case *types.Interface:
				if sealed(u) {
					// No other package can implement it: methods may be
					// added, not removed or changed.
					add(name, "type"+tparams+" interface, sealed")
					for i := range u.NumMethods() {
						if m := u.Method(i); m.Exported() {
							add(name+"."+m.Name(), "method"+w.signature(m.Type().(*types.Signature)))
						}
					}
				} else {
					// Others implement it: any change to its methods
					// breaks them.
					add(name, "type"+tparams+" "+w.typ(u))
				}
				continue
			default:
				add(name, "type"+tparams+" "+w.typ(u))
			}
			// Methods, promoted ones too, with the receiver that has them.
			ptr := types.NewMethodSet(types.NewPointer(named))
			val := types.NewMethodSet(named)
			for i := range ptr.Len() {
				m := ptr.At(i).Obj()
				if !m.Exported() {
					continue
				}
				recv := "(*" + name + ")"
				if val.Lookup(m.Pkg(), m.Name()) != nil {
					recv = "(" + name + ")"
				}
				add(name+"."+m.Name(), "method "+recv+" func"+w.signature(m.Type().(*types.Signature)))
			}
		}
	}
	return lines
}

// sealed reports whether an interface has an unexported method, or is a
// constraint, so that no other package can implement it.
func sealed(t *types.Interface) bool {
	if !t.IsMethodSet() {
		return true
	}
	for i := range t.NumMethods() {
		if !t.Method(i).Exported() {
			return true
		}
	}
	return false
}

// writer writes types without parameter names, which callers never see,
// and with the packages of this repository by name.
type writer struct{ pkg *types.Package }

func (w *writer) qualify(p *types.Package) string {
	if strings.HasPrefix(p.Path(), modulePrefix) {
		return p.Name()
	}
	return p.Path()
}

func (w *writer) typ(t types.Type) string {
	switch t := t.(type) {
	case *types.Basic:
		return t.Name()
	case *types.Alias:
		return w.typ(types.Unalias(t))
	case *types.Named:
		s := t.Obj().Name()
		if p := t.Obj().Pkg(); p != nil {
			s = w.qualify(p) + "." + s
		}
		if args := t.TypeArgs(); args != nil && args.Len() > 0 {
			var a []string
			for i := range args.Len() {
				a = append(a, w.typ(args.At(i)))
			}
			s += "[" + strings.Join(a, ", ") + "]"
		}
		return s
	case *types.TypeParam:
		return t.Obj().Name()
	case *types.Pointer:
		return "*" + w.typ(t.Elem())
	case *types.Slice:
		return "[]" + w.typ(t.Elem())
	case *types.Array:
		return fmt.Sprintf("[%d]%s", t.Len(), w.typ(t.Elem()))
	case *types.Map:
		return "map[" + w.typ(t.Key()) + "]" + w.typ(t.Elem())
	case *types.Chan:
		switch t.Dir() {
		case types.SendOnly:
			return "chan<- " + w.typ(t.Elem())
		case types.RecvOnly:
			return "<-chan " + w.typ(t.Elem())
		}
		return "chan " + w.typ(t.Elem())
	case *types.Signature:
		return "func" + w.signature(t)
	case *types.Struct:
		var fields []string
		for i := range t.NumFields() {
			f := t.Field(i)
			s := f.Name() + " " + w.typ(f.Type())
			if f.Embedded() {
				s = w.typ(f.Type())
			}
			if tag := t.Tag(i); tag != "" {
				s += " " + fmt.Sprintf("%q", tag)
			}
			fields = append(fields, s)
		}
		return "struct{" + strings.Join(fields, "; ") + "}"
	case *types.Interface:
		var elems []string
		for i := range t.NumEmbeddeds() {
			elems = append(elems, w.typ(t.EmbeddedType(i)))
		}
		for i := range t.NumExplicitMethods() {
			m := t.ExplicitMethod(i)
			elems = append(elems, m.Name()+w.signature(m.Type().(*types.Signature)))
		}
		slices.Sort(elems)
		if len(elems) == 0 {
			return "any"
		}
		return "interface{ " + strings.Join(elems, "; ") + " }"
	case *types.Union:
		var terms []string
		for i := range t.Len() {
			term := t.Term(i)
			s := w.typ(term.Type())
			if term.Tilde() {
				s = "~" + s
			}
			terms = append(terms, s)
		}
		return strings.Join(terms, " | ")
	case *types.Tuple:
		var elems []string
		for i := range t.Len() {
			elems = append(elems, w.typ(t.At(i).Type()))
		}
		return "(" + strings.Join(elems, ", ") + ")"
	}
	return t.String()
}

func (w *writer) typeParams(l *types.TypeParamList) string {
	if l == nil || l.Len() == 0 {
		return ""
	}
	var ps []string
	for i := range l.Len() {
		p := l.At(i)
		ps = append(ps, p.Obj().Name()+" "+w.typ(p.Constraint()))
	}
	return "[" + strings.Join(ps, ", ") + "]"
}

// signature writes a function's type parameters, parameters and results.
func (w *writer) signature(sig *types.Signature) string {
	var params []string
	for i := range sig.Params().Len() {
		t := sig.Params().At(i).Type()
		if sig.Variadic() && i == sig.Params().Len()-1 {
			params = append(params, "..."+w.typ(t.(*types.Slice).Elem()))
			continue
		}
		params = append(params, w.typ(t))
	}
	s := w.typeParams(sig.TypeParams()) + "(" + strings.Join(params, ", ") + ")"
	switch r := sig.Results(); r.Len() {
	case 0:
	case 1:
		s += " " + w.typ(r.At(0).Type())
	default:
		s += " " + w.typ(r)
	}
	return s
}

// ReadListing reads a listing written by WriteListing.
func ReadListing(r io.Reader) ([]string, error) {
	var lines []string
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if line := sc.Text(); line != "" && !strings.HasPrefix(line, "#") {
			lines = append(lines, line)
		}
	}
	return lines, sc.Err()
}

// listingHeader opens the listing file.
const listingHeader = `# The API of idem's public packages at the last release: one feature a line,
# its name, what it is and its type. Written by the release procedure
# (docs/development.md, "Releasing"); tools/apicheck compares the API of the
# tree with it, and fails on a line gone from it (a name removed, a type or
# signature changed) that CHANGELOG.md's Unreleased section does not name.
`

// WriteListing writes lines, with the header, to path.
func WriteListing(path string, lines []string) error {
	return os.WriteFile(path, []byte(listingHeader+strings.Join(lines, "\n")+"\n"), 0o644)
}

// Break is a feature of the recorded API that the current one lacks or
// has changed: Was is the recorded line, Now the current lines of the
// same name.
type Break struct {
	Name string
	Was  string
	Now  []string
}

// Compare returns the recorded features that current lacks, of the
// packages named in pkgNames, and those current adds.
func Compare(recorded, current []string, pkgNames []string) (breaks []Break, added []string) {
	ofPkgs := func(line string) bool {
		for _, p := range pkgNames {
			if strings.HasPrefix(line, p+".") {
				return true
			}
		}
		return false
	}
	have := make(map[string]bool, len(current))
	byName := make(map[string][]string)
	for _, line := range current {
		have[line] = true
		name, _, _ := strings.Cut(line, " ")
		byName[name] = append(byName[name], line)
	}
	was := make(map[string]bool, len(recorded))
	for _, line := range recorded {
		if !ofPkgs(line) {
			continue
		}
		was[line] = true
		if !have[line] {
			name, _, _ := strings.Cut(line, " ")
			breaks = append(breaks, Break{Name: name, Was: line, Now: byName[name]})
		}
	}
	for _, line := range current {
		if !was[line] {
			added = append(added, line)
		}
	}
	return breaks, added
}

// Section returns the text of a changelog's section, in Keep a
// Changelog's form: "## [Unreleased]", or "## [0.2.0] - 2026-12-24" for
// name 0.2.0.
func Section(changelog, name string) string {
	heading := regexp.MustCompile(`(?m)^## \[` + regexp.QuoteMeta(name) + `\].*$`)
	loc := heading.FindStringIndex(changelog)
	if loc == nil {
		return ""
	}
	rest := changelog[loc[1]:]
	if next := strings.Index(rest, "\n## "); next >= 0 {
		rest = rest[:next]
	}
	return rest
}

// Announced reports whether text names the feature name, or the type or
// function it belongs to, in backquotes: `idem.Flow.Run`, or `idem.Flow`
// for all of the type, announces a change to the method Run.
func Announced(text, name string) bool {
	pkg, rest, _ := strings.Cut(name, ".")
	parts := strings.Split(rest, ".")
	for i := range parts {
		candidate := pkg + "." + strings.Join(parts[:i+1], ".")
		if regexp.MustCompile("`" + regexp.QuoteMeta(candidate) + `($|[^\w.])`).MatchString(text) {
			return true
		}
	}
	return false
}
