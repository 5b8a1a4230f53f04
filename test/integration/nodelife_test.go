package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/test/testenv"
)

// nodeLife is one controller and one node plugin of the real binary, with
// a pool, the node's state directory and a kubelet directory of its own.
type nodeLife struct {
	t                          *testing.T
	work, pool, state, kubelet string
	bootFile                   string // empty: the kernel's boot id
	ctrl, node                 *crashProc
	nodeID                     string
}

func startNodeLife(t *testing.T, bin string, nodeEnv ...string) *nodeLife {
	t.Helper()
	work := t.TempDir()
	l := &nodeLife{t: t, work: work, pool: filepath.Join(work, "pool"), state: filepath.Join(work, "node-state"),
		kubelet: filepath.Join(work, "kubelet")}
	for _, d := range []string{l.pool, l.state, l.kubelet} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	poolArg := "--block-pool=zone-a=" + l.pool
	l.ctrl = &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: []string{"--roles", "controller", poolArg, "--block-pool-filesystem=direct", "-v", "2"}}
	l.node = &crashProc{t: t, name: "node", bin: bin, socket: filepath.Join(work, "n.sock"), log: filepath.Join(work, "node.log"),
		args: []string{"--roles", "node", "--node-id", "life-node", "--zone", "zone-a", poolArg, "--block-pool-filesystem=direct", "--state-dir", l.state, "-v", "2"},
		env:  nodeEnv}
	l.ctrl.start()
	l.node.start()
	t.Cleanup(func() {
		l.ctrl.stop()
		l.node.stop()
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("controller log:\n%s\nnode log:\n%s", testenv.ReadFile(l.ctrl.log), testenv.ReadFile(l.node.log))
		}
	})
	info, err := l.nc().NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	l.nodeID = info.GetNodeId()
	return l
}

// restartNode stops the node plugin gracefully and starts it again.
func (l *nodeLife) restartNode() {
	l.t.Helper()
	l.node.stop()
	l.node.conn = nil
	l.node.start()
}

func (l *nodeLife) cc() csi.ControllerClient { return csi.NewControllerClient(l.ctrl.conn) }
func (l *nodeLife) nc() csi.NodeClient       { return csi.NewNodeClient(l.node.conn) }

// useBootID makes every later start of the node plugin read its boot id
// from a file of the test's, holding id.
func (l *nodeLife) useBootID(id string) {
	l.t.Helper()
	if l.bootFile == "" {
		l.bootFile = filepath.Join(l.work, "boot_id")
		l.node.baseEnv = append(l.node.baseEnv, "MODEGUARD_BOOT_ID_FILE="+l.bootFile)
	}
	if err := os.WriteFile(l.bootFile, []byte(id+"\n"), 0o600); err != nil {
		l.t.Fatal(err)
	}
}

// reboot does to the node what a reboot does: the plugin dies, every mount
// under the kubelet directory and every loop device of the pool goes, and
// the state directory stays, as it is on disk.
func (l *nodeLife) reboot() {
	l.t.Helper()
	_ = l.node.cmd.Process.Kill()
	<-l.node.done
	for _, m := range localcluster.MountsUnder(l.kubelet) {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			l.t.Fatalf("unmounting %s: %v", m, err)
		}
	}
	for _, dev := range localcluster.LoopsUnder(l.pool) {
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			l.t.Fatalf("detaching %s: %v: %s", dev, err, out)
		}
	}
	if loops := settledLoops(l.pool, 0); len(loops) > 0 {
		l.t.Fatalf("loop devices of the pool still bound after the reboot: %v", loops)
	}
}

func capability(mode accessmode.Mode, fsType string) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if fsType == "" {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}}
	}
	return c
}

// volumeOnNode is a volume created and attached to the node, with the
// arguments the kubelet replays.
type volumeOnNode struct {
	id, staging string
	cap         *csi.VolumeCapability
	volCtx      map[string]string
	pubCtx      map[string]string
}

