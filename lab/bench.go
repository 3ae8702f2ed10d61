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
	"github.com/pgidem/idem/cmd/idem/cli"
	"github.com/pgidem/idem/lab/bench"
)

func runBench(ctx context.Context, args []string, stdout io.Writer) error {
	fs := program.NewFlagSet(stdout, "bench", `bench [flags]

Measures idem.Run and idem.Do against a bare transaction, the key-row-only
floor and other designs, side by side and interleaved, with each phase's
heap allocations per operation. -delay adds a round trip between the pool
and the server, through a proxy on 127.0.0.1, as a network would. Like
demo, it runs in a database (or schema, or server) of its own, removed at
the end.

The first execution against bare and against the floor at 32 clients with
a 1 ms round trip, in one line:

  go run ./lab bench -delay 1ms -clients 32 -storm-keys 0`)
	clientList := fs.String("clients", "1,8,32", "comma-separated client counts to measure at")
	rounds := fs.Int("rounds", 5, "interleaved rounds of every phase")
	ops := fs.Int("ops", 300, "operations per phase per round")
	stormKeys := fs.Int("storm-keys", 50, "keys each sent by 4 clients at once, to count what each design lets through")
	delay := fs.Duration("delay", 0, "round trip to add between the pool and the server (a proxy on 127.0.0.1 holds what the server sends this long), e.g. 1ms")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	var clients []int
	for _, f := range strings.Split(*clientList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return cli.UsageError{Err: fmt.Errorf("-clients: %q is not a positive number", f)}
		}
		clients = append(clients, n)
	}
	if *rounds < 1 || *ops < 1 || *stormKeys < 0 || *delay < 0 {
		return cli.UsageError{Err: errors.New("-rounds and -ops must be at least 1, -storm-keys and -delay at least 0")}
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
		return cli.DatabaseError{Err: err}
	}
	if err := bench.CreateSchema(ctx, pool); err != nil {
		return cli.DatabaseError{Err: err}
	}
	var version string
	if err := pool.QueryRow(ctx, `SELECT version()`).Scan(&version); err != nil {
		return cli.DatabaseError{Err: err}
	}
	fmt.Fprintf(stdout, "idem bench: %d rounds x %d ops per phase, interleaved; %d CPUs; %s\n",
		*rounds, *ops, runtime.NumCPU(), version)
	var meter bench.Meter
	direct, err := bench.PingTime(ctx, pool, 50)
	if err != nil {
		return cli.DatabaseError{Err: err}
	}
	if *delay > 0 {
		delayed, proxy, err := bench.DelayedPool(ctx, pool.Config(), *delay, int32(maxClients+4))
		if err != nil {
			return cli.DatabaseError{Err: err}
		}
		defer proxy.Close()
		defer delayed.Close()
		through, err := bench.PingTime(ctx, delayed, 50)
		if err != nil {
			return cli.DatabaseError{Err: err}
		}
		fmt.Fprintf(stdout, "round trip: %v added by a proxy on %s; median ping %v direct, %v through it\n",
			*delay, proxy.Addr(), direct.Round(time.Microsecond), through.Round(time.Microsecond))
		pool = delayed
		meter.RoundTrips = proxy.RoundTrips
	} else {
		fmt.Fprintf(stdout, "round trip: as the server is reached; median ping %v\n", direct.Round(time.Microsecond))
	}

	scope := fmt.Sprintf("bench-%d", time.Now().UnixNano())
	phases := bench.StandardPhases(pool, scope)
	designs := bench.Designs(pool, scope)
	phases = append(phases, bench.DesignPhases(designs[1:])...)
	// Open every connection the largest count uses, warm every statement
	// cache on each, and give the replay phases keys to replay.
	if _, err := meter.Interleave(ctx, phases, maxClients, 1, int64(max(100, 4*maxClients))); err != nil {
		return err
	}
	for _, c := range clients {
		// The pool pings a connection idle for over a second before it
		// hands it out: after a smaller count, that would be a round trip
		// more for the first phase only, so warm up untimed.
		if _, err := meter.Interleave(ctx, phases, c, 1, int64(2*c)); err != nil {
			return err
		}
		totals, err := meter.Interleave(ctx, phases, c, *rounds, int64(*ops))
		if err != nil {
			return err
		}
		printTotals(stdout, c, phases, totals)
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

// printTotals prints one client count's table: each phase's throughput,
// latencies, ratios to the bare transaction and to the floor, heap
// allocations per operation, and round trips per operation when counted.
func printTotals(stdout io.Writer, clients int, phases []bench.Phase, totals map[string]*bench.Stats) {
	bare := totals["bare"].Throughput()
	var floor float64
	if s, ok := totals[bench.Floor]; ok {
		floor = s.Throughput()
	}
	fmt.Fprintf(stdout, "\n%d client(s)\n", clients)
	w := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "phase\ttx/s\tp50\tp99\tvs bare\tvs floor\tallocs/op\tB/op\tround trips/op\t")
	for _, p := range phases {
		s := totals[p.Name]
		vsFloor := "-"
		if floor > 0 {
			vsFloor = fmt.Sprintf("%.2fx", s.Throughput()/floor)
		}
		roundTrips := "-"
		if s.Counted {
			roundTrips = fmt.Sprintf("%.2f", s.RoundTripsPerOp())
		}
		fmt.Fprintf(w, "%s\t%.0f\t%s\t%s\t%.2fx\t%s\t%.1f\t%.0f\t%s\t\n", p.Name, s.Throughput(),
			s.Percentile(0.50).Round(time.Microsecond), s.Percentile(0.99).Round(time.Microsecond),
			s.Throughput()/bare, vsFloor, s.AllocsPerOp(), s.BytesPerOp(), roundTrips)
	}
	w.Flush()
}
