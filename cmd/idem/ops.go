package main

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
)

// migrations returns goose over idem's embedded migrations, set up as
// idem.Migrate sets it up: idem's version table and idem's advisory lock,
// so that this command and a replica's Migrate never apply one migration
// twice, and no global registry.
func migrations(db *sql.DB) (*goose.Provider, error) {
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(idem.MigrationLockID))
	if err != nil {
		return nil, err
	}
	return goose.NewProvider(goose.DialectPostgres, db, idem.Migrations(),
		goose.WithTableName(idem.MigrationTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true))
}

func runMigrate(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "migrate", `migrate up|down|status

Applies or rolls back idem's embedded migrations, recorded in the table
`+idem.MigrationTable+` (never the application's goose table):

  up      apply every migration not yet applied
  down    roll back the most recent migration: one version, no more
  status  list every migration, applied or pending, with when it was applied

The database comes from DATABASE_URL, or else the PG* variables; the
command prints it before acting.`)
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return cli.UsageError{Err: errors.New("want one of up, down, status")}
	}
	pool, err := connect(ctx, stdout, "migrate", 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := migrations(db)
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
			return cli.DatabaseError{Err: fmt.Errorf("migrate status: %w", err)}
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
		return cli.UsageError{Err: fmt.Errorf("unknown migrate action %q: want up, down or status", fs.Arg(0))}
	}
	return nil
}

// connectMigrated connects and checks that idem's migrations are applied,
// so that a command on an unmigrated database says so plainly.
func connectMigrated(ctx context.Context, stdout io.Writer, command string) (*pgxpool.Pool, error) {
	pool, err := connect(ctx, stdout, command, 4)
	if err != nil {
		return nil, err
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if err := checkMigrated(ctx, db); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

func checkMigrated(ctx context.Context, db *sql.DB) error {
	// Asking goose for the version would create its version table; look
	// first.
	store, err := database.NewStore(database.DialectPostgres, idem.MigrationTable)
	if err != nil {
		return err
	}
	extended, ok := store.(database.StoreExtender)
	if !ok {
		return fmt.Errorf("goose cannot tell whether %s exists", idem.MigrationTable)
	}
	exists, err := extended.TableExists(ctx, db)
	if err != nil {
		return cli.DatabaseError{Err: fmt.Errorf("look for %s: %w", idem.MigrationTable, err)}
	}
	if !exists {
		return cli.DatabaseError{Err: errors.New("idem's migrations are not applied: run 'idem migrate up'")}
	}
	provider, err := migrations(db)
	if err != nil {
		return err
	}
	current, target, err := provider.GetVersions(ctx)
	if err != nil {
		return cli.DatabaseError{Err: fmt.Errorf("read migration version: %w", err)}
	}
	if current < target {
		return cli.DatabaseError{Err: fmt.Errorf("idem's migrations are not applied (version %d of %d): run 'idem migrate up'", current, target)}
	}
	return nil
}

func runPurge(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "purge", `purge [-batch N]

Deletes the records past their expiry, N per transaction, until none is
left, and prints how many. Expired records already count as absent:
purging only keeps the table and its indexes small. Rows that a live claim
holds are skipped, not waited for.`)
	batch := fs.Int("batch", idem.DefaultPurgeBatch, fmt.Sprintf("records deleted per transaction, 1 to %d", math.MaxInt32))
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	// Checked as idem.Purge checks it, before connecting.
	if *batch < 1 || *batch > math.MaxInt32 {
		return cli.UsageError{Err: fmt.Errorf("-batch must be between 1 and %d, got %d", math.MaxInt32, *batch)}
	}
	pool, err := connectMigrated(ctx, stdout, "purge")
	if err != nil {
		return err
	}
	defer pool.Close()

	started := time.Now()
	total, err := idem.Purge(ctx, pool, *batch)
	if errors.Is(err, idem.ErrInvalidOption) {
		return cli.UsageError{Err: err}
	}
	if err != nil {
		return fmt.Errorf("purge after %d records: %w", total, err)
	}
	elapsed := time.Since(started)
	fmt.Fprintf(stdout, "purged %d expired records in %s (%.0f records/s)\n",
		total, elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds())
	return nil
}

func runStats(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "stats", `stats

Prints the operations running now and the duplicates waiting for them; for
idem's tables: the records done, in progress (committed in progress, which
idem never does: a hand-written statement or an older version wrote them,
and the next call on the key takes them over; records written in progress
by transactions still open are not visible), and past expiry (awaiting
purge); how many scopes hold records; the oldest live record; the table's
and its indexes' size on disk; and the outbox's pending messages (with the
oldest one's age), parked messages awaiting a decision, and delivered
messages awaiting purge; and the flows (idem.Flow) running, abandoned
(no executor holds them: a retry or a resumer continues them), needing
attention, finished and past expiry. It only reads.

At READ COMMITTED a running operation has no record until it commits: its
lock is all there is to see. The running and waiting counts are the
advisory locks whose id carries idem's tag, held and awaited in this
database, as pg_locks shows them: 0x1de0 in the id's top 16 bits
(locktype advisory, objsubid 1, classid >> 16 = 7648). They are an estimate:
an application's own advisory lock whose bigint id falls in that range
counts as an operation too, and 1 in 65,536 of ids spread over all bigints,
as hashtextextended's are, does. Locks taken with two int keys never count.`)
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	pool, err := connectMigrated(ctx, stdout, "stats")
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := idem.ReadStats(ctx, pool)
	if err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	oldest := "-"
	if !s.OldestLive.IsZero() {
		oldest = fmt.Sprintf("%s (%s ago)", s.OldestLive.Format(time.RFC3339), time.Since(s.OldestLive).Round(time.Second))
	}
	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	// Labelled with what they count, which may include an application's
	// own locks (see the help above).
	fmt.Fprintf(w, "operations running now (advisory locks with idem's tag)\t%d%s\n", s.Running, since(s.OldestRunning, " (oldest began %s ago)"))
	fmt.Fprintf(w, "duplicates waiting (advisory lock waits with idem's tag)\t%d\n", s.Waiting)
	fmt.Fprintf(w, "records done\t%d\n", s.Done)
	fmt.Fprintf(w, "records in progress\t%d\n", s.InProgress)
	fmt.Fprintf(w, "records past expiry, awaiting purge\t%d\n", s.Expired)
	fmt.Fprintf(w, "scopes\t%d\n", s.Scopes)
	fmt.Fprintf(w, "oldest live record\t%s\n", oldest)
	fmt.Fprintf(w, "table size\t%s\n", bytesize(s.TableBytes))
	fmt.Fprintf(w, "index size\t%s\n", bytesize(s.IndexBytes))
	oldestPending := "-"
	if !s.OldestPending.IsZero() {
		oldestPending = fmt.Sprintf("%s ago", time.Since(s.OldestPending).Round(time.Second))
	}
	fmt.Fprintf(w, "outbox pending\t%d (oldest %s)\n", s.OutboxPending, oldestPending)
	fmt.Fprintf(w, "outbox parked, awaiting a decision\t%d\n", s.OutboxParked)
	fmt.Fprintf(w, "outbox delivered, awaiting purge\t%d\n", s.OutboxDelivered)
	fmt.Fprintf(w, "flows running\t%d%s\n", s.FlowsRunning, since(s.OldestFlowRunning, " (oldest in progress began %s ago)"))
	fmt.Fprintf(w, "flows abandoned, to resume\t%d\n", s.FlowsAbandoned)
	fmt.Fprintf(w, "flows needing attention (idem inspect -flow)\t%d\n", s.FlowsAttention)
	fmt.Fprintf(w, "flows finished\t%d\n", s.FlowsFinished)
	fmt.Fprintf(w, "flows past expiry, awaiting purge\t%d\n", s.FlowsExpired)
	return w.Flush()
}

