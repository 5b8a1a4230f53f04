// Command agent runs inside the test VMs that package vmtest boots (see
// test/vm/vmtest): the VM's init chroots into the host's root filesystem,
// seen over 9p, and starts it. It serves a small HTTP/JSON API on the VM's
// bridge address through which the host runs commands, reads and writes
// files, and starts, kills and watches one node plugin process.
//
// Every request is a POST of a JSON object to one path, answered with a JSON
// object; HTTP errors mean the request itself was bad, while the failure of
// the operation it asked for is reported in the answer:
//
//	/ping          {}                                  -> {"name", "uptime_seconds"}
//	/run           {"name", "args", "dir", "env"}      -> {"output", "exit_code"}
//	/write         {"path", "data", "perm"}            -> {"error", "errno"}
//	/read          {"path"}                            -> {"data", "error", "errno"}
//	/plugin/start  {"path", "args", "log", "probe"}    -> {"error", "pid"}
//	/plugin/kill   {}                                  -> {"error"}
//	/plugin/status {}                                  -> {"pid", "running", "exit"}
//	/lock/hold     {"path", "start", "len", "wait"}    -> {"id", "pid", "error", "errno"}
//	/lock/write    {"id", "offset", "data"}            -> {"error", "errno"}
//	/lock/release  {"id"}                              -> {"error", "errno"}
//	/lock/try      {"path", "start", "len", "timeout_ms"} -> {"outcome", "conflict", "error", "errno"}
//
// Each lock is held or tried by a child process of the agent (see lock.go).
//
// A command that cannot be started gets exit code 127 and the reason as
// output, as from a shell.
package main

import (
	"github.com/modeguard/modeguard/test/vm/agentapi"

	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

var (
	name  = flag.String("name", "vm", "this VM's name, for log lines")
	start = time.Now()
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == lockChildArg {
		lockChild(os.Args[2:])
	}
	listen := flag.String("listen", ":10001", "address to serve the API on")
	flag.Parse()
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("agent " + *name + ": ")
	p := &plugin{}
	locks := &lockHolders{}
	mux := http.NewServeMux()
	handle(mux, agentapi.PathPing, func(ctx context.Context, _ *struct{}) (any, error) {
		return map[string]any{"name": *name, "uptime_seconds": time.Since(start).Seconds()}, nil
	})
	handle(mux, agentapi.PathRun, runCommand)
	handle(mux, agentapi.PathWrite, writeFile)
	handle(mux, agentapi.PathRead, readFile)
	handle(mux, agentapi.PathPluginStart, p.start)
	handle(mux, agentapi.PathPluginKill, p.kill)
	handle(mux, agentapi.PathPluginStatus, p.status)
	handle(mux, agentapi.PathLockHold, locks.hold)
	handle(mux, agentapi.PathLockWrite, locks.write)
	handle(mux, agentapi.PathLockRelease, locks.release)
	handle(mux, agentapi.PathLockTry, tryLock)
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("serving on %s", lis.Addr())
	log.Fatal(http.Serve(lis, mux))
}

// handle registers a JSON-in, JSON-out handler. An error from fn is a bad
// request (HTTP 400); failures of the operation belong in fn's answer.
func handle[Req any](mux *http.ServeMux, path string, fn func(context.Context, *Req) (any, error)) {
	mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.Error(w, "POST only", http.StatusMethodNotAllowed)
			return
		}
		req := new(Req)
		if err := json.NewDecoder(r.Body).Decode(req); err != nil {
			http.Error(w, "decoding the request: "+err.Error(), http.StatusBadRequest)
			return
		}
		resp, err := fn(r.Context(), req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if err := json.NewEncoder(w).Encode(resp); err != nil {
			log.Printf("%s: writing the answer: %v", path, err)
		}
	})
}

func runCommand(ctx context.Context, req *agentapi.RunRequest) (any, error) {
	if req.Name == "" {
		return nil, errors.New("no command")
	}
	cmd := exec.CommandContext(ctx, req.Name, req.Args...)
	cmd.Dir = req.Dir
	cmd.Env = append(os.Environ(), req.Env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// Children that keep the output open must not hold the answer forever.
	cmd.WaitDelay = 5 * time.Second
	err := cmd.Run()
	resp := &agentapi.RunResponse{}
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		resp.ExitCode = exit.ExitCode()
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			resp.ExitCode = 128 + int(ws.Signal())
		}
	case cmd.Process == nil: // could not start
		fmt.Fprintf(&out, "%v\n", err)
		resp.ExitCode = 127
	default:
		fmt.Fprintf(&out, "\nagent: %v\n", err)
		resp.ExitCode = -1
		if cmd.ProcessState != nil {
			resp.ExitCode = cmd.ProcessState.ExitCode()
		}
	}
	resp.Output = out.Bytes()
	return resp, nil
}

