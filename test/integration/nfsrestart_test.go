package integration

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/backend/nfs/imagestore"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/test/testenv"
)

// The NFS server across restarts of the controller: exports must always be
// the volume their record names, served from its own storage, however
// publishes, unpublishes, fences and kills of the controller interleave.
// Each test runs once per storage an NFS volume can have: one image per
// volume (xfs or ext4), loop-mounted on the server, and xfs project quotas
// (which need a kernel with xfs quota support: make test-vm runs them in a
// VM with Debian's kernel).

// identityFile is a file the tests put in each volume's root on the server
// at its first export, holding the volume id: an export that serves it
// serves that volume's own data.
const identityFile = ".modeguard-test-identity"

// nfsStorageKinds are the --nfs-storage choices the tests run with, each
// with the flags that select it.
var nfsStorageKinds = []struct {
	name  string
	flags []string
	quota bool
}{
	{name: "images-xfs", flags: []string{"--nfs-storage", "images", "--nfs-image-filesystem", "xfs"}},
	{name: "images-ext4", flags: []string{"--nfs-storage", "images", "--nfs-image-filesystem", "ext4"}},
	{name: "quota", flags: []string{"--nfs-storage", "quota", "--nfs-pool-size", "2Gi"}, quota: true},
}

// forEachNFSStorage runs f as a subtest per storage kind; the quota storage
// is skipped (saying why) on a kernel without xfs quota support.
func forEachNFSStorage(t *testing.T, f func(t *testing.T, flags []string)) {
	for _, k := range nfsStorageKinds {
		t.Run(k.name, func(t *testing.T) {
			if k.quota && !projquota.KernelSupportsQuota() {
				t.Skip("this kernel's xfs has no quota support (/proc/fs/xfs/xqmstat); make test-vm runs the quota storage in a VM")
			}
			f(t, k.flags)
		})
	}
}

// iterations is how often the restart sequences run, each with volumes of
// its own; MODEGUARD_NFS_RESTART_ITERATIONS overrides it.
func iterations(t *testing.T) int {
	if v := os.Getenv("MODEGUARD_NFS_RESTART_ITERATIONS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("MODEGUARD_NFS_RESTART_ITERATIONS=%q: want a positive number", v)
		}
		return n
	}
	return 20
}

// nfsWorld is a controller with the NFS backend and a fence list, its own
// ganesha, and node namespaces as clients, with the test's model of what
// must be served.
type nfsWorld struct {
	t    *testing.T
	ctx  context.Context
	net  *ganeshatest.Network
	ctrl *testenv.Controller
	gdir string
	work string

	// The model: each volume's attachments (node index -> read-only) and
	// the fenced nodes.
	vols   map[string]*modelVolume
	fenced map[int]bool
	// checks counts client checks: nfs-cp creates its file exclusively,
	// so every check writes files of new names.
	checks int
}

type modelVolume struct {
	name     string
	vol      *csi.Volume
	mode     accessmode.Mode
	attached map[int]bool // node -> read-only
	path     string       // its export's path on the server, once exported
	marked   bool         // identity file written
}

func newNFSWorld(t *testing.T, nodes int, flags ...string) *nfsWorld {
	t.Helper()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nsenter", "mkfs.xfs", "mkfs.ext4")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: nodes, Prefix: "mgr"})
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	t.Cleanup(cancel)
	args := append([]string{"--fence-file", filepath.Join(work, "state", "fences.json")}, flags...)
	ctrl, gdir := startNFSControllerIn(ctx, t, bin, net, work, args...)
	return &nfsWorld{t: t, ctx: ctx, net: net, ctrl: ctrl, gdir: gdir, work: work,
		vols: map[string]*modelVolume{}, fenced: map[int]bool{}}
}

func (w *nfsWorld) nodeID(i int) string {
	return nodeid.Node{Name: fmt.Sprintf("node-%d", i+1), Zone: "zone-a", Address: w.net.Nodes[i].Addr.String()}.String()
}

func (w *nfsWorld) fences() fence.FenceControllerClient {
	return fence.NewFenceControllerClient(w.ctrl.Conn())
}

func (w *nfsWorld) create(name string, mode accessmode.Mode) *modelVolume {
	w.t.Helper()
	resp, err := w.ctrl.CSI.CreateVolume(w.ctx, &csi.CreateVolumeRequest{
		Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(mode)},
		Parameters:         map[string]string{"backend": "nfs"},
	})
	if err != nil {
		w.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	v := &modelVolume{name: name, vol: resp.GetVolume(), mode: mode, attached: map[int]bool{}}
	w.vols[v.vol.GetVolumeId()] = v
	return v
}

