package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
)

// BinaryEnv names a driver binary built already, which BuildBinary then
// returns instead of building one (test/vm/projquota.sh sets it: a build
// inside a VM under emulation takes minutes).
const BinaryEnv = "MODEGUARD_TEST_BINARY"

// BuildBinary compiles the driver (with the race detector) into a
// directory of the test's and returns its path.
func BuildBinary(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv(BinaryEnv); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("%s=%s: %v", BinaryEnv, bin, err)
		}
		return bin
	}
	bin := filepath.Join(t.TempDir(), "modeguard")
	cmd := exec.Command("go", "build", "-race", "-o", bin, "github.com/modeguard/modeguard/cmd/modeguard")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building modeguard: %v\n%s", err, out)
	}
	return bin
}

// Controller is a modeguard controller process run inside a network
// namespace (with nsenter --net, so it shares the host's mounts), serving
// CSI on a unix socket the test reaches from the host.
type Controller struct {
	t    testing.TB
	Bin  string
	Args []string // without --endpoint, which Start adds
	// Env is added to the environment of the next Start only (a fault
	// point to die at, say), then cleared.
	Env      []string
	NetNS    string // /run/netns/<name>
	Log      string
	Endpoint string // unix:///...
	// GaneshaDir is the --nfs-ganesha-dir StartNFSController gave it.
	GaneshaDir string

	cmd  *exec.Cmd
	done chan struct{}
	conn *grpc.ClientConn
	CSI  csi.ControllerClient
}

// NewController prepares a controller whose socket and log live in dir.
func NewController(t testing.TB, bin, netns, dir string, args ...string) *Controller {
	return &Controller{t: t, Bin: bin, Args: args, NetNS: netns,
		Log: filepath.Join(dir, "controller.log"), Endpoint: "unix://" + filepath.Join(dir, "csi.sock")}
}

// Start launches the process and waits until it answers Probe.
func (c *Controller) Start(ctx context.Context) {
	c.t.Helper()
	logFile, err := os.OpenFile(c.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		c.t.Fatal(err)
	}
	args := append([]string{"--net=" + c.NetNS, "--", c.Bin, "--endpoint", c.Endpoint}, c.Args...)
	c.cmd = exec.Command("nsenter", args...)
	c.cmd.Stdout, c.cmd.Stderr = logFile, logFile
	if len(c.Env) > 0 {
		c.cmd.Env = append(os.Environ(), c.Env...)
		c.Env = nil
	}
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := c.cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	done, cmd := make(chan struct{}), c.cmd
	c.done = done
	go func() { cmd.Wait(); logFile.Close(); close(done) }()
	if c.conn == nil {
		conn, err := grpc.NewClient(c.Endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			c.t.Fatal(err)
		}
		c.conn, c.CSI = conn, csi.NewControllerClient(conn)
	}
	id := csi.NewIdentityClient(c.conn)
	// Generous: in a VM under emulation a start with ganesha takes 15 s
	// and more.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := id.Probe(pctx, &csi.ProbeRequest{})
		cancel()
		if err == nil && resp.GetReady().GetValue() {
			return
		}
		select {
		case <-c.done:
			c.t.Fatalf("controller exited during start-up:\n%s", ReadFile(c.Log))
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("controller not ready:\n%s", ReadFile(c.Log))
		}
	}
}

// WaitExited waits until the process has ended by itself (at a fault
// point, say), failing the test after timeout.
func (c *Controller) WaitExited(timeout time.Duration) {
	c.t.Helper()
	select {
	case <-c.done:
	case <-time.After(timeout):
		c.t.Fatalf("controller still runs after %v", timeout)
	}
}

// Conn is the connection to the controller's endpoint, for the services
// it serves besides CSI's (csi-addons); a Stop closes it.
func (c *Controller) Conn() *grpc.ClientConn { return c.conn }

// Kill stops the controller with SIGKILL, as a crash would. Its ganesha
// and bus get their parent-death signal and die with it (WaitNFSServerGone
// waits for that); the next Start brings up a new ganesha on the same
// directory, with the same recovery database.
func (c *Controller) Kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
}

