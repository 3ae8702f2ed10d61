package idem_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// The tests of what a flow promises when things go wrong around it: other
// databases calling the same provider, results that cannot be stored,
// calls that hang, executors that slow down, and secrets in what it
// stores. Crashes and freezes of real processes are in flow_crash_test.go,
// failovers in standby_test.go.

func TestFlowProviderKeysDifferAcrossDatabases(t *testing.T) {
	ctx, _, scope, p := setupFlow(t)
	// Two installations, new, that call the same provider account: staging
	// beside production, or a database created again.
	a, b := migratedDatabase(t, ctx), migratedDatabase(t, ctx)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	first, err := flow.Run(ctx, a, scope, "order-1", fpCharge, chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	second, err := flow.Run(ctx, b, scope, "order-1", fpCharge, chargeIn{Amount: 9900})
	if err != nil {
		t.Fatal(err)
	}
	charges, keys := p.effects()
	if charges != 2 || len(keys) != 2 || first.Value.ChargeID == second.Value.ChargeID {
		t.Fatalf("two databases' operations: charges %d, keys %v, answers %+v and %+v; want 2 charges under 2 keys",
			charges, keys, first.Value, second.Value)
	}
}

// migratedDatabase returns the pool of a new database of the test's own,
// with idem's tables and the tests' business tables.
func migratedDatabase(t *testing.T, ctx context.Context) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(ctx, env.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, testdb.AppSchema); err != nil {
		t.Fatal(err)
	}
	return pool
}

func TestFlowCallResultThatCannotBeStoredStopsTheFlow(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	flow := idem.MustNewFlow(testdb.Name("nan"), func(ctx context.Context, s *idem.Steps, in chargeIn) (float64, error) {
		return idem.Call(s, "charge", func(ctx context.Context, key string) (float64, error) {
			_, _, err := p.charge(ctx, key, in.Amount)
			return math.NaN(), err // applied, and answered with what JSON cannot hold
		})
	})
	_, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if !errors.Is(err, idem.ErrFlowStopped) || !errors.Is(err, idem.ErrResponseNotStorable) {
		t.Fatalf("the run whose call's result cannot be stored: %v, want ErrFlowStopped and ErrResponseNotStorable", err)
	}
	for range 4 {
		if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); !errors.Is(err, idem.ErrFlowStopped) {
			t.Fatalf("a retry: %v, want ErrFlowStopped", err)
		}
	}
	if p.calls.Load() != 1 {
		t.Fatalf("the provider was called %d times, want once", p.calls.Load())
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.State != "attention" || !strings.Contains(info.LastError, "cannot be stored") {
		t.Fatalf("the flow: %+v, %v; want it stopped for attention, saying why", info, err)
	}
}

