package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dbbatch"
	"github.com/pgidem/idem/internal/dbsqlc"
	"github.com/pgidem/idem/internal/keylock"
	"github.com/pgidem/idem/internal/pgtime"
)

// A run claims its flow before the flow's function runs, so that no code
// of the flow runs for a replay, a mismatch or a duplicate that waits.
// The claim's first round trip (claimStart) takes the flow's advisory
// lock (FlowStartLock), reads the flow (FlowGet) and checks that the key
// has none (FlowStartFree); then, on a pgx pool or connection at the
// session's isolation level, BEGIN, which makes the round trip's implicit
// transaction, the lock's, the one the flow's row will be written in.
//
// On Citus the lock is taken on the node of the scope's shard, whichever
// node the query came in through (its statement names the flow's row), so
// that runs of one flow through any nodes meet at one lock; but there a
// statement of an implicit transaction is a transaction of its own, which
// lets its lock go at once. So on Citus, and in a connection's first
// claim, which asks whether its database has Citus (CitusInstalled), the
// round trip is FlowGet and the check, then BEGIN, the lock, and the check
// again with a snapshot taken once the lock is held. So:
//
//   - a key with no flow: the run holds the flow's lock in that open
//     transaction, and its function runs; the flow's first statement (its
//     first local step's, which runs in it, or a call's intent, or the
//     answer) writes the flow's row there (FlowStartHeld) and commits it,
//     so that the claim costs one round trip and no commit of its own;
//   - a key with a flow: the check fails, the server runs nothing after
//     it, and the implicit transaction ends with the round trip, leaving
//     the connection idle: the claim judges what FlowGet read (a replay, a
//     mismatch, a stopped flow, one another executor holds) in one round
//     trip;
//   - a lock another executor holds (one starting the flow): nothing after
//     it runs, and the claim waits, polling, as for a flow another
//     executor holds. (In the Citus form, the lock, or the check after it
//     when a row was committed since the first, fails after BEGIN: the
//     transaction is rolled back, a second round trip.)
//
// A transaction with options that must begin it (an isolation level other
// than the session's, a BeginQuery or CommitQuery, or a TxBeginner that
// is no pgx pool or connection) begins first, and one that found the key
// taken is rolled back: a second round trip. A flow that expired, or that
// its executor abandoned, takes a second round trip, which starts it
// again (FlowRestart) or takes it over (FlowTakeOver) and reads its steps
// (FlowSteps); a look once the key was seen to have a flow is FlowGet
// alone. None of the statements waits for a row or a lock another
// transaction holds: a duplicate waits under its budget only, polling.

