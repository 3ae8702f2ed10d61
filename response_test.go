package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

func TestResponseTooLargeStoresNothing(t *testing.T) {
	ctx, pool, scope := setup(t)
	var calls atomic.Int64
	_, err := idem.Run(ctx, pool, scope, "k", fpA, func(ctx context.Context, tx pgx.Tx) (payment, error) {
		p, err := pay(scope, "k", 1, &calls)(ctx, tx)
		p.Note = strings.Repeat("x", 200)
		return p, err
	}, idem.WithMaxResponseSize(100))
	if !errors.Is(err, idem.ErrResponseTooLarge) {
		t.Fatalf("err = %v, want ErrResponseTooLarge", err)
	}
	if countRecords(t, pool, scope) != 0 || countPayments(t, pool, scope) != 0 {
		t.Fatal("an oversized response left a record or a payment")
	}

	// Inside the caller's transaction the claim is released and the
	// transaction stays usable.
	err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := idem.Do(ctx, tx, scope, "k2", fpA, func(context.Context, pgx.Tx) (string, error) {
			return strings.Repeat("x", 200), nil
		}, idem.WithMaxResponseSize(100))
		if !errors.Is(err, idem.ErrResponseTooLarge) {
			t.Errorf("Do err = %v, want ErrResponseTooLarge", err)
		}
		_, err = tx.Exec(ctx, `SELECT 1`)
		return err
	})
	if err != nil {
		t.Fatalf("transaction after ErrResponseTooLarge: %v", err)
	}
	if countRecords(t, pool, scope) != 0 {
		t.Fatal("an oversized response left a record")
	}
}

type richValue struct {
	Int      int64             `json:"int"`
	Big      uint64            `json:"big"`
	Float    float64           `json:"float"`
	Text     string            `json:"text"`
	Bytes    []byte            `json:"bytes"`
	Map      map[string]int    `json:"map"`
	Nested   *richValue        `json:"nested"`
	List     []string          `json:"list"`
	Empty    map[string]string `json:"empty"`
	Time     time.Time         `json:"time"`
	Nothing  *int              `json:"nothing"`
	Escaping string            `json:"escaping"`
}

func TestStoredValuesReplayEqual(t *testing.T) {
	ctx, pool, scope := setup(t)
	values := map[string]any{
		"rich": richValue{
			Int: -42, Big: 1<<64 - 1, Float: 0.1 + 0.2, Text: "größe ✓ 🚀 \"quoted\" \\ </script>",
			Bytes: []byte{0, 1, 2, 255}, Map: map[string]int{"b": 2, "a": 1},
			Nested: &richValue{Int: 1, List: []string{}}, List: []string{"x", ""},
			Empty: map[string]string{}, Time: time.Date(2026, 11, 29, 12, 0, 0, 123456789, time.UTC),
			Escaping: `\u0000 is text here, not a NUL`,
		},
		"float extremes": []float64{1e21, 5e-324, math.Copysign(0, -1), 1.7976931348623157e308},
		"null":           nil,
		"string":         "plain",
	}
	for name, v := range values {
		key := "k-" + strings.ReplaceAll(name, " ", "-")
		run := func() (idem.Result[any], error) {
			return idem.Run(ctx, pool, scope, key, fpA, func(context.Context, pgx.Tx) (any, error) { return v, nil })
		}
		if _, err := run(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		replay, err := run()
		if err != nil || !replay.Replayed {
			t.Fatalf("%s: replay %+v, %v", name, replay, err)
		}
		// Compare through the same decoding the first caller would apply.
		if got, want := normalize(t, replay.Value), normalize(t, v); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: replayed %v, want %v", name, got, want)
		}
	}

	typed, err := idem.Run(ctx, pool, scope, "typed", fpA, func(context.Context, pgx.Tx) (richValue, error) {
		return values["rich"].(richValue), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	replayed, err := idem.Run(ctx, pool, scope, "typed", fpA, func(context.Context, pgx.Tx) (richValue, error) {
		return richValue{}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(normalize(t, replayed.Value), normalize(t, typed.Value)) || !replayed.Value.Time.Equal(typed.Value.Time) ||
		replayed.Value.Big != typed.Value.Big || replayed.Value.Float != typed.Value.Float {
		t.Fatalf("typed replay differs:\n got %+v\nwant %+v", replayed.Value, typed.Value)
	}
}

// rawMarshaler is a Marshaler that answers its own bytes, as a hand-written
// MarshalJSON may.
type rawMarshaler string

func (m rawMarshaler) MarshalJSON() ([]byte, error) { return []byte(m), nil }

func TestUnstorableValuesFailTyped(t *testing.T) {
	ctx, pool, scope := setup(t)
	cases := map[string]any{
		"NUL in a string":                       "a\x00b",
		"NUL in a key":                          map[string]int{"a\x00": 1},
		"channel":                               make(chan int),
		"lone surrogate":                        json.RawMessage(`"\ud800"`),
		"number beyond numeric, integer":        json.RawMessage(`1e1000000`),
		"number beyond numeric, fraction":       json.Number("1.5e-16383"),
		"number beyond numeric, json.Number":    json.Number("1e200000"),
		"zero with an exponent numeric rejects": json.RawMessage(`0e1073741823`),
		"zero with a huge negative exponent":    json.RawMessage(`-0E-1073741823`),
		"invalid UTF-8 in a json.RawMessage":    json.RawMessage("\"\xff\""),
		"invalid UTF-8 from a Marshaler":        rawMarshaler("{\"name\": \"\xc3\x28\"}"),
	}
	for name, v := range cases {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := idem.Do(ctx, tx, scope, "k", fpA, func(context.Context, pgx.Tx) (any, error) { return v, nil })
			if !errors.Is(err, idem.ErrResponseNotStorable) {
				t.Errorf("%s: err = %v, want ErrResponseNotStorable", name, err)
			}
			_, err = tx.Exec(ctx, `SELECT 1`)
			return err
		})
		if err != nil {
			t.Fatalf("%s: transaction unusable afterwards: %v", name, err)
		}
	}
	if countRecords(t, pool, scope) != 0 {
		t.Fatal("an unstorable value left a record")
	}
}

// normalize decodes v's JSON into plain maps, slices and float64s, so that
// values compare by meaning rather than by spelling.
func normalize(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestNumbersAtJsonbsLimitsAreStored(t *testing.T) {
	ctx, pool, scope := setup(t)
	for i, n := range []string{`1e131071`, `1e-16383`, `1.5e-16382`, `-0.0e131073`, `0e1073741822`} {
		key := fmt.Sprintf("n%d", i)
		run := func() (idem.Result[json.RawMessage], error) {
			return idem.Run(ctx, pool, scope, key, nil, func(context.Context, pgx.Tx) (json.RawMessage, error) {
				return json.RawMessage(n), nil
			})
		}
		if _, err := run(); err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		replay, err := run()
		if err != nil || !replay.Replayed {
			t.Fatalf("%s: replay %v", n, err)
		}
		if !bytes.Equal(fingerprintOf(t, replay.Value), fingerprintOf(t, json.RawMessage(n))) {
			t.Fatalf("%s replayed as another number", n)
		}
	}
}

func fingerprintOf(t *testing.T, doc json.RawMessage) []byte {
	t.Helper()
	fp, err := idem.FingerprintJSON(doc)
	if err != nil {
		t.Fatal(err)
	}
	return fp
}