func failure(err error) *agentapi.FileResponse {
	r := &agentapi.FileResponse{Error: err.Error()}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		r.Errno = int(errno)
	}
	return r
}

func writeFile(ctx context.Context, req *agentapi.FileRequest) (any, error) {
	if req.Path == "" {
		return nil, errors.New("no path")
	}
	perm := os.FileMode(req.Perm)
	if perm == 0 {
		perm = 0o644
	}
	f, err := os.OpenFile(req.Path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return failure(err), nil
	}
	_, err = f.Write(req.Data)
	if err == nil {
		// Errors of NFS writes often show only at flush.
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return failure(err), nil
	}
	return &agentapi.FileResponse{}, nil
}

func readFile(ctx context.Context, req *agentapi.FileRequest) (any, error) {
	if req.Path == "" {
		return nil, errors.New("no path")
	}
	data, err := os.ReadFile(req.Path)
	if err != nil {
		return failure(err), nil
	}
	return &agentapi.FileResponse{Data: data}, nil
}

// plugin supervises the one node plugin process of this VM.
type plugin struct {
	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited, after exit is set
	exit *string       // how it ended; read only after done is closed
}

func (p *plugin) running() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// stopLocked ends a running plugin: SIGTERM, then SIGKILL after grace.
func (p *plugin) stopLocked(ctx context.Context, grace time.Duration) error {
	if !p.running() {
		return nil
	}
	if grace > 0 {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
			return nil
		case <-time.After(grace):
			log.Printf("plugin pid %d did not stop within %s of SIGTERM; killing it", p.cmd.Process.Pid, grace)
		case <-ctx.Done():
		}
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("plugin pid %d still there after SIGKILL: %w", p.cmd.Process.Pid, ctx.Err())
	}
}

func (p *plugin) start(ctx context.Context, req *agentapi.PluginRequest) (any, error) {
	if req.Path == "" || req.Log == "" || req.Probe == "" {
		return nil, errors.New("path, log and probe are required")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stopLocked(ctx, 10*time.Second); err != nil {
		return &agentapi.PluginResponse{Error: "stopping the running plugin: " + err.Error()}, nil
	}
	logFile, err := os.OpenFile(req.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return &agentapi.PluginResponse{Error: err.Error()}, nil
	}
	fmt.Fprintf(logFile, "=== agent %s: %s starting %s %s\n", *name, time.Now().Format(time.RFC3339Nano), req.Path, strings.Join(req.Args, " "))
	cmd := exec.Command(req.Path, req.Args...)
	cmd.Env = append(os.Environ(), req.Env...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Its own process group, so that a Ctrl-C on the console or an
	// agent's exit does not signal it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(logFile, "=== agent %s: cannot start: %v\n", *name, err)
		logFile.Close()
		return &agentapi.PluginResponse{Error: err.Error()}, nil
	}
	done, exit := make(chan struct{}), new(string)
	p.cmd, p.done, p.exit = cmd, done, exit
	go func() {
		err := cmd.Wait()
		*exit = "exit status 0"
		if err != nil {
			*exit = err.Error()
		}
		fmt.Fprintf(logFile, "=== agent %s: %s plugin pid %d ended: %s\n", *name, time.Now().Format(time.RFC3339Nano), cmd.Process.Pid, *exit)
		logFile.Close()
		log.Printf("plugin pid %d ended: %s", cmd.Process.Pid, *exit)
		close(done)
	}()
	log.Printf("plugin started, pid %d", cmd.Process.Pid)
	for {
		conn, err := net.DialTimeout("tcp", req.Probe, time.Second)
		if err == nil {
			conn.Close()
			return &agentapi.PluginResponse{PID: cmd.Process.Pid}, nil
		}
		select {
		case <-done:
			return &agentapi.PluginResponse{Error: fmt.Sprintf("the plugin exited before serving on %s:\n%s", req.Probe, tail(req.Log, 40))}, nil
		case <-ctx.Done():
			return &agentapi.PluginResponse{PID: cmd.Process.Pid, Error: fmt.Sprintf("the plugin does not serve on %s (still running as pid %d): %v:\n%s",
				req.Probe, cmd.Process.Pid, ctx.Err(), tail(req.Log, 40))}, nil
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (p *plugin) kill(ctx context.Context, _ *struct{}) (any, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stopLocked(ctx, 0); err != nil {
		return &agentapi.PluginResponse{Error: err.Error()}, nil
	}
	return &agentapi.PluginResponse{}, nil
}

func (p *plugin) status(ctx context.Context, _ *struct{}) (any, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := &agentapi.PluginResponse{Running: p.running()}
	if p.cmd != nil {
		r.PID = p.cmd.Process.Pid
		if !r.Running {
			r.Exit = *p.exit
		}
	}
	return r, nil
}

// tail returns the last n lines of the file at path.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
