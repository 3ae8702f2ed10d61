package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
)

// soakSchema is the soak's business table, apart from the demo's and the
// tests' so that a soak never counts anyone else's rows.
const soakSchema = `
CREATE TABLE IF NOT EXISTS idem_soak_payment (
    id           bigserial   PRIMARY KEY,
    scope        text        NOT NULL,
    key          text        NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
)`

// soakIndex lets the final check read one run's rows without a scan of
// every run's.
const soakIndex = `CREATE INDEX IF NOT EXISTS idem_soak_payment_scope_key_idx ON idem_soak_payment (scope, key)`

// maxSoakPayments is the most payments one run may make.
const maxSoakPayments = 100_000

// Bounds on every request loop, so that no fault can keep the soak running
// forever: a payment that is still unanswered past either bound counts as a
// failure.
const (
	// soakMaxAttempts is the most attempts a payment makes.
	soakMaxAttempts = 1000
	// soakAttemptTimeout is the deadline of an attempt the chaos spares.
	soakAttemptTimeout = 15 * time.Second
	// soakShortTimeoutMax is the longest deadline the chaos gives an
	// attempt it means to abandon: about the time an attempt takes, so that
	// some are abandoned before their COMMIT and some after it.
	soakShortTimeoutMax = 20 * time.Millisecond
	// soakRetryDelayMax caps the backoff between a payment's attempts.
	soakRetryDelayMax = 250 * time.Millisecond
	// soakRestartTimeout bounds the user's restart command.
	soakRestartTimeout = 2 * time.Minute
	// soakRecoveryTimeout is how long the final check waits for the server
	// to come back after a restart.
	soakRecoveryTimeout = time.Minute
	// soakProgressEvery is how often a running soak says how far it got.
	soakProgressEvery = 10 * time.Second
)

// soakConfig is one soak run: its size, its database, and how hard the
// chaos hits. A zero interval or chance turns that fault off.
type soakConfig struct {
	// DatabaseURL is the database to soak: one made for the soak, which
	// writes idem's tables and its own there (runSoak makes one).
	DatabaseURL string
	// Payments is how many logical payments to make, at most.
	Payments int
	// Clients is how many payments are in flight at once, each on its own
	// connection.
	Clients int
	// Duration, when positive, stops starting payments once it has passed;
	// the payments already started still run until answered.
	Duration time.Duration
	// PaymentTimeout is the longest a payment may take, all its attempts
	// included, before it counts as a failure.
	PaymentTimeout time.Duration

	// TerminateEvery is how often one of the soak's backends that is in a
	// transaction is terminated with pg_terminate_backend. Paced by the
	// clock, it waits after each fault for an attempt to be answered, so
	// that a machine too slow to answer between two ticks still gets
	// through.
	TerminateEvery time.Duration
	// CutEvery is how often the proxy cuts a connection at random, waiting
	// after each cut for an attempt to be answered, as TerminateEvery does.
	CutEvery time.Duration
	// TerminateEveryWrites, when positive, terminates the backend of one
	// business write in that many, inside the write's transaction, before
	// its COMMIT. These faults are paced by the soak's progress, not by
	// the clock: the machine's speed changes how long a soak takes, not
	// which faults it meets. A payment's write after one that such a fault
	// hit (this one or CutEveryWrites) is never hit, so every payment gets
	// through.
	TerminateEveryWrites int
	// CutEveryWrites, when positive, cuts the connection of one business
	// write in that many, inside its transaction, as TerminateEveryWrites
	// terminates one.
	CutEveryWrites int
	// CutBeforeCommit is the chance that the proxy cuts a connection
	// instead of passing a COMMIT on to the server.
	CutBeforeCommit float64
	// CutAfterCommit is the chance that the proxy cuts a connection instead
	// of passing the server's answer to a COMMIT back to the client.
	CutAfterCommit float64
	// TimeoutRate is the chance that an attempt runs under a deadline so
	// short that the client abandons it while the server still works.
	TimeoutRate float64
	// RestartCommand, when set, is run with sh -c every RestartEvery to
	// restart PostgreSQL.
	RestartCommand string
	// RestartEvery is how often RestartCommand runs.
	RestartEvery time.Duration
	// Verbose adds an example error of every kind of failed attempt.
	Verbose bool

	// startupDelay makes every connection through the proxy that much
	// slower to start, as on a busy machine. Tests set it.
	startupDelay time.Duration
}

// defaultSoakConfig returns the configuration of "idem soak" without flags:
// sized to finish in about a minute on two cores.
func defaultSoakConfig() soakConfig {
	return soakConfig{
		Payments:        40_000,
		Clients:         16,
		PaymentTimeout:  2 * time.Minute,
		TerminateEvery:  25 * time.Millisecond,
		CutEvery:        50 * time.Millisecond,
		CutBeforeCommit: 0.03,
		CutAfterCommit:  0.03,
		TimeoutRate:     0.03,
		RestartEvery:    20 * time.Second,
	}
}

