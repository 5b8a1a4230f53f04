// Package ganeshatest builds throw-away networks of namespaces for tests
// that run a real ganesha and real NFS clients on one machine.
//
// Setup creates, with iproute2:
//
//	<prefix>-srv-<suffix>   the server namespace: bridge br0 with 10.99.X.1/24, lo up
//	<prefix>-n1-<suffix>    node 1: eth0 = 10.99.X.11/24, its veth peer is a port of br0
//	<prefix>-n2-<suffix>    node 2: eth0 = 10.99.X.12/24, likewise
//	...
//
// where <suffix> is random and X is a random number in 1..254. Every
// interface lives inside a namespace of this network (the veth pair is
// created inside the node namespace with its peer placed directly into the
// server namespace), so nothing is added to the caller's namespace and
// networks of parallel tests cannot collide. Run the server in the server
// namespace (ganesha.ServerConfig.NetNSPath = Network.Server.Path) and
// clients with Node.Run, which enters the node's network namespace only.
//
// Cleanup (registered by Setup with tb.Cleanup, and safe to call again)
// kills by PID whatever still runs in the namespaces, reports that as a test
// error, and deletes the namespaces, which removes the bridge and the veths.
package ganeshatest

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Options shape a Network.
type Options struct {
	Nodes  int    // node namespaces, 2 when zero
	Prefix string // namespace name prefix, "mgt" when empty
}

// Namespace is one network namespace of a Network.
type Namespace struct {
	Name string     // as "ip netns" knows it
	Path string     // /run/netns/<Name>
	Addr netip.Addr // its address on the bridge's subnet
}

// Network is a server namespace with a bridge and node namespaces attached
// to it.
type Network struct {
	Suffix string
	Subnet netip.Prefix // 10.99.X.0/24
	Bridge string       // the bridge's name inside the server namespace
	Server Namespace
	Nodes  []Namespace

	mu      sync.Mutex
	created []string // namespaces created so far, deleted by Cleanup
	cleaned bool
}

// RequireRoot skips the test unless it runs as root.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("skipping: needs root (network namespaces, ganesha)")
	}
}

// RequireCommands skips the test when any of the commands is not in PATH,
// naming the Debian package that provides it when known.
func RequireCommands(tb testing.TB, names ...string) {
	tb.Helper()
	pkgs := map[string]string{
		"ip": "iproute2", "nsenter": "util-linux",
		"ganesha.nfsd": "nfs-ganesha nfs-ganesha-vfs", "dbus-daemon": "dbus-daemon",
		"nfs-cp": "libnfs-utils", "nfs-cat": "libnfs-utils", "nfs-ls": "libnfs-utils",
	}
	var missing []string
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			if p := pkgs[n]; p != "" {
				n += " (Debian: " + p + ")"
			}
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		tb.Skipf("skipping: not installed: %s", strings.Join(missing, ", "))
	}
}

// Setup creates a Network and registers its Cleanup. It skips the test when
// not root or when ip is missing, and fails it when a step fails.
func Setup(tb testing.TB, opts Options) *Network {
	tb.Helper()
	RequireRoot(tb)
	RequireCommands(tb, "ip", "nsenter")
	if opts.Nodes == 0 {
		opts.Nodes = 2
	}
	if opts.Nodes < 0 || opts.Nodes > 200 {
		tb.Fatalf("ganeshatest: %d nodes", opts.Nodes)
	}
	if opts.Prefix == "" {
		opts.Prefix = "mgt"
	}
	x := 1 + rand.IntN(254)
	n := &Network{
		Suffix: fmt.Sprintf("%08x", rand.Uint32()),
		Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 99, byte(x), 0}), 24),
		Bridge: "br0",
	}
	tb.Cleanup(func() { Cleanup(tb, n) })
	addr := func(host byte) netip.Addr { return netip.AddrFrom4([4]byte{10, 99, byte(x), host}) }
	n.Server = n.namespace(opts.Prefix+"-srv-"+n.Suffix, addr(1))
	for i := range opts.Nodes {
		n.Nodes = append(n.Nodes, n.namespace(opts.Prefix+"-n"+strconv.Itoa(i+1)+"-"+n.Suffix, addr(byte(11+i))))
	}
	for _, ns := range append([]Namespace{n.Server}, n.Nodes...) {
		if err := ipCmd("netns", "add", ns.Name); err != nil {
			tb.Fatalf("ganeshatest: %v", err)
		}
		n.mu.Lock()
		n.created = append(n.created, ns.Name)
		n.mu.Unlock()
		if err := ipCmd("-n", ns.Name, "link", "set", "lo", "up"); err != nil {
			tb.Fatalf("ganeshatest: %v", err)
		}
	}
	srv := n.Server.Name
	prefix := "/" + strconv.Itoa(n.Subnet.Bits())
	steps := [][]string{
		{"-n", srv, "link", "add", n.Bridge, "type", "bridge"},
		{"-n", srv, "addr", "add", n.Server.Addr.String() + prefix, "dev", n.Bridge},
		{"-n", srv, "link", "set", n.Bridge, "up"},
	}
	for i, node := range n.Nodes {
		port := nodePort(i)
		steps = append(steps,
			[]string{"-n", node.Name, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", srv},
			[]string{"-n", srv, "link", "set", port, "master", n.Bridge},
			[]string{"-n", srv, "link", "set", port, "up"},
			[]string{"-n", node.Name, "addr", "add", node.Addr.String() + prefix, "dev", "eth0"},
			[]string{"-n", node.Name, "link", "set", "eth0", "up"},
		)
	}
	for _, s := range steps {
		if err := ipCmd(s...); err != nil {
			tb.Fatalf("ganeshatest: %v", err)
		}
	}
	if _, err := exec.LookPath("ping"); err == nil {
		for _, node := range n.Nodes {
			if err := waitPing(node, n.Server.Addr); err != nil {
				tb.Fatalf("ganeshatest: %s cannot reach the server: %v", node.Name, err)
			}
		}
	}
	return n
}

