package main

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/pgidem/idem"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migrationTable is the service's own goose version table: goose's
// default. idem records its versions in idem.MigrationTable, so the two
// sets, both numbered from 00001, never mistake each other's.
const migrationTable = "goose_db_version"

// migrate applies idem's migrations, then the service's own. Both hold an
// advisory lock while they run, idem's and goose's default (two different
// ids), so that replicas starting at once apply each migration once.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	// A *sql.DB over the pool for goose: closing it leaves the pool open.
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()

	if err := idem.Migrate(ctx, db); err != nil {
		return err
	}

	files, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return err
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, files,
		goose.WithTableName(migrationTable),
		goose.WithSessionLocker(locker),
		// This provider only: no global registry of Go migrations.
		goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return err
	}
	if _, err := provider.Up(ctx); err != nil {
		return fmt.Errorf("payments: migrate: %w", err)
	}
	return nil
}
