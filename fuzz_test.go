package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/idem"
)

// FuzzFingerprintJSON checks that FingerprintJSON gives one digest to every
// spelling of a JSON value (keys in any order, any whitespace, any escapes,
// any spelling of a number) and another digest to a different value, and
// that it rejects what is not JSON without panicking.
func FuzzFingerprintJSON(f *testing.F) {
	f.Fuzz(func(t *testing.T, doc []byte, seed uint64) {
		fp, err := idem.FingerprintJSON(json.RawMessage(doc))
		if doc != nil && !json.Valid(doc) {
			if err == nil {
				t.Fatalf("FingerprintJSON accepted invalid JSON %q", doc)
			}
			return
		}
		if !utf8.Valid(doc) {
			if err == nil {
				t.Fatalf("FingerprintJSON accepted invalid UTF-8 %q", doc)
			}
			return
		}
		if err != nil && strings.Contains(err.Error(), "surrogate") {
			// Decoding turns a lone surrogate into U+FFFD: the rejection is
			// right only if the decoded value shows one.
			if !strings.ContainsRune(fmt.Sprint(decodeJSON(t, doc)), utf8.RuneError) {
				t.Fatalf("FingerprintJSON rejected %q for a lone surrogate it does not hold", doc)
			}
			return
		}
		if err != nil {
			t.Fatalf("FingerprintJSON(%q): %v", doc, err)
		}
		if len(fp) != 32 {
			t.Fatalf("FingerprintJSON(%q) has %d bytes, want 32", doc, len(fp))
		}
		if doc == nil {
			return // a nil json.RawMessage encodes as null
		}

		tree := decodeJSON(t, doc)
		rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
		respelled := respell(rng, tree)
		if !json.Valid(respelled) {
			t.Fatalf("the test respelled %q as invalid JSON %q", doc, respelled)
		}
		if got := mustFingerprint(t, json.RawMessage(respelled)); !bytes.Equal(got, fp) {
			t.Fatalf("%q and its respelling %q have different fingerprints", doc, respelled)
		}
		// The decoded value, encoded again by encoding/json, is the same value.
		if got := mustFingerprint(t, tree); !bytes.Equal(got, fp) {
			t.Fatalf("%q and its decoded value %#v have different fingerprints", doc, tree)
		}

		changed := respell(rng, mutate(tree))
		if got := mustFingerprint(t, json.RawMessage(changed)); bytes.Equal(got, fp) {
			t.Fatalf("%q and the different value %q have the same fingerprint", doc, changed)
		}
		wrapped := append(append([]byte("["), doc...), ']')
		if got := mustFingerprint(t, json.RawMessage(wrapped)); bytes.Equal(got, fp) {
			t.Fatalf("%q and %q have the same fingerprint", doc, wrapped)
		}
	})
}

// FuzzFingerprint checks Fingerprint's length prefixes: the digest changes
// when bytes move from one part to the next, when parts swap, and when the
// parts are joined into one.
func FuzzFingerprint(f *testing.F) {
	f.Fuzz(func(t *testing.T, a, b []byte, move uint8) {
		fp := idem.Fingerprint(a, b)
		if len(fp) != 32 {
			t.Fatalf("Fingerprint has %d bytes, want 32", len(fp))
		}
		if !bytes.Equal(idem.Fingerprint(bytes.Clone(a), bytes.Clone(b)), fp) {
			t.Fatal("Fingerprint is not deterministic")
		}
		joined := slices.Concat(a, b)
		differ := func(what string, parts ...[]byte) {
			t.Helper()
			if bytes.Equal(idem.Fingerprint(parts...), fp) {
				t.Fatalf("Fingerprint(%q, %q) equals the fingerprint of %s %q", a, b, what, parts)
			}
		}
		if n := int(move); n > 0 && n <= len(a) {
			differ("the parts with bytes moved forward", a[:len(a)-n], joined[len(a)-n:])
		}
		if n := int(move); n > 0 && n <= len(b) {
			differ("the parts with bytes moved back", joined[:len(a)+n], b[n:])
		}
		if !bytes.Equal(a, b) {
			differ("the swapped parts", b, a)
		}
		differ("the joined parts", joined)
		differ("the parts and an empty one", a, b, nil)
	})
}