func TestFlowDuplicateKeepsItsWaitWhenTheFlowExpiresWhileItWaits(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	// The answer's retention is over as soon as it is recorded.
	flow := chargeFlow(p, &steps, idem.WithRetention(time.Microsecond), idem.WithProviderWindow(0))
	calling, answer := make(chan struct{}), make(chan struct{})
	p.before = func(_ string, attempt int) error {
		if attempt == 1 {
			close(calling)
			<-answer
		}
		return nil
	}
	first := make(chan error, 1)
	go func() {
		_, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		first <- err
	}()
	<-calling
	// The duplicate runs on a pool of its own, which counts its looks.
	looks := make(chan struct{}, 100)
	cfg := pool.Config()
	cfg.AfterRelease = func(*pgx.Conn) bool {
		select {
		case looks <- struct{}{}:
		default:
		}
		return true
	}
	dupPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer dupPool.Close()
	dup := make(chan ran[chargeOut], 1)
	go func() {
		res, err := flow.Run(ctx, dupPool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Second))
		dup <- ran[chargeOut]{res, err}
	}()
	<-looks // it found the flow held, and waits
	close(answer)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	// The duplicate finds the flow completed and expired between two of
	// its looks: the key is free again, and its run is the key's next
	// operation, within its wait.
	select {
	case res := <-dup:
		if res.err != nil {
			t.Fatalf("the duplicate: %+v, %v", res.Result, res.err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the duplicate has waited a minute on a wait of a second")
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

func TestFlowResumeIsNotHeldUpByAHungCall(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithCallTimeout(-1))
	// The longest abandoned, which a pass takes first, has a call that
	// hangs until the pass is cancelled.
	for _, key := range []string{"hung", "a", "b"} {
		abandon(t, ctx, pool, flow, p, scope, key)
		leaseRanOut(t, ctx, pool, scope, key)
	}
	hung := providerKeyOf(t, ctx, pool, scope, "hung", "charge")
	passCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	p.before = func(key string, _ int) error {
		if key == hung {
			<-passCtx.Done()
			return passCtx.Err()
		}
		return nil
	}
	done := make(chan struct{})
	var resumed int
	var err error
	go func() {
		defer close(done)
		resumed, err = flow.Resume(passCtx, pool)
	}()
	for _, key := range []string{"a", "b"} {
		waitForState(t, ctx, pool, scope, key, "done")
	}
	cancel() // the hung call's pass is the only one left
	<-done
	if resumed != 2 || err == nil {
		t.Fatalf("Resume = %d, %v; want the 2 others completed and the hung one's error", resumed, err)
	}
}

func TestFlowCallThatHangsGivesTheFlowUpAfterItsTimeout(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithCallTimeout(100*time.Millisecond), idem.WithLease(300*time.Millisecond))
	hanging, unblock := make(chan struct{}), make(chan struct{})
	p.after = func(_ string, attempt int) error {
		if attempt == 1 {
			close(hanging)
			<-unblock // ignores its context
		}
		return nil
	}
	first := make(chan ran[chargeOut], 1)
	go func() {
		res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
		first <- ran[chargeOut]{res, err}
	}()
	<-hanging
	// Past the call's timeout its lease is no longer renewed: the client's
	// retry takes the flow over once it has run out, rather than waiting
	// for ever.
	retry, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}, idem.WithWait(time.Minute))
	if err != nil || retry.Replayed || retry.Value.ChargeID != "ch_1" {
		t.Fatalf("the retry: %+v, %v; want the flow taken over and completed", retry, err)
	}
	close(unblock)
	if res := <-first; res.err != nil || !res.Replayed || res.Value != retry.Value {
		t.Fatalf("the hung executor, once its call returned: %+v, %v; want %+v replayed", res.Result, res.err, retry.Value)
	}
	checkOneCharge(t, pool, scope, "k", p, 2)
}

// waitForState waits until the flow (scope, key) is in state.
func waitForState(t *testing.T, ctx context.Context, pool *pgxpool.Pool, scope, key, state string) {
	t.Helper()
	for {
		info, err := idem.InspectFlow(ctx, pool, scope, key)
		if err != nil {
			t.Fatal(err)
		}
		if info.State == state {
			return
		}
		if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
			t.Fatalf("the flow %s is %s, not %s: %v", key, info.State, state, err)
		}
	}
}

func TestFlowTakenOverContinuesWithTheRecordedInput(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps)
	// The fingerprint covers only the order, not the amount.
	fp := idem.Fingerprint([]byte("order-1"))
	p.after = func(string, int) error { return errors.New("connection reset by peer") }
	if _, err := flow.Run(ctx, pool, scope, "k", fp, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	p.after = nil
	res, err := flow.Run(ctx, pool, scope, "k", fp, chargeIn{Amount: 9900})
	if err != nil {
		t.Fatal(err)
	}
	key := providerKeyOf(t, ctx, pool, scope, "k", "charge")
	p.mu.Lock()
	amounts := p.amounts[key]
	p.mu.Unlock()
	if len(amounts) != 2 || amounts[0] != 2500 || amounts[1] != 2500 {
		t.Fatalf("the provider key %s carried the amounts %v, want 2500 twice (answer %+v)", key, amounts, res.Value)
	}
}