// publish attaches v to node, as the model then expects.
func (w *nfsWorld) publish(v *modelVolume, node int) {
	w.t.Helper()
	readOnly := v.mode == accessmode.MultiNodeReaderOnly
	if _, err := w.ctrl.CSI.ControllerPublishVolume(w.ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.vol.GetVolumeId(), NodeId: w.nodeID(node), VolumeCapability: nfsCapability(v.mode), Readonly: readOnly,
	}); err != nil {
		w.t.Fatalf("publishing %s to node-%d: %v\n%s", v.vol.GetVolumeId(), node+1, err, w.ganeshaLogAbout(v))
	}
	v.attached[node] = readOnly
	w.mark(v)
}

func (w *nfsWorld) unpublish(v *modelVolume, node int) {
	w.t.Helper()
	if _, err := w.ctrl.CSI.ControllerUnpublishVolume(w.ctx, &csi.ControllerUnpublishVolumeRequest{
		VolumeId: v.vol.GetVolumeId(), NodeId: w.nodeID(node)}); err != nil {
		w.t.Fatalf("unpublishing %s from node-%d: %v", v.vol.GetVolumeId(), node+1, err)
	}
	delete(v.attached, node)
}

func (w *nfsWorld) remove(v *modelVolume) {
	w.t.Helper()
	for n := range v.attached {
		w.unpublish(v, n)
	}
	if _, err := w.ctrl.CSI.DeleteVolume(w.ctx, &csi.DeleteVolumeRequest{VolumeId: v.vol.GetVolumeId()}); err != nil {
		w.t.Fatalf("deleting %s: %v", v.vol.GetVolumeId(), err)
	}
	delete(w.vols, v.vol.GetVolumeId())
}

func cidrsOf(w *nfsWorld, nodes []int) []*fence.CIDR {
	var out []*fence.CIDR
	for _, n := range nodes {
		out = append(out, &fence.CIDR{Cidr: w.net.Nodes[n].Addr.String() + "/32"})
	}
	return out
}

func (w *nfsWorld) fence(nodes ...int) {
	w.t.Helper()
	if _, err := w.fences().FenceClusterNetwork(w.ctx, &fence.FenceClusterNetworkRequest{Cidrs: cidrsOf(w, nodes)}); err != nil {
		w.t.Fatalf("fencing nodes %v: %v\n%s", nodes, err, w.ganeshaLogTail())
	}
	for _, n := range nodes {
		w.fenced[n] = true
	}
}

func (w *nfsWorld) unfence(nodes ...int) {
	w.t.Helper()
	if _, err := w.fences().UnfenceClusterNetwork(w.ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: cidrsOf(w, nodes)}); err != nil {
		w.t.Fatalf("lifting the fence of nodes %v: %v\n%s", nodes, err, w.ganeshaLogTail())
	}
	for _, n := range nodes {
		delete(w.fenced, n)
	}
}

// kill ends the controller by SIGKILL, and with it its ganesha, and
// starts it again on the same directories.
func (w *nfsWorld) kill() {
	w.t.Helper()
	ganeshaPID, busPID := testenv.NFSServerPIDs(w.t, w.gdir)
	w.ctrl.Kill()
	testenv.WaitNFSServerGone(w.t, w.gdir, ganeshaPID, busPID)
	w.ctrl.Start(w.ctx)
}

// served is who the model says an export of v serves: "address RW|RO",
// sorted; none when no unfenced node holds it.
func (w *nfsWorld) served(v *modelVolume) []string {
	out := []string{}
	for n, ro := range v.attached {
		if w.fenced[n] {
			continue
		}
		access := "RW"
		if ro {
			access = "RO"
		}
		out = append(out, w.net.Nodes[n].Addr.String()+" "+access)
	}
	slices.Sort(out)
	return out
}

// fileName is the last element of v's export path (and of its pseudo path).
func fileName(v *modelVolume) string {
	return strings.NewReplacer(":", "_").Replace(v.vol.GetVolumeId())
}

// exportOf finds v's export among ganesha's.
func exportOf(v *modelVolume, exports []ganesha.ExportInfo) (ganesha.ExportInfo, bool) {
	for _, e := range exports {
		if filepath.Base(e.Path) == fileName(v) {
			return e, true
		}
	}
	return ganesha.ExportInfo{}, false
}

