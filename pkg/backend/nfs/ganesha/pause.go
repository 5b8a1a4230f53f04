package ganesha

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// MaxStopWait bounds how long Pause waits for every thread of ganesha to
// stop after SIGSTOP: a thread inside a system call stops only when the call
// returns, and one stuck that long in the kernel means the pause cannot be
// trusted to have caught ganesha between two system calls.
const MaxStopWait = 2 * time.Second

// ErrPauseExpired is what a resume function returns when maxStall ran out
// first and ganesha was already running again: whatever was done during the
// pause may have seen ganesha write.
var ErrPauseExpired = errors.New("ganesha: the pause ran out and ganesha was resumed before the pause was ended")

// Pause stops ganesha with SIGSTOP and returns once every one of its
// threads is stopped, so no system call of ganesha's (a write, an fsync) is
// under way and none starts until resume: what ganesha acknowledged to its
// clients is in the filesystems it serves, and nothing changes them through
// it. Clients see their calls wait; the kernel keeps their connections, and
// each call is answered after resume as if the server had been slow.
//
// resume sends SIGCONT, once, and returns nil when ganesha was held stopped
// until then, or ErrPauseExpired when maxStall ran out first: a timer in
// this process resumes ganesha after maxStall whatever its caller does, so
// a caller that hangs stalls the clients for maxStall at most. Should this
// process die meanwhile, ganesha dies with it (the parent-death signal
// kills a stopped process too) and the next Server starts a new one:
// nothing stays stopped.
//
// One pause at a time: Pause waits (until ctx ends) for an earlier one to
// end, so that one caller's resume never ends another caller's pause.
//
// Nothing in the supervision mistakes a stopped ganesha for a dead one: the
// supervisor only watches for the process to exit, and D-Bus calls made
// meanwhile (Control, WaitReady) are answered after resume, within their
// own timeouts when maxStall is shorter.
func (s *Server) Pause(ctx context.Context, maxStall time.Duration) (resume func() error, err error) {
	if maxStall <= 0 {
		return nil, fmt.Errorf("ganesha: pause of %v: want a positive bound", maxStall)
	}
	select {
	case s.pauseSem <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("ganesha: waiting for another pause to end: %w", ctx.Err())
	case <-s.stopCh:
		return nil, errors.New("ganesha: server stopped")
	}
	s.mu.Lock()
	g := s.ganesha
	s.mu.Unlock()
	if g == nil || g.exited() {
		<-s.pauseSem
		return nil, errors.New("ganesha: ganesha.nfsd is not running")
	}
	var (
		once    sync.Once
		expired bool
	)
	end := func(byTimer bool) (ended bool) {
		once.Do(func() {
			ended, expired = true, byTimer
			// A ganesha that exited meanwhile is not signalled: os.Process
			// knows it is gone (a pidfd), so no other process can be hit.
			_ = g.cmd.Process.Signal(syscall.SIGCONT)
			<-s.pauseSem
		})
		return ended
	}
	timer := time.AfterFunc(maxStall, func() {
		if !end(true) {
			return
		}
		s.logf("ganesha: resumed ganesha.nfsd (pid %d) after the longest pause allowed, %v, before its caller ended the pause", g.pid, maxStall)
	})
	fail := func(err error) (func() error, error) {
		timer.Stop()
		end(false)
		return nil, err
	}
	if err := g.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return fail(fmt.Errorf("ganesha: stopping ganesha.nfsd (pid %d): %w", g.pid, err))
	}
	if err := waitStopped(ctx, g, min(maxStall, MaxStopWait)); err != nil {
		return fail(err)
	}
	var (
		resumeOnce sync.Once
		resumeErr  error
	)
	return func() error {
		resumeOnce.Do(func() {
			timer.Stop()
			end(false)
			if expired {
				resumeErr = ErrPauseExpired
			}
		})
		return resumeErr
	}, nil
}

// waitStopped polls the states of g's threads until every one is stopped
// (or gone), at most d.
func waitStopped(ctx context.Context, g *proc, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		running, err := runningThreads(g.pid)
		switch {
		case g.exited():
			return fmt.Errorf("ganesha: ganesha.nfsd (pid %d) exited while being paused", g.pid)
		case err != nil:
			return fmt.Errorf("ganesha: reading the threads of ganesha.nfsd (pid %d): %w", g.pid, err)
		case len(running) == 0:
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("ganesha: %d threads of ganesha.nfsd (pid %d) did not stop within %v after SIGSTOP (states %s): "+
				"they are inside system calls that do not return", len(running), g.pid, d, strings.Join(running, " "))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("ganesha: waiting for ganesha.nfsd to stop: %w", ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// runningThreads lists "tid:state" for each thread of pid that is not
// stopped: state T (stopped by a signal), t (stopped by a tracer), Z and
// X (exiting) are stopped for this purpose.
func runningThreads(pid int) ([]string, error) {
	dir := filepath.Join("/proc", fmt.Sprint(pid), "task")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var running []string
	for _, e := range entries {
		state, err := ThreadState(pid, e.Name())
		if errors.Is(err, os.ErrNotExist) {
			continue // the thread ended
		}
		if err != nil {
			return nil, err
		}
		switch state {
		case 'T', 't', 'Z', 'X':
		default:
			running = append(running, e.Name()+":"+string(state))
		}
	}
	return running, nil
}

// ThreadState is the state letter /proc/PID/task/TID/stat reports (R, S,
// D, T, ...).
func ThreadState(pid int, tid string) (byte, error) {
	data, err := os.ReadFile(filepath.Join("/proc", fmt.Sprint(pid), "task", tid, "stat"))
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces and parentheses:
	// the state is the first field after the last ')'.
	i := strings.LastIndexByte(string(data), ')')
	if i < 0 || i+2 >= len(data) {
		return 0, fmt.Errorf("unexpected stat line %q", data)
	}
	return data[i+2], nil
}

// ThreadStates maps each thread of pid to its state letter, for callers
// that check that a process runs (or is stopped).
func ThreadStates(pid int) (map[string]byte, error) {
	entries, err := os.ReadDir(filepath.Join("/proc", fmt.Sprint(pid), "task"))
	if err != nil {
		return nil, err
	}
	out := make(map[string]byte, len(entries))
	for _, e := range entries {
		st, err := ThreadState(pid, e.Name())
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out[e.Name()] = st
	}
	return out, nil
}