func (c soakConfig) validate() error {
	chance := func(name string, p float64) error {
		if p < 0 || p > 1 {
			return fmt.Errorf("%s must be between 0 and 1, got %g", name, p)
		}
		return nil
	}
	switch {
	case c.Payments < 1 || c.Payments > maxSoakPayments:
		return fmt.Errorf("-payments must be between 1 and %d, got %d", maxSoakPayments, c.Payments)
	case c.Clients < 1 || c.Clients > 64:
		return fmt.Errorf("-clients must be between 1 and 64, got %d", c.Clients)
	case c.Duration < 0 || c.TerminateEvery < 0 || c.CutEvery < 0:
		return errors.New("-duration, -terminate-every and -cut-every must not be negative")
	case c.TerminateEveryWrites < 0 || c.CutEveryWrites < 0:
		return errors.New("-terminate-every-writes and -cut-every-writes must not be negative")
	case c.PaymentTimeout <= 0:
		return errors.New("-payment-timeout must be positive")
	case c.RestartCommand != "" && c.RestartEvery <= 0:
		return errors.New("-restart-every must be positive when -restart is set")
	}
	return errors.Join(chance("-cut-before-commit", c.CutBeforeCommit),
		chance("-cut-after-commit", c.CutAfterCommit), chance("-timeout-rate", c.TimeoutRate))
}

func runSoak(ctx context.Context, args []string, stdout io.Writer) error {
	cfg := defaultSoakConfig()
	fs := newFlagSet(stdout, "soak", `soak [flags]

Makes many payments while injecting faults, then checks that none was lost
or doubled. Like demo, it runs in a database (or schema, or server) of its
own, removed at the end.

-terminate-every and -cut-every pace their faults by the clock, so a slower
machine meets more of them per payment (each waits for an attempt to be
answered before the next). -terminate-every-writes and -cut-every-writes
pace theirs by the payments' writes, whatever the machine's speed: set the
clock-paced ones to 0 and use these where that speed is unknown, as in CI.`)
	fs.IntVar(&cfg.Payments, "payments", cfg.Payments, fmt.Sprintf("logical payments to make (at most %d)", maxSoakPayments))
	fs.IntVar(&cfg.Clients, "clients", cfg.Clients, "concurrent clients, one connection each")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "stop starting payments after this long (0: make all of -payments)")
	fs.DurationVar(&cfg.PaymentTimeout, "payment-timeout", cfg.PaymentTimeout, "longest a payment may take, retries included, before it counts as a failure")
	fs.DurationVar(&cfg.TerminateEvery, "terminate-every", cfg.TerminateEvery, "terminate one of the soak's backends in a transaction this often, and not again before an attempt is answered (0: never)")
	fs.DurationVar(&cfg.CutEvery, "cut-every", cfg.CutEvery, "cut one proxied connection at random this often, and not again before an attempt is answered (0: never)")
	fs.IntVar(&cfg.TerminateEveryWrites, "terminate-every-writes", cfg.TerminateEveryWrites, "terminate the backend of one payment write in `N`, in its transaction before COMMIT; never two of a payment's writes in a row (0: never)")
	fs.IntVar(&cfg.CutEveryWrites, "cut-every-writes", cfg.CutEveryWrites, "cut the connection of one payment write in `N`, in its transaction before COMMIT; never two of a payment's writes in a row (0: never)")
	fs.Float64Var(&cfg.CutBeforeCommit, "cut-before-commit", cfg.CutBeforeCommit, "chance that a COMMIT is dropped with its connection before it reaches the server")
	fs.Float64Var(&cfg.CutAfterCommit, "cut-after-commit", cfg.CutAfterCommit, "chance that the reply to a COMMIT is dropped with its connection after the server committed")
	fs.Float64Var(&cfg.TimeoutRate, "timeout-rate", cfg.TimeoutRate, "chance that an attempt runs under a deadline of at most "+soakShortTimeoutMax.String()+" and is abandoned")
	fs.StringVar(&cfg.RestartCommand, "restart", cfg.RestartCommand, "shell command that restarts PostgreSQL, run every -restart-every (empty: never restart)")
	fs.DurationVar(&cfg.RestartEvery, "restart-every", cfg.RestartEvery, "how often to run the -restart command")
	fs.BoolVar(&cfg.Verbose, "v", cfg.Verbose, "print an example error of every kind of failed attempt")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := cfg.validate(); err != nil {
		return usageError{err}
	}
	sc, err := openScratch(ctx, stdout, "soak")
	if err != nil {
		return err
	}
	defer sc.Close()
	cfg.DatabaseURL = sc.URL
	_, err = soak(ctx, cfg, stdout)
	return err
}

// soakPayment is what a payment returns, and what a replay gives back.
type soakPayment struct {
	ID          int64  `json:"id"`
	Key         string `json:"key"`
	AmountCents int64  `json:"amount_cents"`
}

// soakRequest is what a payment's fingerprint covers.
type soakRequest struct {
	AmountCents int64 `json:"amount_cents"`
}

