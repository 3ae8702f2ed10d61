package outbox_test

import (
	"context"
	"errors"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// errRollBack rolls back a transaction that only tried statements.
var errRollBack = errors.New("roll back")

// sqlBlocks returns the SQL code blocks of a Markdown file.
func sqlBlocks(t *testing.T, path string) []string {
	t.Helper()
	doc, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	for _, m := range regexp.MustCompile("(?s)```sql\n(.*?)```").FindAllStringSubmatch(string(doc), -1) {
		blocks = append(blocks, m[1])
	}
	return blocks
}

// normalized is stmt without comments and with its spaces collapsed.
func normalized(stmt string) string {
	var lines []string
	for _, l := range strings.Split(stmt, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "--") {
			lines = append(lines, l)
		}
	}
	return strings.TrimSuffix(strings.Join(strings.Fields(strings.Join(lines, " ")), " "), ";")
}

// The statements docs/outbox.md gives operators run against the migrated
// schema, and its requeue statement is the one outbox.Requeue runs, so the
// page cannot drift from the table or from Requeue.
func TestDocumentedQueriesRun(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	// A database of the test's own: the purge statement locks every old
	// delivered message, which would hold up other tests' relays.
	pool := migratedDatabase(t, ctx)
	blocks := sqlBlocks(t, "../docs/outbox.md")
	if len(blocks) < 5 {
		t.Fatalf("%d SQL blocks in docs/outbox.md, want the 5 operator statements", len(blocks))
	}

	queries, err := os.ReadFile("../queries/outbox.sql")
	if err != nil {
		t.Fatal(err)
	}
	requeue := regexp.MustCompile(`(?s)-- name: OutboxRequeue :execrows\n(.*?;)`).FindSubmatch(queries)
	if requeue == nil {
		t.Fatal("no OutboxRequeue in queries/outbox.sql")
	}
	requeueSQL := normalized(strings.ReplaceAll(string(requeue[1]), "@id::bigint", "$1"))
	documentedRequeue := false

	var parked int64
	for i, block := range blocks {
		err := idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			ids, err := outbox.EnqueueMany(ctx, tx, []outbox.Entry{
				{Scope: "s", Key: "parked", Destination: "d"},
				{Scope: "s", Key: "delivered", Destination: "d"},
			})
			if err != nil {
				return err
			}
			parked = ids[0]
			if _, err := tx.Exec(ctx, `UPDATE outbox_message SET state = 'parked', attempts = 20, last_error = 'x' WHERE id = $1`, ids[0]); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `UPDATE outbox_message SET state = 'delivered', delivered_at = now() - interval '1 year'
				WHERE id = $1`, ids[1]); err != nil {
				return err
			}
			var args []any
			if strings.Contains(block, "$1") {
				args = append(args, parked)
			}
			tag, err := tx.Exec(ctx, block, args...)
			if err != nil {
				return err
			}
			if strings.HasPrefix(block, "UPDATE") || strings.HasPrefix(block, "DELETE") {
				if tag.RowsAffected() != 1 {
					t.Errorf("block %d changed %d rows, want 1:\n%s", i, tag.RowsAffected(), block)
				}
			}
			if normalized(block) == requeueSQL {
				documentedRequeue = true
			}
			return errRollBack
		})
		if !errors.Is(err, errRollBack) {
			t.Errorf("block %d: %v\n%s", i, err, block)
		}
	}
	if !documentedRequeue {
		t.Errorf("docs/outbox.md does not give OutboxRequeue's statement:\n%s", requeueSQL)
	}
}