func TestFlowSlowExecutorWhoseLeaseRanOutFinishesWhenNobodyTookItOver(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	lease := 50 * time.Millisecond
	flow := idem.MustNewFlow(testdb.Name("slow"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		c, err := idem.Call(s, "charge", func(ctx context.Context, key string) (string, error) {
			id, _, err := p.charge(ctx, key, in.Amount)
			return id, err
		})
		if err != nil {
			return "", err
		}
		// A loaded machine: the function is slow between its last step and
		// its answer, past its lease, and nobody takes the flow over.
		leaseRanOut(t, ctx, pool, s.Scope(), s.Key())
		steps.Add(1)
		return c, nil
	}, idem.WithLease(lease))
	res, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if err != nil || res.Value != "ch_1" {
		t.Fatalf("the slow executor: %+v, %v; want its answer recorded", res, err)
	}
	if again, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err != nil || !again.Replayed {
		t.Fatalf("the retry: %+v, %v; want a replay", again, err)
	}
}

func TestFlowWithACodecSealsItsLastError(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps atomic.Int64
	flow := chargeFlow(p, &steps, idem.WithCodec(&reverseCodec{}), idem.WithProviderWindow(0), idem.WithWait(0))
	const card = "4242 4242 4242 4242"
	p.after = func(string, int) error { return errors.New("declined card " + card) }
	if _, err := flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500}); err == nil {
		t.Fatal("the first run succeeded")
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || info.LastError == "" || strings.Contains(info.LastError, card) {
		t.Fatalf("the stored last error: %q, %v; want it sealed", info.LastError, err)
	}
	// The retry, with a window of zero, stops the flow for attention; the
	// caller, which has the codec, reads why.
	_, err = flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if !errors.Is(err, idem.ErrFlowStopped) {
		t.Fatalf("the retry: %v, want ErrFlowStopped", err)
	}
	_, err = flow.Run(ctx, pool, scope, "k", fpCharge, chargeIn{Amount: 2500})
	if !errors.Is(err, idem.ErrFlowStopped) || !strings.Contains(err.Error(), "provider window") {
		t.Fatalf("a run of the stopped flow: %v, want ErrFlowStopped saying why, opened", err)
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, "k"); err != nil || strings.Contains(info.LastError, "provider window") {
		t.Fatalf("the stored reason: %q, %v; want it sealed", info.LastError, err)
	}
}

// keyingCodec is reverseCodec that also keys the fingerprints it is given.
type keyingCodec struct{ reverseCodec }

func (c *keyingCodec) KeyFingerprint(scope string, fp []byte) []byte {
	return idem.Fingerprint([]byte("a secret of the codec's"), []byte(scope), fp)
}

