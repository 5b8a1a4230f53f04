package main

import (
	"github.com/modeguard/modeguard/test/vm/agentapi"

	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// POSIX locks belong to a process: they never conflict with another lock of
// the same process and all go when the process closes any descriptor of the
// file. So the agent takes none itself; each lock is taken by a child: the
// agent binary again, run as "agent lock-child hold|try|try-read PATH
// START LEN WAIT" (try-read: a read lock through a read-only descriptor).
// The child speaks JSON lines: on stdout its answer, on stdin (hold only)
// the commands that follow. A holder whose stdin closes (the agent
// died) exits, and its lock goes with it.
const lockChildArg = "lock-child"

// childAnswer is one line a lock child writes.
type childAnswer struct {
	OK       bool                `json:"ok,omitempty"`
	PID      int                 `json:"pid,omitempty"`
	Outcome  string              `json:"outcome,omitempty"`
	Conflict *agentapi.LockRange `json:"conflict,omitempty"`
	Error    string              `json:"error,omitempty"`
	Errno    int                 `json:"errno,omitempty"`
}

// childCommand is one line the agent writes to a holder.
type childCommand struct {
	Op     string `json:"op"` // "write" or "release"
	Offset int64  `json:"offset,omitempty"`
	Data   []byte `json:"data,omitempty"`
}

func errnoOf(err error) int {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return int(errno)
	}
	return 0
}

func lockOf(start, length int64) *syscall.Flock_t {
	return &syscall.Flock_t{Type: syscall.F_WRLCK, Whence: io.SeekStart, Start: start, Len: length}
}

func readLockOf(start, length int64) *syscall.Flock_t {
	l := lockOf(start, length)
	l.Type = syscall.F_RDLCK
	return l
}

// lockChild is the child's main: it never returns.
func lockChild(args []string) {
	out := json.NewEncoder(os.Stdout)
	fail := func(what string, err error) {
		_ = out.Encode(childAnswer{Outcome: agentapi.LockFailed, Error: what + ": " + err.Error(), Errno: errnoOf(err)})
		os.Exit(1)
	}
	if len(args) != 5 {
		fail("usage", fmt.Errorf("%s hold|try|try-read PATH START LEN WAIT", lockChildArg))
	}
	mode, path := args[0], args[1]
	start, err1 := strconv.ParseInt(args[2], 10, 64)
	length, err2 := strconv.ParseInt(args[3], 10, 64)
	wait, err3 := strconv.ParseBool(args[4])
	if err := errors.Join(err1, err2, err3); err != nil {
		fail("arguments", err)
	}
	flags, want := os.O_RDWR, lockOf(start, length)
	switch mode {
	case "hold":
		flags |= os.O_CREATE
	case "try-read":
		flags, want, mode = os.O_RDONLY, readLockOf(start, length), "try"
	}
	f, err := os.OpenFile(path, flags, 0o644)
	if err != nil {
		fail("open", err)
	}
	cmd := syscall.F_SETLK
	if wait {
		cmd = syscall.F_SETLKW
	}
	err = syscall.FcntlFlock(f.Fd(), cmd, want)
	if mode == "try" {
		switch {
		case err == nil:
			unlock := lockOf(start, length)
			unlock.Type = syscall.F_UNLCK
			if err := syscall.FcntlFlock(f.Fd(), syscall.F_SETLK, unlock); err != nil {
				fail("unlocking", err)
			}
			_ = out.Encode(childAnswer{Outcome: agentapi.LockAcquired})
		case errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EACCES):
			a := childAnswer{Outcome: agentapi.LockDenied, Errno: errnoOf(err), Error: err.Error()}
			probe := *want
			if gerr := syscall.FcntlFlock(f.Fd(), syscall.F_GETLK, &probe); gerr == nil && probe.Type != syscall.F_UNLCK {
				typ := "read"
				if probe.Type == syscall.F_WRLCK {
					typ = "write"
				}
				a.Conflict = &agentapi.LockRange{Type: typ, Start: probe.Start, Len: probe.Len, PID: int(probe.Pid)}
			}
			_ = out.Encode(a)
		default:
			fail("F_SETLK", err)
		}
		os.Exit(0)
	}
	if err != nil {
		fail("locking", err)
	}
	_ = out.Encode(childAnswer{OK: true, PID: os.Getpid()})
	in := json.NewDecoder(bufio.NewReader(os.Stdin))
	for {
		var c childCommand
		if err := in.Decode(&c); err != nil {
			os.Exit(0) // the agent is gone: the lock goes with this process
		}
		switch c.Op {
		case "write":
			_, err := f.WriteAt(c.Data, c.Offset)
			if err == nil {
				err = f.Sync()
			}
			if err != nil {
				_ = out.Encode(childAnswer{Error: err.Error(), Errno: errnoOf(err)})
				continue
			}
			_ = out.Encode(childAnswer{OK: true})
		case "release":
			unlock := lockOf(start, length)
			unlock.Type = syscall.F_UNLCK
			err := syscall.FcntlFlock(f.Fd(), syscall.F_SETLK, unlock)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				_ = out.Encode(childAnswer{Error: err.Error(), Errno: errnoOf(err)})
				os.Exit(1)
			}
			_ = out.Encode(childAnswer{OK: true})
			os.Exit(0)
		default:
			_ = out.Encode(childAnswer{Error: "unknown op " + strconv.Quote(c.Op)})
		}
	}
}