// claim finds k's flow: none yet, and it returns a run that starts it,
// holding the flow's lock in the claim's open transaction; or a flow to
// continue (started again, or taken over); or its answer, to replay.
// While another executor holds the flow, or is starting it, claim looks
// again, until deadline, the end of the wait budget.
func (f *Flow[In, Out]) claim(ctx context.Context, db TxBeginner, k keyRef, input []byte, o *options, obs *flowObservation,
	deadline time.Time,
) (*flowRun, []byte, error) {
	lease := pgtime.Interval(o.lease)
	// restart is false while another executor is known to hold the flow,
	// which FlowRestart would not change. full is set once the flow was
	// seen to need what only the whole batch does (an expired flow to
	// start again, an abandoned one to take over); seen once the key was
	// seen to have a flow, whose look is then FlowGet alone (which commits:
	// a replay under synchronous replication waits for the standby).
	restart, full, seen := true, false, false
	for attempt := 0; ; attempt++ {
		var (
			restarted, tookOver, found bool
			restartRow                 dbsqlc.FlowRestartRow
			takenRow                   dbsqlc.FlowTakeOverRow
			rec                        dbsqlc.FlowGetRow
			steps                      []dbsqlc.FlowStepsRow
		)
		epoch := newEpoch()
		sent := time.Now()
		if !seen && !full {
			open, err := claimStart(ctx, db, k, o, &rec, &found)
			switch {
			case err != nil:
				return nil, nil, translate("idem: flow: claim key", err)
			case open != nil:
				return f.fresh(db, k, input, o, obs, epoch, sent, open), nil, nil
			case !found:
				// Another executor is starting the flow: wait for its row.
			case rec.State == flowDone && rec.StandbyWait:
				// A replay under synchronous replication: its look rolled
				// back with the round trip; FlowGet alone commits, and
				// waits for the standby.
				seen = true
				continue
			}
		} else {
			b := &pgx.Batch{}
			if full && restart {
				dbbatch.QueueFlowRestart(b, dbsqlc.FlowRestartParams{Scope: k.scope, Key: k.key, FlowName: f.name, Fingerprint: k.fp,
					Input: string(input), Epoch: epoch, Lease: lease, Retention: o.retentionInterval()}, &restartRow, &restarted)
			}
			if full {
				dbbatch.QueueFlowTakeOver(b, dbsqlc.FlowTakeOverParams{Epoch: epoch, Lease: lease, Scope: k.scope, Key: k.key,
					FlowName: f.name, Fingerprint: k.fp}, &takenRow, &tookOver)
			}
			dbbatch.QueueFlowGet(b, namedFor(db), dbsqlc.FlowGetParams{Mark: true, Scope: k.scope, Key: k.key}, &rec, &found)
			if full {
				dbbatch.QueueFlowSteps(b, dbsqlc.FlowStepsParams{Scope: k.scope, Key: k.key}, &steps)
			}
			if err := sendBatch(ctx, db, b); err != nil {
				return nil, nil, translate("idem: flow: claim key", err)
			}
			if !found && !restarted && !tookOver {
				// Gone since the last look (ended, expired and purged), or
				// not there yet: look again, to start it.
				full, seen, restart = false, false, true
				continue
			}
		}
		switch {
		case restarted:
			obs.claimDone(outcomeClaimed)
			keys := providerKeys{namespace: restartRow.ProviderNamespace, operation: restartRow.Operation}
			return newFlowRun(db, k, f.name, keys, epoch, input, sent, nil, o, obs), nil, nil
		case tookOver:
			obs.claimDone(outcomeResumed)
			keys := providerKeys{namespace: takenRow.ProviderNamespace, operation: takenRow.Operation}
			return newFlowRun(db, k, f.name, keys, epoch, takenRow.Input, sent, steps, o, obs), nil, nil
		case !found:
			// Another executor is starting the flow (its lock is taken):
			// look again, within the wait budget.
		case rec.Expired && !full:
			// Expired: start it again, at once.
			full = true
			continue
		case rec.Expired:
			// Expired, with another caller starting the key's next
			// operation (FlowRestart skipped its row): look again.
			restart = true
		case rec.Name != f.name || !bytes.Equal(rec.Fingerprint, k.fp):
			obs.claimDone(outcomeMismatch)
			return nil, nil, ErrFingerprintMismatch
		case rec.State == flowDone:
			// Under synchronous replication, the look committed before it
			// answered, once the standby had the answer (FlowGet's
			// standby_wait, syncrep.go).
			if err := replayConfirmed(ctx); err != nil {
				return nil, nil, err
			}
			obs.claimDone(outcomeReplayed)
			return nil, rec.Output, nil
		case rec.State == flowAttention:
			obs.claimDone(outcomeStopped)
			return nil, nil, fmt.Errorf("%w: it needs attention: %s", ErrFlowStopped, openText(rec.LastError.String, k.scope, o))
		case rec.State == flowEnded:
			obs.claimDone(outcomeStopped)
			return nil, nil, fmt.Errorf("%w: an operator ended it: %s", ErrFlowStopped, openText(rec.LastError.String, k.scope, o))
		case !rec.Leased && !full:
			// Running, its lease run out: take it over, at once.
			full, seen = true, true
			continue
		default:
			// Another executor holds the flow: wait for it to finish, or
			// for its lease to run out.
			restart = false
		}
		seen = seen || found
		// Look again, within the wait budget.
		remaining := time.Until(deadline)
		if remaining <= 0 {
			obs.claimDone(outcomeInProgress)
			return nil, nil, fmt.Errorf("%w: flow %q is running elsewhere past the wait budget", ErrInProgress, f.name)
		}
		if err := backoff.Sleep(ctx, min(pollDelay(attempt), remaining)); err != nil {
			return nil, nil, err
		}
	}
}

