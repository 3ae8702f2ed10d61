//go:build unix

package pgtemp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5"
)

// copyBackup fills data with a base backup of primary, set up to stream
// from it, without pg_basebackup, which some installations lack (the
// embedded-postgres builds carry initdb, pg_ctl and postgres alone):
// PostgreSQL's low-level backup API around a copy of the primary's data
// directory, which is on this machine. A physical replication slot on the
// primary keeps the WAL from the backup's start until the standby has
// streamed it; pg_basebackup -X stream would have copied that WAL instead.
func (s *Server) copyBackup(ctx context.Context, data string, cred *syscall.Credential, primary *Server) (err error) {
	conn, err := pgx.Connect(ctx, primary.URL)
	if err != nil {
		return fmt.Errorf("base backup of 127.0.0.1:%d: %w", primary.Port, err)
	}
	// Closing the session ends a backup it left running.
	defer conn.Close(context.Background())

	var versionNum string
	if err := conn.QueryRow(ctx, `SHOW server_version_num`).Scan(&versionNum); err != nil {
		return fmt.Errorf("base backup of 127.0.0.1:%d: %w", primary.Port, err)
	}
	// PostgreSQL 15 renamed the functions and dropped exclusive backups,
	// whose flag 14's functions still take.
	start, stop := `SELECT pg_backup_start($1, true)`, `SELECT labelfile, coalesce(spcmapfile, '') FROM pg_backup_stop(false)`
	if n, _ := strconv.Atoi(versionNum); n < 150000 {
		start, stop = `SELECT pg_start_backup($1, true, false)`, `SELECT labelfile, coalesce(spcmapfile, '') FROM pg_stop_backup(false, false)`
	}

	slot := "pgtemp_" + randomHex(8)
	if _, err := conn.Exec(ctx, `SELECT pg_create_physical_replication_slot($1, true)`, slot); err != nil {
		return fmt.Errorf("base backup of 127.0.0.1:%d: create a replication slot: %w", primary.Port, err)
	}
	defer func() {
		if err != nil {
			_, _ = conn.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, slot)
		}
	}()
	if _, err := conn.Exec(ctx, start, "pgtemp standby"); err != nil {
		return fmt.Errorf("base backup of 127.0.0.1:%d: start: %w", primary.Port, err)
	}
	if err := copyDataDir(filepath.Join(primary.Dir, "data"), data, cred); err != nil {
		return fmt.Errorf("base backup of 127.0.0.1:%d: copy: %w", primary.Port, err)
	}
	var label, spcmap string
	if err := conn.QueryRow(ctx, stop).Scan(&label, &spcmap); err != nil {
		return fmt.Errorf("base backup of 127.0.0.1:%d: stop: %w", primary.Port, err)
	}

	// What pg_basebackup -R writes, and the slot.
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres password=%s sslmode=disable", primary.Port, primary.password)
	files := map[string]string{
		"backup_label":   label,
		"standby.signal": "",
	}
	if spcmap != "" {
		files["tablespace_map"] = spcmap
	}
	for name, content := range files {
		if err := writeOwned(filepath.Join(data, name), []byte(content), 0o600, cred); err != nil {
			return err
		}
	}
	auto, err := os.OpenFile(filepath.Join(data, "postgresql.auto.conf"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(auto, "primary_conninfo = '%s'\nprimary_slot_name = '%s'\n", conninfo, slot)
	if cerr := auto.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if cred != nil {
		return os.Chown(filepath.Join(data, "postgresql.auto.conf"), int(cred.Uid), int(cred.Gid))
	}
	return nil
}

// excludedContents are the directories of a data directory whose contents
// a base backup leaves out (the server recreates them), as pg_basebackup
// does. Of pg_wal, the timeline history files are kept.
var excludedContents = map[string]bool{
	"pg_wal": true, "pg_replslot": true, "pg_stat_tmp": true, "pg_dynshmem": true,
	"pg_notify": true, "pg_serial": true, "pg_snapshots": true, "pg_subtrans": true,
}

// excludedFiles are the files a base backup leaves out, wherever they are.
var excludedFiles = map[string]bool{
	"postmaster.pid": true, "postmaster.opts": true, "pg_internal.init": true,
	"backup_label": true, "tablespace_map": true,
	"postgresql.auto.conf.tmp": true, "current_logfiles.tmp": true,
}

// copyDataDir copies a running server's data directory from src to dst,
// which must not exist, owned by cred's user when cred is set. A file
// that the server removes while it is copied is left out, and one it
// changes may be copied torn: the backup's WAL, replayed from the backup's
// start, repairs both (the server writes full pages while a backup runs).
func copyDataDir(src, dst string, cred *syscall.Credential) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		name := d.Name()
		if strings.HasPrefix(name, "pgsql_tmp") || (!d.IsDir() && excludedFiles[name]) {
			return nil
		}
		parent := filepath.Base(filepath.Dir(rel))
		if excludedContents[parent] && filepath.Dir(filepath.Dir(rel)) == "." &&
			!(parent == "pg_wal" && strings.HasSuffix(name, ".history")) {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		target := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		switch {
		case d.IsDir():
			if err := os.Mkdir(target, info.Mode().Perm()); err != nil {
				return err
			}
			if err := chown(target, cred); err != nil {
				return err
			}
			if rel == "pg_wal" {
				// The server needs it and does not recreate it before 17.
				status := filepath.Join(target, "archive_status")
				if err := os.Mkdir(status, 0o700); err != nil {
					return err
				}
				return chown(status, cred)
			}
			return nil
		case d.Type()&fs.ModeSymlink != 0:
			// A tablespace: pgtemp's servers have none.
			return fmt.Errorf("%s is a symbolic link: tablespaces are not copied", path)
		case d.Type().IsRegular():
			return copyFile(path, target, info.Mode().Perm(), cred)
		default:
			return nil
		}
	})
}

func copyFile(src, dst string, perm fs.FileMode, cred *syscall.Credential) error {
	in, err := os.Open(src)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return chown(dst, cred)
}

// writeOwned writes a file owned by cred's user when cred is set.
func writeOwned(path string, content []byte, perm fs.FileMode, cred *syscall.Credential) error {
	if err := os.WriteFile(path, content, perm); err != nil {
		return err
	}
	return chown(path, cred)
}

func chown(path string, cred *syscall.Credential) error {
	if cred == nil {
		return nil
	}
	return os.Lchown(path, int(cred.Uid), int(cred.Gid))
}
