// Command idem is idem's operator command: it runs idem's migrations and
// maintenance, and shows what its tables hold.
//
// Usage:
//
//	idem <command> [flags]
//
// The server comes from DATABASE_URL, or else from the standard PG*
// variables (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, ...). The
// commands (migrate, purge, stats, inspect, flows, flow-resolve, flow-end,
// console) act on that database and print it before acting; schema prints
// idem's tables as SQL and connects to nothing. Run "idem <command> -h" for what a command does and
// its flags. The demo, the soaks and the benchmarks are not part of it: they
// live in the repository's lab (go run ./lab, from a checkout).
package main

import "github.com/pgidem/idem/cmd/idem/cli"

var program = cli.Program{
	Name:       "idem",
	Invocation: "idem",
	Footer: `The server comes from DATABASE_URL, or else the standard PG* variables.
Every command but schema acts on that database, and prints it first.`,
}

func commands() []cli.Command {
	return []cli.Command{
		{Name: "migrate", Summary: "apply, roll back or list the embedded migrations: migrate up|down|status", Run: runMigrate},
		{Name: "purge", Summary: "delete expired records in batches", Run: runPurge},
		{Name: "stats", Summary: "show the operations running now, records by state, the table's size, the outbox backlog and the flows", Run: runStats},
		{Name: "inspect", Summary: "show one record, or with -flow one flow: inspect [-flow] SCOPE KEY", Run: runInspect},
		{Name: "flows", Summary: "list the flows needing attention (or -state running, ended), newest first", Run: runFlows},
		{Name: "flow-resolve", Summary: "settle the call a flow stopped at: flow-resolve SCOPE KEY STEP applied|not-applied", Run: runFlowResolve},
		{Name: "flow-end", Summary: "end a flow that runs or needs attention: flow-end SCOPE KEY REASON", Run: runFlowEnd},
		{Name: "console", Summary: "serve the web console on 127.0.0.1 (see docs/console.md)", Run: runConsole},
		{Name: "schema", Summary: "print idem's tables as SQL, for sqlc and other tools that read a schema", Run: runSchema},
	}
}

func main() { program.Main(commands()) }
