package integration

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/inspect"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestKeptPoolThroughTheBinary: a controller and a node plugin started
// with the default --block-pool-filesystem on a pool directory on ext4
// both use the xfs with reflinks kept there (one mount, one loop device),
// so a snapshot of a volume the node has staged and writes succeeds. The
// filesystem stays mounted while either process runs and goes, device and
// all, when the last one stops cleanly. So too with
// --block-pool-filesystem=xfs and the xfs kept there (auto, the default,
// keeps a btrfs on this machine).
func TestKeptPoolThroughTheBinary(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	for _, c := range []struct{ choice, fs string }{{block.PoolFilesystemAuto, "btrfs"}, {block.PoolFilesystemXFS, "xfs"}} {
		t.Run(c.choice, func(t *testing.T) { keptPoolThroughTheBinary(t, bin, c.choice, c.fs) })
	}
}

func keptPoolThroughTheBinary(t *testing.T, bin, choice, fs string) {
	work := t.TempDir()
	pool := filepath.Join(testenv.LoopFilesystem(t, 1<<30, "ext4", "-q"), "pool")
	state, kubelet := filepath.Join(work, "state"), filepath.Join(work, "kubelet")
	for _, d := range []string{pool, state, kubelet} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	kept, image := filepath.Join(pool, block.KeptMountDir), filepath.Join(pool, block.KeptImageName)
	poolArgs := []string{"--block-pool=zone-a=" + pool}
	if choice != block.PoolFilesystemAuto {
		poolArgs = append(poolArgs, "--block-pool-filesystem="+choice)
	}
	ctrl := &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: append([]string{"--roles", "controller", "-v", "2"}, poolArgs...)}
	node := &crashProc{t: t, name: "node", bin: bin, socket: filepath.Join(work, "n.sock"), log: filepath.Join(work, "node.log"),
		args: append([]string{"--roles", "node", "--node-id", "kept-node", "--zone", "zone-a", "--state-dir", state, "-v", "2"}, poolArgs...)}
	ctrl.start()
	node.start()
	t.Cleanup(func() {
		ctrl.stop()
		node.stop()
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("controller log:\n%s\nnode log:\n%s", testenv.ReadFile(ctrl.log), testenv.ReadFile(node.log))
		}
	})
	keptMounts := func() int {
		n := 0
		for _, m := range localcluster.MountsUnder(pool) {
			if m == kept {
				n++
			}
		}
		return n
	}
	if n := keptMounts(); n != 1 {
		t.Fatalf("%d mounts at %s, want the one both processes use", n, kept)
	}
	if devs, err := loop.DevicesOf(image); err != nil || len(devs) != 1 {
		t.Fatalf("kept image bound to %v (%v), want one device", devs, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(kept, &st); err != nil {
		t.Fatal(err)
	}
	if magic := map[string]int64{"xfs": unix.XFS_SUPER_MAGIC, "btrfs": unix.BTRFS_SUPER_MAGIC}[fs]; int64(st.Type) != magic {
		t.Fatalf("%s is of type %#x, want a %s", kept, st.Type, fs)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cc, nc := csi.NewControllerClient(ctrl.conn), csi.NewNodeClient(node.conn)
	mountCap := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	}
	info, err := nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	vol, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "kept", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	pub, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: info.GetNodeId(), VolumeCapability: mountCap})
	if err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(kubelet, "staging")
	if _, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap,
		PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolume().GetVolumeContext()}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(staging, "data"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("written before the snapshot"); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	snap, err := cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: id, Name: "kept-snap"})
	f.Close()
	if err != nil {
		t.Fatalf("CreateSnapshot of a staged volume on a kept pool: %v", err)
	}
	if !snap.GetSnapshot().GetReadyToUse() {
		t.Errorf("the snapshot is not ready at once: %v", snap)
	}

	// The controller stops: the node still has its volume's image open in
	// the kept filesystem, which stays.
	ctrl.stop()
	if n := keptMounts(); n != 1 {
		t.Fatalf("%d mounts at %s after the controller stopped, want 1", n, kept)
	}
	if _, err := nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	node.stop()
	released := func(after string) {
		t.Helper()
		if n := keptMounts(); n != 0 {
			t.Errorf("%d mounts at %s after %s", n, kept, after)
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			devs, err := loop.DevicesOf(image)
			if err != nil {
				t.Fatal(err)
			}
			if len(devs) == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("kept image still bound to %v after %s", devs, after)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	released("every process stopped")

	// inspect, given only the pool directory, mounts the kept filesystem
	// its image holds, whichever it is, finds the volume in it, and lets
	// go of it again.
	out, err := exec.Command(bin, "inspect", "--block-pool", "zone-a="+pool, "--json", id).Output()
	if err != nil {
		t.Fatalf("modeguard inspect of a kept %s: %v", fs, err)
	}
	var report inspect.Report
	if err := json.Unmarshal(out, &report); err != nil {
		t.Fatalf("inspect --json printed no report: %v\n%s", err, out)
	}
	if len(report.Volumes) != 1 || len(report.Volumes[0].Attachments) != 1 {
		t.Errorf("inspect found %+v in the kept %s, want the volume attached to its node", report.Volumes, fs)
	}
	released("inspect")
}
