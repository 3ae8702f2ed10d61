package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/pgidem/idem/cmd/idem/cli"
)

// TestSchemaIsTheCommittedFile keeps the repository's schema.sql, which
// sqlc users copy, what "idem schema" prints for the migrations of this
// checkout. (The library's own tests check that schema.sql makes the
// tables the migrations make.)
func TestSchemaIsTheCommittedFile(t *testing.T) {
	t.Parallel()
	var out, errs bytes.Buffer
	if code := run(context.Background(), []string{"schema"}, &out, &errs); code != cli.ExitOK {
		t.Fatalf("idem schema: exit %d\n%s", code, errs.String())
	}
	committed, err := os.ReadFile(filepath.Join("..", "..", "schema.sql"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), committed) {
		t.Fatal("schema.sql is not what idem schema prints: run go run ./cmd/idem schema > schema.sql at the repository's root, and commit it")
	}
	for _, want := range []string{"-- 00001_create_idempotency_key.sql\n", "CREATE TABLE IF NOT EXISTS idempotency_key", "CREATE FUNCTION idem_key_lock"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("idem schema does not print %q", want)
		}
	}
	for _, not := range []string{"+goose", "DROP TABLE"} {
		if strings.Contains(out.String(), not) {
			t.Errorf("idem schema prints %q, from goose's annotations or a Down section", not)
		}
	}
	if code := run(context.Background(), []string{"schema", "extra"}, &out, &errs); code != cli.ExitUsage {
		t.Errorf("idem schema extra: exit %d, want %d", code, cli.ExitUsage)
	}
}

func TestSchemaTakesTheUpSectionsInOrder(t *testing.T) {
	t.Parallel()
	migrations := fstest.MapFS{
		"00002_b.sql": {Data: []byte("-- +goose Up\n-- +goose StatementBegin\nCREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1; $$;\n-- +goose StatementEnd\n-- +goose Down\nDROP FUNCTION f();\n")},
		"00001_a.sql": {Data: []byte("-- +goose Up\nCREATE TABLE a (id int);\n\n-- +goose Down\nDROP TABLE a;\n")},
	}
	var out bytes.Buffer
	if err := writeSchema(&out, migrations); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	a, b := strings.Index(got, "-- 00001_a.sql\nCREATE TABLE a (id int);\n"), strings.Index(got, "-- 00002_b.sql\nCREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1; $$;\n")
	if a < 0 || b < a || strings.Contains(got, "DROP") || strings.Contains(got, "+goose") {
		t.Fatalf("schema of two migrations:\n%s", got)
	}
	for name, migration := range map[string]string{
		"no Up section": "-- +goose Down\nDROP TABLE a;\n",
		"ENVSUB":        "-- +goose Up\n-- +goose ENVSUB ON\nCREATE TABLE ${T} (id int);\n",
	} {
		if err := writeSchema(&out, fstest.MapFS{"00001_x.sql": {Data: []byte(migration)}}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
