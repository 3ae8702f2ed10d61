package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/cli"
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

	// Failover, when set, runs the failover soak instead, on a primary and
	// a standby of its own, replicating in this mode: replicationSync or
	// replicationAsync. Payments is then the least number of payments.
	Failover string
	// Failovers is how many failovers the failover soak makes.
	Failovers int
	// Flows is the least number of flows (reserve, a call to a provider,
	// record) the failover soak runs beside its payments, from clients of
	// their own, counting the provider's charges per operation.
	Flows int

	// startupDelay makes every connection through the proxy that much
	// slower to start, as on a busy machine. Tests set it.
	startupDelay time.Duration
	// noFsync runs the failover soak's servers with fsync = off, to save
	// a loaded machine's disk. It changes nothing the soak checks: the
	// soak kills processes, not machines, and what a killed server wrote
	// survives it in the operating system's page cache, whether it was
	// fsynced or not (synchronous_commit still waits for the write, on
	// the primary and, with synchronous replication, on the standby).
	// Tests set it.
	noFsync bool
}

// defaultSoakConfig returns the configuration of "go run ./lab soak" without flags:
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
	case c.Failover != "" && c.Failover != replicationSync && c.Failover != replicationAsync:
		return fmt.Errorf("-failover must be %s or %s, got %q", replicationSync, replicationAsync, c.Failover)
	case c.Flows < 0 || c.Flows > maxSoakPayments:
		return fmt.Errorf("-flows must be between 0 and %d, got %d", maxSoakPayments, c.Flows)
	case c.Flows > 0 && c.Failover == "":
		return errors.New("-flows is for the failover soak (-failover sync|async); the flows' own soak is flowsoak")
	case c.Failover != "" && (c.Failovers < 1 || c.Failovers > maxFailovers):
		return fmt.Errorf("-failovers must be between 1 and %d, got %d", maxFailovers, c.Failovers)
	case c.Failover != "" && (c.TerminateEvery > 0 || c.CutEvery > 0 || c.TerminateEveryWrites > 0 || c.CutEveryWrites > 0 ||
		c.CutBeforeCommit > 0 || c.CutAfterCommit > 0 || c.RestartCommand != "" || c.Duration > 0):
		return errors.New("-failover's faults are the failovers (and -timeout-rate): the other faults, -restart and -duration do not apply to it")
	}
	return errors.Join(chance("-cut-before-commit", c.CutBeforeCommit),
		chance("-cut-after-commit", c.CutAfterCommit), chance("-timeout-rate", c.TimeoutRate))
}

