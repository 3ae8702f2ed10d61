package pgtemp

import "syscall"

// dieWithParent has the server sent SIGQUIT, an immediate shutdown, when
// the process that started it dies, even by SIGKILL.
func dieWithParent(attr *syscall.SysProcAttr) { attr.Pdeathsig = syscall.SIGQUIT }
