package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// plugin is one driver process, reached over its real gRPC socket.
type plugin struct {
	name     string
	binary   string
	args     []string
	socket   string
	logPath  string
	cmd      *exec.Cmd
	done     chan struct{}
	conn     *grpc.ClientConn
	identity csi.IdentityClient
	ctrl     csi.ControllerClient
	node     csi.NodeClient
	// apiOnly: a storage target, which serves no CSI: it is up once its
	// socket takes connections.
	apiOnly bool
}

// newTarget prepares a storage target (--roles target) serving pool on
// dir/target.sock.
func newTarget(binary, dir, pool string) (*plugin, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &plugin{name: "target", binary: binary, socket: filepath.Join(dir, "target.sock"), logPath: filepath.Join(dir, "log"), apiOnly: true}
	p.args = []string{"--roles", "target", "--block-pool=" + zone + "=" + pool, "--block-pool-filesystem=direct", "--target-endpoint", "unix://" + p.socket,
		"-v", strconv.Itoa(driverVerbosity)}
	return p, nil
}

// newPlugin prepares a driver process serving on dir/csi.sock.
func newPlugin(binary, name, dir string, args ...string) (*plugin, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &plugin{name: name, binary: binary, socket: filepath.Join(dir, "csi.sock"), logPath: filepath.Join(dir, "log")}
	p.args = append([]string{"--endpoint", "unix://" + p.socket, "-v", strconv.Itoa(driverVerbosity)}, args...)
	return p, nil
}

// dial connects a fresh client once the socket exists: a connection tried
// before the process listens would wait out gRPC's reconnect backoff (a
// second), which is not the driver's start-up time.
func (p *plugin) dial() error {
	if p.conn != nil {
		_ = p.conn.Close()
	}
	conn, err := grpc.NewClient("unix://"+p.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	p.conn = conn
	p.identity, p.ctrl, p.node = csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn)
	return nil
}

// start launches the process and returns how long it took until Probe
// answered ready: the start-up time a CO sees.
func (p *plugin) start(ctx context.Context) (time.Duration, error) {
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, err
	}
	defer logf.Close()
	_ = os.Remove(p.socket)
	if p.conn != nil {
		_ = p.conn.Close()
		p.conn = nil
	}
	p.cmd = exec.Command(p.binary, p.args...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	began := time.Now()
	if err := p.cmd.Start(); err != nil {
		return 0, err
	}
	p.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(p.cmd, p.done)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		select {
		case <-p.done:
			return 0, fmt.Errorf("%s exited at start; log %s:\n%s", p.name, p.logPath, tail(p.logPath))
		default:
		}
		if p.conn == nil {
			c, err := net.Dial("unix", p.socket)
			if err != nil {
				time.Sleep(time.Millisecond)
				continue
			}
			_ = c.Close()
			if p.apiOnly {
				return time.Since(began), nil
			}
			if err := p.dial(); err != nil {
				return 0, err
			}
		}
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := p.identity.Probe(cctx, &csi.ProbeRequest{})
		cancel()
		if err == nil && (resp.GetReady() == nil || resp.GetReady().GetValue()) {
			return time.Since(began), nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%s not ready after 2 minutes (last: %v)", p.name, err)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// stop ends the process by its PID: SIGTERM, then SIGKILL after 20 s.
func (p *plugin) stop() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	p.cmd = nil
}

// rssKiB is the process's resident set size now.
func (p *plugin) rssKiB() (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "VmRSS:"); ok {
			return strconv.ParseInt(strings.Fields(v)[0], 10, 64)
		}
	}
	return 0, fmt.Errorf("no VmRSS for pid %d", p.cmd.Process.Pid)
}

func tail(path string) string {
	data, _ := os.ReadFile(path)
	if len(data) > 3000 {
		data = data[len(data)-3000:]
	}
	return string(data)
}
