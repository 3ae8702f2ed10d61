package idemhttp

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	valid := []struct {
		name, header, key string
	}{
		{"sf-string", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{"sf-string with spaces inside", `"order 42, attempt 1"`, "order 42, attempt 1"},
		{"escaped quote", `"say \"hi\""`, `say "hi"`},
		{"escaped backslash", `"a\\b"`, `a\b`},
		{"only escapes", `"\"\\"`, `"\`},
		{"surrounding whitespace", " \t\"k\" \t", "k"},
		{"bare token", "8e03978e-40d5", "8e03978e-40d5"},
		{"bare token of every kind of visible ASCII", `a!#$%&'()*+,-./:;<=>?@[\]^_{|}~z`, `a!#$%&'()*+,-./:;<=>?@[\]^_{|}~z`},
		{"bare token with a quote inside", `ab"c`, `ab"c`},
		{"bare token that looks like an inner list", `("a")`, `("a")`},
		{"bare token with whitespace around", "  k1\t", "k1"},
		{"longest sf-string", `"` + strings.Repeat("a", idem.MaxKeyLength) + `"`, strings.Repeat("a", idem.MaxKeyLength)},
		{"longest bare token", strings.Repeat("b", idem.MaxKeyLength), strings.Repeat("b", idem.MaxKeyLength)},
		{"bound applies after unquoting", `"` + strings.Repeat(`\"`, idem.MaxKeyLength) + `"`, strings.Repeat(`"`, idem.MaxKeyLength)},
	}
	for _, c := range valid {
		got, err := parseKey([]string{c.header})
		if err != nil || got != c.key {
			t.Errorf("%s: parseKey(%q) = %q, %v; want %q", c.name, c.header, got, err, c.key)
		}
	}

	invalid := []struct {
		name   string
		values []string
	}{
		{"absent", nil},
		{"empty", []string{""}},
		{"only whitespace", []string{" \t "}},
		{"empty sf-string", []string{`""`}},
		{"lone quote", []string{`"`}},
		{"unterminated", []string{`"abc`}},
		{"escaped closing quote", []string{`"abc\"`}},
		{"trailing backslash", []string{`"abc\`}},
		{"escape of another character", []string{`"a\nb"`}},
		{"text after the closing quote", []string{`"a"b`}},
		{"parameters", []string{`"a";p=1`}},
		{"two items", []string{`"a", "b"`}},
		{"tab in sf-string", []string{"\"a\tb\""}},
		{"DEL in sf-string", []string{"\"a\x7fb\""}},
		{"non-ASCII in sf-string", []string{"\"caf\xc3\xa9\""}},
		{"space in bare token", []string{"a b"}},
		{"tab in bare token", []string{"a\tb"}},
		{"control byte in bare token", []string{"a\x01b"}},
		{"NUL in bare token", []string{"a\x00b"}},
		{"non-ASCII bare token", []string{"caf\xc3\xa9"}},
		{"sf-string over the bound", []string{`"` + strings.Repeat("a", idem.MaxKeyLength+1) + `"`}},
		{"bare token over the bound", []string{strings.Repeat("a", idem.MaxKeyLength+1)}},
		{"escapes over the bound", []string{`"` + strings.Repeat(`\\`, idem.MaxKeyLength+1) + `"`}},
		{"two fields", []string{"a", "b"}},
		{"two equal fields", []string{"a", "a"}},
	}
	for _, c := range invalid {
		if got, err := parseKey(c.values); err == nil {
			t.Errorf("%s: parseKey(%q) = %q, want an error", c.name, c.values, got)
		}
	}
}

// quote serializes key as an sf-string.
func quote(key string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
}

func FuzzParseKey(f *testing.F) {
	for _, seed := range []string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, "8e03978e-40d5", `"a\"b\\c"`, `""`, `"`, `"a\`,
		`"a"b`, `"a";p=1`, " \"k\" ", "a b", "caf\xc3\xa9", "\"\x00\"", `ab"c`,
		`"` + strings.Repeat(`\\`, idem.MaxKeyLength) + `"`, strings.Repeat("x", idem.MaxKeyLength+1),
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, header string) {
		key, err := parseKey([]string{header})
		if err != nil {
			return
		}
		if key == "" || len(key) > idem.MaxKeyLength {
			t.Fatalf("parseKey(%q) = %q: empty or over %d bytes", header, key, idem.MaxKeyLength)
		}
		for i := range len(key) {
			if key[i] < 0x20 || key[i] > 0x7e {
				t.Fatalf("parseKey(%q) = %q: byte %#02x is not printable ASCII", header, key, key[i])
			}
		}
		// Every accepted key is a key the database accepts, and reads
		// back as itself when sent as an sf-string.
		if again, err := parseKey([]string{quote(key)}); err != nil || again != key {
			t.Fatalf("key %q sent as %s parses as %q, %v", key, quote(key), again, err)
		}
		// A bare token is the key itself, apart from surrounding blanks.
		if trimmed := strings.Trim(header, " \t"); !strings.HasPrefix(trimmed, `"`) && trimmed != key {
			t.Fatalf("bare token %q parsed as %q", header, key)
		}
	})
}

func TestMiddlewareParseKeyReadsTheConfiguredHeader(t *testing.T) {
	t.Parallel()
	m, err := NewMiddleware(&pgxpool.Pool{}, Config{
		Scope:  func(*http.Request) (string, error) { return "s", nil },
		Header: "x-request-key",
	})
	if err != nil {
		t.Fatal(err)
	}
	request := func(header string, values ...string) *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/payments", nil)
		for _, v := range values {
			r.Header.Add(header, v)
		}
		return r
	}

	if key, err := m.ParseKey(request("X-Request-Key", `"order \"7\""`)); err != nil || key != `order "7"` {
		t.Errorf("ParseKey = %q, %v; want the key unquoted", key, err)
	}
	for name, c := range map[string]struct {
		r       *http.Request
		missing bool
	}{
		// The default header is not the configured one.
		"missing":    {request(DefaultHeader, "k"), true},
		"invalid":    {request("X-Request-Key", `"open`), false},
		"sent twice": {request("X-Request-Key", "a", "b"), false},
	} {
		key, err := m.ParseKey(c.r)
		if key != "" || !errors.Is(err, idem.ErrInvalidKey) || isKeyMissing(err) != c.missing {
			t.Errorf("%s: ParseKey = %q, %v; want an error wrapping idem.ErrInvalidKey, missing=%v", name, key, err, c.missing)
			continue
		}
		if !strings.Contains(err.Error(), "X-Request-Key") {
			t.Errorf("%s: error %q does not name the header", name, err)
		}
	}
}

// TestParseKeyFindsTheFieldWhateverTheCaseOfItsName gives ParseKey, and
// the middleware, requests whose key's field is set in the header map
// directly, under names spelled in other cases, as http.Header allows: a
// key there is found, and two of them are a field sent twice, never read
// as the one or the other.
func TestParseKeyFindsTheFieldWhateverTheCaseOfItsName(t *testing.T) {
	t.Parallel()
	m, err := NewMiddleware(&pgxpool.Pool{}, Config{Scope: func(*http.Request) (string, error) { return "s", nil }})
	if err != nil {
		t.Fatal(err)
	}
	request := func(fields map[string][]string) *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/payments", nil)
		for name, values := range fields {
			r.Header[name] = values
		}
		return r
	}
	for name, fields := range map[string]map[string][]string{
		"in lower case":         {"idempotency-key": {"k"}},
		"in upper case":         {"IDEMPOTENCY-KEY": {`"k"`}},
		"beside an empty entry": {DefaultHeader: nil, "idempotency-key": {"k"}},
	} {
		if key, err := m.ParseKey(request(fields)); err != nil || key != "k" {
			t.Errorf("%s: ParseKey = %q, %v; want k", name, key, err)
		}
	}

	handlerRan := false
	next := m.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { handlerRan = true }))
	for name, fields := range map[string]map[string][]string{
		"two keys in two cases":       {DefaultHeader: {"a"}, "idempotency-key": {"b"}},
		"two keys in two other cases": {"idempotency-key": {"a"}, "IDEMPOTENCY-KEY": {"b"}},
		"one key in two cases":        {DefaultHeader: {"a"}, "idempotency-key": {"a"}},
	} {
		key, err := m.ParseKey(request(fields))
		if key != "" || !errors.Is(err, idem.ErrInvalidKey) || isKeyMissing(err) || !strings.Contains(err.Error(), "more than once") {
			t.Errorf("%s: ParseKey = %q, %v; want the error of a field sent twice", name, key, err)
		}
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, request(fields))
		if rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), ProblemKeyInvalid) {
			t.Errorf("%s: the middleware answered %d %s, want 400 %s", name, rec.Code, rec.Body, ProblemKeyInvalid)
		}
	}
	if handlerRan {
		t.Error("the handler ran for a request with two keys")
	}
}
