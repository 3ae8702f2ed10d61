package main

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"os"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/pgtemp"
)

// The failover soak's servers: a throwaway primary and a streaming standby
// of it, which the soak kills, promotes and rebuilds, each server keeping
// its port, so that one multi-host connection string reaches whichever is
// the primary.

// Replication modes of the failover soak.
const (
	// replicationSync commits wait for the standby to flush the commit
	// (synchronous_standby_names = '*', synchronous_commit = on).
	replicationSync = "sync"
	// replicationAsync commits do not wait for the standby.
	replicationAsync = "async"
)

// The settings that turn synchronous replication on and off. ALTER SYSTEM
// takes no parameters; these are constants.
const (
	syncOn  = `ALTER SYSTEM SET synchronous_standby_names = '*'`
	syncOff = `ALTER SYSTEM SET synchronous_standby_names = ''`
	// fsyncOff is for tests: see soakConfig.noFsync.
	fsyncOff = `ALTER SYSTEM SET fsync = off`
)

// clusterMaxConnections is each server's max_connections: the soak's
// pools, the relay's, and the checks, with room to spare.
const clusterMaxConnections = 150

// clusterWaitTimeout bounds each wait for a server's state: a promotion,
// a standby that starts streaming or becomes synchronous.
const clusterWaitTimeout = 2 * time.Minute

// cluster is a primary and its standby.
type cluster struct {
	mode string
	// nodes are the two servers; primary is the index of the primary.
	nodes   [2]*pgtemp.Server
	primary int
	// password is the postgres role's, the same on both.
	password string
}

// failover is what one failover did, and how long each step took from
// the kill.
type failover struct {
	// Way is how the primary was stopped.
	Way string
	// From and To are the ports of the old and the new primary.
	From, To int
	// AnsweredBefore is the number of payments answered when the primary
	// was killed.
	AnsweredBefore int64
	// Killed is when the primary was killed.
	Killed time.Time
	// Promoted is how long after the kill the standby was promoted;
	// Answering, how long until the clients' first answer after it.
	Promoted, Answering time.Duration
	// Streaming is how long until the old primary, rebuilt as a standby
	// of the new, streamed from it; Synchronous, until it was the
	// synchronous standby (sync mode).
	Streaming, Synchronous time.Duration

	// LostBefore and LostAfter count the answered payments this failover
	// lost (those answered nearest to its kill): answered before the kill,
	// and after it, by a backend of the killed postmaster that was still
	// running. LostBeforeMax and LostAfterMax are the longest time between
	// such an answer and the kill.
	LostBefore, LostAfter       int
	LostBeforeMax, LostAfterMax time.Duration
}