// soakFaults counts the faults that actually hit, by kind.
type soakFaults struct {
	// Terminated counts backends killed with pg_terminate_backend while
	// they were in a transaction.
	Terminated int64
	// TimedOut counts attempts that the client abandoned when their short
	// deadline passed.
	TimedOut int64
	// CutBeforeCommit counts connections cut instead of passing a COMMIT
	// to the server.
	CutBeforeCommit int64
	// CutAfterCommit counts connections cut instead of passing the reply
	// to a COMMIT back to the client.
	CutAfterCommit int64
	// CutRandom counts connections cut at a random moment.
	CutRandom int64
	// TerminatedInWrite counts backends terminated inside a business
	// write's transaction (TerminateEveryWrites).
	TerminatedInWrite int64
	// CutInWrite counts connections cut inside a business write's
	// transaction (CutEveryWrites).
	CutInWrite int64
	// Restarts counts runs of the restart command.
	Restarts int64
}

// soakReport is what a soak run did and found.
type soakReport struct {
	// Operations is the number of logical payments started.
	Operations int
	// Answered is the number of payments that got an answer.
	Answered int
	// Attempts is the number of calls to idem.Run, all payments together.
	Attempts int64
	// Executed and Replayed split the answers: the payment ran in the
	// attempt that answered, or an earlier attempt had committed it.
	Executed, Replayed int64
	// Writes is the number of times the business write ran, committed or
	// rolled back by a fault.
	Writes int64
	// Failures counts failed attempts by kind.
	Failures map[string]int64
	// Faults counts the faults injected.
	Faults soakFaults
	// Connections is the number of connections opened through the proxy:
	// the clients' own, each fault costing one, and the driver's cancel
	// requests.
	Connections int64
	// Rows is the number of payments in the table for this run.
	Rows int64
	// Lost counts answered payments with no row; Doubled counts payments
	// with more than one.
	Lost, Doubled int
	// WrongAnswers counts answers that differ from the payment's row or
	// from its stored response.
	WrongAnswers int
	// Stranded counts claims left in progress.
	Stranded int
	// Elapsed is the time from the first payment to the last answer.
	Elapsed time.Duration
}

// soakRun is the state of one soak while its clients and chaos run.
type soakRun struct {
	cfg   soakConfig
	pool  *pgxpool.Pool // through the proxy
	scope string
	// admin, appName and proxy inject the faults tied to writes: admin is
	// the unproxied pool, appName names the soak's own backends.
	admin   *pgxpool.Pool
	appName string
	proxy   *chaosProxy

	attempts, executed, replayed, writes, timedOut atomic.Int64
	// terminatesDue and cutsDue count the faults tied to writes that are
	// due and not injected yet; terminatedInWrite and cutInWrite count
	// those injected.
	terminatesDue, cutsDue        atomic.Int64
	terminatedInWrite, cutInWrite atomic.Int64

	mu       sync.Mutex
	failures map[string]int64
	samples  map[string]string
}