// nodePort is the name, in the server namespace, of the bridge's port
// that node i's eth0 is the other end of.
func nodePort(i int) string { return "p" + strconv.Itoa(i+1) }

// SetNodeLink sets node i's port on the bridge up or down. Down cuts the
// node off in both directions, as a pulled cable does: its eth0 loses its
// carrier and nothing reaches it or leaves it, while its address and
// routes stay as they were, so that what runs there notices only by
// timeouts. Up joins it again.
func (n *Network) SetNodeLink(i int, up bool) error {
	if i < 0 || i >= len(n.Nodes) {
		return fmt.Errorf("ganeshatest: no node %d", i)
	}
	state := "down"
	if up {
		state = "up"
	}
	return ipCmd("-n", n.Server.Name, "link", "set", nodePort(i), state)
}

func (n *Network) namespace(name string, a netip.Addr) Namespace {
	return Namespace{Name: name, Path: "/run/netns/" + name, Addr: a}
}

// Cleanup kills by PID every process still in the network's namespaces
// (a test error: whoever started it should have stopped it), then deletes
// the namespaces. Calling it again does nothing.
func Cleanup(tb testing.TB, n *Network) {
	tb.Helper()
	if n == nil {
		return
	}
	n.mu.Lock()
	if n.cleaned {
		n.mu.Unlock()
		return
	}
	n.cleaned = true
	names := append([]string(nil), n.created...)
	n.mu.Unlock()
	for _, name := range names {
		pids := NamespacePIDs(name)
		if len(pids) > 0 {
			tb.Errorf("ganeshatest: processes still running in %s: %v; killing them", name, pids)
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			deadline := time.Now().Add(5 * time.Second)
			for len(NamespacePIDs(name)) > 0 && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
		}
		if err := ipCmd("netns", "del", name); err != nil {
			tb.Errorf("ganeshatest: %v", err)
		}
	}
}

// NamespacePIDs lists the processes in a named namespace ("ip netns pids").
func NamespacePIDs(name string) []int {
	out, err := exec.Command("ip", "netns", "pids", name).Output()
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// Names lists the namespaces of the network, server first.
func (n *Network) Names() []string {
	names := []string{n.Server.Name}
	for _, node := range n.Nodes {
		names = append(names, node.Name)
	}
	return names
}

// NFSURL is a libnfs URL for file in the export at pseudo on the server,
// NFSv4: nfs://<server><pseudo>/<file>?version=4. An empty file names the
// export's root directory; an empty pseudo the pseudo file system's root.
func (n *Network) NFSURL(pseudo, file string) string {
	if pseudo == "" {
		pseudo = "/"
	}
	u := "nfs://" + n.Server.Addr.String() + pseudo
	if file != "" {
		u = strings.TrimSuffix(u, "/") + "/" + file
	}
	return u + "?version=4"
}

// Command is name args run inside ns's network namespace, entered with
// "nsenter --net" (which executes name in place, so the PID is name's own).
// Not "ip netns exec": it also gives the command a mount namespace of its
// own, a private copy of every mount on the machine, and while the command
// runs the filesystems of other tests' mounts stay alive in that copy,
// their loop devices held open, after those tests have unmounted them. A
// detach then only takes effect once the command has exited.
func (ns Namespace) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + ns.Path, "--", name}, args...)...)
}

// Run runs name args inside ns and returns stdout; on failure the error
// includes stderr.
func (ns Namespace) Run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := ns.Command(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s in %s: %w: %s", name, strings.Join(args, " "), ns.Name, err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

// NFSCopy runs nfs-cp src dst in ns; either may be an nfs:// URL.
func (ns Namespace) NFSCopy(ctx context.Context, src, dst string) error {
	_, err := ns.Run(ctx, "nfs-cp", src, dst)
	return err
}

// NFSCat returns the content of the file at url, read with nfs-cat from ns.
func (ns Namespace) NFSCat(ctx context.Context, url string) ([]byte, error) {
	return ns.Run(ctx, "nfs-cat", url)
}

// NFSLs returns the names nfs-ls lists for the directory at url, from ns.
func (ns Namespace) NFSLs(ctx context.Context, url string) ([]string, error) {
	out, err := ns.Run(ctx, "nfs-ls", url)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 {
			names = append(names, f[len(f)-1])
		}
	}
	return names, nil
}

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func waitPing(ns Namespace, to netip.Addr) error {
	var err error
	for range 50 {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		_, err = ns.Run(ctx, "ping", "-c", "1", "-W", "1", to.String())
		cancel()
		if err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}
