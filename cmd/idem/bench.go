package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/cmd/idem/internal/bench"
)

func runBench(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet(stdout, "bench", `bench [flags]

Measures idem.Run against a bare transaction and other designs, side by
side and interleaved. Like demo, it runs in a database (or schema, or
server) of its own, removed at the end.`)
	clientList := fs.String("clients", "1,8,32", "comma-separated client counts to measure at")
	rounds := fs.Int("rounds", 5, "interleaved rounds of every phase")
	ops := fs.Int("ops", 300, "operations per phase per round")
	stormKeys := fs.Int("storm-keys", 50, "keys each sent by 4 clients at once, to count what each design lets through")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	var clients []int
	for _, f := range strings.Split(*clientList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return usageError{fmt.Errorf("-clients: %q is not a positive number", f)}
		}
		clients = append(clients, n)
	}
	if *rounds < 1 || *ops < 1 || *stormKeys < 0 {
		return usageError{errors.New("-rounds and -ops must be at least 1, -storm-keys at least 0")}
	}
	maxClients := 0
	for _, c := range clients {
		maxClients = max(maxClients, c)
	}
	sc, err := openScratch(ctx, stdout, "bench")
	if err != nil {
		return err
	}
	defer sc.Close()
	pool, err := connectTo(ctx, sc.URL, int32(maxClients+4))
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := idem.Migrate(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		return databaseError{err}
	}
	if err := bench.CreateSchema(ctx, pool); err != nil {
		return databaseError{err}
	}
	var version string
	if err := pool.QueryRow(ctx, `SELECT version()`).Scan(&version); err != nil {
		return databaseError{err}
	}
	fmt.Fprintf(stdout, "idem bench: %d rounds x %d ops per phase, interleaved; %d CPUs; %s\n",
		*rounds, *ops, runtime.NumCPU(), version)

	scope := fmt.Sprintf("bench-%d", time.Now().UnixNano())
	phases := bench.StandardPhases(pool, scope)
	designs := bench.Designs(pool, scope)
	phases = append(phases, bench.DesignPhases(designs[1:])...)
	// Warm every statement cache and give the replay phases keys to replay.
	if _, err := bench.Interleave(ctx, phases, 4, 1, 100); err != nil {
		return err
	}
	for _, c := range clients {
		totals, err := bench.Interleave(ctx, phases, c, *rounds, int64(*ops))
		if err != nil {
			return err
		}
		bare := totals["bare"].Throughput()
		fmt.Fprintf(stdout, "\n%d client(s)\n", c)
		w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(w, "phase\ttx/s\tp50\tp99\tvs bare\t")
		for _, p := range phases {
			s := totals[p.Name]
			fmt.Fprintf(w, "%s\t%.0f\t%s\t%s\t%.2fx\t\n", p.Name, s.Throughput(),
				s.Percentile(0.50).Round(time.Microsecond), s.Percentile(0.99).Round(time.Microsecond), s.Throughput()/bare)
		}
		w.Flush()
	}

	if *stormKeys > 0 {
		fmt.Fprintf(stdout, "\nconcurrent duplicates: %d keys, each sent by 4 clients at once\n", *stormKeys)
		w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(w, "design\tdoubled effects\trejected calls\t")
		for _, d := range designs {
			r, err := bench.Storm(ctx, pool, scope, d, *stormKeys, 4)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "%s\t%d\t%d\t\n", d.Name, r.Duplicates, r.Rejected)
		}
		w.Flush()
	}
	return nil
}
