package idem

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// CitusStatementsAsBefore sets whether Run on Citus claims with KeyLock
// and stores its record between KeyWaitBudgetCitus and
// KeyWaitRestoreCitus, as before KeyLockCitus and KeyStoreBudgetCitus,
// for BenchmarkCitusRatios's comparison, and returns the function that
// puts it back.
func CitusStatementsAsBefore(on bool) (restore func()) {
	was := citusStatementsAsBefore
	citusStatementsAsBefore = on
	return func() { citusStatementsAsBefore = was }
}

// TxOver is txOver of an empty batch that begins a transaction with
// opts, for TestAnEmptyBatchBeginsNoTransaction.
func TxOver(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions) pgx.Tx {
	return txOver(ctx, conn, emptyBegin(opts))
}

// ClaimStatementName is the name under which a flow's claim prepares its
// lock, FlowStartLock, in pgx's default exec mode
// (namedStatements), for TestAStaleStatementOfIdemsNameIsReplaced.
func ClaimStatementName() string {
	var named []string
	b := &pgx.Batch{}
	dbbatch.QueueFlowStartLock(b, nil, dbsqlc.FlowStartLockParams{}, nil)
	for _, q := range b.QueuedQueries {
		named = append(named, statementName(q.SQL))
	}
	return named[0]
}
