// Package vmtest boots small qemu VMs with Debian's stock kernel, which has
// the NFS client this machine's kernel lacks, so that tests can run the
// modeguard node plugin where its kernel NFS mounts really happen.
//
// Start builds (once, cached in CacheDir) an uncompressed kernel and a
// busybox initramfs with the virtio, 9p and NFS client modules, creates a
// server network namespace with a bridge (ganesha and the controller run
// there) and one tap device per VM on that bridge, and boots the VMs under
// software emulation inside the server namespace. Each VM's init loads the
// modules, gives eth0 the VM's address, mounts the host's root filesystem
// over 9p, puts a VM-local tmpfs at the VM's WorkDir/<name>/local (so that
// mount points live on the VM's own storage, see VM.Path), chroots into the
// host's root and runs the agent (test/vm/agent), through which the host
// runs commands and the node plugin in the VM. The host reaches the agents
// and the plugins only from inside the server namespace: see
// Cluster.Dialer.
//
//	server namespace <Prefix>-srv-<suffix>
//	  br0 10.99.X.1/24 ── tap1 ── vm1 eth0 10.99.X.21   agent :10001, plugin :10000
//	                   └─ tap2 ── vm2 eth0 10.99.X.22
//
// Everything is torn down by the cleanup Start registers: the qemu
// processes (by PID), the taps and the namespace; anything else still
// running in the namespace is reported as a test error and killed. A test
// process killed before its cleanup ran (a go test timeout) takes its qemus
// with it (parent-death signal); its namespace, and whatever still runs in
// it, is removed by the next Start (owners are recorded in CacheDir/netns).
//
// Under software emulation a VM needs about 4.5 s from qemu's start until
// its agent answers (kernel 2 s, loading the NFS modules 1.5 s), a -race
// node plugin about 1.5 s to serve, an NFS stage about 1 s.
package vmtest

