// Package localcluster runs a modeguard deployment on one machine: one
// controller process and several node plugin processes in two zones, each
// with its own state directory, sharing one pool directory per zone — the
// way several nodes of a zone share a pool. It backs `modeguard demo` and the
// multi-process integration tests.
//
// Every process is started from the given binary and stopped by its PID;
// Stop also unmounts whatever the stories left mounted under the work dir
// and detaches loop devices backed by the pools, so nothing outlives it.
package localcluster

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/stories"
)

// NodeSpec is one node plugin to run.
type NodeSpec struct {
	Name string
	Zone string
}

// DefaultNodes are the nodes the stories expect: two in zone-a, one in zone-b.
var DefaultNodes = []NodeSpec{
	{Name: stories.NodeA1, Zone: "zone-a"},
	{Name: stories.NodeA2, Zone: "zone-a"},
	{Name: stories.NodeB1, Zone: "zone-b"},
}

// Cluster is a running deployment.
type Cluster struct {
	Binary  string
	WorkDir string
	Pools   map[string]string // zone -> pool dir
	// Verbosity is passed to every process as -v.
	Verbosity int

	controller *process
	nodes      map[string]*process
	// targets are the storage targets by zone, with StartWithTargets.
	targets    map[string]*process
	targetOpts *Targets
	conns      []*grpc.ClientConn
	Stories    *stories.Cluster
}

type process struct {
	name     string
	args     []string
	endpoint string
	logPath  string
	cmd      *exec.Cmd
	done     chan struct{}
	// ready says whether the started process serves; nil: it answers
	// CSI's Probe ready.
	ready func(ctx context.Context) error
}

// Targets makes StartWithTargets put every zone's pool behind a storage
// target of its own (a process with --roles target), which the controller
// reaches instead of the pool: over a unix socket, or over loopback TCP
// with mutual TLS when TLS is set. The node plugins still see the pools
// (the loop transport: one machine).
type Targets struct {
	TLS *TargetTLS
}

// TargetTLS are the files of both sides of the targets' API.
type TargetTLS struct {
	Target, Controller remote.TLSFiles
}

