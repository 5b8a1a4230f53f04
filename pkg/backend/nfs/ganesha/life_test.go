package ganesha

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
)

// The test binary doubles as a helper process: with helperEnv set, TestMain
// runs the helper instead of the tests.
const (
	helperEnv       = "MODEGUARD_GANESHA_TEST_HELPER"
	helperConfigEnv = "MODEGUARD_GANESHA_TEST_HELPER_CONFIG"
)

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "":
		os.Exit(m.Run())
	case "supervise":
		os.Exit(superviseHelper())
	case "idle":
		// Only its arguments matter; it ends when its stdin closes.
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}
	fmt.Fprintf(os.Stderr, "unknown %s %q\n", helperEnv, os.Getenv(helperEnv))
	os.Exit(2)
}

// helperConfig is what the supervising helper runs.
type helperConfig struct {
	Dir, ExportDir, ListenAddress, NetNSPath string
	PIDFile                                  string // where it writes "<ganesha pid> <bus pid>" once ready
	// Pause, when set, has it pause ganesha (for far longer than a test)
	// before it writes PIDFile.
	Pause bool
}

// superviseHelper runs a Server the way the controller does, in a process
// of its own, reports its children and waits until its stdin closes (then
// stops the Server) or it is killed.
func superviseHelper() int {
	var c helperConfig
	if err := json.Unmarshal([]byte(os.Getenv(helperConfigEnv)), &c); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, err := StartServer(ctx, ServerConfig{Dir: c.Dir, ExportDir: c.ExportDir, ListenAddress: c.ListenAddress, NetNSPath: c.NetNSPath,
		Logf: func(f string, a ...any) { fmt.Fprintf(os.Stderr, f+"\n", a...) }})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if c.Pause {
		if _, err := srv.Pause(ctx, time.Hour); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	tmp := c.PIDFile + ".tmp"
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%d %d\n", srv.GaneshaPID(), srv.BusPID()), 0o600); err == nil {
		err = os.Rename(tmp, c.PIDFile)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	if err := srv.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// helper is a running helper process.
type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   string // its stdout and stderr
	done  chan struct{}
}

// startHelper runs the test binary as helper mode with args, and registers
// a cleanup that closes its stdin, kills it by PID if it has not ended 20 s
// later, and waits for it.
func startHelper(t *testing.T, mode string, cfg *helperConfig, args ...string) *helper {
	t.Helper()
	h := &helper{cmd: exec.Command(os.Args[0], args...), out: filepath.Join(t.TempDir(), "helper.out"), done: make(chan struct{})}
	h.cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	if cfg != nil {
		data, err := json.Marshal(cfg)
		if err != nil {
			t.Fatal(err)
		}
		h.cmd.Env = append(h.cmd.Env, helperConfigEnv+"="+string(data))
	}
	out, err := os.Create(h.out)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	h.cmd.Stdout, h.cmd.Stderr = out, out
	if h.stdin, err = h.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = h.cmd.Wait(); close(h.done) }()
	t.Cleanup(func() {
		h.stdin.Close()
		select {
		case <-h.done:
		case <-time.After(20 * time.Second):
			t.Errorf("helper %d did not end when its stdin closed; killing it", h.cmd.Process.Pid)
			_ = h.cmd.Process.Kill()
			<-h.done
		}
		if t.Failed() {
			data, _ := os.ReadFile(h.out)
			t.Logf("helper %s output:\n%s", mode, data)
		}
	})
	return h
}

func (h *helper) running() bool {
	select {
	case <-h.done:
		return false
	default:
		return true
	}
}

// parentOf returns the parent PID of pid from /proc.
func parentOf(pid int) (int, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "PPid:"); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return 0, fmt.Errorf("no PPid in /proc/%d/status", pid)
}