import (
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/localcluster"

	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const (
	agentPort       = 10001
	agentPortString = "10001"
	pluginPort      = 10000
	// bootTimeout bounds how long Start waits for a VM's agent to answer.
	bootTimeout = 90 * time.Second
)

// Options shape a Cluster.
type Options struct {
	VMs      int    // number of VM nodes, default 2
	Prefix   string // netns name prefix, default "mgv"
	Binary   string // path of the modeguard binary to run as node plugin inside the VMs (host path; visible in the VM through 9p)
	MemoryMB int    // per VM, default 512
	// NodeDiskMB, when set, gives each VM a disk of its own of that size
	// (ext4, a sparse file in its directory) in place of the tmpfs at
	// Path(): what the node keeps there (plugin state, staging and target
	// paths) survives Reboot, as a node's disk survives a reboot.
	NodeDiskMB int
}

// Cluster is a server namespace with a bridge and VMs attached to it.
type Cluster struct {
	Server   netip.Addr // the server netns bridge address (ganesha/controller live here)
	ServerNS string     // /run/netns/<name> of the server namespace
	WorkDir  string     // host dir for this cluster (logs etc.)
	VMs      []*VM

	tb      testing.TB
	opts    Options
	img     Image
	nsName  string
	nsMade  bool
	taps    []string
	client  *http.Client
	mu      sync.Mutex
	cleaned bool
}

// VM is one virtual machine of a Cluster.
type VM struct {
	Name string     // e.g. "vm1"
	Addr netip.Addr // its address on the bridge, e.g. 10.99.X.21

	c       *Cluster
	tap     string
	dir     string // WorkDir/<Name>: console and plugin logs
	local   string // WorkDir/<Name>/local: a tmpfs inside the VM, or its node disk
	console string
	cmd     *exec.Cmd
	done    chan struct{} // closed when qemu has exited
	waitErr error
	// consoleShown: a boot failure already reported the console.
	consoleShown bool
	// maxVolumes is the limit the last started plugin reports (NodeID).
	maxVolumes int64
}

var safePath = regexp.MustCompile(`^/[A-Za-z0-9/._-]+$`)

// Start prepares kernel+initramfs (cached across runs), the namespace and
// bridge, boots the VMs in parallel, waits for each VM's agent to answer
// (failing with the VM's console log tail after 90 s), and registers a
// cleanup that stops every qemu by PID (SIGTERM, then SIGKILL), deletes the
// taps and the namespace, and reports leftovers. It skips the test when not
// root, or when qemu-system-x86_64 is missing, or when the image is not
// cached and apt-get download is not available.
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("vmtest: needs root (network namespaces, tap devices, qemu)")
	}
	for _, tool := range []string{"qemu-system-x86_64", "ip", "nsenter", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("vmtest: %s is not installed (Debian: qemu-system-x86, iproute2, util-linux)", tool)
		}
	}
	if opts.VMs == 0 {
		opts.VMs = 2
	}
	if opts.VMs < 0 || opts.VMs > 200 {
		t.Fatalf("vmtest: %d VMs", opts.VMs)
	}
	if opts.Prefix == "" {
		opts.Prefix = "mgv"
	}
	if opts.MemoryMB == 0 {
		opts.MemoryMB = 512
	}
	if opts.Binary != "" {
		abs, err := filepath.Abs(opts.Binary)
		if err != nil {
			t.Fatalf("vmtest: %v", err)
		}
		if _, err := os.Stat(abs); err != nil {
			t.Fatalf("vmtest: the plugin binary: %v", err)
		}
		opts.Binary = abs
	}

	t0 := time.Now()
	img, err := PrepareImage(t.Logf)
	var skip errSkip
	if errors.As(err, &skip) {
		t.Skipf("vmtest: %v", err)
	}
	if err != nil {
		t.Fatalf("vmtest: preparing the VM image: %v", err)
	}
	if d := time.Since(t0); d > time.Second {
		t.Logf("vmtest: VM image ready in %s", d.Round(time.Millisecond))
	}

	work, err := os.MkdirTemp("", "mgvm-")
	if err == nil && !safePath.MatchString(work) {
		// The path goes on the kernel command line and into qemu options.
		os.Remove(work)
		work, err = os.MkdirTemp("/var/tmp", "mgvm-")
	}
	if err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	if err := os.Chmod(work, 0o755); err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	x := 1 + rand.IntN(254)
	c := &Cluster{
		Server:  netip.AddrFrom4([4]byte{10, 99, byte(x), 1}),
		WorkDir: work,
		tb:      t,
		opts:    opts,
		img:     img,
		nsName:  fmt.Sprintf("%s-srv-%08x", opts.Prefix, rand.Uint32()),
	}
	c.ServerNS = "/run/netns/" + c.nsName
	c.client = &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			return c.Dialer()(ctx, addr)
		},
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     30 * time.Second,
	}}
	t.Cleanup(c.cleanup)

	if err := BuildAgent(filepath.Join(work, "agent")); err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	for i := range opts.VMs {
		name := "vm" + strconv.Itoa(i+1)
		v := &VM{
			Name: name, Addr: netip.AddrFrom4([4]byte{10, 99, byte(x), byte(21 + i)}),
			c: c, tap: "tap" + strconv.Itoa(i+1), dir: filepath.Join(work, name),
		}
		v.local = filepath.Join(v.dir, "local")
		v.console = filepath.Join(v.dir, "console.log")
		if err := os.MkdirAll(v.local, 0o755); err != nil {
			t.Fatalf("vmtest: %v", err)
		}
		if opts.NodeDiskMB > 0 {
			if err := MakeNodeDisk(v.diskPath(), opts.NodeDiskMB); err != nil {
				t.Fatalf("vmtest: %v", err)
			}
		}
		c.VMs = append(c.VMs, v)
	}
	reclaimStale(t)
	if err := c.register(); err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	if err := c.setupNetwork(); err != nil {
		t.Fatalf("vmtest: %v", err)
	}

	t0 = time.Now()
	for _, v := range c.VMs {
		if err := v.boot(img); err != nil {
			t.Fatalf("vmtest: %v", err)
		}
	}
	errs := make([]error, len(c.VMs))
	took := make([]time.Duration, len(c.VMs))
	var wg sync.WaitGroup
	for i, v := range c.VMs {
		wg.Go(func() {
			errs[i] = v.waitAgent(t0)
			took[i] = time.Since(t0)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	for i, v := range c.VMs {
		t.Logf("vmtest: %s (%s) up in %s", v.Name, v.Addr, took[i].Round(time.Millisecond))
	}
	for _, v := range c.VMs {
		if err := v.setHostname(); err != nil {
			t.Fatalf("vmtest: %v", err)
		}
	}
	return c
}

// setHostname names the VM after itself. The NFSv4 client names itself to
// the server by the host name, and every VM boots as "(none)": the server
// would take the VMs for one client, each mount replacing the other's state
// (opens and locks). Named after the VM, as real nodes have names of their
// own.
func (v *VM) setHostname() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, code, err := v.Run(ctx, "hostname", v.Name)
	if err != nil || code != 0 {
		return fmt.Errorf("naming %s: exit %d, %v: %s", v.Name, code, err, out)
	}
	return nil
}

func (v *VM) diskPath() string { return filepath.Join(v.dir, "disk.img") }

// MakeNodeDisk makes a sparse file of mb MiB holding an empty ext4, a VM's
// node disk (Machine.Disk).
func MakeNodeDisk(path string, mb int) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = f.Truncate(int64(mb) << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", path).CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.ext4 %s: %v: %s", path, err, out)
	}
	return nil
}

