package integration

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
	"github.com/modeguard/modeguard/pkg/peer"
	"github.com/modeguard/modeguard/test/certs"
	"github.com/modeguard/modeguard/test/testenv"
)

// takeoverFault is a way for the acting controller to fail.
type takeoverFault struct {
	name string
	// inject makes the acting controller fail, and returns once the
	// failure has taken effect.
	inject func(t *testing.T, r *takeoverRig)
	// end, unless nil, ends the failure once the other controller acts:
	// the former acting controller is then back, and must stand by.
	end func(t *testing.T, r *takeoverRig)
}

// takeoverFaults are the failures of design section 6, cases A to C.
var takeoverFaults = []takeoverFault{
	{name: "kill", inject: func(t *testing.T, r *takeoverRig) {
		p := r.controllers[0]
		if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		<-p.done
	}},
	{name: "cut-off", inject: func(t *testing.T, r *takeoverRig) {
		if err := r.net.SetNodeLink(0, false); err != nil {
			t.Fatal(err)
		}
	}, end: func(t *testing.T, r *takeoverRig) {
		if err := r.net.SetNodeLink(0, true); err != nil {
			t.Fatal(err)
		}
	}},
	{name: "freeze", inject: func(t *testing.T, r *takeoverRig) {
		p := r.controllers[0]
		if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		// The signal is sent; the process stops when the kernel next
		// handles it.
		waitFor(t, "the acting controller to stop", 10*time.Second, func() bool { return processState(p.cmd.Process.Pid) == "T" })
	}, end: func(t *testing.T, r *takeoverRig) {
		if err := r.controllers[0].cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
	}},
}

// TestTakeoverUnderAStream: two controllers of the storage targets of two
// zones and of the NFS target, each controller in a network namespace of
// its own, reaching the targets and each other over TCP with mutual TLS.
// A stream of controller calls goes
// to either controller while the acting one is killed, cut off from the
// network, or frozen and thawed once its term ran out. The other takes
// over within 30 s, as a prober through it measures; every call of the
// stream gets its final answer; and what the targets store afterwards is
// exactly what the acknowledged calls did. A former acting controller that
// comes back (cut off, then joined again; frozen, then thawed) steps down
// and changes nothing.
func TestTakeoverUnderAStream(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ip", "nsenter")
	bin := testenv.BuildBinary(t)
	// The NFS target runs ganesha; without it the stream is of block
	// volumes only.
	nfs := true
	for _, cmd := range []string{"ganesha.nfsd", "dbus-daemon", "mkfs.xfs", "mkfs.ext4"} {
		if _, err := exec.LookPath(cmd); err != nil {
			nfs = false
		}
	}
	if !nfs {
		t.Log("no NFS target: ganesha, its bus, mkfs.xfs or mkfs.ext4 are missing; the stream has block volumes only")
	}
	for _, fault := range takeoverFaults {
		t.Run(fault.name, func(t *testing.T) {
			t.Parallel()
			takeoverUnderAStream(t, bin, fault, nfs)
		})
	}
}

// takeoverWorkers is how many workers send the stream's volume calls (a
// fencer sends the fence calls besides).
const takeoverWorkers = 4

// takeoverBound is the longest take-over the design allows (section 8.3,
// R9): leases run out at most 15 s after the last renewal, and the standby
// reads them every second.
const takeoverBound = 30 * time.Second

