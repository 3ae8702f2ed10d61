package idem_test

import (
	"context"
	"database/sql"
	"io/fs"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/migration"
)

// setupEmpty returns a fresh database without any migrations applied.
func setupEmpty(t *testing.T) (context.Context, *sql.DB) {
	t.Helper()
	t.Parallel()
	db, err := sql.Open("pgx", env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return context.Background(), db
}

// idemGoose returns a goose provider of idem's migrations on db, set up
// as MigrationLockID's documentation says an application's own goose
// set-up does: with MigrationTable and the lock.
func idemGoose(t *testing.T, db *sql.DB) *goose.Provider {
	t.Helper()
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(idem.MigrationLockID))
	if err != nil {
		t.Fatal(err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, idem.Migrations(),
		goose.WithTableName(idem.MigrationTable), goose.WithSessionLocker(locker), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	return provider
}

func TestMigrateTwiceIsANoOp(t *testing.T) {
	ctx, db := setupEmpty(t)
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatalf("first Migrate: %v", err)
	}
	var versions int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_goose_version`).Scan(&versions); err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatalf("second Migrate: %v", err)
	}
	var after int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_goose_version`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != versions {
		t.Fatalf("version rows went from %d to %d on a second Migrate", versions, after)
	}
	var exists bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('idempotency_key') IS NOT NULL`).Scan(&exists); err != nil || !exists {
		t.Fatalf("idempotency_key missing after Migrate: %v", err)
	}
}

func TestMigrateBesideAnApplicationsGoose(t *testing.T) {
	ctx, db := setupEmpty(t)
	// The application's own migrations, numbered like ours, in goose's
	// default version table.
	appFS := fstest.MapFS{
		"00001_orders.sql": {Data: []byte("-- +goose Up\nCREATE TABLE orders (id bigint PRIMARY KEY);\n-- +goose Down\nDROP TABLE orders;\n")},
	}
	app, err := goose.NewProvider(goose.DialectPostgres, db, appFS, goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Up(ctx); err != nil {
		t.Fatalf("app migrations: %v", err)
	}
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatalf("idem after the app: %v", err)
	}
	if _, err := app.Up(ctx); err != nil {
		t.Fatalf("app migrations again: %v", err)
	}
	appVersion, err := app.GetDBVersion(ctx)
	if err != nil || appVersion != 1 {
		t.Fatalf("app version %d, %v; want 1", appVersion, err)
	}
	provider, err := migration.NewProvider(db, idem.Migrations())
	if err != nil {
		t.Fatal(err)
	}
	current, target, err := provider.GetVersions(ctx)
	if err != nil || current != target {
		t.Fatalf("idem at version %d, embedded target %d, %v", current, target, err)
	}
	for _, table := range []string{"orders", "idempotency_key", "goose_db_version", "idem_goose_version"} {
		var exists bool
		if err := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil || !exists {
			t.Errorf("table %s missing", table)
		}
	}
}

func TestMigrationsFSHoldsTheGooseFiles(t *testing.T) {
	t.Parallel()
	files, err := fs.Glob(idem.Migrations(), "*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("no migrations in Migrations(): %v", err)
	}
	for _, name := range files {
		b, err := fs.ReadFile(idem.Migrations(), name)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), "-- +goose Up") || !strings.Contains(string(b), "-- +goose Down") {
			t.Errorf("%s is not a goose migration with Up and Down", name)
		}
	}
}

// TestMigrationTableIsTheOneMigrateUses keeps the documented constant and
// the table goose is set up with the same.
func TestMigrationTableIsTheOneMigrateUses(t *testing.T) {
	if idem.MigrationTable != migration.Table {
		t.Fatalf("idem.MigrationTable = %q, but migrations record in %q", idem.MigrationTable, migration.Table)
	}
}

// TestGooseWithTheMigrationTableIsMigrate runs idem's migrations as
// MigrationLockID's documentation says an application's own goose set-up
// does: with MigrationTable and the lock. Both record in one table, so
// Migrate then finds every version applied, and goose finds Migrate's.
func TestGooseWithTheMigrationTableIsMigrate(t *testing.T) {
	ctx, db := setupEmpty(t)
	provider := idemGoose(t, db)
	// Part of the way with goose, the rest with Migrate.
	if _, err := provider.UpTo(ctx, 2); err != nil {
		t.Fatal(err)
	}
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatalf("Migrate after goose: %v", err)
	}
	current, target, err := provider.GetVersions(ctx)
	if err != nil || current != target {
		t.Fatalf("goose sees version %d of %d, %v; want Migrate's versions in the same table", current, target, err)
	}
	if results, err := provider.Up(ctx); err != nil || len(results) != 0 {
		t.Fatalf("goose after Migrate applied %d migrations, %v; want none", len(results), err)
	}
}

// TestMigrateWaitsForMigrationLockID holds the documented lock in another
// session: Migrate applies nothing while it is held, and everything once
// it is released.
func TestMigrateWaitsForMigrationLockID(t *testing.T) {
	ctx, db := setupEmpty(t)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	// The holder takes the lock for a transaction, which a transaction
	// pooler keeps on one server connection (a session lock could be
	// released on another, behind PgBouncer).
	holder, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback() }()
	if _, err := holder.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, idem.MigrationLockID); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- idem.Migrate(ctx, db) }()
	// Migrate's first try at the lock comes at once; give it a while to
	// get past it, if it wrongly could.
	for range 20 {
		var exists bool
		if err := db.QueryRowContext(ctx, `SELECT to_regclass('idempotency_key') IS NOT NULL`).Scan(&exists); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			t.Fatalf("Migrate returned (%v) while another session held MigrationLockID", err)
		default:
		}
		if exists {
			t.Fatal("Migrate applied a migration while another session held MigrationLockID")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := holder.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Migrate once the lock was released: %v", err)
	}
}