// FuzzKeyValidation checks that Do, Run and Once reject exactly the invalid
// scopes and keys (empty, over 255 bytes, not UTF-8, holding a NUL), with
// the right error and before anything reaches the database, and let every
// valid pair through to it.
func FuzzKeyValidation(f *testing.F) {
	ctx := context.Background()
	fn := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	f.Fuzz(func(t *testing.T, scope, key string) {
		var want error
		switch {
		case !validIdentifier(scope):
			want = idem.ErrInvalidScope
		case !validIdentifier(key):
			want = idem.ErrInvalidKey
		}

		if want != nil {
			// Any use of the database panics, and fails the test.
			_, err := idem.Do(ctx, panicTx{}, scope, key, nil, fn)
			checkRejected(t, "Do", scope, key, err, want)
			_, err = idem.Run(ctx, panicBeginner{}, scope, key, nil, fn)
			checkRejected(t, "Run", scope, key, err, want)
			_, err = idem.Once(ctx, panicTx{}, scope, key, func(context.Context, pgx.Tx) error { return nil })
			checkRejected(t, "Once", scope, key, err, want)
			return
		}

		tx := &unreachableTx{}
		if _, err := idem.Do(ctx, tx, scope, key, nil, fn); !errors.Is(err, errUnreachable) || tx.uses == 0 {
			t.Fatalf("Do(%q, %q) = %v after %d statements, want it to reach the database", scope, key, err, tx.uses)
		}
		db := &unreachableBeginner{}
		if _, err := idem.Run(ctx, db, scope, key, nil, fn); !errors.Is(err, errUnreachable) || db.begins == 0 {
			t.Fatalf("Run(%q, %q) = %v after %d begins, want it to reach the database", scope, key, err, db.begins)
		}
	})
}

// validIdentifier is the rule for scopes and keys, written out again.
func validIdentifier(s string) bool {
	return s != "" && len(s) <= idem.MaxKeyLength && utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

func checkRejected(t *testing.T, call, scope, key string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s(%q, %q) = %v, want %v", call, scope, key, err, want)
	}
}

// panicBeginner is a TxBeginner that fails the test on any use, as panicTx
// does for a transaction.
type panicBeginner struct{ idem.TxBeginner }

// errUnreachable is what the stand-in database answers to everything.
var errUnreachable = errors.New("the database is not reachable in this test")

// unreachableTx is a transaction that counts the statements sent to it and
// fails each one, showing that a call got as far as the database.
type unreachableTx struct {
	pgx.Tx
	uses int
}

func (tx *unreachableTx) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	tx.uses++
	return pgconn.CommandTag{}, errUnreachable
}

func (tx *unreachableTx) Query(context.Context, string, ...any) (pgx.Rows, error) {
	tx.uses++
	return nil, errUnreachable
}

func (tx *unreachableTx) QueryRow(context.Context, string, ...any) pgx.Row {
	tx.uses++
	return unreachableRow{}
}

func (tx *unreachableTx) Conn() *pgx.Conn { return nil }

func (tx *unreachableTx) SendBatch(context.Context, *pgx.Batch) pgx.BatchResults {
	tx.uses++
	return unreachableResults{}
}

// unreachableResults are the results of a batch that never got through.
type unreachableResults struct{ pgx.BatchResults }

func (unreachableResults) Tx() pgx.Tx   { return nil }
func (unreachableResults) Close() error { return errUnreachable }

type unreachableRow struct{}

func (unreachableRow) Scan(...any) error { return errUnreachable }

// unreachableBeginner is a TxBeginner that counts and fails every begin.
type unreachableBeginner struct{ begins int }

func (b *unreachableBeginner) BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error) {
	b.begins++
	return nil, errUnreachable
}

func mustFingerprint(t *testing.T, v any) []byte {
	t.Helper()
	fp, err := idem.FingerprintJSON(v)
	if err != nil {
		t.Fatalf("FingerprintJSON(%#v): %v", v, err)
	}
	return fp
}

// decodeJSON decodes a valid document into a tree of nil, bool, string,
// json.Number, []any and map[string]any.
func decodeJSON(t *testing.T, doc []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		t.Fatalf("decode %q: %v", doc, err)
	}
	return tree
}

// respell writes a decoded tree as JSON again, spelled differently where
// JSON allows: object keys shuffled, whitespace between any tokens,
// characters escaped or not, numbers with other digits and exponents.
func respell(rng *rand.Rand, tree any) []byte {
	var buf bytes.Buffer
	writeRespelled(&buf, rng, tree)
	return buf.Bytes()
}

func writeRespelled(buf *bytes.Buffer, rng *rand.Rand, node any) {
	space := func() {
		for rng.IntN(3) == 0 {
			buf.WriteByte(" \t\n\r"[rng.IntN(4)])
		}
	}
	space()
	switch n := node.(type) {
	case nil:
		buf.WriteString("null")
	case bool:
		buf.WriteString(strconv.FormatBool(n))
	case string:
		writeRespelledString(buf, rng, n)
	case json.Number:
		buf.WriteString(respellNumber(rng, n.String()))
	case []any:
		buf.WriteByte('[')
		for i, elem := range n {
			if i > 0 {
				buf.WriteByte(',')
			}
			writeRespelled(buf, rng, elem)
		}
		space()
		buf.WriteByte(']')
	case map[string]any:
		keys := slices.Sorted(maps.Keys(n))
		rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		buf.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				buf.WriteByte(',')
			}
			space()
			writeRespelledString(buf, rng, k)
			space()
			buf.WriteByte(':')
			writeRespelled(buf, rng, n[k])
		}
		space()
		buf.WriteByte('}')
	default:
		panic(fmt.Sprintf("unexpected JSON node %T", node))
	}
	space()
}

