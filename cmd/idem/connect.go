package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// where describes a connection's target: database, host and user.
func where(cc *pgx.ConnConfig) string {
	host := cc.Host
	if strings.HasPrefix(host, "/") {
		host = fmt.Sprintf("socket %s/.s.PGSQL.%d", host, cc.Port)
	} else {
		host = net.JoinHostPort(host, fmt.Sprint(cc.Port))
	}
	return fmt.Sprintf("database %q on %s as %q", cc.Database, host, cc.User)
}

// parseConfig parses a connection string, which may be empty: the PG*
// variables fill in what it does not say.
func parseConfig(connString string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		if connString == os.Getenv("DATABASE_URL") && connString != "" {
			return nil, usageError{fmt.Errorf("parse DATABASE_URL: %w", err)}
		}
		return nil, usageError{fmt.Errorf("parse the connection settings: %w", err)}
	}
	return cfg, nil
}

// connect opens a pool on DATABASE_URL, or on the PG* variables when it is
// unset, after saying on stdout what it connects to, and checks that the
// server answers. It is for the operator commands, which act on the
// database they are given.
func connect(ctx context.Context, stdout io.Writer, command string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := parseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(stdout, "idem %s: %s\n", command, where(cfg.ConnConfig))
	return openPool(ctx, cfg, maxConns)
}

func openPool(ctx context.Context, cfg *pgxpool.Config, maxConns int32) (*pgxpool.Pool, error) {
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, databaseError{err}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, databaseError{connectError(cfg.ConnConfig, err)}
	}
	return pool, nil
}

// connectError says in one line why a connection failed: the server's own
// answer when it gave one (a wrong password is not an unreachable server),
// once, though the driver may have tried several addresses and TLS modes.
func connectError(cc *pgx.ConnConfig, err error) error {
	target := where(cc)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		answer := fmt.Sprintf("%s: %s (SQLSTATE %s)", pgErr.Severity, pgErr.Message, pgErr.Code)
		switch {
		case strings.HasPrefix(pgErr.Code, "28"):
			return fmt.Errorf("the server refused the credentials for %s: %s; check the user and password in DATABASE_URL or PGUSER/PGPASSWORD", target, answer)
		case pgErr.Code == "3D000":
			return fmt.Errorf("no %s: %s", target, answer)
		default:
			return fmt.Errorf("the server refused the connection to %s: %s", target, answer)
		}
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) {
		return fmt.Errorf("cannot reach the server for %s (set DATABASE_URL or PG* variables): %v", target, opErr)
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return fmt.Errorf("no answer from the server for %s: %w", target, err)
	}
	return fmt.Errorf("cannot connect to %s: %w", target, err)
}
