//go:build unix

// Package citustemp starts a throwaway Citus cluster on this machine: a
// coordinator and workers, each a [pgtemp] server loading the citus
// extension from the PostgreSQL installation pgtemp finds, on 127.0.0.1
// only, stopped and removed by Stop. It is for the tests of idem on Citus
// (go test -tags citus, see .ci/citus and docs/large-deployments.md); the
// installation must hold Citus (its citus.so and extension files).
package citustemp

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/pgtemp"
)

// Cluster is a running coordinator and its workers.
type Cluster struct {
	Coordinator *pgtemp.Server
	Workers     []*pgtemp.Server

	// password is every node's postgres password (the coordinator's):
	// the nodes connect to one another with it (pg_dist_authinfo).
	password string
}

// Config configures Start.
type Config struct {
	// Workers is the number of workers. Defaults to 2.
	Workers int
	// ShardCount is citus.shard_count, the number of shards a table
	// distributed without a count of its own gets. Defaults to 8 (Citus's
	// own default, 32, makes each table's creation slow on a small
	// machine).
	ShardCount int
	// Fast turns off durability on every node, as pgtemp.Config.Fast.
	Fast bool
	// Settings are server settings (name to value) of every node, after
	// the cluster's own, which they override: synchronous_commit=on, say,
	// for a Fast cluster whose nodes are stopped the hard way and
	// restarted (RestartWorker, RestartCoordinator), whose commits must
	// outlive the crash. Defaults to none.
	Settings map[string]string
}

// Start starts the nodes, one after the other. The cluster must be
// stopped with Stop, which removes it.
func Start(ctx context.Context, cfg Config) (_ *Cluster, err error) {
	if cfg.Workers < 0 || cfg.ShardCount < 0 {
		return nil, errors.New("citustemp: Config.Workers and Config.ShardCount must not be negative")
	}
	if cfg.Workers == 0 {
		cfg.Workers = 2
	}
	if cfg.ShardCount == 0 {
		cfg.ShardCount = 8
	}
	settings := map[string]string{
		"shared_preload_libraries": "citus",
		"citus.shard_count":        strconv.Itoa(cfg.ShardCount),
		// The nodes talk over 127.0.0.1 without TLS (libpq would look for
		// client certificates in a home the server's user may not read).
		"citus.node_conninfo": "sslmode=disable",
		// One machine: the nodes need not tell one another their stats.
		"citus.enable_statistics_collection": "off",
	}
	maps.Copy(settings, cfg.Settings)
	c := &Cluster{}
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()
	c.Coordinator, err = pgtemp.Start(ctx, pgtemp.Config{Fast: cfg.Fast, MaxConnections: 200, Settings: settings})
	if err != nil {
		return nil, fmt.Errorf("citustemp: coordinator: %w", err)
	}
	pc, err := pgx.ParseConfig(c.Coordinator.URL)
	if err != nil {
		return nil, err
	}
	c.password = pc.Password
	for i := range cfg.Workers {
		w, err := pgtemp.Start(ctx, pgtemp.Config{Fast: cfg.Fast, MaxConnections: 200, Settings: settings})
		if err != nil {
			return nil, fmt.Errorf("citustemp: worker %d: %w", i+1, err)
		}
		c.Workers = append(c.Workers, w)
		// The worker takes the coordinator's password, for the URLs below
		// and the nodes' connections to one another.
		if err := exec(ctx, w.URL, `SELECT format('ALTER ROLE postgres PASSWORD %L', $1::text)`, c.password); err != nil {
			return nil, fmt.Errorf("citustemp: worker %d: %w", i+1, err)
		}
	}
	return c, nil
}

// URL is the connection string of database db on the coordinator.
func (c *Cluster) URL(db string) string { return nodeURL(c.Coordinator, c.password, db) }

// WorkerURL is the connection string of database db on worker i (from 0).
func (c *Cluster) WorkerURL(i int, db string) string { return nodeURL(c.Workers[i], c.password, db) }

func nodeURL(s *pgtemp.Server, password, db string) string {
	return fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d/%s?sslmode=disable", password, s.Port, db)
}