// claimStart sends the claim's first round trip (see above) for k, with
// the flow's transaction options, and returns the open transaction that
// holds the flow's lock, with the installation's id it read (the
// namespace of the flow's provider keys), when the key has no flow; or
// nil, having read the flow into rec and set found, when it has one; or
// nil, with found false, when another executor holds the flow's lock.
func claimStart(ctx context.Context, db TxBeginner, k keyRef, o *options, rec *dbsqlc.FlowGetRow, found *bool) (*openStep, error) {
	conn, pooled, err := stepConn(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("acquire connection: %w", err)
	}
	opts := o.txOptions
	var namespace pgtype.UUID
	named := namedFor(db)
	lock := func(b *pgx.Batch) {
		dbbatch.QueueFlowStartLock(b, named, dbsqlc.FlowStartLockParams{LockID: keylock.FlowID(k.scope, k.key), Scope: k.scope, Key: k.key}, &namespace)
	}
	get := func(b *pgx.Batch) {
		dbbatch.QueueFlowGet(b, named, dbsqlc.FlowGetParams{Scope: k.scope, Key: k.key}, rec, found)
		dbbatch.QueueFlowStartFree(b, named, dbsqlc.FlowStartFreeParams{Scope: k.scope, Key: k.key})
	}
	look := func(b *pgx.Batch) {
		lock(b)
		get(b)
	}
	var tx pgx.Tx
	if conn == nil || opts.BeginQuery != "" {
		// Any other TxBeginner, or a BeginQuery of the caller's, which may
		// hold several statements (pgx sends it alone, through the simple
		// protocol): BEGIN in a round trip of its own.
		var beginner TxBeginner = db
		if conn != nil {
			beginner = conn
		}
		if tx, err = beginner.BeginTx(ctx, opts); err == nil {
			b := &pgx.Batch{}
			queueIdleTimeout(b, o, named)
			look(b)
			err = tx.SendBatch(ctx, b).Close()
		}
	} else {
		late := opts.CommitQuery == "" && beginsLate(opts) && canBeginLate(conn)
		// On Citus, or on a connection that does not know yet whether its
		// database has Citus (it then asks, in the same round trip), the
		// lock follows BEGIN.
		data := conn.PgConn().CustomData()
		citus, known := citusOf(data)
		var installed, asked bool
		for {
			b := &pgx.Batch{}
			switch {
			case late && (citus || !known):
				if !known {
					dbbatch.QueueCitusInstalled(b, &installed)
					asked = true
				}
				// The look first, in the round trip's implicit transaction,
				// which BEGIN makes explicit; then the lock, and the check
				// again with a snapshot taken once it is held.
				get(b)
				b.Queue(beginSQL(opts), named)
				queueIdleTimeout(b, o, named)
				lock(b)
				dbbatch.QueueFlowStartFree(b, named, dbsqlc.FlowStartFreeParams{Scope: k.scope, Key: k.key})
			case late:
				// On PostgreSQL the lock, the look and the check, in the
				// round trip's implicit transaction, which BEGIN makes
				// explicit: a claim that finds the lock taken or the flow
				// leaves the connection idle.
				look(b)
				b.Queue(beginSQL(opts), named)
				queueIdleTimeout(b, o, named)
			default:
				b.BeginTx(opts)
				queueIdleTimeout(b, o, named)
				look(b)
			}
			results := conn.SendBatch(ctx, b)
			tx = results.Tx()
			err = results.Close()
			if late && beganTooLate(conn, err) {
				// Nothing ran: again, BEGIN first.
				late = false
				continue
			}
			break
		}
		if asked && (err == nil || errors.Is(err, dbbatch.ErrNotHeld)) {
			// CitusInstalled, the round trip's first statement, ran.
			setCitus(data, installed)
		}
		if late && (err == nil || conn.PgConn().TxStatus() != 'I') {
			// The transaction BEGIN began, open, or failed after BEGIN (the
			// lock taken, a row committed since the first check), to roll
			// back.
			tx = txOver(ctx, conn, emptyBegin(opts))
		}
	}
	if err != nil {
		if tx != nil && (conn == nil || conn.PgConn().TxStatus() != 'I') {
			rollback(ctx, tx)
		}
		forgetNamed(conn, err)
		releaseConn(pooled)
		if errors.Is(err, dbbatch.ErrNotHeld) {
			return nil, nil // found, or the lock taken
		}
		return nil, err
	}
	if tx == nil { // pgx made no transaction of the one BEGIN began
		releaseConn(pooled)
		return nil, errors.New("idem: flow: claim key: no transaction began")
	}
	return &openStep{conn: conn, pooled: pooled, tx: tx, starts: true, namespace: namespace}, nil
}