// lockChildProc is a running lock child.
type lockChildProc struct {
	mu    sync.Mutex // one command at a time
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *json.Decoder
}

// startLockChild starts a child and returns its first answer; when ctx
// ends first, it kills the child.
func startLockChild(ctx context.Context, mode string, req *agentapi.LockRequest) (*lockChildProc, childAnswer, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, childAnswer{}, err
	}
	cmd := exec.Command(self, lockChildArg, mode, req.Path,
		strconv.FormatInt(req.Start, 10), strconv.FormatInt(req.Len, 10), strconv.FormatBool(req.Wait))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, childAnswer{}, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, childAnswer{}, err
	}
	if err := cmd.Start(); err != nil {
		return nil, childAnswer{}, err
	}
	c := &lockChildProc{cmd: cmd, stdin: stdin, out: json.NewDecoder(stdout)}
	a, err := c.answer(ctx)
	if err != nil {
		return nil, childAnswer{}, err
	}
	return c, a, nil
}

// answer reads the child's next answer; when ctx ends first, or the child
// ends without one, it kills and reaps the child.
func (c *lockChildProc) answer(ctx context.Context) (childAnswer, error) {
	var a childAnswer
	errc := make(chan error, 1)
	go func() { errc <- c.out.Decode(&a) }()
	select {
	case err := <-errc:
		if err != nil {
			c.kill()
			return a, fmt.Errorf("the lock process (pid %d) gave no answer: %w", c.cmd.Process.Pid, err)
		}
		return a, nil
	case <-ctx.Done():
		c.kill()
		return a, ctx.Err()
	}
}

// kill ends the child with SIGKILL and reaps it.
func (c *lockChildProc) kill() {
	_ = c.cmd.Process.Kill()
	c.stdin.Close()
	_ = c.cmd.Wait()
}

// send writes one command and reads its answer.
func (c *lockChildProc) send(ctx context.Context, cmd childCommand) (childAnswer, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	line, err := json.Marshal(cmd)
	if err != nil {
		return childAnswer{}, err
	}
	if _, err := c.stdin.Write(append(line, '\n')); err != nil {
		return childAnswer{}, fmt.Errorf("the lock process (pid %d) is gone: %w", c.cmd.Process.Pid, err)
	}
	return c.answer(ctx)
}

// lockHolders are the agent's lock holding children, by id.
type lockHolders struct {
	mu   sync.Mutex
	next int
	m    map[int]*lockChildProc
}

func (l *lockHolders) get(id int) (*lockChildProc, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.m[id]
	if !ok {
		return nil, fmt.Errorf("no lock holder %d", id)
	}
	return c, nil
}

func (l *lockHolders) forget(id int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.m, id)
}

func (l *lockHolders) hold(ctx context.Context, req *agentapi.LockRequest) (any, error) {
	if req.Path == "" {
		return nil, errors.New("no path")
	}
	c, first, err := startLockChild(ctx, "hold", req)
	if err != nil {
		return &agentapi.HoldResponse{Error: err.Error()}, nil
	}
	if !first.OK {
		_ = c.cmd.Wait()
		return &agentapi.HoldResponse{Error: first.Error, Errno: first.Errno}, nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[int]*lockChildProc{}
	}
	l.next++
	l.m[l.next] = c
	log.Printf("pid %d holds a write lock on %s [%d, +%d)", first.PID, req.Path, req.Start, req.Len)
	return &agentapi.HoldResponse{ID: l.next, PID: first.PID}, nil
}

func (l *lockHolders) write(ctx context.Context, req *agentapi.HolderWriteRequest) (any, error) {
	c, err := l.get(req.ID)
	if err != nil {
		return nil, err
	}
	a, err := c.send(ctx, childCommand{Op: "write", Offset: req.Offset, Data: req.Data})
	if err != nil {
		l.forget(req.ID)
		return &agentapi.FileResponse{Error: err.Error()}, nil
	}
	return &agentapi.FileResponse{Error: a.Error, Errno: a.Errno}, nil
}

func (l *lockHolders) release(ctx context.Context, req *agentapi.HolderRequest) (any, error) {
	c, err := l.get(req.ID)
	if err != nil {
		return nil, err
	}
	l.forget(req.ID)
	a, err := c.send(ctx, childCommand{Op: "release"})
	if err != nil {
		return &agentapi.HoldResponse{Error: err.Error()}, nil
	}
	_ = c.cmd.Wait()
	return &agentapi.HoldResponse{Error: a.Error, Errno: a.Errno}, nil
}

// try tries the lock in a child of its own and lets it go at once.
func tryLock(ctx context.Context, req *agentapi.LockRequest) (any, error) {
	if req.Path == "" {
		return nil, errors.New("no path")
	}
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	tctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req.Wait = false
	mode := "try"
	if req.Read {
		mode = "try-read"
	}
	c, a, err := startLockChild(tctx, mode, req)
	switch {
	case err != nil && tctx.Err() != nil:
		return &agentapi.TryLockResponse{Outcome: agentapi.LockBlocked, Error: fmt.Sprintf("no answer within %v", timeout)}, nil
	case err != nil:
		return &agentapi.TryLockResponse{Outcome: agentapi.LockFailed, Error: err.Error()}, nil
	}
	_ = c.cmd.Wait()
	return &agentapi.TryLockResponse{Outcome: a.Outcome, Conflict: a.Conflict, Error: a.Error, Errno: a.Errno}, nil
}