// CreateDatabase creates database db on every node (Citus does not
// propagate CREATE DATABASE), with the citus extension in each, and makes
// the workers the coordinator's for it, as Citus's documentation has a
// cluster set up: the cluster's metadata lives in each database.
func (c *Cluster) CreateDatabase(ctx context.Context, db string) error {
	nodes := append([]*pgtemp.Server{c.Coordinator}, c.Workers...)
	for _, n := range nodes {
		if err := exec(ctx, nodeURL(n, c.password, "postgres"), `SELECT format('CREATE DATABASE %I', $1::text)`, db); err != nil {
			return fmt.Errorf("citustemp: create database %s on port %d: %w", db, n.Port, err)
		}
		url := nodeURL(n, c.password, db)
		if err := execPlain(ctx, url, `CREATE EXTENSION citus`); err != nil {
			return fmt.Errorf("citustemp: create extension on port %d: %w", n.Port, err)
		}
		// Nodes connect to one another as postgres with its password.
		if err := exec(ctx, url, `SELECT format('INSERT INTO pg_dist_authinfo (nodeid, rolename, authinfo) VALUES (0, %L, %L)', 'postgres', 'password=' || $1::text)`, c.password); err != nil {
			return fmt.Errorf("citustemp: authinfo on port %d: %w", n.Port, err)
		}
	}
	url := c.URL(db)
	if err := execPlain(ctx, url, `SELECT citus_set_coordinator_host('127.0.0.1', `+strconv.Itoa(c.Coordinator.Port)+`)`); err != nil {
		return fmt.Errorf("citustemp: set coordinator: %w", err)
	}
	for _, w := range c.Workers {
		if err := execPlain(ctx, url, `SELECT citus_add_node('127.0.0.1', `+strconv.Itoa(w.Port)+`)`); err != nil {
			return fmt.Errorf("citustemp: add worker on port %d: %w", w.Port, err)
		}
	}
	return nil
}

// DropDatabase drops database db on every node, closing its connections.
func (c *Cluster) DropDatabase(ctx context.Context, db string) error {
	var errs []error
	for _, n := range append([]*pgtemp.Server{c.Coordinator}, c.Workers...) {
		err := exec(ctx, nodeURL(n, c.password, "postgres"), `SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', $1::text)`, db)
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// RestartWorker starts worker i (from 0) again, on its data directory and
// port, once the test stopped it with Kill (syscall.SIGQUIT: an immediate
// stop, which a restart recovers from as from a crash): see
// pgtemp.Server.Restart. The cluster's metadata and connection strings
// name the same node.
func (c *Cluster) RestartWorker(ctx context.Context, i int) error {
	if err := c.Workers[i].Restart(ctx); err != nil {
		return fmt.Errorf("citustemp: worker %d: %w", i+1, err)
	}
	return nil
}

// RestartCoordinator starts the coordinator again once the test stopped
// it with Kill, as RestartWorker does a worker.
func (c *Cluster) RestartCoordinator(ctx context.Context) error {
	if err := c.Coordinator.Restart(ctx); err != nil {
		return fmt.Errorf("citustemp: coordinator: %w", err)
	}
	return nil
}

// Stop stops every node and removes it.
func (c *Cluster) Stop() error {
	var errs []error
	for _, w := range c.Workers {
		errs = append(errs, w.Stop())
	}
	if c.Coordinator != nil {
		errs = append(errs, c.Coordinator.Stop())
	}
	return errors.Join(errs...)
}

// exec runs the statement that query, given args, returns as text: a
// statement that takes no parameters (CREATE DATABASE, ALTER ROLE), with
// its names and literals quoted by format.
func exec(ctx context.Context, url, query string, args ...any) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var stmt string
	if err := conn.QueryRow(ctx, query, args...).Scan(&stmt); err != nil {
		return err
	}
	_, err = conn.Exec(ctx, stmt)
	return err
}

// execPlain runs a statement built from this package's own values.
func execPlain(ctx context.Context, url, stmt string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, stmt)
	return err
}