func (l *nodeLife) createAttached(ctx context.Context, name string, size int64, c *csi.VolumeCapability) *volumeOnNode {
	l.t.Helper()
	vol, err := l.cc().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}})
	if err != nil {
		l.t.Fatal(err)
	}
	v := &volumeOnNode{id: vol.GetVolume().GetVolumeId(), cap: c, volCtx: vol.GetVolume().GetVolumeContext(),
		staging: filepath.Join(l.kubelet, "plugins", name, "globalmount")}
	pub, err := l.cc().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.id, NodeId: l.nodeID, VolumeCapability: c})
	if err != nil {
		l.t.Fatal(err)
	}
	v.pubCtx = pub.GetPublishContext()
	return v
}

func (l *nodeLife) stage(ctx context.Context, v *volumeOnNode) error {
	_, err := l.nc().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		VolumeCapability: v.cap, PublishContext: v.pubCtx, VolumeContext: v.volCtx})
	return err
}

func (l *nodeLife) publish(ctx context.Context, v *volumeOnNode, target string) error {
	_, err := l.nc().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: target,
		VolumeCapability: v.cap, PublishContext: v.pubCtx, VolumeContext: v.volCtx})
	return err
}

func (l *nodeLife) unpublish(ctx context.Context, v *volumeOnNode, target string) error {
	_, err := l.nc().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: target})
	return err
}

func (l *nodeLife) unstage(ctx context.Context, v *volumeOnNode) error {
	_, err := l.nc().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
	return err
}

func (l *nodeLife) remove(ctx context.Context, v *volumeOnNode) {
	l.t.Helper()
	if _, err := l.cc().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id, NodeId: l.nodeID}); err != nil {
		l.t.Fatal(err)
	}
	if _, err := l.cc().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id}); err != nil {
		l.t.Fatal(err)
	}
}