// Reboot cuts the VM's power (SIGKILL to its qemu, by PID: nothing in the
// guest gets to flush or unmount) and boots it again with the same name,
// address and node disk, returning once its agent answers. Everything the
// kernel held is gone, mounts and loop devices included; what the node
// wrote to its disk (Options.NodeDiskMB) stays. The node plugin is not
// started again: that is StartPlugin's, as it is the kubelet's.
func (v *VM) Reboot(ctx context.Context) error {
	if v.cmd == nil {
		return fmt.Errorf("%s: not running", v.Name)
	}
	_ = v.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-v.done:
	case <-ctx.Done():
		return fmt.Errorf("%s: qemu (pid %d) survives SIGKILL: %w", v.Name, v.cmd.Process.Pid, ctx.Err())
	}
	// Keep the console of the first boot for a failure's report.
	if err := os.Rename(v.console, v.console+".before-reboot"); err != nil && !os.IsNotExist(err) {
		return err
	}
	v.c.client.CloseIdleConnections()
	if err := v.boot(v.c.img); err != nil {
		return err
	}
	if err := v.waitAgent(time.Now()); err != nil {
		return err
	}
	return v.setHostname()
}

// BuildAgent builds test/vm/agent, static, at dst: a VM's init runs
// Machine.WorkDir/agent.
func BuildAgent(dst string) error {
	_, self, _, ok := runtime.Caller(0)
	if !ok {
		return errors.New("cannot tell where package vmtest's source is")
	}
	cmd := exec.Command("go", "build", "-o", dst, ".")
	cmd.Dir = filepath.Join(filepath.Dir(self), "..", "agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building the agent: %v: %s", err, out)
	}
	return nil
}

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// ownersDir records, for each server namespace, the test process that made
// it (a file named after the namespace holding the PID and the work dir),
// so that namespaces of test processes that were killed before their
// cleanup ran (a go test timeout) can be deleted by the next Start.
var ownersDir = filepath.Join(CacheDir, "netns")

func (c *Cluster) register() error {
	if err := os.MkdirAll(ownersDir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(ownersDir, c.nsName), fmt.Appendf(nil, "%d %s\n", os.Getpid(), c.WorkDir), 0o644)
}