func TestACodecThatKeysFingerprintsKeepsThemFromBeingConfirmed(t *testing.T) {
	ctx, pool, scope, p := setupFlow(t)
	var steps, calls atomic.Int64
	codec := &keyingCodec{}
	// A flow's default fingerprint, of its input.
	flow := chargeFlow(p, &steps, idem.WithCodec(codec))
	if _, err := flow.Run(ctx, pool, scope, "f", nil, chargeIn{Amount: 2500}); err != nil {
		t.Fatal(err)
	}
	// A Run's fingerprint.
	if _, err := idem.Run(ctx, pool, scope, "r", fpA, pay(scope, "r", 2500, &calls), idem.WithCodec(codec)); err != nil {
		t.Fatal(err)
	}
	guess, err := idem.FingerprintJSON(chargeIn{Amount: 2500})
	if err != nil {
		t.Fatal(err)
	}
	var flowFP, runFP []byte
	if err := pool.QueryRow(ctx, `SELECT fingerprint FROM idem_flow WHERE scope = $1 AND key = 'f'`, scope).Scan(&flowFP); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT fingerprint FROM idempotency_key WHERE scope = $1 AND key = 'r'`, scope).Scan(&runFP); err != nil {
		t.Fatal(err)
	}
	if string(flowFP) == string(guess) || string(runFP) == string(fpA) {
		t.Fatal("a stored fingerprint is the plain hash of the request")
	}
	// Retries compare as before: the same request replays, another is refused.
	if res, err := flow.Run(ctx, pool, scope, "f", nil, chargeIn{Amount: 2500}); err != nil || !res.Replayed {
		t.Fatalf("the flow's retry: %+v, %v", res, err)
	}
	if _, err := flow.Run(ctx, pool, scope, "f", nil, chargeIn{Amount: 9900}); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("the flow's key with another input: %v, want ErrFingerprintMismatch", err)
	}
	if res, err := idem.Run(ctx, pool, scope, "r", fpA, pay(scope, "r", 2500, &calls), idem.WithCodec(codec)); err != nil || !res.Replayed {
		t.Fatalf("the Run's retry: %+v, %v", res, err)
	}
	if _, err := idem.Run(ctx, pool, scope, "r", fpB, pay(scope, "r", 2500, &calls), idem.WithCodec(codec)); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("the Run's key with another request: %v, want ErrFingerprintMismatch", err)
	}
}

// TestFlowAtMostOnceCallWhoseFunctionWasNeverCalledIsMadeOnce ends a
// run's context as its AtMostOnce call's intent commits (a client that
// hangs up, a request's deadline): the call's function is never called,
// so the attempt is no attempt. The record says that none reached the
// provider, the retry makes the call, once, and the flow answers; it is
// not stopped for a person, and its provider window starts then.
func TestFlowAtMostOnceCallWhoseFunctionWasNeverCalledIsMadeOnce(t *testing.T) {
	ctx, _, scope, _ := setupFlow(t)
	var armed atomic.Bool
	var cancel atomic.Pointer[context.CancelFunc]
	tracer := &onBatchEnd{fn: func() {
		if armed.CompareAndSwap(true, false) {
			(*cancel.Load())() // once the intent's round trip is over
		}
	}}
	pool := countedPool(t, ctx, new(testdb.WireCount), func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = tracer })
	var sent atomic.Int64
	flow := idem.MustNewFlow(testdb.Name("sms"), func(ctx context.Context, s *idem.Steps, in chargeIn) (string, error) {
		if _, err := idem.Local(s, "order", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payment (scope, key, amount_cents) VALUES ($1, $2, $3)`, s.Scope(), s.Key(), in.Amount)
			return 1, err
		}); err != nil {
			return "", err
		}
		armed.Store(true)
		return idem.Call(s, "sms", func(ctx context.Context, _ string) (string, error) {
			sent.Add(1)
			return "sms sent", nil
		}, idem.AtMostOnce())
	})
	runCtx, stop := context.WithCancel(ctx)
	cancel.Store(&stop)
	if _, err := flow.Run(runCtx, pool, scope, "k", nil, chargeIn{Amount: 1}); !errors.Is(err, context.Canceled) {
		t.Fatalf("the run whose context ended at the intent: %v, want context.Canceled", err)
	}
	if sent.Load() != 0 {
		t.Fatalf("the call's function ran %d times, want none: the context ended before it", sent.Load())
	}
	info, err := idem.InspectFlow(ctx, pool, scope, "k")
	if err != nil || len(info.Steps) != 2 || info.Steps[1].State != "unsent" || info.Steps[1].Attempts != 0 {
		t.Fatalf("InspectFlow: %+v, %v; want the call unsent, with no attempt", info.Steps, err)
	}
	res, err := flow.Run(ctx, pool, scope, "k", nil, chargeIn{Amount: 1})
	if err != nil || res.Value != "sms sent" {
		t.Fatalf("the retry: %+v, %v; want the call made and the flow answered", res, err)
	}
	if sent.Load() != 1 {
		t.Fatalf("the call's function ran %d times, want once", sent.Load())
	}
	if info, err := idem.InspectFlow(ctx, pool, scope, "k"); err != nil || info.Steps[1].Attempts != 1 {
		t.Fatalf("InspectFlow after the retry: %+v, %v; want one attempt", info.Steps, err)
	}
}

// onBatchEnd is a pgx tracer that calls fn as each batch ends.
type onBatchEnd struct{ fn func() }

func (o *onBatchEnd) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (o *onBatchEnd) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (o *onBatchEnd) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (o *onBatchEnd) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (o *onBatchEnd) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     { o.fn() }