// TestSupervisorKilledTakesItsChildren: a process that runs a Server (as
// the controller does) killed with SIGKILL takes its ganesha and
// dbus-daemon with it, although both were started through nsenter into a
// network namespace and ganesha served a client as a squashed user (its
// worker threads changed credentials) before.
func TestSupervisorKilledTakesItsChildren(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1})
	node := net.Nodes[0]
	runDir, exportDir, data := testDirs(t)
	pidFile := filepath.Join(t.TempDir(), "pids")
	h := startHelper(t, "supervise", &helperConfig{Dir: runDir, ExportDir: exportDir,
		ListenAddress: net.Server.Addr.String(), NetNSPath: net.Server.Path, PIDFile: pidFile})
	var gPID, bPID int
	waitFor(t, "the helper's Server to be ready", func() bool {
		if !h.running() {
			t.Fatalf("the helper ended before its Server was ready")
		}
		content, err := os.ReadFile(pidFile)
		if err != nil {
			return false
		}
		_, err = fmt.Sscanf(string(content), "%d %d", &gPID, &bPID)
		return err == nil
	})
	gArg, bArg := filepath.Join(runDir, GaneshaConfName), "--config-file="+filepath.Join(runDir, BusConfName)
	for _, p := range []struct {
		pid int
		arg string
	}{{gPID, gArg}, {bPID, bArg}} {
		if !alive(p.pid, p.arg) {
			t.Fatalf("pid %d does not run with %s", p.pid, p.arg)
		}
		if ppid, err := parentOf(p.pid); err != nil || ppid != h.cmd.Process.Pid {
			t.Fatalf("pid %d has parent %d (%v), want the helper %d", p.pid, ppid, err, h.cmd.Process.Pid)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	control, err := Dial("unix:path=" + filepath.Join(runDir, BusSocketName))
	if err != nil {
		t.Fatal(err)
	}
	defer control.Close()
	e := Export{ID: 5, Path: data, Pseudo: "/pvc-5", Clients: []ClientRule{{Address: node.Addr}}}
	confPath := ExportFilePath(exportDir, e.ID)
	if err := WriteExportFile(confPath, e); err != nil {
		t.Fatal(err)
	}
	if err := control.ApplyExport(ctx, confPath, e.ID); err != nil {
		t.Fatal(err)
	}
	local := filepath.Join(t.TempDir(), "payload")
	if err := os.WriteFile(local, []byte("squashed\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := node.NFSCopy(ctx, local, net.NFSURL(e.Pseudo, "f")); err != nil {
		t.Fatal(err)
	}

	if err := h.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-h.done
	waitFor(t, "ganesha and its bus to die with their supervisor", func() bool {
		return !alive(gPID, gArg) && !alive(bPID, bArg)
	})
	waitFor(t, "the server namespace to be empty", func() bool {
		return len(ganeshatest.NamespacePIDs(net.Server.Name)) == 0
	})
}

// TestSupervisorKilledDuringAPauseTakesGanesha: a process killed while it
// holds its ganesha paused (SIGSTOP) takes ganesha with it, stopped as it
// is: nothing stays frozen for a next controller to find, and the server's
// network namespace is empty.
func TestSupervisorKilledDuringAPauseTakesGanesha(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 0})
	runDir, exportDir, _ := testDirs(t)
	pidFile := filepath.Join(t.TempDir(), "pids")
	h := startHelper(t, "supervise", &helperConfig{Dir: runDir, ExportDir: exportDir,
		ListenAddress: net.Server.Addr.String(), NetNSPath: net.Server.Path, PIDFile: pidFile, Pause: true})
	var gPID, bPID int
	waitFor(t, "the helper's Server to be ready and paused", func() bool {
		if !h.running() {
			t.Fatalf("the helper ended before its Server was paused")
		}
		content, err := os.ReadFile(pidFile)
		if err != nil {
			return false
		}
		_, err = fmt.Sscanf(string(content), "%d %d", &gPID, &bPID)
		return err == nil
	})
	states, err := ThreadStates(gPID)
	if err != nil {
		t.Fatal(err)
	}
	for tid, st := range states {
		if st != 'T' {
			t.Fatalf("thread %s of the paused ganesha is in state %c, want T", tid, st)
		}
	}
	if err := h.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-h.done
	gArg, bArg := filepath.Join(runDir, GaneshaConfName), "--config-file="+filepath.Join(runDir, BusConfName)
	waitFor(t, "the paused ganesha and its bus to die with their supervisor", func() bool {
		return !alive(gPID, gArg) && !alive(bPID, bArg)
	})
	waitFor(t, "the server namespace to be empty", func() bool {
		return len(ganeshatest.NamespacePIDs(net.Server.Name)) == 0
	})
}