// reclaimStale deletes the namespaces (and kills, by PID, whatever still
// runs in them) that test processes no longer running left behind.
func reclaimStale(t testing.TB) {
	entries, _ := os.ReadDir(ownersDir)
	for _, e := range entries {
		rec := filepath.Join(ownersDir, e.Name())
		data, err := os.ReadFile(rec)
		if err != nil {
			continue
		}
		var pid int
		var work string
		if _, err := fmt.Sscanf(string(data), "%d %s", &pid, &work); err != nil || pid <= 0 {
			continue
		}
		if err := syscall.Kill(pid, 0); err == nil || errors.Is(err, syscall.EPERM) {
			continue // its owner still runs
		}
		if _, err := os.Stat("/run/netns/" + e.Name()); err == nil {
			pids := ganeshatest.NamespacePIDs(e.Name())
			t.Logf("vmtest: deleting %s, left by test process %d that is gone (killing %v in it)", e.Name(), pid, pids)
			for _, p := range pids {
				_ = syscall.Kill(p, syscall.SIGKILL)
			}
			deadline := time.Now().Add(5 * time.Second)
			for len(ganeshatest.NamespacePIDs(e.Name())) > 0 && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if err := ipCmd("netns", "del", e.Name()); err != nil {
				t.Logf("vmtest: %v", err)
				continue
			}
		}
		if strings.HasPrefix(filepath.Base(work), "mgvm-") && len(localcluster.MountsUnder(work)) == 0 {
			os.RemoveAll(work)
		}
		os.Remove(rec)
	}
}

// setupNetwork creates the server namespace, its bridge and one tap per VM.
func (c *Cluster) setupNetwork() error {
	if err := ipCmd("netns", "add", c.nsName); err != nil {
		return err
	}
	c.mu.Lock()
	c.nsMade = true
	c.mu.Unlock()
	ns := c.nsName
	steps := [][]string{
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", ns, "link", "add", "br0", "type", "bridge"},
		{"-n", ns, "addr", "add", c.Server.String() + "/24", "dev", "br0"},
		{"-n", ns, "link", "set", "br0", "up"},
	}
	for _, s := range steps {
		if err := ipCmd(s...); err != nil {
			return err
		}
	}
	for _, v := range c.VMs {
		if err := ipCmd("-n", ns, "tuntap", "add", v.tap, "mode", "tap"); err != nil {
			return err
		}
		c.mu.Lock()
		c.taps = append(c.taps, v.tap)
		c.mu.Unlock()
		for _, s := range [][]string{
			{"-n", ns, "link", "set", v.tap, "master", "br0"},
			{"-n", ns, "link", "set", v.tap, "up"},
		} {
			if err := ipCmd(s...); err != nil {
				return err
			}
		}
	}
	return nil
}

// Machine is what QemuArgs needs to know of one VM.
type Machine struct {
	Name     string     // the VM's name (its directory below WorkDir)
	Addr     netip.Addr // its address on the bridge, a /24
	WorkDir  string     // host directory holding agent and Name/local (safePath)
	MemoryMB int
	Tap      string // the tap device its network card is attached to
	Console  string // file the serial console is written to
	Disk     string // the node disk (MakeNodeDisk), mounted at WorkDir/Name/local; "" for a tmpfs there
	// TBSizeMB bounds qemu's cache of translated code (0: qemu's default,
	// 1 GiB, which a VM running a kubelet fills to about half).
	TBSizeMB int
}

