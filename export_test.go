package idem

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/idem/internal/dbbatch"
)

// TxOver is txOver of an empty batch that begins a transaction with
// opts, for TestAnEmptyBatchBeginsNoTransaction.
func TxOver(ctx context.Context, conn *pgx.Conn, opts pgx.TxOptions) pgx.Tx {
	return txOver(ctx, conn, emptyBegin(opts))
}

// ClaimStatementName is the name under which a flow's claim prepares its
// first statement, FlowStartLock, in pgx's default exec mode
// (namedStatements), for TestAStaleStatementOfIdemsNameIsReplaced.
func ClaimStatementName() string {
	var named []string
	b := &pgx.Batch{}
	dbbatch.QueueFlowStartLock(b, nil, 0, nil)
	for _, q := range b.QueuedQueries {
		named = append(named, statementName(q.SQL))
	}
	return named[0]
}