// TestChildrenOutliveTheThreadThatStartedThem: the parent-death signal
// follows the thread that forked a child. StartServer called on a thread
// that then ends (a goroutine that exits locked to its thread) must not
// take ganesha and its bus along: they are started on the spawner's thread,
// which lives as long as the process.
func TestChildrenOutliveTheThreadThatStartedThem(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 0})
	runDir, exportDir, _ := testDirs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type result struct {
		srv *Server
		err error
		tid int
	}
	var r result
	for r.srv == nil && r.err == nil {
		ch := make(chan result, 1)
		go func() {
			runtime.LockOSThread()
			tid := unix.Gettid()
			if tid == os.Getpid() {
				// The runtime never ends the main thread; try another.
				runtime.UnlockOSThread()
				ch <- result{}
				return
			}
			// Still locked when this goroutine returns: the runtime ends
			// the thread.
			srv, err := StartServer(ctx, ServerConfig{Dir: runDir, ExportDir: exportDir, NetNSPath: net.Server.Path,
				ListenAddress: net.Server.Addr.String(), Logf: t.Logf})
			ch <- result{srv, err, tid}
		}()
		r = <-ch
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() {
		if err := r.srv.Stop(); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	g, b := r.srv.GaneshaPID(), r.srv.BusPID()
	waitFor(t, "the thread that called StartServer to end", func() bool {
		_, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", r.tid))
		return os.IsNotExist(err)
	})
	// A parent-death signal is sent while the thread exits, before its
	// /proc entry goes. A ganesha that answers through its bus now was not
	// killed, and the supervisor did not have to start it again.
	if err := r.srv.Control().Ping(ctx); err != nil {
		t.Fatalf("ganesha does not answer after the thread that started it ended: %v", err)
	}
	if r.srv.GaneshaPID() != g || r.srv.BusPID() != b || r.srv.Restarts() != 0 {
		t.Fatalf("ganesha %d -> %d, bus %d -> %d, %d restarts: the children died with the thread",
			g, r.srv.GaneshaPID(), b, r.srv.BusPID(), r.srv.Restarts())
	}
}

// abandon makes srv's supervisor stop as if its process had died before its
// children got a parent-death signal: the children keep running, nothing
// is cleaned up.
func abandon(srv *Server) {
	srv.stopOnce.Do(func() {
		close(srv.stopCh)
		<-srv.supDone
		srv.control.Close()
	})
}

// TestStartServerStopsLeftovers: a ganesha and bus left running on a Dir
// are stopped by the next start on that Dir, found by their pid files or,
// without them, by their command lines; a Server on another Dir and a
// process whose arguments merely contain this Dir's paths are left alone.
func TestStartServerStopsLeftovers(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 0})
	otherRun, otherExports, _ := testDirs(t)
	other := startServer(t, net, otherRun, otherExports, func(c *ServerConfig) { c.Port = 2050 })
	for _, pidFiles := range []bool{true, false} {
		t.Run(fmt.Sprintf("pid files %v", pidFiles), func(t *testing.T) {
			runDir, exportDir, _ := testDirs(t)
			first := startServer(t, net, runDir, exportDir)
			oldG, oldB := first.GaneshaPID(), first.BusPID()
			abandon(first)
			if !pidFiles {
				for _, f := range []string{GaneshaPIDName, BusPIDName} {
					if err := os.Remove(filepath.Join(runDir, f)); err != nil {
						t.Fatal(err)
					}
				}
			}
			decoy := startHelper(t, "idle", nil,
				"-f", "/decoy"+filepath.Join(runDir, GaneshaConfName), "--config-file=/decoy"+filepath.Join(runDir, BusConfName))

			second := startServer(t, net, runDir, exportDir)
			if !gone(oldG, runDir) || !gone(oldB, runDir) {
				t.Fatalf("left over ganesha %d / bus %d still run", oldG, oldB)
			}
			if err := second.WaitReady(context.Background()); err != nil {
				t.Fatal(err)
			}
			if slices.Contains([]int{oldG, oldB}, second.GaneshaPID()) {
				t.Fatalf("the second server reports an old PID")
			}
			if !decoy.running() {
				t.Errorf("a process whose arguments only contain the runtime directory's paths was stopped")
			}
			if err := other.Control().Ping(context.Background()); err != nil || other.Restarts() != 0 {
				t.Errorf("the server on another directory was disturbed: %v, %d restarts", err, other.Restarts())
			}
		})
	}
}
