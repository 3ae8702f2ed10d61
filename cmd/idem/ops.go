package main

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/dbsqlc"
)

func runMigrate(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("migrate", "migrate up|down|status")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return usageError{errors.New("want one of up, down, status")}
	}
	pool, err := connect(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := idem.NewMigrationProvider(db)
	if err != nil {
		return err
	}
	switch fs.Arg(0) {
	case "up":
		results, err := provider.Up(ctx)
		for _, r := range results {
			fmt.Fprintf(stdout, "applied %s (%s)\n", r.Source.Path, r.Duration.Round(time.Millisecond))
		}
		if err != nil {
			return fmt.Errorf("migrate up: %w", err)
		}
		if len(results) == 0 {
			fmt.Fprintln(stdout, "up to date")
		}
	case "down":
		r, err := provider.Down(ctx)
		if r != nil {
			fmt.Fprintf(stdout, "rolled back %s\n", r.Source.Path)
		}
		if err != nil {
			return fmt.Errorf("migrate down: %w", err)
		}
	case "status":
		statuses, err := provider.Status(ctx)
		if err != nil {
			return databaseError{fmt.Errorf("migrate status: %w", err)}
		}
		w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(w, "VERSION\tSTATE\tAPPLIED AT\tFILE")
		for _, s := range statuses {
			applied := "-"
			if !s.AppliedAt.IsZero() {
				applied = s.AppliedAt.Format(time.RFC3339)
			}
			fmt.Fprintf(w, "%d\t%s\t%s\t%s\n", s.Source.Version, s.State, applied, s.Source.Path)
		}
		return w.Flush()
	default:
		return usageError{fmt.Errorf("unknown migrate action %q: want up, down or status", fs.Arg(0))}
	}
	return nil
}

// connectMigrated connects and checks that idem's migrations are applied,
// so that a command on an unmigrated database says so plainly.
func connectMigrated(ctx context.Context) (*pgxpool.Pool, error) {
	pool, err := connect(ctx, 4)
	if err != nil {
		return nil, err
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if err := checkMigrated(ctx, pool, db); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

func checkMigrated(ctx context.Context, pool *pgxpool.Pool, db *sql.DB) error {
	// Asking goose would create its version table; look first.
	exists, err := dbsqlc.New(pool).SchemaTableExists(ctx, idem.MigrationTable)
	if err != nil {
		return databaseError{fmt.Errorf("look for %s: %w", idem.MigrationTable, err)}
	}
	if !exists {
		return databaseError{errors.New("idem's migrations are not applied: run 'idem migrate up'")}
	}
	provider, err := idem.NewMigrationProvider(db)
	if err != nil {
		return err
	}
	current, target, err := provider.GetVersions(ctx)
	if err != nil {
		return databaseError{fmt.Errorf("read migration version: %w", err)}
	}
	if current < target {
		return databaseError{fmt.Errorf("idem's migrations are not applied (version %d of %d): run 'idem migrate up'", current, target)}
	}
	return nil
}

func runPurge(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("purge", "purge [flags]")
	batch := fs.Int("batch", idem.DefaultPurgeBatch, "records deleted per transaction")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *batch < 1 {
		return usageError{errors.New("-batch must be at least 1")}
	}
	pool, err := connectMigrated(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()

	progress := isTerminal(stdout)
	started := time.Now()
	var total int64
	for {
		var deleted int64
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			deleted, err = dbsqlc.New(tx).KeyPurgeExpired(ctx, int32(*batch))
			return err
		})
		if err != nil {
			return fmt.Errorf("purge after %d records: %w", total, err)
		}
		total += deleted
		if progress {
			fmt.Fprintf(stdout, "\rpurged %d records", total)
		}
		if deleted < int64(*batch) {
			break
		}
	}
	if progress {
		fmt.Fprintln(stdout)
	}
	elapsed := time.Since(started)
	fmt.Fprintf(stdout, "purged %d expired records in %s (%.0f records/s)\n",
		total, elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds())
	return nil
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	info, err := f.Stat()
	return err == nil && info.Mode()&os.ModeCharDevice != 0
}

func runStats(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("stats", "stats")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	pool, err := connectMigrated(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := dbsqlc.New(pool).KeyStats(ctx)
	if err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	oldest := "-"
	if s.OldestLive.Valid {
		oldest = fmt.Sprintf("%s (%s ago)", s.OldestLive.Time.Format(time.RFC3339), time.Since(s.OldestLive.Time).Round(time.Second))
	}
	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "records done\t%d\n", s.Done)
	fmt.Fprintf(w, "records in progress\t%d\n", s.InProgress)
	fmt.Fprintf(w, "records past expiry, awaiting purge\t%d\n", s.Expired)
	fmt.Fprintf(w, "scopes\t%d\n", s.Scopes)
	fmt.Fprintf(w, "oldest live record\t%s\n", oldest)
	fmt.Fprintf(w, "table size\t%s\n", bytesize(s.TableBytes))
	fmt.Fprintf(w, "index size\t%s\n", bytesize(s.IndexBytes))
	o, err := dbsqlc.New(pool).OutboxStats(ctx)
	if err != nil {
		return fmt.Errorf("stats: outbox: %w", err)
	}
	oldestPending := "-"
	if o.OldestPending.Valid {
		oldestPending = fmt.Sprintf("%s ago", time.Since(o.OldestPending.Time).Round(time.Second))
	}
	fmt.Fprintf(w, "outbox pending\t%d (oldest %s)\n", o.Pending, oldestPending)
	fmt.Fprintf(w, "outbox parked, awaiting a decision\t%d\n", o.Parked)
	fmt.Fprintf(w, "outbox delivered, awaiting purge\t%d\n", o.Delivered)
	return w.Flush()
}

func bytesize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func runInspect(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("inspect", "inspect [-show-response] SCOPE KEY")
	show := fs.Bool("show-response", false, "print the stored response, which may hold personal data (redacted by default)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 2 {
		return usageError{errors.New("want SCOPE and KEY")}
	}
	pool, err := connectMigrated(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	scope, key := fs.Arg(0), fs.Arg(1)
	r, err := dbsqlc.New(pool).KeyInspect(ctx, dbsqlc.KeyInspectParams{Scope: scope, Key: key})
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("no record for scope %q, key %q", scope, key)
	}
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	state := r.State
	if r.Expired {
		state += " (expired: counts as absent)"
	}
	response := fmt.Sprintf("(%d bytes of JSON, redacted; -show-response prints it)", len(r.Response))
	switch {
	case r.Response == nil:
		response = "(none)"
	case *show:
		response = string(r.Response)
	}
	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "scope\t%s\n", scope)
	fmt.Fprintf(w, "key\t%s\n", key)
	fmt.Fprintf(w, "state\t%s\n", state)
	fmt.Fprintf(w, "fingerprint\t%s\n", strings.ToLower(hex.EncodeToString(r.Fingerprint)))
	fmt.Fprintf(w, "created\t%s\n", r.CreatedAt.Time.Format(time.RFC3339Nano))
	fmt.Fprintf(w, "expires\t%s\n", r.ExpiresAt.Time.Format(time.RFC3339Nano))
	fmt.Fprintf(w, "response\t%s\n", response)
	return w.Flush()
}
