package main

import (
	"os/exec"
	"syscall"
)

// dieWithParent has the kernel kill a worker with SIGKILL when the soak
// dies: a worker the soak froze cannot read its closed input, and would
// stay stopped for ever.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
