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

// Migrations returns the embedded goose migrations, for programs that run
// goose themselves: give goose [MigrationTable] and [MigrationLockID] (see
// there), as [Migrate] does, never the application's own version table.
// For tools that read a schema but cannot see embedded files, such as
// sqlc, the repository's schema.sql holds the same SQL (docs/sqlc.md).
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err) // the directory is embedded at build time
	}
	return sub
}

// Migrate applies every embedded migration that db has not applied yet, and
// does nothing when all are applied. It records versions in
// [MigrationTable] and holds the advisory lock [MigrationLockID] while it
// runs, so replicas may call it concurrently at start-up. It uses no goose
// global state. To go back a version, or see which are applied, use the idem
// command (idem migrate down, idem migrate status) or goose itself over
// [Migrations].
//
// Migrate does not close db: the caller does, when done with it. With pgx,
// open db with github.com/jackc/pgx/v5/stdlib, for example
// stdlib.OpenDBFromPool(pool), and close it once Migrate returns: it only
// borrows the pool's connections, and closing it leaves the pool open. Run
// Migrate on a direct connection to PostgreSQL (or a session-mode pooler),
// not through a transaction pooler, which cannot keep its session lock.
//
// Running goose over Migrations with MigrationTable and MigrationLockID
// does what Migrate does: both read and write one version table, so each
// finds the versions the other applied, and their runs wait for each
// other. With another table, such as the application's own, goose would
// take the application's versions for idem's (both start at 1) and skip
// migrations, and Migrate would then apply them again. See
// docs/migrations.md.
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
