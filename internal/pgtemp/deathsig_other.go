//go:build unix && !linux

package pgtemp

import "syscall"

// dieWithParent does nothing here: only Linux can tie a child's life to its
// parent's. Stop, and the interrupt handlers of its callers, stop it.
func dieWithParent(*syscall.SysProcAttr) {}