// Freeze stops the controller with SIGSTOP, as a stalled process or a
// paused VM: it holds its connections and its state, and does nothing.
func (c *Controller) Freeze() { _ = c.cmd.Process.Signal(syscall.SIGSTOP) }

// Thaw lets a frozen controller run again (SIGCONT).
func (c *Controller) Thaw() { _ = c.cmd.Process.Signal(syscall.SIGCONT) }

// NFSServerPIDs reads the PIDs of the ganesha and the bus a controller runs
// from their pid files in its --nfs-ganesha-dir.
func NFSServerPIDs(t testing.TB, ganeshaDir string) (ganeshaPID, busPID int) {
	t.Helper()
	var pids [2]int
	for i, name := range []string{ganesha.GaneshaPIDName, ganesha.BusPIDName} {
		pid, err := strconv.Atoi(strings.TrimSpace(ReadFile(filepath.Join(ganeshaDir, name))))
		if err != nil {
			t.Fatalf("pid file %s: %v", name, err)
		}
		pids[i] = pid
	}
	return pids[0], pids[1]
}

// WaitNFSServerGone waits until the given ganesha and bus of ganeshaDir no
// longer run (a zombie has an empty command line), failing the test after
// 30 s.
func WaitNFSServerGone(t testing.TB, ganeshaDir string, pids ...int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var running []int
		for _, pid := range pids {
			cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
			if err == nil && strings.Contains(string(cmdline), ganeshaDir) {
				running = append(running, pid)
			}
		}
		if len(running) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pids %v of the NFS server in %s still run", running, ganeshaDir)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// NFSControl is a ganesha.Control on the private bus of the ganesha a
// controller runs in ganeshaDir (closed at the end of the test).
func NFSControl(t testing.TB, ganeshaDir string) *ganesha.Control {
	t.Helper()
	c, err := ganesha.Dial("unix:path=" + filepath.Join(ganeshaDir, ganesha.BusSocketName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// WaitGraceEnded waits until the ganesha a controller runs in ganeshaDir is
// out of its grace period: after a restart with clients it knew, it refuses
// new opens and locks until they reclaimed (kernel clients wait; libnfs
// clients fail with NFS4ERR_GRACE).
func WaitGraceEnded(ctx context.Context, t testing.TB, ganeshaDir string) {
	t.Helper()
	if err := NFSControl(t, ganeshaDir).WaitGraceEnded(ctx); err != nil {
		t.Fatal(err)
	}
}

// Stop stops the controller with SIGTERM (SIGKILL after 20 s) and closes
// the client connection.
func (c *Controller) Stop() {
	defer func() {
		if c.conn != nil {
			c.conn.Close()
			c.conn = nil
		}
	}()
	if c.cmd == nil {
		return
	}
	select {
	case <-c.done:
		return
	default:
	}
	// A frozen controller acts on SIGTERM only once thawed.
	c.Thaw()
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(20 * time.Second):
		c.t.Errorf("controller did not stop on SIGTERM; killing it")
		c.Kill()
	}
}

// ReadFile returns a file's content, or "" when it cannot be read.
func ReadFile(p string) string {
	data, _ := os.ReadFile(p)
	return string(data)
}

// StartNFSController runs a controller with the NFS backend (its own
// ganesha, storage under a temp dir) inside the network namespace netns,
// serving NFS from server, and registers its stop and the cleanup of what
// it leaves: the common start of every NFS test that needs the binary.
func StartNFSController(ctx context.Context, t testing.TB, bin, netns, server string, extra ...string) *Controller {
	t.Helper()
	work := t.TempDir()
	gdir := filepath.Join(work, "ganesha")
	args := append([]string{"--roles", "controller", "-v", "2",
		"--nfs-export-root", filepath.Join(work, "nfs"), "--nfs-server", server,
		"--nfs-ganesha-dir", gdir}, extra...)
	ctrl := NewController(t, bin, netns, work, args...)
	ctrl.GaneshaDir = gdir
	ctrl.Start(ctx)
	t.Cleanup(func() {
		ctrl.Stop()
		CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("controller log:\n%s", ReadFile(ctrl.Log))
		}
	})
	return ctrl
}