func takeoverUnderAStream(t *testing.T, bin string, fault takeoverFault, nfs bool) {
	began := time.Now()
	r := newTakeoverRig(t, bin, nfs)
	acting, standby := r.controllers[0], r.controllers[1]
	s := startStream(t, []*grpc.ClientConn{acting.conn, standby.conn}, takeoverWorkers, nfs)
	defer func() {
		if t.Failed() {
			s.giveUp()
		}
	}()
	pr := startProber(standby.conn)
	defer pr.finish()
	s.waitAcknowledged(t, "before the fault", time.Time{}, 5)

	// The fault strikes while calls are under way, which the take-over
	// must neither lose nor do twice.
	for deadline := time.Now().Add(time.Minute); s.inFlight.Load() < takeoverWorkers/2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("never %d calls in flight at once", takeoverWorkers/2)
		}
	}
	faultAt := time.Now()
	fault.inject(t, r)
	// Only a probe sent once the fault took effect shows that the standby
	// acts: one sent before may have reached the acting controller.
	struck := time.Now()
	var took time.Duration
	waitFor(t, "the standby to answer the prober", 2*takeoverBound, func() bool {
		var ok bool
		took, ok = pr.firstSuccessAfter(struck)
		took += struck.Sub(faultAt)
		return ok
	})
	t.Logf("%s: the standby answered ListVolumes %v after the fault (%d probes failed before)",
		fault.name, took.Round(100*time.Millisecond), pr.failedBefore(faultAt, took))
	if took > takeoverBound {
		t.Errorf("%s: the take-over took %v, more than %v", fault.name, took.Round(100*time.Millisecond), takeoverBound)
	}
	s.waitAcknowledged(t, "after the take-over", faultAt.Add(took), 2)
	phases := fmt.Sprintf("set up and stream %v, fault to take-over %v, stream after it %v",
		faultAt.Sub(began).Round(100*time.Millisecond), took.Round(100*time.Millisecond), time.Since(faultAt.Add(took)).Round(100*time.Millisecond))

	// What the former acting controller logs once back.
	var backLog string
	if fault.end != nil {
		logFrom := len(testenv.ReadFile(acting.log))
		fault.end(t, r)
		ended := time.Now()
		waitFor(t, "the former acting controller to step down", time.Minute, func() bool {
			return strings.Contains(testenv.ReadFile(acting.log)[logFrom:], "Stepping down as the acting controller")
		})
		t.Logf("%s: the former acting controller, back, stepped down within %v", fault.name, time.Since(ended).Round(100*time.Millisecond))
		// It takes calls again, as a standby forwarding them.
		s.waitAcknowledged(t, "with the former acting controller back", ended, 2)
		backLog = testenv.ReadFile(acting.log)[logFrom:]
		phases += fmt.Sprintf(", back to a standby that forwards %v", time.Since(ended).Round(100*time.Millisecond))
		t.Logf("%s: back, the former acting controller refused %d calls itself, the targets unasked", fault.name,
			len(slices.DeleteFunc(strings.Split(backLog, "\n"), func(l string) bool { return !strings.Contains(l, "not sent: this controller") })))
	}

	stopping := time.Now()
	ledger := s.finish()
	pr.finish()
	if acted := actedBack(backLog, ledger, faultAt, struck); len(acted) > 0 {
		t.Errorf("%s: the former acting controller, back, acted on calls sent to it after the fault:\n%s", fault.name, strings.Join(acted, "\n"))
	}
	// Only what the targets wrote counts: the controllers stop first. The
	// NFS target is read as it runs, with no controller to change it (its
	// records are on the filesystem it mounts); the block pools once their
	// targets stopped, as they are left.
	for _, p := range r.controllers {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
		p.stop()
	}
	st := newTargetState()
	if r.nfsTarget != nil {
		if err := st.readNFSTarget(filepath.Join(r.nfsDir, "nfs"), filepath.Join(r.nfsDir, "ganesha", "exports")); err != nil {
			t.Fatalf("reading the NFS target's records: %v", err)
		}
		r.nfsTarget.Stop()
	}
	for _, p := range r.targets {
		p.Stop()
	}
	reportStream(t, ledger, faultAt)
	for _, p := range callProblems(ledger) {
		t.Error(p)
	}
	phases += fmt.Sprintf(", stopping %v", time.Since(stopping).Round(100*time.Millisecond))
	if err := st.readBlockPools(context.Background(), r.pools); err != nil {
		t.Fatalf("reading the targets' pools: %v", err)
	}
	problems := stateProblems(ledger, st)
	for _, p := range problems {
		t.Error(p)
	}
	nfsVolumes := len(slices.DeleteFunc(slices.Clone(st.volumes), func(v *backend.Volume) bool { return v.Zone != "" }))
	t.Logf("%s: the targets hold %d volumes (%d of NFS) and %d snapshots; %d problems; the subtest took %v (%s)",
		fault.name, len(st.volumes), nfsVolumes, len(st.snapshots), len(problems), time.Since(began).Round(time.Second), phases)
}

