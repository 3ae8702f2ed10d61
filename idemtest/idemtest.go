// Package idemtest gives an application's tests PostgreSQL databases of
// their own, each with idem's migrations applied.
//
// What idem promises rests on the server: a unique constraint arbitrates
// each key, and the claim commits or rolls back with the application's own
// write. A test of code built on idem proves something only against a real
// PostgreSQL, so idemtest offers the one idem's own tests use: found or
// started by the same code, a fresh database for every test (tests run in
// parallel and share nothing), and nothing to set up on a developer's
// machine or in CI beyond a PostgreSQL installation, Docker, or
// TEST_DATABASE_URL.
//
// Call [Main] from the package's TestMain, and [Pool] in each test that
// needs a database:
//
//	func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }
//
//	func TestPayment(t *testing.T) {
//		t.Parallel()
//		pool := idemtest.Pool(t) // a database of this test's own
//		if err := migrateApp(t.Context(), pool); err != nil { // the application's own migrations
//			t.Fatal(err)
//		}
//		res, err := idem.Run(t.Context(), pool, "tenant-1", "key-1", nil, chargeCard)
//		...
//	}
//
// The server is, in this order:
//
//  1. the one TEST_DATABASE_URL names, when it is set: the tests create
//     their databases there and drop them again, so its role must be
//     allowed to create databases;
//  2. a postgres container started with testcontainers-go, where Docker
//     runs;
//  3. a throwaway server started from a PostgreSQL installation on the
//     machine (initdb and postgres on PATH or in the usual install
//     directories), in a temporary directory, listening on 127.0.0.1
//     only, as an unprivileged user when the tests run as root.
//
// When none of them works, Main fails the test binary before any test
// runs, saying what it tried and how to fix each: the tests never skip
// for want of a database. Only under -short does Pool skip its test, and
// Main says so once.
//
// When the tests end, Main stops the server it started and drops the
// databases left, also when the run is interrupted (SIGINT, SIGTERM).
//
// idemtest is part of idem's module and needs testcontainers-go, which
// idem's own tests need already: it adds nothing to what an application
// that uses idem, idemhttp and outbox downloads, and nothing to its
// binaries unless they import it.
package idemtest

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testserver"
)

// run is the state of the test binary that Main runs.
var run struct {
	mu      sync.Mutex
	started bool
	server  *testserver.Server
	// databases are those made by Pool and not yet dropped.
	databases map[string]bool
}

// Main runs the tests of m on a PostgreSQL server, found in the order the
// package documentation gives, and returns the exit code for os.Exit. Call
// it from TestMain, once. It fails (exit code 1, with a message on
// standard error that says what it tried) when it finds no server, before
// any test runs.
func Main(m *testing.M) int {
	run.mu.Lock()
	run.started = true
	run.mu.Unlock()
	return testserver.Run(m, testserver.Config{Prefix: "idemtest", Setup: setup})
}

func setup(_ context.Context, s *testserver.Server) (func(), error) {
	run.mu.Lock()
	defer run.mu.Unlock()
	run.server = s
	run.databases = map[string]bool{}
	// What the tests' cleanups did not drop: an interrupted run's.
	return func() {
		run.mu.Lock()
		defer run.mu.Unlock()
		for name := range run.databases {
			if err := s.DropDatabase(name); err != nil {
				fmt.Fprintf(os.Stderr, "idemtest: %v\n", err)
			}
		}
		run.databases = nil
	}, nil
}

// Pool creates a database for t alone, applies idem's migrations to it
// (see [idem.Migrate]), and returns a pool on it. The pool is closed and
// the database dropped when t and its subtests end, after t's own
// cleanups. pool.Config().ConnString() is the database's connection
// string, for code that connects by itself.
//
// Apply the application's own migrations to it in the test, or in a
// helper of the package's tests that calls Pool.
//
// Pool fails t when [Main] did not run, and skips it under -short.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	run.mu.Lock()
	started, s := run.started, run.server
	run.mu.Unlock()
	if !started {
		t.Fatal("idemtest: Pool needs idemtest.Main: add func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) } to the package's tests")
	}
	if testing.Short() {
		t.Skip("idemtest: -short: database tests are skipped")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	name := "idemtest_" + testserver.RandomHex(6)
	if err := s.CreateDatabase(ctx, name); err != nil {
		t.Fatalf("idemtest: on %s: %v", s.Desc, err)
	}
	run.mu.Lock()
	run.databases[name] = true
	run.mu.Unlock()
	// Cleanups run last first: the pool closes before its database drops.
	t.Cleanup(func() {
		if err := s.DropDatabase(name); err != nil {
			t.Errorf("idemtest: %v", err)
			return
		}
		run.mu.Lock()
		delete(run.databases, name)
		run.mu.Unlock()
	})

	pool, err := pgxpool.New(ctx, s.DatabaseURL(name))
	if err != nil {
		t.Fatalf("idemtest: %v", err)
	}
	t.Cleanup(pool.Close)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if err := idem.Migrate(ctx, db); err != nil {
		t.Fatalf("idemtest: %v", err)
	}
	return pool
}
