//go:build !linux

package main

import "os/exec"

// dieWithParent does nothing where the kernel has no parent-death signal:
// a worker left frozen by a soak that died must be killed by hand.
func dieWithParent(*exec.Cmd) {}