// writeRespelledString writes s as a JSON string, each character either as
// itself, when JSON allows it, or as one of its escapes.
func writeRespelledString(buf *bytes.Buffer, rng *rand.Rand, s string) {
	short := map[rune]string{'"': `\"`, '\\': `\\`, '/': `\/`, '\b': `\b`, '\f': `\f`, '\n': `\n`, '\r': `\r`, '\t': `\t`}
	buf.WriteByte('"')
	for _, r := range s {
		mustEscape := r == '"' || r == '\\' || r < 0x20
		switch choice := rng.IntN(3); {
		case !mustEscape && choice == 0:
			buf.WriteRune(r)
		case short[r] != "" && choice == 1:
			buf.WriteString(short[r])
		case r > 0xffff:
			hi, lo := utf16.EncodeRune(r)
			fmt.Fprintf(buf, `\u%04x\u%04X`, hi, lo)
		default:
			fmt.Fprintf(buf, `\u%04x`, r)
		}
	}
	buf.WriteByte('"')
}

// respellExponentLimit keeps respelled numbers' exponents within the range
// FingerprintJSON compares exactly; past it, it documents that a number
// keeps its literal spelling.
const respellExponentLimit = 1000

// respellNumber spells the JSON number lit another way: trailing zeros in
// the fraction, the decimal point moved into the exponent, the exponent
// written with a sign, leading zeros or another letter case. Numbers whose
// exponent is out of the exactly compared range are left as they are.
func respellNumber(rng *rand.Rand, lit string) string {
	mantissa, exp := lit, 0
	if i := strings.IndexAny(lit, "eE"); i >= 0 {
		var err error
		if exp, err = strconv.Atoi(strings.TrimPrefix(lit[i+1:], "+")); err != nil || abs(exp) > respellExponentLimit {
			return lit
		}
		mantissa = lit[:i]
	}
	sign := ""
	if strings.HasPrefix(mantissa, "-") {
		sign, mantissa = "-", mantissa[1:]
	}
	whole, frac, _ := strings.Cut(mantissa, ".")

	if rng.IntN(2) == 0 && abs(exp-len(frac)) <= respellExponentLimit {
		// Move the decimal point to the end: 12.5e3 is 125e2.
		whole, frac, exp = strings.TrimLeft(whole+frac, "0"), "", exp-len(frac)
		if whole == "" {
			whole = "0"
		}
	}
	frac += strings.Repeat("0", rng.IntN(3))
	out := sign + whole
	if frac != "" {
		out += "." + frac
	}
	if exp != 0 || rng.IntN(2) == 0 {
		out += []string{"e", "E"}[rng.IntN(2)]
		switch {
		case exp < 0:
			out += "-"
		case rng.IntN(2) == 0:
			out += "+"
		}
		out += strings.Repeat("0", rng.IntN(3)) + strconv.Itoa(abs(exp))
	}
	return out
}

func abs(n int) int {
	if n < 0 {
		return -n
	}
	return n
}

// mutate returns a tree that holds a different value: one leaf changed, or
// one element or member added where there is no leaf.
func mutate(node any) any {
	switch n := node.(type) {
	case nil:
		return false
	case bool:
		return !n
	case string:
		return n + "x"
	case json.Number:
		// Add a little to the number's magnitude, far past its last digit,
		// where rounding through float64 would lose it.
		lit := n.String()
		mantissa, exponent := lit, ""
		if i := strings.IndexAny(lit, "eE"); i >= 0 {
			mantissa, exponent = lit[:i], lit[i:]
		}
		if !strings.Contains(mantissa, ".") {
			mantissa += "."
		}
		return json.Number(mantissa + "0000000000000000001" + exponent)
	case []any:
		if len(n) == 0 {
			return []any{nil}
		}
		changed := slices.Clone(n)
		changed[0] = mutate(changed[0])
		return changed
	case map[string]any:
		changed := maps.Clone(n)
		if len(n) == 0 {
			changed[""] = nil
			return changed
		}
		first := slices.Min(slices.Collect(maps.Keys(n)))
		changed[first] = mutate(n[first])
		return changed
	}
	panic(fmt.Sprintf("unexpected JSON node %T", node))
}
