package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Where describes a connection's target: database, host and user.
func Where(cc *pgx.ConnConfig) string {
	host := cc.Host
	if strings.HasPrefix(host, "/") {
		host = fmt.Sprintf("socket %s/.s.PGSQL.%d", host, cc.Port)
	} else {
		host = net.JoinHostPort(host, fmt.Sprint(cc.Port))
	}
	return fmt.Sprintf("database %q on %s as %q", cc.Database, host, cc.User)
}

// ParseConfig parses a connection string, which may be empty: the PG*
// variables fill in what it does not say. A string that does not parse is
// a UsageError.
func ParseConfig(connString string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		if connString == os.Getenv("DATABASE_URL") && connString != "" {
			return nil, UsageError{Err: fmt.Errorf("parse DATABASE_URL: %w", err)}
		}
		return nil, UsageError{Err: fmt.Errorf("parse the connection settings: %w", err)}
	}
	return cfg, nil
}

// OpenPool opens a pool on cfg, of at most maxConns connections when
// maxConns is positive (else pgxpool's default), and checks that the server
// answers. A server that does not is a DatabaseError that says why, as
// ConnectError does.
func OpenPool(ctx context.Context, cfg *pgxpool.Config, maxConns int32) (*pgxpool.Pool, error) {
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, DatabaseError{Err: err}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, DatabaseError{Err: ConnectError(cfg.ConnConfig, err)}
	}
	return pool, nil
}

// ConnectError says in one line why a connection failed: the server's own
// answer when it gave one (a wrong password is not an unreachable server),
// once, though the driver may have tried several addresses and TLS modes.
func ConnectError(cc *pgx.ConnConfig, err error) error {
	target := Where(cc)
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
