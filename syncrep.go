package idem

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// A replay under synchronous replication answers only once the standby has
// the record it answers from.
//
// PostgreSQL marks a transaction committed before its COMMIT waits for a
// synchronous standby, and a wait cut short (by the cancel request pgx
// sends when a context ends mid-COMMIT) leaves the commit on the primary
// alone, visible to others: a replay could answer from a record that a
// failover then loses. The statements that read a record to replay
// (KeyGet, FlowGet) therefore write a marker when the session's COMMITs
// wait for a synchronous standby (see standby_wait in queries/key.sql),
// which makes the COMMIT of their transaction wait for the standby to
// have everything up to it, the record's commit included. Where no
// standby is waited for they write nothing, and a replay costs what it
// did.
//
// Each replay's transaction commits before the answer is given: Run's
// (commitReplay), the lookup of WithLookupFirst and a flow's claim, each
// a statement or batch that PostgreSQL commits before it answers
// (replayConfirmed after it), and for Do and Once the caller's, which
// the caller commits before it answers.

// commitReplay ends the transaction of Run's replay with COMMIT, which
// waits for a synchronous standby when the claim wrote the marker, and
// costs what a ROLLBACK costs when it did not. A context that ended before
// the COMMIT returned is an error, never the answer.
func commitReplay(ctx context.Context, tx pgx.Tx) error {
	if err := replayConfirmed(ctx); err != nil {
		return err // the caller's deferred rollback ends tx
	}
	if err := tx.Commit(ctx); err != nil {
		return translate("idem: replay: commit", err)
	}
	return replayConfirmed(ctx)
}

// replayConfirmed is nil when a replay's transaction committed while ctx
// was live, and ctx's error otherwise. pgx's default reaction to a
// context that ends mid-statement closes the connection and returns an
// error; another (pgconn.CancelRequestContextWatcherHandler) only sends a
// cancel request, after which PostgreSQL ends a COMMIT's wait for the
// standby with a warning and reports the COMMIT as a success. Only the
// context tells that the wait may have been cut short.
func replayConfirmed(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("idem: replay: %w (the context ended before its transaction committed: a synchronous standby may not have the record yet; retry with the key)", err)
	}
	return nil
}

// commitConfirmed is replayConfirmed for Run's first execution, whose
// COMMIT wrote the record: a context that ended before the COMMIT
// returned may have cut its wait for a synchronous standby short, and the
// answer is then not given; a retry with the key replays it once the
// standby has it.
func commitConfirmed(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("idem: commit: %w (the context ended before COMMIT returned: a synchronous standby may not have the record yet; retry with the key)", err)
	}
	return nil
}