// since formats how long ago t was into format, or "" when t is unset.
func since(t time.Time, format string) string {
	if t.IsZero() {
		return ""
	}
	return fmt.Sprintf(format, time.Since(t).Round(time.Millisecond))
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
	fs := program.NewFlagSet(stdout, "inspect", `inspect [-flow] [-show-response] SCOPE KEY

Prints one key: whether an operation is running on it now, and its record:
state, fingerprint, creation and expiry, and the size of its stored
response, which is shown only with -show-response. With -flow, prints the
flow of the key instead (idem.Flow): its state, the step it is at, its
runs and last error, and each step with, for calls, the provider key and
the attempts that may have reached the provider (calls of the step's
function, but those that surely never left); its input and answer only
with -show-response.
Flags may come before or after SCOPE and KEY.

Whether the key is running comes from pg_locks, as an estimate: it is an
advisory lock with the key's id, held in this database, that its
duplicates wait for. Another key whose 48-bit hash is the same shares that
id, and so would an application's own lock of that very id: either shows as
running too.`)
	show := fs.Bool("show-response", false, "print the stored response, which may hold personal data (redacted by default)")
	flow := fs.Bool("flow", false, "show the key's flow rather than its record")
	operands, err := cli.ParseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(operands) != 2 {
		return cli.UsageError{Err: errors.New("want SCOPE and KEY")}
	}
	pool, err := connectMigrated(ctx, stdout, "inspect")
	if err != nil {
		return err
	}
	defer pool.Close()
	scope, key := operands[0], operands[1]
	if *flow {
		return inspectFlow(ctx, stdout, pool, scope, key, *show)
	}
	r, err := idem.Inspect(ctx, pool, scope, key)
	if errors.Is(err, idem.ErrInvalidScope) || errors.Is(err, idem.ErrInvalidKey) {
		return cli.UsageError{Err: err}
	}
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	// Labelled with what it looks at (see the help above).
	const runningLabel = "running now (advisory lock with its id)"
	running := "no"
	if r.Running {
		running = fmt.Sprintf("yes%s, %d duplicate(s) waiting", since(r.RunningSince, ", its transaction began %s ago"), r.Waiting)
	}
	if !r.Found {
		// A flow keeps no record of Run's kind: say that it is there.
		f, err := idem.InspectFlow(ctx, pool, scope, key)
		if err != nil {
			return fmt.Errorf("inspect: %w", err)
		}
		if f.Found {
			fmt.Fprintf(stdout, "scope %q, key %q: no record, but a flow (%s, %s): idem inspect -flow %s %s shows it\n",
				scope, key, f.Name, f.State, scope, key)
			return nil
		}
		if r.Running {
			fmt.Fprintf(stdout, "scope %q, key %q: no record yet; %s: %s\n", scope, key, runningLabel, running)
			return nil
		}
		return fmt.Errorf("no record or flow for scope %q, key %q, and no advisory lock with its id: no operation running on it", scope, key)
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
	fmt.Fprintf(w, "%s\t%s\n", runningLabel, running)
	fmt.Fprintf(w, "fingerprint\t%s\n", strings.ToLower(hex.EncodeToString(r.Fingerprint)))
	fmt.Fprintf(w, "created\t%s\n", r.CreatedAt.Format(time.RFC3339Nano))
	fmt.Fprintf(w, "expires\t%s\n", r.ExpiresAt.Format(time.RFC3339Nano))
	fmt.Fprintf(w, "response\t%s\n", response)
	return w.Flush()
}
