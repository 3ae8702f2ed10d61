package idem

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationTable is the table in which [Migrate] records the applied
// versions. It is not goose's default, so an application's own goose
// migrations and this package's never mistake each other's versions.
const MigrationTable = "idem_goose_version"

// migrationLockID is the advisory lock that serializes concurrent Migrate
// calls (several replicas starting at once). It is not goose's default id,
// so it never waits on an application's own goose run. The value spells
// "idem" in ASCII.
const migrationLockID = 0x6964656d

// Migrations returns the embedded goose migrations, for applications that
// run goose themselves. Run them with their own version table (see
// [MigrationTable]) rather than the application's.
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err) // the directory is embedded at build time
	}
	return sub
}

// Migrate applies every embedded migration that db has not applied yet, and
// does nothing when all are applied. It records versions in
// [MigrationTable] and holds its own advisory lock while it runs, so
// replicas may call it concurrently at start-up. It uses no goose global
// state.
//
// With pgx, open db with github.com/jackc/pgx/v5/stdlib, for example
// stdlib.OpenDBFromPool(pool).
func Migrate(ctx context.Context, db *sql.DB) error {
	provider, err := NewMigrationProvider(db)
	if err != nil {
		return err
	}
	if _, err := provider.Up(ctx); err != nil {
		return fmt.Errorf("idem: migrate: %w", err)
	}
	return nil
}

// NewMigrationProvider returns a goose provider over the embedded
// migrations, set up as [Migrate] uses it (own version table, own advisory
// lock, no global registry), for callers that need more than Up: Down,
// Status or a target version.
func NewMigrationProvider(db *sql.DB) (*goose.Provider, error) {
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(migrationLockID))
	if err != nil {
		return nil, fmt.Errorf("idem: migration lock: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, Migrations(),
		goose.WithTableName(MigrationTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("idem: migration provider: %w", err)
	}
	return provider, nil
}