// QemuArgs returns the arguments of qemu-system-x86_64 that boot m from img
// under software emulation: one CPU, the host's root over 9p, one network
// card on m.Tap, the node disk if any. The VM's init (initScript) mounts
// the host's root, chroots into it and runs WorkDir/agent (BuildAgent).
func QemuArgs(img Image, m Machine) []string {
	a := m.Addr.As4()
	disk := 0
	if m.Disk != "" {
		disk = 1
	}
	accel := "tcg,thread=multi"
	if m.TBSizeMB > 0 {
		accel += ",tb-size=" + strconv.Itoa(m.TBSizeMB)
	}
	args := []string{
		"-accel", accel, "-cpu", "max", "-smp", "1", "-m", strconv.Itoa(m.MemoryMB),
		"-nographic", "-nodefaults", "-no-user-config", "-no-reboot",
		"-kernel", img.Kernel, "-initrd", img.Initrd,
		// mitigations=off: the guest's Spectre mitigations (retpolines, RSB
		// filling on every context switch) guard against a CPU the
		// emulator is not, and cost it indirect-jump lookups.
		"-append", fmt.Sprintf("console=ttyS0 quiet panic=-1 mitigations=off mgname=%s mgaddr=%s/24 mgwork=%s mgdisk=%d", m.Name, m.Addr, m.WorkDir, disk),
		"-serial", "file:" + m.Console,
		"-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,id=hostroot,multidevs=remap",
		"-netdev", "tap,id=net0,ifname=" + m.Tap + ",script=no,downscript=no",
		"-device", fmt.Sprintf("virtio-net-pci,netdev=net0,romfile=,mac=52:54:00:%02x:%02x:%02x", a[1], a[2], a[3]),
	}
	if m.Disk != "" {
		args = append(args, "-drive", "file="+m.Disk+",format=raw,if=none,id=disk0",
			"-device", "virtio-blk-pci,drive=disk0,romfile=")
	}
	return args
}

// boot starts the VM's qemu inside the server namespace.
func (v *VM) boot(img Image) error {
	c := v.c
	m := Machine{Name: v.Name, Addr: v.Addr, WorkDir: c.WorkDir, MemoryMB: c.opts.MemoryMB, Tap: v.tap, Console: v.console}
	if c.opts.NodeDiskMB > 0 {
		m.Disk = v.diskPath()
	}
	args := append([]string{"--net=" + c.ServerNS, "--", "qemu-system-x86_64"}, QemuArgs(img, m)...)
	logFile, err := os.Create(filepath.Join(v.dir, "qemu.log"))
	if err != nil {
		return err
	}
	cmd := exec.Command("nsenter", args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// nsenter execs qemu, so the PID is qemu's. Pdeathsig: a test binary
	// killed by its timeout takes its VMs with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return fmt.Errorf("starting qemu for %s: %v", v.Name, err)
	}
	v.cmd, v.done = cmd, make(chan struct{})
	go func() {
		v.waitErr = cmd.Wait()
		logFile.Close()
		close(v.done)
	}()
	return nil
}

// waitAgent waits until the VM's agent answers, or the VM stops, or
// bootTimeout has passed since t0.
func (v *VM) waitAgent(t0 time.Time) error {
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		var resp struct{}
		err := v.call(ctx, "/ping", struct{}{}, &resp)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-v.done:
			v.consoleShown = true
			msg := fmt.Sprintf("%s stopped while booting (qemu: %v)", v.Name, v.waitErr)
			if q := strings.TrimSpace(readTail(filepath.Join(v.dir, "qemu.log"), 20)); q != "" {
				msg += "; qemu said:\n" + q
			}
			return fmt.Errorf("%s\nconsole:\n%s", msg, v.ConsoleTail(60))
		case <-time.After(200 * time.Millisecond):
		}
		if time.Since(t0) > bootTimeout {
			v.consoleShown = true
			return fmt.Errorf("%s: no answer from its agent within %s (last: %v); console:\n%s",
				v.Name, bootTimeout, err, v.ConsoleTail(60))
		}
	}
}

// Dialer returns a dialer that makes TCP connections from inside the server
// namespace, for grpc.WithContextDialer and the like.
func (c *Cluster) Dialer() func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		return dialInNetNS(ctx, c.ServerNS, addr)
	}
}

// dialInNetNS dials from a fresh goroutine locked to its thread, which
// enters the namespace for the socket() call and goes back. Should going
// back fail, the goroutine ends still locked, and the runtime throws that
// thread away rather than letting it run other goroutines in the wrong
// namespace.
func dialInNetNS(ctx context.Context, nsPath, addr string) (net.Conn, error) {
	type result struct {
		conn net.Conn
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		conn, err, restored := dialLocked(ctx, nsPath, addr)
		if restored {
			runtime.UnlockOSThread()
		}
		ch <- result{conn, err}
	}()
	r := <-ch
	return r.conn, r.err
}