// takeoverRig is the set-up of a take-over test: a network of namespaces
// (ganeshatest), the storage targets of two zones (and, with nfs, the NFS
// target) in its server namespace, serving TCP with mutual TLS, and two
// controllers, each in a node namespace, with peer listeners.
// controllers[0] acts.
type takeoverRig struct {
	net         *ganeshatest.Network
	pools       map[string]string // zone: pool directory
	targets     []*testenv.Target // the block targets
	nfsTarget   *testenv.Target   // nil without NFS
	nfsDir      string            // its export root and ganesha's files are under it
	controllers []*crashProc
}

func newTakeoverRig(t *testing.T, bin string, nfs bool) *takeoverRig {
	r := &takeoverRig{net: ganeshatest.Setup(t, ganeshatest.Options{Nodes: 2, Prefix: "mgh"}), pools: map[string]string{}}
	work := t.TempDir()
	ca := certs.NewCA(t, "modeguard")
	targetTLS := ca.Server(r.net.Server.Addr.String())
	// One certificate per controller, for the targets and for the other
	// controller alike.
	controllerTLS := ca.Peer(peer.ServerName)
	tlsArgs := func(f certs.Files) []string {
		return []string{"--tls-cert=" + f.Cert, "--tls-key=" + f.Key, "--tls-ca=" + f.CA}
	}
	var targetArgs []string
	for i, zone := range streamZones {
		pool := filepath.Join(work, "pool-"+zone)
		if err := os.MkdirAll(pool, 0o700); err != nil {
			t.Fatal(err)
		}
		r.pools[zone] = pool
		addr := netip.AddrPortFrom(r.net.Server.Addr, uint16(9870+i)).String()
		p := testenv.NewTCPTarget(t, bin, r.net.Server.Path, addr, filepath.Join(work, "target-"+zone+".log"),
			append([]string{"--roles", "target", "-v", "2", "--block-pool=" + zone + "=" + pool, "--block-pool-filesystem=direct"},
				tlsArgs(targetTLS)...)...)
		p.Start(context.Background())
		t.Cleanup(p.Stop)
		r.targets = append(r.targets, p)
		targetArgs = append(targetArgs, "--block-target="+zone+"="+addr)
	}
	if nfs {
		r.nfsDir = filepath.Join(work, "nfs-target")
		if err := os.MkdirAll(r.nfsDir, 0o700); err != nil {
			t.Fatal(err)
		}
		addr := netip.AddrPortFrom(r.net.Server.Addr, 9872).String()
		r.nfsTarget = testenv.NewTCPTarget(t, bin, r.net.Server.Path, addr, filepath.Join(work, "nfs-target.log"), append([]string{
			"--roles", "target", "-v", "2",
			"--nfs-export-root", filepath.Join(r.nfsDir, "nfs"), "--nfs-storage=" + nfsStorage(), "--nfs-pool-size=1Gi",
			// Where the images storage serves, ext4 images: xfs ones are
			// 300 MiB at least, and slower to make.
			"--nfs-image-filesystem=ext4",
			"--nfs-server", r.net.Server.Addr.String(), "--nfs-ganesha-dir", filepath.Join(r.nfsDir, "ganesha")},
			tlsArgs(targetTLS)...)...)
		r.nfsTarget.Start(context.Background())
		t.Cleanup(func() {
			r.nfsTarget.Stop()
			testenv.CleanupUnder(t, r.nfsDir)
		})
		targetArgs = append(targetArgs, "--nfs-target="+addr)
	}
	for i := range 2 {
		name := fmt.Sprintf("controller-%d", i+1)
		listen := netip.AddrPortFrom(r.net.Nodes[i].Addr, 9871).String()
		p := &crashProc{t: t, name: name, bin: bin, netns: r.net.Nodes[i].Path,
			socket: filepath.Join(work, name+".sock"), log: filepath.Join(work, name+".log"),
			args: slices.Concat([]string{"--roles", "controller", "-v", "2", "--controller-peer-listen=tcp://" + listen},
				tlsArgs(controllerTLS), targetArgs)}
		p.start()
		t.Cleanup(func() {
			// Thawed first, should the test have failed with it frozen.
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			p.stop()
			if t.Failed() {
				t.Logf("%s log:\n%s", name, testenv.ReadFile(p.log))
			}
		})
		r.controllers = append(r.controllers, p)
		// The first acts before the second starts, which then stands by.
		if i == 0 {
			untilActing(t, p)
		}
	}
	return r
}

