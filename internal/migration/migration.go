// Package migration sets up goose over idem's embedded migrations, for the
// idem package's Migrate and for the idem command's down and status.
package migration

import (
	"database/sql"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// Table is the table in which the applied versions are recorded. It is not
// goose's default, so an application's own goose migrations and idem's
// never mistake each other's versions.
const Table = "idem_goose_version" // idem.MigrationTable

// LockID is the advisory lock that serializes concurrent runs (several
// replicas starting at once). It is not goose's default id, so it never
// waits on an application's own goose run. The value spells "idem" in
// ASCII.
const LockID = 0x6964656d // idem.MigrationLockID

// NewProvider returns a goose provider over migrations, with its own
// version table, its own advisory lock and no global registry.
func NewProvider(db *sql.DB, migrations fs.FS) (*goose.Provider, error) {
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(LockID))
	if err != nil {
		return nil, fmt.Errorf("idem: migration lock: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, migrations,
		goose.WithTableName(Table),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("idem: migration provider: %w", err)
	}
	return provider, nil
}