// mark writes v's identity file on the server, once: the first publish
// has made its storage usable, and ganesha's export says where it is.
func (w *nfsWorld) mark(v *modelVolume) {
	w.t.Helper()
	if v.marked || len(w.served(v)) == 0 {
		return
	}
	exports, err := testenv.NFSControl(w.t, w.gdir).Exports(w.ctx)
	if err != nil {
		w.t.Fatal(err)
	}
	e, ok := exportOf(v, exports)
	if !ok {
		w.t.Fatalf("%s is published, but ganesha has no export of it", v.vol.GetVolumeId())
	}
	v.path = e.Path
	if err := os.WriteFile(filepath.Join(v.path, identityFile), []byte(v.vol.GetVolumeId()), 0o644); err != nil {
		w.t.Fatalf("marking %s: %v", v.vol.GetVolumeId(), err)
	}
	v.marked = true
}

// checkServer holds the world against the model, as ganesha, the mount
// table and the loop devices report it, never as the records do: ganesha
// serves an export for exactly the volumes some unfenced node holds, to
// exactly those nodes; each from its path, which is the volume's own
// storage (its own image for the image storage) holding its identity
// file; and ganesha has taken that path's filesystem for it, by the
// device number the mount table has there.
func (w *nfsWorld) checkServer(when string) {
	w.t.Helper()
	control := testenv.NFSControl(w.t, w.gdir)
	exports, err := control.Exports(w.ctx)
	if err != nil {
		w.t.Fatalf("%s: listing ganesha's exports: %v", when, err)
	}
	unknown := map[uint16]ganesha.ExportInfo{}
	for _, e := range exports {
		unknown[e.ID] = e
	}
	filesystems, err := control.Filesystems(w.ctx)
	if err != nil {
		w.t.Fatalf("%s: listing ganesha's filesystems: %v", when, err)
	}
	table, err := mounts.All()
	if err != nil {
		w.t.Fatal(err)
	}
	for _, v := range w.vols {
		e, has := exportOf(v, exports)
		delete(unknown, e.ID)
		want := w.served(v)
		if len(want) == 0 {
			if has {
				w.t.Errorf("%s: ganesha exports %s (id %d, clients %v), which no unfenced node holds", when, v.vol.GetVolumeId(), e.ID, e.Clients)
			}
			continue
		}
		if !has {
			w.t.Errorf("%s: ganesha has no export of %s, which is published to %v", when, v.vol.GetVolumeId(), want)
			continue
		}
		got := []string{}
		for _, c := range e.Clients {
			got = append(got, c.Address.String()+" "+c.Access)
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			w.t.Errorf("%s: the export of %s serves %v, want %v", when, v.vol.GetVolumeId(), got, want)
		}
		if v.path != "" && e.Path != v.path {
			w.t.Errorf("%s: the export of %s serves %s, not its path %s", when, v.vol.GetVolumeId(), e.Path, v.path)
		}
		w.checkStorage(when, v, e.Path, table, filesystems)
	}
	for _, e := range unknown {
		w.t.Errorf("%s: ganesha exports %s (id %d), which is no volume of the test's", when, e.Path, e.ID)
	}
}