// The data a pod keeps in a volume: a file for a filesystem, the first
// bytes of the device for raw block.
func putData(t *testing.T, target string, raw bool, data []byte) {
	t.Helper()
	if raw {
		f, err := os.OpenFile(target, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt(data, 0); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		return
	}
	writeSynced(t, filepath.Join(target, "data"), data)
}

func getData(target string, raw bool, n int) ([]byte, error) {
	if !raw {
		return os.ReadFile(filepath.Join(target, "data"))
	}
	f, err := os.Open(target)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	buf := make([]byte, n)
	_, err = f.ReadAt(buf, 0)
	return buf, err
}

// filesBelow lists every regular file below dir on the filesystem dir
// itself is on, i.e. what landed on the node's root filesystem rather
// than in a volume. It must be called with nothing mounted below dir.
func filesBelow(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil && fi.Size() > 0 {
				out = append(out, strings.TrimPrefix(p, dir+"/"))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestNodeRebootKeepsEachVolumeItsData: a pod writes to a volume; the node
// reboots (the plugin dies, every mount and loop device goes, the state
// directory stays); the kubelet replays its calls. The pod must see its own
// data, or the call must fail: never an empty staging directory on the
// node's disk, never another volume's device. Each access type runs with
// the kernel's boot id unchanged (the checks of the mount table and the
// loop devices alone must catch it: a crash of everything but the disk
// looks the same) and with a new boot id (the records are forgotten); and
// before the plugin starts again another volume takes the loop device the
// volume had, as the kernel hands device names out again after a boot.
func TestNodeRebootKeepsEachVolumeItsData(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	for _, fsType := range []string{"ext4", "xfs", ""} {
		for _, newBoot := range []bool{false, true} {
			name := fsType
			if name == "" {
				name = "raw-block"
			}
			if newBoot {
				name += "/new-boot-id"
			} else {
				name += "/same-boot-id"
			}
			t.Run(name, func(t *testing.T) { rebootScenario(t, bin, fsType, newBoot) })
		}
	}
}

func rebootScenario(t *testing.T, bin, fsType string, newBoot bool) {
	l := startNodeLife(t, bin)
	if newBoot {
		l.useBootID("boot-before")
		l.restartNode()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	raw := fsType == ""
	size := int64(64 << 20)
	if fsType == "xfs" {
		size = 320 << 20
	}
	v := l.createAttached(ctx, "rebooted", size, capability(accessmode.SingleNodeSingleWriter, fsType))
	target := filepath.Join(l.kubelet, "pods", "pod-1", "volumes", "rebooted")
	if err := l.stage(ctx, v); err != nil {
		t.Fatal(err)
	}
	if err := l.publish(ctx, v, target); err != nil {
		t.Fatal(err)
	}
	before := make([]byte, 64<<10)
	if _, err := rand.Read(before); err != nil {
		t.Fatal(err)
	}
	putData(t, target, raw, before)
	loops := localcluster.LoopsUnder(l.pool)
	if len(loops) != 1 {
		t.Fatalf("loop devices of the pool before the reboot: %v, want one", loops)
	}
	oldDevice := loops[0]

	l.reboot()
	if newBoot {
		l.useBootID("boot-after")
	}
	// Another volume's image takes the device name the volume had.
	squatter := filepath.Join(l.work, "other-volume.img")
	pattern := bytes.Repeat([]byte("another volume's data "), 4096)
	if err := os.WriteFile(squatter, pattern, 0o600); err != nil {
		t.Fatal(err)
	}
	// Other test processes bind free loop devices meanwhile, and one may
	// have taken the name first: then another image holds it all the same,
	// which is what the driver must cope with, but not one this test owns,
	// so what it checks of the squatter's image and device is skipped.
	ownSquatter := true
	if out, err := exec.Command("losetup", oldDevice, squatter).CombinedOutput(); err != nil {
		b, berr := exec.Command("losetup", "--noheadings", "--output", "BACK-FILE", oldDevice).Output()
		taken := strings.TrimSpace(string(b))
		if berr != nil || taken == "" || strings.HasPrefix(taken, l.pool) {
			t.Fatalf("binding another image to %s: %v: %s (now bound to %q)", oldDevice, err, out, taken)
		}
		t.Logf("%s was taken by another process's image (%s) before this test could bind one to it", oldDevice, taken)
		ownSquatter = false
	} else {
		t.Cleanup(func() { _ = exec.Command("losetup", "-d", oldDevice).Run() })
	}
	l.node.start()

	// The kubelet may try the publish before it restages: it must fail,
	// not bind an empty directory or the other volume's device.
	err := l.publish(ctx, v, target)
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("NodePublishVolume before the stage is redone: %v, want FailedPrecondition", err)
	}
	if m := localcluster.MountsUnder(l.kubelet); len(m) > 0 {
		t.Fatalf("a refused publish left mounts: %v", m)
	}
	t.Logf("publish before the restage refused as it must: %v", err)

	// The kubelet's replay: stage, then publish, with the same arguments.
	if err := l.stage(ctx, v); err != nil {
		t.Fatalf("NodeStageVolume after the reboot: %v", err)
	}
	if err := l.publish(ctx, v, target); err != nil {
		t.Fatalf("NodePublishVolume after the reboot: %v", err)
	}
	got, err := getData(target, raw, len(before))
	if err != nil || !bytes.Equal(got, before) {
		t.Fatalf("after the reboot the pod reads %d bytes of its data (err %v, equal %v)", len(got), err, bytes.Equal(got, before))
	}
	after := make([]byte, 64<<10)
	if _, err := rand.Read(after); err != nil {
		t.Fatal(err)
	}
	putData(t, target, raw, after)
	if b, err := exec.Command("losetup", "--noheadings", "--output", "BACK-FILE", oldDevice).Output(); ownSquatter && (err != nil || strings.TrimSpace(string(b)) != squatter) {
		t.Errorf("%s, taken by another image, is now bound to %q (err %v): the driver touched a device that is not its volume's", oldDevice, strings.TrimSpace(string(b)), err)
	}

	// Everything the pod wrote went to the volume: once it is unmounted,
	// nothing lies in the staging or target path on the node's own disk,
	// and the other volume's image is as it was.
	if err := l.unpublish(ctx, v, target); err != nil {
		t.Fatal(err)
	}
	if err := l.unstage(ctx, v); err != nil {
		t.Fatal(err)
	}
	if m := localcluster.MountsUnder(l.kubelet); len(m) > 0 {
		t.Fatalf("mounts left after unpublish and unstage: %v", m)
	}
	if files := filesBelow(t, l.kubelet); len(files) > 0 {
		t.Errorf("the pod's writes landed on the node's root filesystem: %v", files)
	}
	if data, err := os.ReadFile(squatter); ownSquatter && (err != nil || !bytes.Equal(data, pattern)) {
		t.Errorf("the image that took the old device changed (err %v)", err)
	}
	// And what it wrote after the reboot is in the volume.
	if err := l.stage(ctx, v); err != nil {
		t.Fatal(err)
	}
	if err := l.publish(ctx, v, target); err != nil {
		t.Fatal(err)
	}
	if got, err := getData(target, raw, len(after)); err != nil || !bytes.Equal(got, after) {
		t.Errorf("the write made after the reboot is not in the volume (err %v)", err)
	}
	if err := l.unpublish(ctx, v, target); err != nil {
		t.Fatal(err)
	}
	if err := l.unstage(ctx, v); err != nil {
		t.Fatal(err)
	}
	l.remove(ctx, v)
	if out, err := exec.Command("losetup", "-d", oldDevice).CombinedOutput(); err != nil {
		t.Fatalf("detaching the other image: %v: %s", err, out)
	}
	l.ctrl.stop()
	l.node.stop()
	l.ctrl.conn, l.node.conn = nil, nil
	assertNothingLeft(t, l.work, []string{l.pool, l.state})
}

// TestStageAfterCrashBetweenUnstageAndRecord: the node plugin dies after
// NodeUnstageVolume unmounted and detached the volume and before it removed
// the stage record; the next call is a NodeStageVolume (a new pod), not the
// unstage's retry. It must stage the volume again rather than answer from
// the record and leave the pod an empty directory.
func TestStageAfterCrashBetweenUnstageAndRecord(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	l := startNodeLife(t, bin, faultpoint.EnvVar+"=node.unstage.backend-unstaged")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	v := l.createAttached(ctx, "unstaged", 64<<20, capability(accessmode.SingleNodeWriter, "ext4"))
	first := filepath.Join(l.kubelet, "pods", "first", "vol")
	if err := l.stage(ctx, v); err != nil {
		t.Fatal(err)
	}
	if err := l.publish(ctx, v, first); err != nil {
		t.Fatal(err)
	}
	data := []byte("written before the unstage")
	putData(t, first, false, data)
	if err := l.unpublish(ctx, v, first); err != nil {
		t.Fatal(err)
	}
	if err := l.unstage(ctx, v); err == nil || !l.node.diedOfSIGKILL() {
		t.Fatalf("NodeUnstageVolume: want the plugin killed at node.unstage.backend-unstaged, got %v", err)
	}
	l.node.start()
	second := filepath.Join(l.kubelet, "pods", "second", "vol")
	if err := l.stage(ctx, v); err != nil {
		t.Fatalf("NodeStageVolume after the interrupted unstage: %v", err)
	}
	if err := l.publish(ctx, v, second); err != nil {
		t.Fatalf("NodePublishVolume after the interrupted unstage: %v", err)
	}
	if got, err := getData(second, false, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the new pod reads %q (err %v), want the volume's data", got, err)
	}
	if err := l.unpublish(ctx, v, second); err != nil {
		t.Fatal(err)
	}
	if err := l.unstage(ctx, v); err != nil {
		t.Fatal(err)
	}
	if files := filesBelow(t, l.kubelet); len(files) > 0 {
		t.Errorf("files on the node's root filesystem: %v", files)
	}
	l.remove(ctx, v)
}

// TestForgottenMountsAreNotReportedGone: the node state loses a stage and a
// publish the kernel still holds (a state directory restored from a
// backup, say). NodeUnpublishVolume and NodeUnstageVolume must not answer
// OK while the volume stays mounted: they unmount what the mount table
// shows of this volume, and leave a mount of anything else alone.
func TestForgottenMountsAreNotReportedGone(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	l := startNodeLife(t, bin)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	v := l.createAttached(ctx, "forgotten", 64<<20, capability(accessmode.SingleNodeWriter, "ext4"))
	target := filepath.Join(l.kubelet, "pods", "pod", "vol")
	if err := l.stage(ctx, v); err != nil {
		t.Fatal(err)
	}
	if err := l.publish(ctx, v, target); err != nil {
		t.Fatal(err)
	}
	// The state is lost; the kernel keeps the mounts.
	l.node.stop()
	l.node.conn = nil
	if err := os.RemoveAll(l.state); err != nil {
		t.Fatal(err)
	}
	l.node.start()
	// A mount of something else at another target is not this volume's.
	other := filepath.Join(l.kubelet, "pods", "other", "vol")
	if err := os.MkdirAll(other, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", other, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(other, unix.MNT_DETACH)
	if err := l.unpublish(ctx, v, other); err != nil {
		t.Fatalf("NodeUnpublishVolume of a path holding another filesystem: %v, want OK (the volume is not published there)", err)
	}
	if mounted, _ := testMounted(other); !mounted {
		t.Fatal("NodeUnpublishVolume removed a mount that was not the volume's")
	}
	if err := l.unpublish(ctx, v, target); err != nil {
		t.Fatalf("NodeUnpublishVolume of a forgotten publish: %v", err)
	}
	if mounted, _ := testMounted(target); mounted {
		t.Fatal("NodeUnpublishVolume answered OK while the volume stays mounted at the target")
	}
	if err := l.unstage(ctx, v); err != nil {
		t.Fatalf("NodeUnstageVolume of a forgotten stage: %v", err)
	}
	if mounted, _ := testMounted(v.staging); mounted {
		t.Fatal("NodeUnstageVolume answered OK while the volume stays mounted at the staging path")
	}
	if loops := settledLoops(l.pool, 0); len(loops) > 0 {
		t.Fatalf("NodeUnstageVolume of a forgotten stage left the loop device: %v", loops)
	}
	l.remove(ctx, v)
}

func testMounted(p string) (bool, error) {
	for _, m := range localcluster.MountsUnder(filepath.Dir(p)) {
		if m == p {
			return true, nil
		}
	}
	return false, nil
}

// The modes, abbreviated as the table below names them.
var modeAbbrev = map[string]accessmode.Mode{
	"SNW": accessmode.SingleNodeWriter, "SNRO": accessmode.SingleNodeReaderOnly, "MNRO": accessmode.MultiNodeReaderOnly,
	"MNSW": accessmode.MultiNodeSingleWriter, "MNMW": accessmode.MultiNodeMultiWriter,
	"SNSW": accessmode.SingleNodeSingleWriter, "SNMW": accessmode.SingleNodeMultiWriter,
}

// withinAttached: for each mode a volume is attached to a node with, the
// modes a stage or publish on that node may ask for: those that allow no
// more nodes, writer nodes or workloads per node.
var withinAttached = map[string]string{
	"SNW":  "SNW SNRO SNSW",
	"SNRO": "SNRO",
	"MNRO": "SNRO MNRO",
	"MNSW": "SNW SNRO MNRO MNSW SNSW SNMW",
	"MNMW": "SNW SNRO MNRO MNSW MNMW SNSW SNMW",
	"SNSW": "SNW SNRO SNSW",
	"SNMW": "SNW SNRO SNSW SNMW",
}

// TestAttachedModeBoundsTheNode: every attached mode × every requested
// mode, on real raw block volumes (the access type every mode can use). A
// NodeStageVolume and a NodePublishVolume asking for more than the mode
// ControllerPublishVolume attached the volume with are refused with
// FAILED_PRECONDITION naming both modes; within it they succeed. Without
// this, a volume attached as SINGLE_NODE_SINGLE_WRITER staged and published
// twice as SINGLE_NODE_MULTI_WRITER reached two pods.
func TestAttachedModeBoundsTheNode(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	l := startNodeLife(t, bin)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	order := []string{"SNW", "SNRO", "MNRO", "MNSW", "MNMW", "SNSW", "SNMW"}
	for _, attached := range order {
		allowed := strings.Fields(withinAttached[attached])
		v := l.createAttached(ctx, "attached-"+strings.ToLower(attached), 16<<20, capability(modeAbbrev[attached], ""))
		for _, asked := range order {
			w := *v
			w.cap = capability(modeAbbrev[asked], "")
			err := l.stage(ctx, &w)
			checkWithin(t, "NodeStageVolume", attached, asked, allowed, err)
			if err == nil {
				if err := l.unstage(ctx, &w); err != nil {
					t.Fatal(err)
				}
			}
		}
		// Staged as attached; each publish mode in turn.
		if err := l.stage(ctx, v); err != nil {
			t.Fatalf("stage as attached (%s): %v", attached, err)
		}
		for _, asked := range order {
			w := *v
			w.cap = capability(modeAbbrev[asked], "")
			target := filepath.Join(l.kubelet, "pods", attached+"-"+asked, "dev")
			err := l.publish(ctx, &w, target)
			checkWithin(t, "NodePublishVolume", attached, asked, allowed, err)
			if err == nil {
				if err := l.unpublish(ctx, &w, target); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := l.unstage(ctx, v); err != nil {
			t.Fatal(err)
		}
		l.remove(ctx, v)
	}
	// The story of the issue, end to end: attached as RWOP, two publishes
	// as SINGLE_NODE_MULTI_WRITER on one staging.
	v := l.createAttached(ctx, "rwop", 16<<20, capability(accessmode.SingleNodeSingleWriter, "ext4"))
	w := *v
	w.cap = capability(accessmode.SingleNodeMultiWriter, "ext4")
	if err := l.stage(ctx, &w); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("staging an RWOP attachment as SINGLE_NODE_MULTI_WRITER: %v, want FailedPrecondition", err)
	}
	if err := l.stage(ctx, v); err != nil {
		t.Fatal(err)
	}
	for _, pod := range []string{"a", "b"} {
		err := l.publish(ctx, &w, filepath.Join(l.kubelet, "pods", pod, "vol"))
		if status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("publishing an RWOP attachment to pod %s as SINGLE_NODE_MULTI_WRITER: %v, want FailedPrecondition", pod, err)
		}
	}
	if err := l.unstage(ctx, v); err != nil {
		t.Fatal(err)
	}
	l.remove(ctx, v)
	l.ctrl.stop()
	l.node.stop()
	l.ctrl.conn, l.node.conn = nil, nil
	assertNothingLeft(t, l.work, []string{l.pool, l.state})
}

func checkWithin(t *testing.T, call, attached, asked string, allowed []string, err error) {
	t.Helper()
	want := false
	for _, a := range allowed {
		want = want || a == asked
	}
	switch {
	case want && err != nil:
		t.Errorf("%s as %s on a volume attached as %s: %v, want OK", call, asked, attached, err)
	case !want && status.Code(err) != codes.FailedPrecondition:
		t.Errorf("%s as %s on a volume attached as %s: %v, want FailedPrecondition", call, asked, attached, err)
	case !want:
		msg := status.Convert(err).Message()
		if !strings.Contains(msg, accessmode.Name(modeAbbrev[attached])) || !strings.Contains(msg, accessmode.Name(modeAbbrev[asked])) {
			t.Errorf("%s as %s on a volume attached as %s: the refusal %q does not name both modes", call, asked, attached, msg)
		}
	}
}
