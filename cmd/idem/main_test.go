package main

import (
	"context"
	"io"
	"os"
	"testing"

	"github.com/pgidem/idem/internal/testdb"
)

var env *testdb.Env

func TestMain(m *testing.M) { os.Exit(testdb.Main(m, &env)) }

// run runs the command line args as main does, with the given output.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return program.Run(ctx, commands(), args, stdout, stderr)
}