// soak runs a soak and returns what it found. The error is nil only when
// every payment was answered, applied exactly once, and answered with what
// was stored.
func soak(ctx context.Context, cfg soakConfig, stdout io.Writer) (*soakReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, usageError{err}
	}
	// Progress and restarts are reported while the clients run.
	stdout = &lockedWriter{w: stdout}
	admin, err := connectSoakAdmin(ctx, cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	sqlDB := stdlib.OpenDBFromPool(admin)
	defer sqlDB.Close()
	if err := idem.Migrate(ctx, sqlDB); err != nil {
		return nil, databaseError{err}
	}
	for _, ddl := range []string{soakSchema, soakIndex} {
		if _, err := admin.Exec(ctx, ddl); err != nil {
			return nil, databaseError{fmt.Errorf("create soak table: %w", err)}
		}
	}

	run := &soakRun{
		cfg:      cfg,
		scope:    "soak-" + randomSuffix(),
		admin:    admin,
		failures: make(map[string]int64),
		samples:  make(map[string]string),
	}
	// The terminator finds the soak's own backends by this name, and only
	// them.
	appName := "idem-" + run.scope
	run.appName = appName

	adminConn := admin.Config().ConnConfig
	proxy, err := newChaosProxy(dialerFor(adminConn.Host, adminConn.Port), cfg.CutBeforeCommit, cfg.CutAfterCommit, cfg.startupDelay)
	if err != nil {
		return nil, err
	}
	defer proxy.close()
	run.proxy = proxy
	run.pool, err = proxiedPool(ctx, admin, proxy.addr().Port, appName, cfg.Clients)
	if err != nil {
		return nil, err
	}
	defer run.pool.Close()

	if cfg.Duration > 0 {
		fmt.Fprintf(stdout, "idem soak: up to %d payments for %s from %d clients, scope %s\n", cfg.Payments, cfg.Duration, cfg.Clients, run.scope)
	} else {
		fmt.Fprintf(stdout, "idem soak: %d payments from %d clients, scope %s\n", cfg.Payments, cfg.Clients, run.scope)
	}
	fmt.Fprintf(stdout, "  through a cutting proxy on %s\n", proxy.addr())
	fmt.Fprintf(stdout, "  faults: %s\n", describeFaults(cfg))

	chaosCtx, stopChaos := context.WithCancel(ctx)
	var chaos sync.WaitGroup
	var terminated, restarts atomic.Int64
	var restartErr error
	if cfg.TerminateEvery > 0 {
		gate := run.progressGate()
		chaos.Go(func() { terminated.Store(terminateLoop(chaosCtx, admin, appName, cfg.TerminateEvery, gate)) })
	}
	if cfg.CutEvery > 0 {
		gate := run.progressGate()
		chaos.Go(func() {
			every(chaosCtx, cfg.CutEvery, func() {
				if gate.open() && proxy.cutRandom() {
					gate.passed()
				}
			})
		})
	}
	if cfg.RestartCommand != "" {
		chaos.Go(func() { restartErr = restartLoop(chaosCtx, cfg.RestartCommand, cfg.RestartEvery, &restarts, stdout) })
	}

	started := time.Now()
	answers, errs, operations := run.payAll(ctx, stdout)
	elapsed := time.Since(started)
	stopChaos()
	chaos.Wait()
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("interrupted after %d payments: %w", operations, err)
	}

	rep := &soakReport{
		Operations: operations,
		Attempts:   run.attempts.Load(),
		Executed:   run.executed.Load(),
		Replayed:   run.replayed.Load(),
		Writes:     run.writes.Load(),
		Failures:   run.failures,
		Faults: soakFaults{
			Terminated:        terminated.Load(),
			TimedOut:          run.timedOut.Load(),
			CutBeforeCommit:   proxy.cutsBeforeCommit.Load(),
			CutAfterCommit:    proxy.cutsAfterCommit.Load(),
			CutRandom:         proxy.cutsRandom.Load(),
			TerminatedInWrite: run.terminatedInWrite.Load(),
			CutInWrite:        run.cutInWrite.Load(),
			Restarts:          restarts.Load(),
		},
		Connections: proxy.accepted.Load(),
		Elapsed:     elapsed,
	}
	if err := waitForServer(ctx, admin); err != nil {
		return rep, databaseError{fmt.Errorf("the server did not come back for the final check: %w", err)}
	}
	if err := run.check(ctx, admin, answers, errs, rep); err != nil {
		return rep, databaseError{err}
	}
	run.print(stdout, rep)

	var violations []string
	if n, first := countErrors(errs); n > 0 {
		violations = append(violations, fmt.Sprintf("%d payments got no answer, first: %v", n, first))
	}
	if rep.Rows != int64(rep.Operations) {
		violations = append(violations, fmt.Sprintf("%d payment rows for %d logical payments", rep.Rows, rep.Operations))
	}
	if rep.Lost > 0 || rep.Doubled > 0 {
		violations = append(violations, fmt.Sprintf("%d payments lost, %d doubled", rep.Lost, rep.Doubled))
	}
	if rep.WrongAnswers > 0 {
		violations = append(violations, fmt.Sprintf("%d answers differ from what was stored", rep.WrongAnswers))
	}
	if rep.Stranded > 0 {
		violations = append(violations, fmt.Sprintf("%d claims left in progress", rep.Stranded))
	}
	if restartErr != nil {
		violations = append(violations, restartErr.Error())
	}
	if len(violations) > 0 {
		return rep, fmt.Errorf("VIOLATION: %s", strings.Join(violations, "; "))
	}
	fmt.Fprintln(stdout, "\nOK: every payment applied exactly once, every answer matches what was stored.")
	return rep, nil
}

// connectSoakAdmin opens the soak's own, unproxied pool: it migrates, runs
// the chaos's SQL and checks the outcome, and is never cut.
func connectSoakAdmin(ctx context.Context, url string) (*pgxpool.Pool, error) {
	return connectTo(ctx, url, 4)
}

// proxiedPool opens the clients' pool on the admin pool's settings, but
// through the proxy, under appName, and without TLS, which would hide the
// protocol from the proxy.
func proxiedPool(ctx context.Context, admin *pgxpool.Pool, port int, appName string, clients int) (*pgxpool.Pool, error) {
	cfg := admin.Config().Copy()
	cfg.MaxConns = int32(clients)
	cfg.MinConns = 0
	cc := cfg.ConnConfig
	cc.Host = "127.0.0.1"
	cc.Port = uint16(port)
	cc.TLSConfig = nil
	cc.Fallbacks = nil
	if cc.RuntimeParams == nil {
		cc.RuntimeParams = make(map[string]string)
	}
	cc.RuntimeParams["application_name"] = appName
	if cc.ConnectTimeout == 0 {
		cc.ConnectTimeout = proxyDialTimeout
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, databaseError{fmt.Errorf("open pool through the proxy: %w", err)}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, databaseError{fmt.Errorf("connect through the proxy (the soak needs a server that accepts connections without TLS): %w", err)}
	}
	return pool, nil
}

