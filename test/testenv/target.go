package testenv

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Target is a storage target process (modeguard --roles target) serving
// its API on a unix socket, or on TCP, run inside a network namespace when
// NetNS is set (with nsenter --net, so it shares the host's mounts).
type Target struct {
	t     testing.TB
	Bin   string
	Args  []string // without --target-endpoint, which Start adds
	NetNS string   // /run/netns/<name>, or "" for the host's network
	Log   string
	// Socket is the unix socket it serves; or Listen the HOST:PORT, with
	// --tls-* in Args, in a namespace the test may not reach: Start then
	// finds it serving by its log.
	Socket, Listen string
	// ExportRoot and GaneshaDir are the --nfs-export-root and
	// --nfs-ganesha-dir StartNFSTarget gave it.
	ExportRoot, GaneshaDir string

	cmd  *exec.Cmd
	done chan struct{}
}

// NewTarget prepares a target whose socket and log are the given paths.
func NewTarget(t testing.TB, bin, netns, socket, log string, args ...string) *Target {
	return &Target{t: t, Bin: bin, Args: args, NetNS: netns, Socket: socket, Log: log}
}

// NewTCPTarget prepares a target serving listen (HOST:PORT; args carry
// its --tls-* files), logging to log.
func NewTCPTarget(t testing.TB, bin, netns, listen, log string, args ...string) *Target {
	return &Target{t: t, Bin: bin, Args: args, NetNS: netns, Listen: listen, Log: log}
}

// Endpoint is the target's address as a controller's --block-target or
// --nfs-target names it.
func (p *Target) Endpoint() string {
	if p.Listen != "" {
		return p.Listen
	}
	return "unix://" + p.Socket
}

// servingLog is what a target logs once it serves its endpoint.
const servingLog = "Serving the storage target"

// Start runs the target and waits until it serves its socket (a minute
// at most: an NFS target formats its storage and starts ganesha first).
func (p *Target) Start(ctx context.Context) {
	t := p.t
	t.Helper()
	logf, err := os.OpenFile(p.Log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	endpoint := p.Endpoint()
	if p.Listen != "" {
		endpoint = "tcp://" + p.Listen
	}
	argv := append([]string{p.Bin, "--target-endpoint", endpoint}, p.Args...)
	if p.NetNS != "" {
		argv = append([]string{"nsenter", "--net=" + p.NetNS, "--"}, argv...)
	}
	// A restarted target appends to its log: only what this start logs
	// tells that it serves.
	logFrom := len(ReadFile(p.Log))
	serves := func() bool {
		if p.Listen != "" {
			return strings.Contains(ReadFile(p.Log)[logFrom:], servingLog)
		}
		conn, err := net.Dial("unix", p.Socket)
		if err == nil {
			conn.Close()
		}
		return err == nil
	}
	p.cmd = exec.Command(argv[0], argv[1:]...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	p.done = done
	go func(cmd *exec.Cmd) { _ = cmd.Wait(); logf.Close(); close(done) }(p.cmd)
	for deadline := time.Now().Add(time.Minute); ; {
		if serves() {
			return
		}
		select {
		case <-done:
			t.Fatalf("the target exited before it served:\n%s", ReadFile(p.Log))
		case <-ctx.Done():
			p.Stop()
			t.Fatalf("the target did not serve: %v", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.Stop()
			t.Fatalf("the target did not serve within a minute:\n%s", ReadFile(p.Log))
		}
	}
}

// Stop ends the target with SIGTERM, or SIGKILL after 20 s.
func (p *Target) Stop() {
	if p.cmd == nil {
		return
	}
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		p.t.Errorf("the target did not stop on SIGTERM; killing it")
		p.Kill()
	}
}

// Kill ends the target with SIGKILL, as a crash would; an NFS target's
// ganesha and bus die with it (WaitNFSServerGone waits for that).
func (p *Target) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// StartNFSTarget runs a storage target serving the NFS volumes (its own
// ganesha, storage under a temp dir) inside the network namespace netns,
// serving NFS from server, and registers its stop and the cleanup of what
// it leaves.
func StartNFSTarget(ctx context.Context, t testing.TB, bin, netns, server string, extra ...string) *Target {
	t.Helper()
	work := t.TempDir()
	root, gdir := filepath.Join(work, "nfs"), filepath.Join(work, "ganesha")
	args := append([]string{"--roles", "target", "-v", "2",
		"--nfs-export-root", root, "--nfs-server", server, "--nfs-ganesha-dir", gdir}, extra...)
	p := NewTarget(t, bin, netns, filepath.Join(work, "target.sock"), filepath.Join(work, "target.log"), args...)
	p.ExportRoot, p.GaneshaDir = root, gdir
	p.Start(ctx)
	t.Cleanup(func() {
		p.Stop()
		CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("NFS target log:\n%s", ReadFile(p.Log))
		}
	})
	return p
}
