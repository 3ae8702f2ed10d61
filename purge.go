package idem

import (
	"context"
	"fmt"
	"math"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// Purge deletes every expired record, batch rows per transaction, and
// returns how many it deleted. Short transactions keep each one's locks and
// WAL small; rows that a concurrent reclaim holds are skipped rather than
// waited for (the reclaim renews them anyway). Purging is never needed for
// correctness: an expired record already counts as absent. It keeps the
// table and its indexes small.
//
// batch must be between 1 and math.MaxInt32; 1000 is a reasonable start.
func Purge(ctx context.Context, db TxBeginner, batch int) (int64, error) {
	if batch < 1 || batch > math.MaxInt32 {
		return 0, fmt.Errorf("%w: purge batch must be between 1 and %d, got %d", ErrInvalidOption, math.MaxInt32, batch)
	}
	var total int64
	for {
		var deleted int64
		err := WithTx(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			deleted, err = dbsqlc.New(tx).KeyPurgeExpired(ctx, int32(batch))
			return err
		})
		if err != nil {
			return total, fmt.Errorf("idem: purge: %w", err)
		}
		total += deleted
		if deleted < int64(batch) {
			return total, nil
		}
	}
}