// Start launches the controller and the nodes and waits until each answers
// Probe. On error, whatever was started is stopped again.
func Start(ctx context.Context, binary, workDir string, nodes []NodeSpec, verbosity int) (*Cluster, error) {
	c := &Cluster{Binary: binary, WorkDir: workDir, Pools: map[string]string{}, nodes: map[string]*process{}, Verbosity: verbosity}
	if err := c.startAll(ctx, nodes); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// StartWithTargets is Start with a storage target per zone (see Targets).
func StartWithTargets(ctx context.Context, binary, workDir string, nodes []NodeSpec, verbosity int, targets Targets) (*Cluster, error) {
	c := &Cluster{Binary: binary, WorkDir: workDir, Pools: map[string]string{}, nodes: map[string]*process{}, Verbosity: verbosity,
		targets: map[string]*process{}, targetOpts: &targets}
	if err := c.startAll(ctx, nodes); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// startTarget starts zone's storage target on its pool and returns the
// controller's arguments for it.
func (c *Cluster) startTarget(ctx context.Context, zone, pool string) ([]string, error) {
	dir := filepath.Join(c.WorkDir, "targets", zone)
	p := &process{name: "target-" + zone, logPath: filepath.Join(dir, "log")}
	endpoint := "unix://" + filepath.Join(dir, "target.sock")
	address := endpoint
	var ctrlTLS remote.TLSFiles
	var tlsArgs []string
	if t := c.targetOpts.TLS; t != nil {
		port, err := freeLoopbackPort()
		if err != nil {
			return nil, err
		}
		address = fmt.Sprintf("127.0.0.1:%d", port)
		endpoint = "tcp://" + address
		tlsArgs = []string{"--tls-cert", t.Target.Cert, "--tls-key", t.Target.Key, "--tls-ca", t.Target.CA}
		ctrlTLS = t.Controller
	}
	p.args = append([]string{"--roles", "target", "--block-pool", zone + "=" + pool, "--block-pool-filesystem=direct", "--target-endpoint", endpoint,
		"-v", fmt.Sprint(c.Verbosity)}, tlsArgs...)
	p.ready = func(ctx context.Context) error {
		rc, err := remote.Dial(ctx, remote.Target{Address: address, TLS: ctrlTLS})
		if err != nil {
			return err
		}
		rc.Close()
		return nil
	}
	if err := c.start(ctx, p); err != nil {
		return nil, err
	}
	c.targets[zone] = p
	return []string{"--block-target=" + zone + "=" + address}, nil
}

// freeLoopbackPort is a TCP port free on 127.0.0.1 a moment ago.
func freeLoopbackPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (c *Cluster) startAll(ctx context.Context, nodes []NodeSpec) error {
	workDir := c.WorkDir
	verbosity := c.Verbosity
	zones := map[string]bool{}
	for _, n := range nodes {
		zones[n.Zone] = true
	}
	var poolArgs []string
	for z := range zones {
		dir := filepath.Join(workDir, "pools", z)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return err
		}
		c.Pools[z] = dir
		poolArgs = append(poolArgs, "--block-pool="+z+"="+dir, "--block-pool-filesystem=direct")
	}
	sort.Strings(poolArgs)
	ctrlPoolArgs := poolArgs
	if c.targetOpts != nil {
		ctrlPoolArgs = nil
		zoneList := make([]string, 0, len(c.Pools))
		for z := range c.Pools {
			zoneList = append(zoneList, z)
		}
		sort.Strings(zoneList)
		for _, z := range zoneList {
			args, err := c.startTarget(ctx, z, c.Pools[z])
			if err != nil {
				return err
			}
			ctrlPoolArgs = append(ctrlPoolArgs, args...)
		}
		if t := c.targetOpts.TLS; t != nil {
			ctrlPoolArgs = append(ctrlPoolArgs, "--tls-cert", t.Controller.Cert, "--tls-key", t.Controller.Key, "--tls-ca", t.Controller.CA)
		}
	}
	c.controller = &process{
		name:     "controller",
		endpoint: "unix://" + filepath.Join(workDir, "controller", "csi.sock"),
		logPath:  filepath.Join(workDir, "controller", "log"),
	}
	c.controller.args = append([]string{"--roles", "controller", "--endpoint", c.controller.endpoint,
		"--max-volumes-per-node", "64", "-v", fmt.Sprint(verbosity)}, ctrlPoolArgs...)
	if err := c.start(ctx, c.controller); err != nil {
		return err
	}
	conn, err := dial(c.controller.endpoint)
	if err != nil {
		return err
	}
	c.conns = append(c.conns, conn)
	c.Stories = &stories.Cluster{Controller: csi.NewControllerClient(conn), WorkDir: filepath.Join(workDir, "kubelet"), Out: os.Stdout}

	for _, n := range nodes {
		dir := filepath.Join(workDir, "nodes", n.Name)
		p := &process{
			name:     n.Name,
			endpoint: "unix://" + filepath.Join(dir, "csi.sock"),
			logPath:  filepath.Join(dir, "log"),
		}
		p.args = append([]string{"--roles", "node", "--endpoint", p.endpoint, "--node-id", n.Name, "--zone", n.Zone,
			"--state-dir", filepath.Join(dir, "state"), "--max-volumes-per-node", "64", "-v", fmt.Sprint(verbosity)}, poolArgs...)
		if err := c.start(ctx, p); err != nil {
			return err
		}
		c.nodes[n.Name] = p
		conn, err := dial(p.endpoint)
		if err != nil {
			return err
		}
		c.conns = append(c.conns, conn)
		proc := p
		c.Stories.Nodes = append(c.Stories.Nodes, &stories.Node{
			Name: n.Name, Zone: n.Zone, Client: csi.NewNodeClient(conn),
			Restart: func(ctx context.Context) error { return c.restart(ctx, proc) },
		})
	}
	return nil
}

func dial(endpoint string) (*grpc.ClientConn, error) {
	return grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

func (c *Cluster) start(ctx context.Context, p *process) error {
	if err := os.MkdirAll(filepath.Dir(p.logPath), 0o700); err != nil {
		return err
	}
	logFile, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	p.cmd = exec.Command(c.Binary, p.args...)
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	// Its own process group, so a Ctrl-C at the terminal reaches only us and
	// we stop the plugins in order.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		logFile.Close()
		return fmt.Errorf("starting %s: %w", p.name, err)
	}
	p.done = make(chan struct{})
	go func() {
		p.cmd.Wait()
		logFile.Close()
		close(p.done)
	}()
	if p.ready != nil {
		return c.waitFor(ctx, p, p.ready)
	}
	return c.waitReady(ctx, p)
}

// waitFor polls ready until it succeeds, or fails with the tail of the
// process's log if it exits or takes too long.
func (c *Cluster) waitFor(ctx context.Context, p *process, ready func(context.Context) error) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		err := ready(pctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited during start-up: %s", p.name, tail(p.logPath))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not become ready (%v): %s", p.name, err, tail(p.logPath))
		}
	}
}