func dialLocked(ctx context.Context, nsPath, addr string) (conn net.Conn, err error, restored bool) {
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return nil, err, true
	}
	defer orig.Close()
	target, err := os.Open(nsPath)
	if err != nil {
		return nil, err, true
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		return nil, fmt.Errorf("entering %s: %w", nsPath, err), true
	}
	defer func() {
		if rerr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); rerr != nil {
			restored = false
			if conn != nil {
				conn.Close()
				conn = nil
			}
			err = fmt.Errorf("leaving %s: %w", nsPath, rerr)
		}
	}()
	var d net.Dialer
	conn, err = d.DialContext(ctx, "tcp", addr)
	return conn, err, true
}

// cleanup stops the VMs, deletes the taps and the namespace and reports
// what else was left. Calling it again does nothing.
func (c *Cluster) cleanup() {
	c.mu.Lock()
	if c.cleaned {
		c.mu.Unlock()
		return
	}
	c.cleaned = true
	c.mu.Unlock()
	t := c.tb
	failed := t.Failed()
	if failed {
		for _, v := range c.VMs {
			if !v.consoleShown {
				t.Logf("vmtest: %s console (tail):\n%s", v.Name, v.ConsoleTail(40))
			}
			if log, err := os.ReadFile(v.pluginLogPath()); err == nil {
				t.Logf("vmtest: %s node plugin log (tail):\n%s", v.Name, tailLines(string(log), 60))
			}
		}
	}
	c.client.CloseIdleConnections()
	for _, v := range c.VMs {
		if v.cmd == nil {
			continue
		}
		_ = v.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-v.done:
		case <-time.After(5 * time.Second):
			t.Errorf("vmtest: qemu of %s (pid %d) ignored SIGTERM; killing it", v.Name, v.cmd.Process.Pid)
			_ = v.cmd.Process.Signal(syscall.SIGKILL)
			select {
			case <-v.done:
			case <-time.After(10 * time.Second):
				t.Errorf("vmtest: qemu of %s (pid %d) survives SIGKILL", v.Name, v.cmd.Process.Pid)
			}
		}
	}
	c.mu.Lock()
	nsMade, taps := c.nsMade, append([]string(nil), c.taps...)
	c.mu.Unlock()
	if nsMade {
		if pids := ganeshatest.NamespacePIDs(c.nsName); len(pids) > 0 {
			t.Errorf("vmtest: processes still running in %s: %v; killing them", c.nsName, pids)
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			deadline := time.Now().Add(5 * time.Second)
			for len(ganeshatest.NamespacePIDs(c.nsName)) > 0 && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
		}
		for _, tap := range taps {
			if err := ipCmd("-n", c.nsName, "link", "del", tap); err != nil {
				t.Errorf("vmtest: %v", err)
			}
		}
		if err := ipCmd("netns", "del", c.nsName); err != nil {
			t.Errorf("vmtest: %v", err)
		} else {
			os.Remove(filepath.Join(ownersDir, c.nsName))
		}
	} else {
		os.Remove(filepath.Join(ownersDir, c.nsName))
	}
	for _, m := range localcluster.MountsUnder(c.WorkDir) {
		t.Errorf("vmtest: leftover mount %s on the host; unmounting it", m)
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			t.Errorf("vmtest: unmounting %s: %v", m, err)
		}
	}
	if failed || t.Failed() {
		t.Logf("vmtest: keeping %s (console, qemu and plugin logs)", c.WorkDir)
		return
	}
	if err := os.RemoveAll(c.WorkDir); err != nil {
		t.Errorf("vmtest: %v", err)
	}
}

func readTail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	return tailLines(string(data), n)
}

// escapes are the terminal control sequences SeaBIOS writes to the console.
var escapes = regexp.MustCompile("\x1b(\\[[0-9;?]*[A-Za-z]|c)")

func tailLines(s string, n int) string {
	s = escapes.ReplaceAllString(strings.ReplaceAll(s, "\r", ""), "")
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
