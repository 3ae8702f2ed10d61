package idem

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/pgidem/idem/internal/migration"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationTable is the table in which [Migrate] records the applied
// versions. It is not goose's default, so an application's own goose
// migrations and this package's never mistake each other's versions.
const MigrationTable = "idem_goose_version"

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
// state. To go back a version, or see which are applied, use the idem
// command (idem migrate down, idem migrate status) or goose itself over
// [Migrations].
//
// With pgx, open db with github.com/jackc/pgx/v5/stdlib, for example
// stdlib.OpenDBFromPool(pool).
func Migrate(ctx context.Context, db *sql.DB) error {
	provider, err := migration.NewProvider(db, Migrations())
	if err != nil {
		return err
	}
	if _, err := provider.Up(ctx); err != nil {
		return fmt.Errorf("idem: migrate: %w", err)
	}
	return nil
}
