package idem_test

import (
	"context"
	"database/sql"
	"os"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
)

// TestSchemaFileMakesWhatTheMigrationsMake applies the repository's
// schema.sql, which sqlc users copy (cmd/idem keeps it what idem schema
// prints), to one empty database and idem's migrations to another, and
// compares what the catalogs hold: relations and their options, columns,
// constraints, indexes and functions.
func TestSchemaFileMakesWhatTheMigrationsMake(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema, err := os.ReadFile("schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	fromFile, err := pgx.Connect(ctx, env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer fromFile.Close(ctx)
	// Without arguments, Exec sends the file as one simple query.
	if _, err := fromFile.Exec(ctx, string(schema)); err != nil {
		t.Fatalf("apply schema.sql: %v", err)
	}

	migratedURL := env.EmptyDatabase(t)
	db, err := sql.Open("pgx", migratedURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	migrated, err := pgx.Connect(ctx, migratedURL)
	if err != nil {
		t.Fatal(err)
	}
	defer migrated.Close(ctx)

	got, want := catalog(t, fromFile), catalog(t, migrated)
	if len(want) < 20 {
		t.Fatalf("the migrated database's catalog has %d entries: %q", len(want), want)
	}
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("schema.sql lacks %s", w)
		}
	}
	for _, g := range got {
		if !slices.Contains(want, g) {
			t.Errorf("schema.sql makes %s, which the migrations do not", g)
		}
	}
}

// catalog describes the public schema's relations (but goose's version
// table), columns, constraints, indexes and functions, one line each,
// sorted.
func catalog(t *testing.T, conn *pgx.Conn) []string {
	t.Helper()
	const notGoose = `c.relname NOT LIKE 'idem\_goose\_version%'`
	queries := []string{
		`SELECT 'relation ' || c.relname || ' kind ' || c.relkind::text || ' options ' || coalesce(array_to_string(c.reloptions, ','), '')
		 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = 'public' AND ` + notGoose,
		`SELECT 'column ' || c.relname || '.' || a.attname || ' ' || a.attnum || ' ' || format_type(a.atttypid, a.atttypmod)
		        || ' notnull ' || a.attnotnull || ' identity ' || a.attidentity::text
		        || ' default ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
		 FROM pg_attribute a
		 JOIN pg_class c ON c.oid = a.attrelid
		 JOIN pg_namespace n ON n.oid = c.relnamespace
		 LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
		 WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped AND ` + notGoose,
		`SELECT 'constraint ' || c.relname || '.' || k.conname || ' ' || pg_get_constraintdef(k.oid) || ' validated ' || k.convalidated
		 FROM pg_constraint k
		 JOIN pg_class c ON c.oid = k.conrelid
		 JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = 'public' AND ` + notGoose,
		`SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'public' AND tablename NOT LIKE 'idem\_goose\_version%'`,
		`SELECT 'function ' || pg_get_functiondef(p.oid)
		 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		 WHERE n.nspname = 'public'`,
	}
	var lines []string
	for _, q := range queries {
		rows, err := conn.Query(context.Background(), q)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		lines = append(lines, got...)
	}
	slices.Sort(lines)
	return lines
}