// startCluster starts a primary and a standby of it, replicating in mode,
// and waits until the standby streams (and, in sync mode, is synchronous).
// With noFsync the servers run with fsync = off, which their standbys
// inherit (see soakConfig.noFsync).
func startCluster(ctx context.Context, mode string, noFsync bool) (*cluster, error) {
	c := &cluster{mode: mode}
	primary, err := pgtemp.Start(ctx, pgtemp.Config{MaxConnections: clusterMaxConnections})
	if err != nil {
		return nil, err
	}
	c.nodes[0] = primary
	u, err := neturl.Parse(primary.URL)
	if err != nil {
		c.close()
		return nil, err
	}
	c.password, _ = u.User.Password()
	if noFsync {
		// In postgresql.auto.conf, which base backups copy.
		if err := c.set(ctx, fsyncOff); err != nil {
			c.close()
			return nil, err
		}
	}
	standby, err := pgtemp.Start(ctx, pgtemp.Config{MaxConnections: clusterMaxConnections, StandbyOf: primary})
	if err != nil {
		c.close()
		return nil, fmt.Errorf("start a standby: %w", err)
	}
	c.nodes[1] = standby
	if _, _, err := c.settle(ctx); err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

// url returns the connection string of database on the cluster: both
// servers, the one that accepts writes chosen at each connection, each
// tried for at most two seconds.
func (c *cluster) url() string {
	u := neturl.URL{
		Scheme:   "postgres",
		User:     neturl.UserPassword("postgres", c.password),
		Host:     fmt.Sprintf("127.0.0.1:%d,127.0.0.1:%d", c.nodes[0].Port, c.nodes[1].Port),
		Path:     "/postgres",
		RawQuery: "sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
	}
	return u.String()
}

// describe says what the cluster is, for the soak's first lines.
func (c *cluster) describe() string {
	p, s := c.nodes[c.primary], c.nodes[1-c.primary]
	replication := "asynchronous replication"
	if c.mode == replicationSync {
		replication = "synchronous replication (synchronous_standby_names = '*', synchronous_commit = on)"
	}
	return fmt.Sprintf("a throwaway PostgreSQL %s primary on 127.0.0.1:%d and a streaming standby on 127.0.0.1:%d (%s, as %s), %s",
		p.Version, p.Port, s.Port, p.BinDir, p.User, replication)
}

// failover kills the primary with sig, promotes the standby, rebuilds the
// old primary as a standby of the new one from a base backup, on its port,
// and waits until it streams (in sync mode: until it is synchronous). In
// sync mode the new primary runs without a synchronous standby from its
// promotion until its new standby streams: commits then wait for no
// standby, as a cluster manager's non-strict synchronous mode does, rather
// than for one that does not exist yet. promoted is called once the
// standby is promoted.
func (c *cluster) failover(ctx context.Context, sig os.Signal, f *failover, promoted func()) error {
	old, next := c.primary, 1-c.primary
	f.Way = wayName(sig)
	f.From, f.To = c.nodes[old].Port, c.nodes[next].Port
	f.Killed = time.Now()
	if err := c.nodes[old].Kill(sig); err != nil {
		return err
	}
	if err := c.promote(ctx, c.nodes[next]); err != nil {
		return err
	}
	c.primary = next
	f.Promoted = time.Since(f.Killed)
	promoted()
	if c.mode == replicationSync {
		if err := c.set(ctx, syncOff); err != nil {
			return err
		}
	}

	port := c.nodes[old].Port
	if err := c.nodes[old].Stop(); err != nil {
		return fmt.Errorf("remove the old primary: %w", err)
	}
	rebuilt, err := pgtemp.Start(ctx, pgtemp.Config{MaxConnections: clusterMaxConnections, StandbyOf: c.nodes[next], Port: port})
	if err != nil {
		// Stop, in close, leaves a server already stopped as it is.
		return fmt.Errorf("rebuild the old primary as a standby: %w", err)
	}
	c.nodes[old] = rebuilt
	streaming, synchronous, err := c.settle(ctx)
	f.Streaming = streaming.Sub(f.Killed)
	if c.mode == replicationSync {
		f.Synchronous = synchronous.Sub(f.Killed)
	}
	return err
}

// wayName names how a signal stops the primary.
func wayName(sig os.Signal) string {
	switch sig {
	case syscall.SIGKILL:
		return "SIGKILL of the postmaster"
	case syscall.SIGQUIT:
		return "immediate shutdown"
	}
	return sig.String()
}

// promote promotes a standby and waits until it accepts writes.
func (c *cluster) promote(ctx context.Context, standby *pgtemp.Server) error {
	return c.on(ctx, standby, func(ctx context.Context, conn *pgx.Conn) error {
		var ok bool
		if err := conn.QueryRow(ctx, `SELECT pg_promote(true, 60)`).Scan(&ok); err != nil {
			return fmt.Errorf("promote the standby on port %d: %w", standby.Port, err)
		}
		if !ok {
			return fmt.Errorf("the standby on port %d was not promoted within 60s", standby.Port)
		}
		return nil
	})
}

// settle waits until the primary has a streaming standby, and returns
// when it had; in sync mode it then makes that standby synchronous and
// returns when it was.
func (c *cluster) settle(ctx context.Context) (streaming, synchronous time.Time, err error) {
	if err := c.waitFor(ctx, `SELECT count(*) > 0 FROM pg_stat_replication WHERE state = 'streaming'`, "a streaming standby"); err != nil {
		return time.Time{}, time.Time{}, err
	}
	streaming = time.Now()
	if c.mode != replicationSync {
		return streaming, time.Time{}, nil
	}
	if err := c.set(ctx, syncOn); err != nil {
		return streaming, time.Time{}, err
	}
	if err := c.waitFor(ctx, `SELECT count(*) > 0 FROM pg_stat_replication WHERE sync_state = 'sync'`, "a synchronous standby"); err != nil {
		return streaming, time.Time{}, err
	}
	return streaming, time.Now(), nil
}

// set runs one of the ALTER SYSTEM statements above on the primary, and
// has it read its configuration again.
func (c *cluster) set(ctx context.Context, stmt string) error {
	return c.on(ctx, c.nodes[c.primary], func(ctx context.Context, conn *pgx.Conn) error {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("%s: %w", stmt, err)
		}
		_, err := conn.Exec(ctx, `SELECT pg_reload_conf()`)
		return err
	})
}

// waitFor polls the primary until query, which returns a boolean, is true.
func (c *cluster) waitFor(ctx context.Context, query, what string) error {
	ctx, cancel := context.WithTimeout(ctx, clusterWaitTimeout)
	defer cancel()
	return c.on(ctx, c.nodes[c.primary], func(ctx context.Context, conn *pgx.Conn) error {
		for {
			var ok bool
			err := conn.QueryRow(ctx, query).Scan(&ok)
			if err == nil && ok {
				return nil
			}
			if err != nil || sleep(ctx, 20*time.Millisecond) != nil {
				return fmt.Errorf("the primary on port %d has no %s: %w", c.nodes[c.primary].Port, what, errors.Join(err, ctx.Err()))
			}
		}
	})
}

// on runs fn on a connection of its own to one server.
func (c *cluster) on(ctx context.Context, srv *pgtemp.Server, fn func(ctx context.Context, conn *pgx.Conn) error) error {
	conn, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return fmt.Errorf("connect to the server on port %d: %w", srv.Port, err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	return fn(ctx, conn)
}

// close stops both servers and removes their directories.
func (c *cluster) close() error {
	var errs []error
	for _, srv := range c.nodes {
		if srv != nil {
			errs = append(errs, srv.Stop())
		}
	}
	return errors.Join(errs...)
}