func runSoak(ctx context.Context, args []string, stdout io.Writer) error {
	cfg := defaultSoakConfig()
	fs := program.NewFlagSet(stdout, "soak", `soak [flags]

Makes many payments while injecting faults, then checks that none was lost
or doubled. Like demo, it runs in a database (or schema, or server) of its
own, removed at the end.

-terminate-every and -cut-every pace their faults by the clock, so a slower
machine meets more of them per payment (each waits for an attempt to be
answered before the next). -terminate-every-writes and -cut-every-writes
pace theirs by the payments' writes, whatever the machine's speed: set the
clock-paced ones to 0 and use these where that speed is unknown, as in CI.

-failover sync|async runs the failover soak instead: it starts a primary
and a streaming standby of its own from a local PostgreSQL installation
(DATABASE_URL and PG* are not used), replicating synchronously or not,
and makes at least -payments payments through a connection string naming
both (target_session_attrs=read-write) while it kills the primary,
promotes the standby and rebuilds the old primary as the new standby,
-failovers times, each after a number of answers. Each payment enqueues a
receipt, which a relay delivers to a consumer using idem.Once. Beside the
payments, at least -flows flows (reserve locally, charge at a provider
that honours idempotency keys, record locally) run through the same
failovers. It checks, per payment, its effect, its record, its receipt,
and whether the answer the client got is the one finally stored, and per
flow, the provider's charges; with async it counts the answered payments
and flows that a failover lost. Its only other fault is
-timeout-rate, off by default; the other faults' flags do not apply.`)
	fs.IntVar(&cfg.Payments, "payments", cfg.Payments, fmt.Sprintf("logical payments to make (at most %d; with -failover, at least, and %d by default)", maxSoakPayments, defaultFailoverPayments))
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
	fs.StringVar(&cfg.Failover, "failover", cfg.Failover, "run the failover soak, with `sync` or async replication, on servers of its own")
	fs.IntVar(&cfg.Failovers, "failovers", defaultFailovers, fmt.Sprintf("failovers the failover soak makes (at most %d)", maxFailovers))
	fs.IntVar(&cfg.Flows, "flows", cfg.Flows, fmt.Sprintf("with -failover: the least number of flows (reserve, a call to a provider that honours keys, record) run beside the payments (%d by default)", defaultFailoverFlows))
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if cfg.Failover != "" {
		// The failover soak's own defaults, for the flags not given.
		set := make(map[string]bool)
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		failoverDefaults(&cfg, set)
	}
	if err := cfg.validate(); err != nil {
		return cli.UsageError{Err: err}
	}
	if cfg.Failover != "" {
		_, err := failoverSoak(ctx, cfg, stdout)
		return err
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
	// longestLate is how long after its deadline the latest attempt
	// returned, in nanoseconds.
	longestLate atomic.Int64

	// Hooks of the failover soak, nil otherwise. afterWrite runs in a
	// payment's transaction after its write; onAnswer is called when
	// payment i is answered; keepPaying, while it returns true, has the
	// clients start payments past cfg.Payments; beforeStart may hold a
	// client back before it starts a payment.
	afterWrite  func(ctx context.Context, tx pgx.Tx, p soakPayment) error
	onAnswer    func(i int)
	keepPaying  func() bool
	beforeStart func(ctx context.Context) bool

	mu       sync.Mutex
	failures map[string]int64
	samples  map[string]string
}

// soak runs a soak and returns what it found. The error is nil only when
// every payment was answered, applied exactly once, and answered with what
// was stored.
func soak(ctx context.Context, cfg soakConfig, stdout io.Writer) (*soakReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, cli.UsageError{Err: err}
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
		return nil, cli.DatabaseError{Err: err}
	}
	for _, ddl := range []string{soakSchema, soakIndex} {
		if _, err := admin.Exec(ctx, ddl); err != nil {
			return nil, cli.DatabaseError{Err: fmt.Errorf("create soak table: %w", err)}
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
	proxy, err := newChaosProxy(adminConn.Host, adminConn.Port, cfg.CutBeforeCommit, cfg.CutAfterCommit, cfg.startupDelay)
	if err != nil {
		return nil, err
	}
	defer proxy.Close()
	run.proxy = proxy
	run.pool, err = proxiedPool(ctx, admin, proxy.Addr().Port, appName, cfg.Clients)
	if err != nil {
		return nil, err
	}
	defer run.pool.Close()

	if cfg.Duration > 0 {
		fmt.Fprintf(stdout, "idem soak: up to %d payments for %s from %d clients, scope %s\n", cfg.Payments, cfg.Duration, cfg.Clients, run.scope)
	} else {
		fmt.Fprintf(stdout, "idem soak: %d payments from %d clients, scope %s\n", cfg.Payments, cfg.Clients, run.scope)
	}
	fmt.Fprintf(stdout, "  through a cutting proxy on %s\n", proxy.Addr())
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
		Connections: proxy.Accepted(),
		Elapsed:     elapsed,
		LongestLate: time.Duration(run.longestLate.Load()),
	}
	if err := waitForServer(ctx, admin); err != nil {
		return rep, cli.DatabaseError{Err: fmt.Errorf("the server did not come back for the final check: %w", err)}
	}
	if err := run.check(ctx, admin, answers, errs, rep); err != nil {
		return rep, cli.DatabaseError{Err: err}
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
		return nil, cli.DatabaseError{Err: fmt.Errorf("open pool through the proxy: %w", err)}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, cli.DatabaseError{Err: fmt.Errorf("connect through the proxy (the soak needs a server that accepts connections without TLS): %w", err)}
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

// failoverDefaults sets the fields of the flags not given (set) to the
// failover soak's defaults: its payments, and none of the other soak's
// faults.
func failoverDefaults(cfg *soakConfig, set map[string]bool) {
	if !set["payments"] {
		cfg.Payments = defaultFailoverPayments
	}
	if !set["flows"] {
		cfg.Flows = defaultFailoverFlows
	}
	for name, field := range map[string]*time.Duration{"terminate-every": &cfg.TerminateEvery, "cut-every": &cfg.CutEvery} {
		if !set[name] {
			*field = 0
		}
	}
	for name, field := range map[string]*float64{"cut-before-commit": &cfg.CutBeforeCommit, "cut-after-commit": &cfg.CutAfterCommit, "timeout-rate": &cfg.TimeoutRate} {
		if !set[name] {
			*field = 0
		}
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
