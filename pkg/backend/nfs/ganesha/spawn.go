package ganesha

import (
	"os/exec"
	"runtime"
	"sync"
)

// The parent-death signal (SysProcAttr.Pdeathsig) is delivered when the
// thread that forked the child exits, not the process: Linux makes that
// thread the child's parent. Go runs cmd.Start on whatever thread the
// calling goroutine happens to be on, and a thread can end while the
// process lives (a goroutine that exits locked to its thread takes the
// thread with it), which would kill a healthy ganesha. So every child of
// this package is started by one goroutine locked to its thread for the
// life of the process: the children die with the process, and only then.

type spawnRequest struct {
	cmd  *exec.Cmd
	done chan error
}

var (
	spawnOnce     sync.Once
	spawnRequests chan spawnRequest
)

// startOnSpawnerThread runs cmd.Start on the spawner's thread.
func startOnSpawnerThread(cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawnRequests = make(chan spawnRequest)
		ready := make(chan struct{})
		go spawner(ready)
		<-ready
	})
	req := spawnRequest{cmd: cmd, done: make(chan error, 1)}
	spawnRequests <- req
	return <-req.done
}

// spawner never returns and never unlocks its thread, so the runtime never
// ends or reuses that thread.
func spawner(ready chan<- struct{}) {
	runtime.LockOSThread()
	close(ready)
	for req := range spawnRequests {
		req.done <- req.cmd.Start()
	}
}