// nfsStorage is how the NFS target keeps its volumes: directories with
// project quotas on an xfs it mounts, where the kernel's xfs has quotas,
// else an image per volume.
func nfsStorage() string {
	if projquota.KernelSupportsQuota() {
		return "quota"
	}
	return "images"
}

// waitAcknowledged waits until every worker and the fencer had at least
// n calls acknowledged after since.
func (s *stream) waitAcknowledged(t *testing.T, when string, since time.Time, n int) {
	t.Helper()
	var counts []int
	waitFor(t, fmt.Sprintf("%d calls of each worker acknowledged %s", n, when), 2*time.Minute, func() bool {
		counts = s.acknowledgedSince(since)
		return slices.Min(counts) >= n
	})
}

// waitFor polls cond every 100 ms until it holds, failing the test after
// timeout.
func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", timeout, what)
		}
	}
}

// processState is the state letter of /proc/PID/stat (T: stopped).
func processState(pid int) string {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	// pid (comm) state ...: comm may hold spaces, so from the last ')'.
	_, rest, _ := strings.Cut(string(data[strings.LastIndexByte(string(data), ')')+1:]), " ")
	state, _, _ := strings.Cut(rest, " ")
	return state
}

// actedBack lists the lines of a former acting controller's log, from
// when it came back, that say it changed the storage for a call that was
// not under way at the fault (from faultAt to struck). Those lines a
// controller logs once a target did what a call asked; a call it had sent
// a target before the fault may have been done then, and its answer read
// only once the controller was back, but any other is a call its ended
// term should have refused.
func actedBack(log string, ledger []*ledgerCall, faultAt, struck time.Time) []string {
	// What identifies a call's object in the lines it logs.
	var underWay []string
	for _, c := range ledger {
		if !slices.ContainsFunc(c.attempts, func(a attempt) bool { return !a.start.After(struck) && !a.end.Before(faultAt) }) {
			continue
		}
		switch {
		case c.cidr != "":
			underWay = append(underWay, c.cidr)
		case c.kind == callCreate || c.kind == callSnapshot:
			underWay = append(underWay, `name="`+c.name+`"`)
		default:
			underWay = append(underWay, `volumeID="`+c.volumeID+`"`)
		}
	}
	var out []string
	for _, line := range strings.Split(log, "\n") {
		acted := slices.ContainsFunc([]string{"Volume created", "Volume deleted", "Volume published to node", "Volume unpublished from",
			"Snapshot created", "Snapshot deleted", "Network fence recorded", "Network fence lifted"}, func(done string) bool {
			return strings.Contains(line, `"`+done+`"`)
		})
		if acted && !slices.ContainsFunc(underWay, func(id string) bool { return strings.Contains(line, id) }) {
			out = append(out, line)
		}
	}
	return out
}

// reportStream logs the stream's figures: calls, attempts, those the
// fault caught in flight, the longest call and the longest time the
// stream had no call acknowledged.
func reportStream(t *testing.T, ledger []*ledgerCall, faultAt time.Time) {
	kinds := map[callKind]int{}
	attempts, retried, caught := 0, 0, 0
	var longest *ledgerCall
	var ends []time.Time
	for _, c := range ledger {
		kinds[c.kind]++
		attempts += len(c.attempts)
		if len(c.attempts) > 1 {
			retried++
		}
		if c.start.Before(faultAt) && c.end.After(faultAt) {
			caught++
		}
		if longest == nil || c.end.Sub(c.start) > longest.end.Sub(longest.start) {
			longest = c
		}
		if c.acknowledged() {
			ends = append(ends, c.end)
		}
	}
	slices.SortFunc(ends, func(a, b time.Time) int { return a.Compare(b) })
	var gap time.Duration
	for i := 1; i < len(ends); i++ {
		gap = max(gap, ends[i].Sub(ends[i-1]))
	}
	t.Logf("stream: %d calls %v, %d attempts, %d calls retried, %d in flight at the fault; longest call %v (%s); longest time without an acknowledged call %v",
		len(ledger), kinds, attempts, retried, caught, longest.end.Sub(longest.start).Round(100*time.Millisecond), longest, gap.Round(100*time.Millisecond))
}