// checkStorage checks that path is v's own storage, and that ganesha
// resolved it to the filesystem mounted there.
func (w *nfsWorld) checkStorage(when string, v *modelVolume, path string, table []*mounts.Mount, filesystems []ganesha.Filesystem) {
	w.t.Helper()
	id := v.vol.GetVolumeId()
	if top := mounts.TopAt(table, path); top != nil {
		// The image storage: the volume's own image, through its loop device.
		image := filepath.Join(filepath.Dir(filepath.Dir(path)), imagestore.ImagesDirName, "volumes__"+filepath.Base(path)+".img")
		if !loop.ValidDevice(top.Source) {
			w.t.Errorf("%s: %s is mounted from %s, not from a loop device", when, path, top.Source)
		} else if ours, err := loop.BoundTo(top.Source, image); err != nil || !ours {
			backing, _ := loop.BackingFile(top.Source)
			w.t.Errorf("%s: %s is served from %s, which is bound to %s, not to its image %s (%v)", when, id, top.Source, backing, image, err)
		}
	}
	if got, err := os.ReadFile(filepath.Join(path, identityFile)); err != nil || string(got) != id {
		w.t.Errorf("%s: the storage at %s, exported for %s, holds the identity %q (%v)", when, path, id, got, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		w.t.Errorf("%s: %v", when, err)
		return
	}
	i := slices.IndexFunc(filesystems, func(f ganesha.Filesystem) bool {
		return f.Major == uint64(unix.Major(st.Dev)) && f.Minor == uint64(unix.Minor(st.Dev))
	})
	if i < 0 {
		w.t.Errorf("%s: ganesha knows no filesystem of device %d:%d, which holds the export of %s at %s (it knows %v)",
			when, unix.Major(st.Dev), unix.Minor(st.Dev), id, path, filesystems)
	} else if f := filesystems[i]; f.Path != path && !strings.HasPrefix(path, f.Path+"/") && f.Path != "/" {
		w.t.Errorf("%s: ganesha takes device %d:%d for the filesystem at %s, but %s's export at %s is on it",
			when, unix.Major(st.Dev), unix.Minor(st.Dev), f.Path, id, path)
	}
}

// checkClients holds the nodes against the model, over NFS: every node
// that holds an unfenced attachment reads the volume's identity and, if
// it holds it read/write, writes to it; every other node reads nothing.
// ganesha refuses opens during its grace period after a start, so this
// waits for it to end first.
func (w *nfsWorld) checkClients(when string) {
	w.t.Helper()
	testenv.WaitGraceEnded(w.ctx, w.t, w.gdir)
	w.checks++
	payload := filepath.Join(w.work, "payload")
	if err := os.WriteFile(payload, []byte(when), 0o644); err != nil {
		w.t.Fatal(err)
	}
	for _, v := range w.vols {
		if !v.marked {
			continue
		}
		share := v.vol.GetVolumeContext()[nfs.ContextShare]
		for n, ns := range w.net.Nodes {
			ro, holds := v.attached[n]
			served := holds && !w.fenced[n]
			got, err := ns.NFSCat(w.ctx, w.net.NFSURL(share, identityFile))
			switch {
			case served && (err != nil || string(got) != v.vol.GetVolumeId()):
				w.t.Errorf("%s: node-%d, which holds %s, reads its identity as %q (%v)", when, n+1, v.vol.GetVolumeId(), got, err)
			case !served && err == nil:
				w.t.Errorf("%s: node-%d reads %s (%q), which it does not hold unfenced", when, n+1, v.vol.GetVolumeId(), got)
			}
			if served && !ro {
				if err := ns.NFSCopy(w.ctx, payload, w.net.NFSURL(share, fmt.Sprintf("written-by-node-%d-at-check-%d", n+1, w.checks))); err != nil {
					w.t.Errorf("%s: node-%d cannot write %s, which it holds read/write: %v", when, n+1, v.vol.GetVolumeId(), err)
				}
			}
		}
	}
}

// ganeshaLogAbout is what ganesha's log says about v's export path.
func (w *nfsWorld) ganeshaLogAbout(v *modelVolume) string {
	var out []string
	for _, line := range strings.Split(testenv.ReadFile(filepath.Join(w.gdir, ganesha.GaneshaLogName)), "\n") {
		if strings.Contains(line, fileName(v)) {
			out = append(out, line)
		}
	}
	return "ganesha.log about it:\n" + strings.Join(out, "\n")
}

func (w *nfsWorld) ganeshaLogTail() string {
	lines := strings.Split(testenv.ReadFile(filepath.Join(w.gdir, ganesha.GaneshaLogName)), "\n")
	return "ganesha.log:\n" + strings.Join(lines[max(0, len(lines)-30):], "\n")
}

// clientCheckEvery is how many iterations pass between checks through the
// clients (each waits out ganesha's grace period after the last kill); the
// server-side checks run in every iteration.
const clientCheckEvery = 5

// TestNFSRepublishAfterARestart: X (RWO) published to A and Y (RWX) to A
// and B; X unpublished; the controller killed and started again; X
// published to A and unpublished; Y unpublished from both and published
// to both again; X published to A. Every step must succeed and leave
// ganesha serving each volume from its own storage. Before the fix the
// last publish failed, in most tries: the restarted controller mounted Y
// on the loop device X had just left, libblkid's cache gave Y X's UUID,
// and ganesha, taking X's filesystem for a duplicate of Y's, could not
// resolve X's path ("resolve_posix_filesystem ... No such file or
// directory"), nor any new volume's until the next restart.
func TestNFSRepublishAfterARestart(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	forEachNFSStorage(t, func(t *testing.T, flags []string) {
		w := newNFSWorld(t, 2, flags...)
		const a, b = 0, 1
		n := iterations(t)
		for i := range n {
			when := fmt.Sprintf("iteration %d", i)
			x := w.create(fmt.Sprintf("x-%d", i), accessmode.SingleNodeWriter)
			y := w.create(fmt.Sprintf("y-%d", i), accessmode.MultiNodeMultiWriter)
			w.publish(x, a)
			w.publish(y, a)
			w.publish(y, b)
			w.unpublish(x, a)
			w.kill()
			w.checkServer(when + ", after the restart")
			w.publish(x, a)
			w.unpublish(x, a)
			w.unpublish(y, a)
			w.unpublish(y, b)
			w.publish(y, a)
			w.publish(y, b)
			w.publish(x, a)
			w.checkServer(when)
			if i%clientCheckEvery == clientCheckEvery-1 || i == n-1 {
				w.checkClients(when)
			}
			w.remove(x)
			w.remove(y)
			if t.Failed() {
				t.Fatalf("%s failed; controller log:\n%s\n%s", when, testenv.ReadFile(w.ctrl.Log), w.ganeshaLogTail())
			}
		}
	})
}

// TestNFSFenceLiftAfterARestart: X (RWO) on A and Y (RWX) on A and B;
// A fenced; the controller killed and started again; A's fence lifted;
// A and B fenced together; both lifted. Every lift must serve the nodes
// what they hold again, and ListClusterFence must match what is served.
func TestNFSFenceLiftAfterARestart(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	forEachNFSStorage(t, func(t *testing.T, flags []string) {
		w := newNFSWorld(t, 2, flags...)
		const a, b = 0, 1
		n := iterations(t)
		for i := range n {
			when := fmt.Sprintf("iteration %d", i)
			x := w.create(fmt.Sprintf("x-%d", i), accessmode.SingleNodeWriter)
			y := w.create(fmt.Sprintf("y-%d", i), accessmode.MultiNodeMultiWriter)
			w.publish(x, a)
			w.publish(y, a)
			w.publish(y, b)
			w.fence(a)
			w.checkServer(when + ", A fenced")
			w.kill()
			w.checkServer(when + ", A fenced, after the restart")
			w.unfence(a)
			w.checkServer(when + ", A's fence lifted")
			w.fence(a, b)
			w.checkServer(when + ", A and B fenced")
			w.unfence(a, b)
			w.checkServer(when + ", both lifted")
			w.checkFenceList(when)
			if i%clientCheckEvery == clientCheckEvery-1 || i == n-1 {
				w.checkClients(when)
			}
			w.remove(x)
			w.remove(y)
			if t.Failed() {
				t.Fatalf("%s failed; controller log:\n%s\n%s", when, testenv.ReadFile(w.ctrl.Log), w.ganeshaLogTail())
			}
		}
	})
}

// checkFenceList compares ListClusterFence with the model.
func (w *nfsWorld) checkFenceList(when string) {
	w.t.Helper()
	resp, err := w.fences().ListClusterFence(w.ctx, &fence.ListClusterFenceRequest{})
	if err != nil {
		w.t.Fatalf("%s: ListClusterFence: %v", when, err)
	}
	got := []string{}
	for _, c := range resp.GetCidrs() {
		got = append(got, c.GetCidr())
	}
	want := []string{}
	for n := range w.fenced {
		want = append(want, w.net.Nodes[n].Addr.String()+"/32")
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		w.t.Errorf("%s: ListClusterFence = %v, want %v", when, got, want)
	}
}

// TestNFSExportsUnderRandomChurn: random publishes, unpublishes, fences,
// lifts and kills of the controller, with the server checked after every
// step and the clients after every few: every node that holds an
// unfenced attachment reads and writes its volume, and no other node
// reads it. MODEGUARD_STRESS_SEED replays a run.
func TestNFSExportsUnderRandomChurn(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("MODEGUARD_STRESS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("MODEGUARD_STRESS_SEED=%q: %v", v, err)
		}
		seed = s
	}
	forEachNFSStorage(t, func(t *testing.T, flags []string) {
		t.Logf("seed %d (MODEGUARD_STRESS_SEED replays it)", seed)
		rng := rand.New(rand.NewPCG(seed, 27))
		w := newNFSWorld(t, 3, flags...)
		modes := []accessmode.Mode{accessmode.SingleNodeWriter, accessmode.MultiNodeMultiWriter, accessmode.MultiNodeReaderOnly}
		var vols []*modelVolume
		for i := range 5 {
			vols = append(vols, w.create(fmt.Sprintf("churn-%d", i), modes[i%len(modes)]))
		}
		const steps, kills = 60, 3
		killAt := map[int]bool{}
		for len(killAt) < kills {
			killAt[1+rng.IntN(steps-1)] = true
		}
		for step := range steps {
			var did string
			switch op := rng.IntN(10); {
			case killAt[step]:
				w.kill()
				did = "killed the controller"
			case op < 4: // publish where the mode lets another node in
				v := vols[rng.IntN(len(vols))]
				n := rng.IntN(len(w.net.Nodes))
				if _, holds := v.attached[n]; holds || w.fenced[n] || (v.mode == accessmode.SingleNodeWriter && len(v.attached) > 0) {
					continue
				}
				w.publish(v, n)
				did = fmt.Sprintf("published %s to node-%d", v.name, n+1)
			case op < 7:
				v := vols[rng.IntN(len(vols))]
				if len(v.attached) == 0 {
					continue
				}
				n := slices.Sorted(maps.Keys(v.attached))[rng.IntN(len(v.attached))]
				w.unpublish(v, n)
				did = fmt.Sprintf("unpublished %s from node-%d", v.name, n+1)
			case op < 8:
				n := rng.IntN(len(w.net.Nodes))
				if w.fenced[n] {
					continue
				}
				w.fence(n)
				did = fmt.Sprintf("fenced node-%d", n+1)
			default:
				if len(w.fenced) == 0 {
					continue
				}
				n := slices.Sorted(maps.Keys(w.fenced))[rng.IntN(len(w.fenced))]
				w.unfence(n)
				did = fmt.Sprintf("lifted the fence of node-%d", n+1)
			}
			when := fmt.Sprintf("step %d (%s)", step, did)
			w.checkServer(when)
			w.checkFenceList(when)
			if step%15 == 14 || step == steps-1 {
				w.checkClients(when)
			}
			if t.Failed() {
				t.Fatalf("%s failed (seed %d); controller log:\n%s\n%s", when, seed, testenv.ReadFile(w.ctrl.Log), w.ganeshaLogTail())
			}
		}
		for _, v := range vols {
			w.remove(v)
		}
	})
}