func describeFaults(cfg soakConfig) string {
	var parts []string
	if cfg.TerminateEvery > 0 {
		parts = append(parts, fmt.Sprintf("terminate a backend every %s", cfg.TerminateEvery))
	}
	if cfg.CutEvery > 0 {
		parts = append(parts, fmt.Sprintf("cut a connection every %s", cfg.CutEvery))
	}
	if cfg.TerminateEveryWrites > 0 {
		parts = append(parts, fmt.Sprintf("terminate the backend of one write in %d", cfg.TerminateEveryWrites))
	}
	if cfg.CutEveryWrites > 0 {
		parts = append(parts, fmt.Sprintf("cut the connection of one write in %d", cfg.CutEveryWrites))
	}
	if cfg.CutBeforeCommit > 0 || cfg.CutAfterCommit > 0 {
		parts = append(parts, fmt.Sprintf("cut %.0f%% of COMMITs before the server, %.0f%% after", cfg.CutBeforeCommit*100, cfg.CutAfterCommit*100))
	}
	if cfg.TimeoutRate > 0 {
		parts = append(parts, fmt.Sprintf("abandon %.0f%% of attempts within %s", cfg.TimeoutRate*100, soakShortTimeoutMax))
	}
	if cfg.RestartCommand != "" {
		parts = append(parts, fmt.Sprintf("restart PostgreSQL every %s", cfg.RestartEvery))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// payAll runs the clients until every payment is started, or Duration has
// passed, and every started payment has ended. It returns each payment's
// answer or error, and how many were started.
func (r *soakRun) payAll(ctx context.Context, stdout io.Writer) ([]soakPayment, []error, int) {
	answers := make([]soakPayment, r.cfg.Payments)
	errs := make([]error, r.cfg.Payments)
	var next, done atomic.Int64
	var stopStarting time.Time
	if r.cfg.Duration > 0 {
		stopStarting = time.Now().Add(r.cfg.Duration)
	}

	progressCtx, stopProgress := context.WithCancel(ctx)
	var progress sync.WaitGroup
	defer progress.Wait()
	defer stopProgress()
	started := time.Now()
	progress.Go(func() {
		every(progressCtx, soakProgressEvery, func() {
			fmt.Fprintf(stdout, "  %s: %d payments answered, %d attempts\n",
				time.Since(started).Round(time.Second), done.Load(), r.attempts.Load())
		})
	})

	var clients sync.WaitGroup
	for range r.cfg.Clients {
		clients.Go(func() {
			for ctx.Err() == nil && (stopStarting.IsZero() || time.Now().Before(stopStarting)) {
				i := int(next.Add(1) - 1)
				if i >= r.cfg.Payments {
					return
				}
				answers[i], errs[i] = r.pay(ctx, i)
				done.Add(1)
			}
		})
	}
	clients.Wait()
	operations := int(min(next.Load(), int64(r.cfg.Payments)))
	return answers[:operations], errs[:operations], operations
}

// pay makes logical payment i: it retries with the same key and request
// until an attempt answers, an error says retrying cannot help, or the
// payment's bounds run out.
func (r *soakRun) pay(ctx context.Context, i int) (soakPayment, error) {
	key := fmt.Sprintf("payment-%d", i)
	amount := int64(100 + i)
	fp, err := idem.FingerprintJSON(soakRequest{AmountCents: amount})
	if err != nil {
		return soakPayment{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PaymentTimeout)
	defer cancel()

	var lastErr error
	// hit says whether a fault tied to writes hit the payment's last
	// attempt: the next one is spared.
	hit := false
	for attempt := 1; attempt <= soakMaxAttempts; attempt++ {
		var res idem.Result[soakPayment]
		res, hit, err = r.attempt(ctx, key, amount, fp, hit)
		if err == nil {
			if res.Replayed {
				r.replayed.Add(1)
			} else {
				r.executed.Add(1)
			}
			return res.Value, nil
		}
		lastErr = err
		if isDefinitive(err) {
			return soakPayment{}, fmt.Errorf("%s: %w", key, err)
		}
		// Back off as a real client would, so that a server that is down
		// is not hammered.
		ceiling := min(time.Millisecond<<min(attempt-1, 10), soakRetryDelayMax)
		if sleep(ctx, rand.N(ceiling)+1) != nil {
			break
		}
	}
	return soakPayment{}, fmt.Errorf("%s: no answer within %s and %d attempts, last error: %w",
		key, r.cfg.PaymentTimeout, soakMaxAttempts, lastErr)
}

// attempt is one call of idem.Run, possibly under a deadline short enough
// that the client walks away from it mid-flight, or with a fault tied to
// writes injected in its transaction, unless spare. It reports whether
// such a fault was injected.
func (r *soakRun) attempt(ctx context.Context, key string, amount int64, fp []byte, spare bool) (idem.Result[soakPayment], bool, error) {
	timeout := soakAttemptTimeout
	abandon := rand.Float64() < r.cfg.TimeoutRate
	if abandon {
		timeout = time.Millisecond + rand.N(soakShortTimeoutMax-time.Millisecond)
	}
	attemptCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	var opts []idem.Option
	if rand.IntN(2) == 0 {
		// Half the attempts look the key up first, so that both of Run's
		// paths meet the faults.
		opts = append(opts, idem.WithLookupFirst())
	}
	r.attempts.Add(1)
	injected := false
	res, err := idem.Run(attemptCtx, r.pool, r.scope, key, fp, func(ctx context.Context, tx pgx.Tx) (soakPayment, error) {
		// Run may call fn again in the same attempt; one fault is enough.
		fault := r.dueFault(r.writes.Add(1), spare || injected)
		// Before the write, the claim alone is at stake; after it, the
		// payment's row too.
		before := rand.IntN(2) == 0
		if fault != noFault && before {
			injected = r.inject(ctx, tx, fault)
		}
		p := soakPayment{Key: key, AmountCents: amount}
		err := tx.QueryRow(ctx,
			`INSERT INTO idem_soak_payment (scope, key, amount_cents) VALUES ($1, $2, $3) RETURNING id`,
			r.scope, key, amount).Scan(&p.ID)
		if err != nil {
			return p, err
		}
		if fault != noFault && !before {
			injected = r.inject(ctx, tx, fault)
		}
		// The work a real payment does before it commits keeps the
		// transaction open, so that the chaos hits some mid-way.
		return p, sleep(ctx, rand.N(2*time.Millisecond))
	}, opts...)
	if err != nil {
		timedOut := abandon && errors.Is(attemptCtx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
		if timedOut {
			r.timedOut.Add(1)
		}
		r.recordFailure(failureKind(err, timedOut), err)
	}
	return res, injected, err
}

// soakFault is a fault tied to writes.
type soakFault int

const (
	noFault soakFault = iota
	terminateFault
	cutFault
)

// dueFault counts write as one more business write, and returns the fault
// it is to meet: one that the count made due, now or at an earlier write
// that was spared, unless this one is spared too. A write meets at most
// one.
func (r *soakRun) dueFault(write int64, spare bool) soakFault {
	if n := int64(r.cfg.TerminateEveryWrites); n > 0 && write%n == 0 {
		r.terminatesDue.Add(1)
	}
	if n := int64(r.cfg.CutEveryWrites); n > 0 && write%n == 0 {
		r.cutsDue.Add(1)
	}
	switch {
	case spare:
		return noFault
	case takeOne(&r.terminatesDue):
		return terminateFault
	case takeOne(&r.cutsDue):
		return cutFault
	}
	return noFault
}

// takeOne takes one from due, and reports whether there was one.
func takeOne(due *atomic.Int64) bool {
	for {
		n := due.Load()
		if n <= 0 {
			return false
		}
		if due.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// inject injects fault into tx's transaction: it terminates the backend
// through the unproxied pool, or has the proxy cut the connection. It
// reports whether the fault hit; one that did not stays due.
func (r *soakRun) inject(ctx context.Context, tx pgx.Tx, fault soakFault) bool {
	conn := tx.Conn().PgConn()
	switch fault {
	case terminateFault:
		var ok bool
		err := r.admin.QueryRow(ctx, `
			SELECT pg_terminate_backend(pid)
			FROM pg_stat_activity
			WHERE pid = $1 AND application_name = $2`, int64(conn.PID()), r.appName).Scan(&ok)
		if err == nil && ok {
			r.terminatedInWrite.Add(1)
			return true
		}
		r.terminatesDue.Add(1)
	case cutFault:
		if r.proxy.cutClient(conn.Conn().LocalAddr()) {
			r.cutInWrite.Add(1)
			return true
		}
		r.cutsDue.Add(1)
	}
	return false
}

// clockGate holds back a fault paced by the clock until an attempt has
// been answered since the last one it let through. A machine too slow to
// answer between two ticks, which would otherwise have every attempt hit,
// then meets at most one such fault per answer. It belongs to one
// goroutine.
type clockGate struct {
	answered func() int64
	last     int64
}

// progressGate returns a gate that counts the run's answered attempts.
func (r *soakRun) progressGate() *clockGate {
	return &clockGate{answered: func() int64 { return r.executed.Load() + r.replayed.Load() }, last: -1}
}

// open reports whether an attempt was answered since the last fault.
func (g *clockGate) open() bool { return g.answered() > g.last }

// passed records that a fault went through.
func (g *clockGate) passed() { g.last = g.answered() }

func (r *soakRun) recordFailure(kind string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures[kind]++
	if _, ok := r.samples[kind]; !ok {
		r.samples[kind] = err.Error()
	}
}

// failureKind names the way an attempt failed, for the report.
func failureKind(err error, timedOut bool) string {
	var pgErr *pgconn.PgError
	switch {
	case timedOut:
		return "abandoned by the client's deadline"
	case errors.Is(err, idem.ErrInProgress):
		return "key held by an earlier attempt still in flight"
	case errors.As(err, &pgErr) && pgErr.Code == "57P01":
		return "backend terminated"
	case errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "57"):
		return "server shutting down or starting (SQLSTATE " + pgErr.Code + ")"
	case errors.As(err, &pgErr):
		return "server error (SQLSTATE " + pgErr.Code + ")"
	case errors.As(err, new(*pgconn.ConnectError)):
		return "could not connect"
	case errors.Is(err, context.DeadlineExceeded):
		return "attempt deadline of " + soakAttemptTimeout.String()
	}
	return "connection lost"
}

// isDefinitive reports whether retrying a payment that failed with err
// cannot help: the request itself is wrong, or the server rejected what
// was sent. Those are bugs, in the soak or in idem, not faults.
func isDefinitive(err error) bool {
	for _, target := range []error{idem.ErrFingerprintMismatch, idem.ErrInvalidKey, idem.ErrInvalidScope,
		idem.ErrInvalidOption, idem.ErrResponseTooLarge, idem.ErrResponseNotStorable} {
		if errors.Is(err, target) {
			return true
		}
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// Data exceptions, integrity violations, syntax or access errors,
		// internal errors.
		switch pgErr.Code[:2] {
		case "22", "23", "42", "XX":
			return true
		}
	}
	return false
}

// terminateLoop terminates, every interval that gate lets through, one of
// the backends named appName that is inside a transaction, and returns how
// many it terminated. Backends of other applications, of other databases
// and the loop's own are never chosen.
func terminateLoop(ctx context.Context, admin *pgxpool.Pool, appName string, interval time.Duration, gate *clockGate) int64 {
	var terminated int64
	every(ctx, interval, func() {
		if !gate.open() {
			return
		}
		var ok bool
		err := admin.QueryRow(ctx, `
			SELECT pg_terminate_backend(pid)
			FROM pg_stat_activity
			WHERE application_name = $1
			  AND datname = current_database()
			  AND backend_type = 'client backend'
			  AND pid <> pg_backend_pid()
			  AND xact_start IS NOT NULL
			ORDER BY random()
			LIMIT 1`, appName).Scan(&ok)
		// No backend in a transaction right now, or the server is
		// restarting: try again at the next tick.
		if err == nil && ok {
			terminated++
			gate.passed()
		}
	})
	return terminated
}

// restartLoop runs command every interval until ctx ends, counting the
// runs in restarts. It returns the first failure of the command.
func restartLoop(ctx context.Context, command string, interval time.Duration, restarts *atomic.Int64, stdout io.Writer) error {
	var failed error
	every(ctx, interval, func() {
		if failed != nil {
			return
		}
		// A restart cut short when the soak ends could leave the server
		// stopped: let it finish, within its own bound.
		runCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), soakRestartTimeout)
		defer cancel()
		started := time.Now()
		out, err := exec.CommandContext(runCtx, "sh", "-c", command).CombinedOutput()
		if err != nil {
			failed = fmt.Errorf("restart command %q failed: %w: %s", command, err, strings.TrimSpace(string(out)))
			return
		}
		restarts.Add(1)
		fmt.Fprintf(stdout, "  restarted PostgreSQL in %s\n", time.Since(started).Round(time.Millisecond))
	})
	return failed
}

// every calls fn every interval until ctx ends.
func every(ctx context.Context, interval time.Duration, fn func()) {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			fn()
		}
	}
}

// waitForServer pings until the server answers, for after a restart.
func waitForServer(ctx context.Context, admin *pgxpool.Pool) error {
	ctx, cancel := context.WithTimeout(ctx, soakRecoveryTimeout)
	defer cancel()
	for {
		err := admin.Ping(ctx)
		if err == nil {
			return nil
		}
		if sleep(ctx, 100*time.Millisecond) != nil {
			return err
		}
	}
}

// check compares the table and the stored responses with the answers the
// clients got, and fills in the report's verdict.
func (r *soakRun) check(ctx context.Context, admin *pgxpool.Pool, answers []soakPayment, errs []error, rep *soakReport) error {
	rows, err := admin.Query(ctx, `SELECT key, id, amount_cents FROM idem_soak_payment WHERE scope = $1`, r.scope)
	if err != nil {
		return fmt.Errorf("read payments: %w", err)
	}
	paymentsByKey := make(map[string][]soakPayment)
	for rows.Next() {
		var p soakPayment
		if err := rows.Scan(&p.Key, &p.ID, &p.AmountCents); err != nil {
			return fmt.Errorf("read payments: %w", err)
		}
		paymentsByKey[p.Key] = append(paymentsByKey[p.Key], p)
		rep.Rows++
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read payments: %w", err)
	}

	rows, err = admin.Query(ctx, `SELECT key, state, response FROM idempotency_key WHERE scope = $1`, r.scope)
	if err != nil {
		return fmt.Errorf("read stored responses: %w", err)
	}
	storedByKey := make(map[string]soakPayment)
	for rows.Next() {
		var key, state string
		var response []byte
		if err := rows.Scan(&key, &state, &response); err != nil {
			return fmt.Errorf("read stored responses: %w", err)
		}
		if state != "done" {
			rep.Stranded++
			continue
		}
		var stored soakPayment
		if err := json.Unmarshal(response, &stored); err != nil {
			return fmt.Errorf("decode stored response of %s: %w", key, err)
		}
		storedByKey[key] = stored
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read stored responses: %w", err)
	}

	for _, payments := range paymentsByKey {
		if len(payments) > 1 {
			rep.Doubled++
		}
	}
	for i, answer := range answers {
		if errs[i] != nil {
			continue
		}
		rep.Answered++
		key := fmt.Sprintf("payment-%d", i)
		payments := paymentsByKey[key]
		if len(payments) == 0 {
			rep.Lost++
			continue
		}
		want := soakPayment{ID: payments[0].ID, Key: key, AmountCents: int64(100 + i)}
		if answer != want || payments[0] != want || storedByKey[key] != want {
			rep.WrongAnswers++
		}
	}
	return nil
}

func (r *soakRun) print(w io.Writer, rep *soakReport) {
	perOp := func(n int64) float64 { return float64(n) / float64(max(rep.Operations, 1)) }
	fmt.Fprintf(w, "\nlogical operations:   %d started, %d answered, in %s (%.0f per second)\n",
		rep.Operations, rep.Answered, rep.Elapsed.Round(time.Millisecond), float64(rep.Answered)/rep.Elapsed.Seconds())
	fmt.Fprintf(w, "attempts:             %d (%.2f per operation)\n", rep.Attempts, perOp(rep.Attempts))
	fmt.Fprintf(w, "  answered, executed: %d\n", rep.Executed)
	fmt.Fprintf(w, "  answered, replayed: %d (an earlier attempt had committed)\n", rep.Replayed)
	var failed int64
	for _, n := range rep.Failures {
		failed += n
	}
	fmt.Fprintf(w, "  failed, retried:    %d\n", failed)
	kinds := make([]string, 0, len(rep.Failures))
	for kind := range rep.Failures {
		kinds = append(kinds, kind)
	}
	slices.SortFunc(kinds, func(a, b string) int {
		return cmp.Or(cmp.Compare(rep.Failures[b], rep.Failures[a]), strings.Compare(a, b))
	})
	for _, kind := range kinds {
		fmt.Fprintf(w, "    %-50s %d\n", kind+":", rep.Failures[kind])
		if r.cfg.Verbose {
			fmt.Fprintf(w, "      e.g. %s\n", r.samples[kind])
		}
	}
	fmt.Fprintf(w, "business writes run:  %d (%d rolled back by faults)\n", rep.Writes, rep.Writes-rep.Rows)
	fmt.Fprintf(w, "connections opened:   %d (through the proxy, cancel requests included)\n", rep.Connections)
	f := rep.Faults
	fmt.Fprintf(w, "faults injected:      %d\n", f.Terminated+f.TimedOut+f.CutBeforeCommit+f.CutAfterCommit+f.CutRandom+f.TerminatedInWrite+f.CutInWrite+f.Restarts)
	fmt.Fprintf(w, "  backends terminated in a transaction:         %d\n", f.Terminated)
	fmt.Fprintf(w, "  calls abandoned by a client timeout:          %d\n", f.TimedOut)
	fmt.Fprintf(w, "  connections cut before COMMIT reached server: %d\n", f.CutBeforeCommit)
	fmt.Fprintf(w, "  connections cut after COMMIT, before reply:   %d\n", f.CutAfterCommit)
	fmt.Fprintf(w, "  connections cut at a random moment:           %d\n", f.CutRandom)
	fmt.Fprintf(w, "  backends terminated inside a write:           %d\n", f.TerminatedInWrite)
	fmt.Fprintf(w, "  connections cut inside a write:               %d\n", f.CutInWrite)
	fmt.Fprintf(w, "  PostgreSQL restarts:                          %d\n", f.Restarts)
	fmt.Fprintf(w, "payments in the table: %d for %d logical operations (lost %d, doubled %d)\n",
		rep.Rows, rep.Operations, rep.Lost, rep.Doubled)
	fmt.Fprintf(w, "answers != stored:     %d (checked against the payment row and the stored response)\n", rep.WrongAnswers)
	fmt.Fprintf(w, "claims in progress:    %d\n", rep.Stranded)
}

// countErrors returns how many errs are set, and the first.
func countErrors(errs []error) (int, error) {
	var n int
	var first error
	for _, err := range errs {
		if err != nil {
			if first == nil {
				first = err
			}
			n++
		}
	}
	return n, first
}

// sleep waits for d or until ctx ends, and then returns ctx's error.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// randomSuffix makes the run's scope unique, so that runs never count each
// other's payments.
func randomSuffix() string {
	return fmt.Sprintf("%d-%08x", time.Now().Unix(), rand.Uint32())
}

// lockedWriter serializes writes from goroutines that report at once.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
