package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/cmd/idem/cli"
)

// connect opens a pool on DATABASE_URL, or on the PG* variables when it is
// unset, after saying on stdout what it connects to, and checks that the
// server answers. It is for the operator commands, which act on the
// database they are given.
func connect(ctx context.Context, stdout io.Writer, command string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := cli.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(stdout, "idem %s: %s\n", command, cli.Where(cfg.ConnConfig))
	return cli.OpenPool(ctx, cfg, maxConns)
}