// fenceCrashPoints are the steps of a fence call a test kills the
// controller at (TestNFSFenceListFollowedAfterACrash).
var fenceCrashPoints = []string{"driver.fence.list-written"}

// TestNFSFenceListFollowedAfterACrash: the controller dies right after it
// wrote a change of the fence list and before it applied it, once for a
// fence and once for its lift. The start that follows must bring the
// exports in line with the list: the fenced node cut off although the
// call never finished, and after the lift served again, never cut off
// with no fence listed.
func TestNFSFenceListFollowedAfterACrash(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	forEachNFSStorage(t, func(t *testing.T, flags []string) {
		w := newNFSWorld(t, 2, flags...)
		const a, b = 0, 1
		x := w.create("x", accessmode.SingleNodeWriter)
		y := w.create("y", accessmode.MultiNodeMultiWriter)
		w.publish(x, a)
		w.publish(y, a)
		w.publish(y, b)
		for _, lift := range []bool{false, true} {
			what := "a fence"
			if lift {
				what = "a lift"
			}
			// The next start dies at the point; the test starts the
			// controller so that it is the one armed.
			w.ctrl.Kill()
			w.ctrl.Env = []string{faultpoint.EnvVar + "=" + fenceCrashPoints[0]}
			w.ctrl.Start(w.ctx)
			var err error
			if lift {
				_, err = w.fences().UnfenceClusterNetwork(w.ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: cidrsOf(w, []int{a})})
				delete(w.fenced, a)
			} else {
				_, err = w.fences().FenceClusterNetwork(w.ctx, &fence.FenceClusterNetworkRequest{Cidrs: cidrsOf(w, []int{a})})
				w.fenced[a] = true
			}
			if err == nil {
				t.Fatalf("%s answered OK, but the controller should have died once the list was written", what)
			}
			w.ctrl.WaitExited(30 * time.Second)
			w.ctrl.Start(w.ctx)
			when := "after the controller died between writing " + what + " and applying it"
			w.checkServer(when)
			w.checkFenceList(when)
			if lift {
				// Through the clients once: each check makes them known
				// to ganesha, and the next start waits out their grace.
				w.checkClients(when)
			}
		}
		w.remove(x)
		w.remove(y)
	})
}