// waitReady polls Probe until the process answers ready, or fails with the
// tail of its log if it exits or takes too long.
func (c *Cluster) waitReady(ctx context.Context, p *process) error {
	conn, err := dial(p.endpoint)
	if err != nil {
		return err
	}
	defer conn.Close()
	id := csi.NewIdentityClient(conn)
	return c.waitFor(ctx, p, func(ctx context.Context) error {
		resp, err := id.Probe(ctx, &csi.ProbeRequest{})
		if err == nil && !resp.GetReady().GetValue() {
			err = fmt.Errorf("Probe answers not ready")
		}
		return err
	})
}

func tail(path string) string {
	data, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(lines) > 10 {
		lines = lines[len(lines)-10:]
	}
	return strings.Join(lines, "\n")
}

// restart kills a node plugin with SIGKILL, as a crash would, and starts it
// again with the same arguments and state directory.
func (c *Cluster) restart(ctx context.Context, p *process) error {
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	<-p.done
	return c.start(ctx, p)
}

// Logs returns where each process writes its log.
func (c *Cluster) Logs() map[string]string {
	out := map[string]string{}
	if c.controller != nil {
		out["controller"] = c.controller.logPath
	}
	for name, p := range c.nodes {
		out[name] = p.logPath
	}
	for _, p := range c.targets {
		out[p.name] = p.logPath
	}
	return out
}

// Stop stops every process by PID (SIGTERM, then SIGKILL after 5 s), then
// unmounts anything left under the work dir and detaches loop devices backed
// by the pools. It returns what it had to clean up by force.
func (c *Cluster) Stop() []string {
	for _, conn := range c.conns {
		conn.Close()
	}
	var forced []string
	procs := []*process{}
	for _, p := range c.nodes {
		procs = append(procs, p)
	}
	if c.controller != nil {
		procs = append(procs, c.controller)
	}
	// The targets last: the controller may be finishing a call to one.
	for _, p := range c.targets {
		procs = append(procs, p)
	}
	for _, p := range procs {
		if p.cmd == nil || p.cmd.Process == nil {
			continue
		}
		select {
		case <-p.done:
			continue
		default:
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(5 * time.Second):
			forced = append(forced, "killed "+p.name)
			_ = p.cmd.Process.Signal(syscall.SIGKILL)
			<-p.done
		}
	}
	for _, m := range MountsUnder(c.WorkDir) {
		forced = append(forced, "unmounted "+m)
		_ = unix.Unmount(m, unix.MNT_DETACH)
	}
	for _, dev := range LoopsUnder(c.WorkDir) {
		forced = append(forced, "detached "+dev)
		_ = exec.Command("losetup", "-d", dev).Run()
	}
	return forced
}
