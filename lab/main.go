// Command lab is idem's laboratory: the demo, the soaks and the benchmarks
// that back the README's claims, run from a checkout of the repository.
//
// Usage:
//
//	go run ./lab <command> [flags]
//
// The commands are demo, soak (and soak -failover sync|async), flowsoak and
// bench; "go run ./lab <command> -h" says what each does and its flags.
// The package benchmarks are in lab/bench (go test -bench ... ./lab/bench)
// and the tests against other libraries' clients in lab/interop.
//
// They never write into a database they did not create: with DATABASE_URL
// or the standard PG* variables set, they make a database of their own on
// that server (a schema of their own where they may not create databases)
// and drop it at the end; with neither, they start a throwaway server from
// the machine's PostgreSQL installation, or one fetched by
// embedded-postgres.
//
// The lab is a module of its own, which no application installs: it may
// use the library's internal packages, and moves in lockstep with the
// library in the same commit. The operator's command is cmd/idem.
package main

import "github.com/pgidem/idem/cmd/idem/cli"

var program = cli.Program{
	Name:       "lab",
	Invocation: "go run ./lab",
	Footer: `Each makes a database of its own on the server that DATABASE_URL or the PG*
variables name, and drops it at the end (with nothing set, it starts a
throwaway server). Benchmarks: go test -bench . ./lab/bench`,
}

func commands() []cli.Command {
	return []cli.Command{
		{Name: "demo", Summary: "fire a retry storm of payments and show that none is lost or doubled", Run: runDemo},
		{Name: "soak", Summary: "inject faults under a payment load and check that nothing is lost or doubled", Run: runSoak},
		{Name: "flowsoak", Summary: "kill the processes running flows that call a provider, and check every effect happened once", Run: runFlowSoak},
		{Name: "bench", Summary: "compare idem.Run with a bare transaction and other designs, side by side", Run: runBench},
	}
}

func main() { program.Main(commands()) }