// beginsLate reports whether a transaction begun with opts may begin
// after other statements: one of the session's isolation level (the
// default, read committed, where it is the session's).
func beginsLate(opts pgx.TxOptions) bool {
	return opts == pgx.TxOptions{} || opts == pgx.TxOptions{IsoLevel: pgx.ReadCommitted}
}

// beginFirstKey notes, in a connection's CustomData, that its session's
// transactions have another isolation level than read committed, where
// a BEGIN of read committed must come first (beganTooLate).
const beginFirstKey = "idem.beginFirst"

// canBeginLate reports whether a batch sent on conn may begin its
// transaction after other statements, which then run in it (the round
// trip's implicit transaction, which BEGIN makes explicit). It is true
// until beganTooLate says otherwise.
func canBeginLate(conn *pgx.Conn) bool {
	data := conn.PgConn().CustomData()
	return data != nil && data[beginFirstKey] == nil
}

// beganTooLate reports whether err is that of a BEGIN sent after other
// statements at an isolation level other than the session's (25001,
// "SET TRANSACTION ISOLATION LEVEL must be called before any query"), and
// if so notes that batches on conn begin first from now on (canBeginLate).
// Nothing of the round trip ran: the statements before it were in the
// round trip's implicit transaction, rolled back, and those after it were
// skipped.
func beganTooLate(conn *pgx.Conn, err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25001" {
		return false
	}
	if data := conn.PgConn().CustomData(); data != nil {
		data[beginFirstKey] = true
	}
	return true
}

// fresh returns the run that starts a flow that no one has started, under
// epoch, claimed at sent, holding the flow's lock in open, the claim's
// transaction, which the run's first statement writes the flow's row in
// (FlowStartHeld, see flow_pending.go).
func (f *Flow[In, Out]) fresh(db TxBeginner, k keyRef, input []byte, o *options, obs *flowObservation, epoch int64, sent time.Time,
	open *openStep,
) *flowRun {
	r := newFlowRun(db, k, f.name, providerKeys{namespace: open.namespace}, epoch, input, sent, nil, o, obs)
	r.start = &dbsqlc.FlowStartParams{Scope: k.scope, Key: k.key, FlowName: f.name, Fingerprint: k.fp, Input: string(input),
		Epoch: epoch, Lease: pgtime.Interval(o.lease), Retention: o.retentionInterval(), LockID: keylock.FlowID(k.scope, k.key)}
	r.keepOpen(open)
	return r
}

// queueIdleTimeout queues, at the start of a flow's transaction (the
// claim's, a local step's), the bound of how long it may sit idle
// (WithIdleTimeout), if any: an executor frozen in the step, or before
// its next statement commits it, holds the flow until the server ends
// its session.
func queueIdleTimeout(b *pgx.Batch, o *options, named pgx.QueryRewriter) {
	if o.idleTimeout > 0 {
		dbbatch.QueueTxIdleTimeout(b, named, millis(o.idleTimeout))
	}
}

// emptyBegin returns an empty batch that begins a transaction with opts:
// sent, it sends nothing, and its results' Tx is pgx's transaction over
// the one the connection is in (txOver).
func emptyBegin(opts pgx.TxOptions) *pgx.Batch {
	b := &pgx.Batch{}
	b.BeginTx(opts)
	b.QueuedQueries = nil
	return b
}

// txOver returns pgx's transaction over the one conn is in, begun by a
// BEGIN that pgx did not queue as such (the claim's, after the flow's
// lock): that of empty, an empty batch that begins one (emptyBegin),
// which sends nothing (TestAnEmptyBatchBeginsNoTransaction), or nil if
// pgx makes none of it.
func txOver(ctx context.Context, conn *pgx.Conn, empty *pgx.Batch) pgx.Tx {
	results := conn.SendBatch(ctx, empty)
	tx := results.Tx()
	_ = results.Close()
	return tx
}
