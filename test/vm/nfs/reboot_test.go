package nfs

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/nodestate"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// rebootVolume is a volume on the rebooting node with the arguments the
// kubelet replays after the reboot.
type rebootVolume struct {
	name            string
	id              string
	cap             *csi.VolumeCapability
	volCtx, pubCtx  map[string]string
	staging, target string
}

// TestNodeVMRebootKeepsVolumes: a node VM with its own disk (the plugin's
// state, the staging and target paths) holds an NFS volume (the kernel's
// client) and an ext4 block volume (a loop device of an image in the pool)
// and loses power: qemu is killed and the VM boots again, with a new boot
// id, every mount and loop device gone and its disk as it was. Before the
// plugin runs, the node's disk holds nothing the pods wrote; the plugin
// forgets the records of the earlier boot, a publish before the restage
// is refused rather than binding an empty directory, and the kubelet's
// replayed stage and publish bring each pod its own data back. What the
// pods write afterwards reaches the volumes, not the node's disk.
func TestNodeVMRebootKeepsVolumes(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestKernelNFSAccessModes and TestNodeRebootKeepsEachVolumeItsData")
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	c := vmtest.Start(t, vmtest.Options{VMs: 1, Binary: bin, NodeDiskMB: 256})
	ctx := testenv.Context(t, 10*time.Minute)
	vm := c.VMs[0]
	// The pool is a host directory; the VM reaches it at the same path
	// through its 9p root, as nodes reach a zone's shared pool.
	pool := filepath.Join(t.TempDir(), "pool")
	ctrl := testenv.StartNFSController(ctx, t, bin, c.ServerNS, c.Server.String(), "--block-pool", "zone-a="+pool, "--block-pool-filesystem=direct")
	pluginArgs := []string{"--block-pool", "zone-a=" + pool, "--block-pool-filesystem=direct"}
	if err := vm.StartPlugin(ctx, pluginArgs...); err != nil {
		t.Fatal(err)
	}
	node := vm.NodeClient(t)
	cc := ctrl.CSI

	mount := func(mode accessmode.Mode, fsType string) *csi.VolumeCapability {
		return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}}}
	}
	vols := []*rebootVolume{
		{name: "nfs", cap: mount(accessmode.SingleNodeWriter, "")},
		{name: "block", cap: mount(accessmode.SingleNodeSingleWriter, "ext4")},
	}
	stage := func(v *rebootVolume) error {
		_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
			VolumeCapability: v.cap, PublishContext: v.pubCtx, VolumeContext: v.volCtx})
		return err
	}
	publish := func(v *rebootVolume) error {
		_, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
			TargetPath: v.target, VolumeCapability: v.cap, PublishContext: v.pubCtx, VolumeContext: v.volCtx})
		return err
	}
	for _, v := range vols {
		resp, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "reboot-" + v.name,
			CapacityRange:      &csi.CapacityRange{RequiredBytes: 64 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{v.cap}, Parameters: map[string]string{"backend": v.name}})
		if err != nil {
			t.Fatalf("CreateVolume %s: %v", v.name, err)
		}
		v.id, v.volCtx = resp.GetVolume().GetVolumeId(), resp.GetVolume().GetVolumeContext()
		pub, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.id, NodeId: vm.NodeID(), VolumeCapability: v.cap})
		if err != nil {
			t.Fatalf("ControllerPublishVolume %s: %v", v.name, err)
		}
		v.pubCtx = pub.GetPublishContext()
		v.staging = vm.Path("kubelet", "plugins", v.name, "globalmount")
		v.target = vm.Path("kubelet", "pods", "p-"+v.name, "volume")
		if err := stage(v); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", v.name, err)
		}
		if err := publish(v); err != nil {
			t.Fatalf("NodePublishVolume %s: %v", v.name, err)
		}
		if err := vm.WriteFile(ctx, filepath.Join(v.target, "before"), []byte("written before the reboot by "+v.name)); err != nil {
			t.Fatal(err)
		}
		// What a pod's write leaves for a crash to find: on the volume.
		if out, code, err := vm.Run(ctx, "sync"); err != nil || code != 0 {
			t.Fatalf("sync: %v %d %s", err, code, out)
		}
	}
	bootID := func() string {
		t.Helper()
		b, err := vm.ReadFile(ctx, "/proc/sys/kernel/random/boot_id")
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	before := bootID()

	start := time.Now()
	if err := vm.Reboot(ctx); err != nil {
		t.Fatal(err)
	}
	after := bootID()
	t.Logf("rebooted in %v; boot id %s, was %s", time.Since(start).Round(time.Millisecond), after, before)
	if after == before {
		t.Fatalf("the boot id did not change across the reboot (%s)", after)
	}
	// The node's disk holds the plugin's state and the empty directories
	// the volumes were mounted on, nothing of what the pods wrote.
	out, code, err := vm.Run(ctx, "find", vm.Path("kubelet"), "-type", "f")
	if err != nil || code != 0 {
		t.Fatalf("find: %v %d %s", err, code, out)
	}
	if strings.TrimSpace(out) != "" {
		t.Errorf("files on the node's disk after the reboot: %s", out)
	}
	for _, v := range vols {
		if _, err := vm.ReadFile(ctx, filepath.Join(v.target, "before")); err == nil {
			t.Errorf("%s: the pod's file is readable at the target before anything was mounted again", v.name)
		}
	}

	if err := vm.StartPlugin(ctx, pluginArgs...); err != nil {
		t.Fatal(err)
	}
	// The client's connection died with the VM; the first call after the
	// reboot may find it reset before gRPC dials again.
	for deadline := time.Now().Add(30 * time.Second); ; {
		info, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err == nil {
			if info.GetNodeId() != vm.NodeID() {
				t.Fatalf("node id after the reboot %q, want %q", info.GetNodeId(), vm.NodeID())
			}
			break
		}
		if status.Code(err) != codes.Unavailable || time.Now().After(deadline) {
			t.Fatalf("NodeGetInfo after the reboot: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, v := range vols {
		// A publish the kubelet would not send first, but nothing may
		// answer it OK: the target would get the empty staging directory.
		err := publish(v)
		if status.Code(err) != codes.FailedPrecondition {
			t.Errorf("%s: publish before the restage: %v, want FAILED_PRECONDITION", v.name, err)
		}
		if err := stage(v); err != nil {
			t.Fatalf("%s: the replayed NodeStageVolume: %v", v.name, err)
		}
		if err := publish(v); err != nil {
			t.Fatalf("%s: the replayed NodePublishVolume: %v", v.name, err)
		}
		got, err := vm.ReadFile(ctx, filepath.Join(v.target, "before"))
		if want := "written before the reboot by " + v.name; err != nil || string(got) != want {
			t.Errorf("%s: after the reboot the pod reads %q, %v; want %q", v.name, got, err, want)
		}
		if err := vm.WriteFile(ctx, filepath.Join(v.target, "after"), []byte("written after the reboot")); err != nil {
			t.Fatalf("%s: writing after the reboot: %v", v.name, err)
		}
	}
	// The records are this boot's now.
	for _, v := range vols {
		id, err := volumeid.Parse(v.id)
		if err != nil {
			t.Fatal(err)
		}
		raw, err := vm.ReadFile(ctx, filepath.Join(vm.Path("state", "volumes"), id.FileName()+".json"))
		if err != nil {
			t.Fatalf("%s: reading its record: %v", v.name, err)
		}
		var rec nodestate.Record
		if err := json.Unmarshal(raw, &rec); err != nil || rec.BootID != after || rec.Staged == nil {
			t.Errorf("%s: the record (%v) is not a stage of this boot %s: %s", v.name, err, after, raw)
		}
	}
	// Unmounted again, the node's disk still holds nothing of the pods';
	// staged at another path, each volume has both files.
	for _, v := range vols {
		if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
			t.Fatal(err)
		}
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
			t.Fatal(err)
		}
	}
	if out, _, _ := vm.Run(ctx, "find", vm.Path("kubelet"), "-type", "f"); strings.TrimSpace(out) != "" {
		t.Errorf("files on the node's disk after unstaging: %s", out)
	}
	for _, v := range vols {
		v.staging = vm.Path("kubelet", "plugins", v.name+"-again", "globalmount")
		v.target = vm.Path("kubelet", "pods", "p-"+v.name+"-again", "volume")
		if err := stage(v); err != nil {
			t.Fatal(err)
		}
		if err := publish(v); err != nil {
			t.Fatal(err)
		}
		for file, want := range map[string]string{"before": "written before the reboot by " + v.name, "after": "written after the reboot"} {
			if got, err := vm.ReadFile(ctx, filepath.Join(v.target, file)); err != nil || string(got) != want {
				t.Errorf("%s: %s reads %q, %v; want %q", v.name, file, got, err, want)
			}
		}
		if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
			t.Fatal(err)
		}
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
			t.Fatal(err)
		}
		if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id, NodeId: vm.NodeID()}); err != nil {
			t.Fatal(err)
		}
		if _, err := cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id}); err != nil {
			t.Fatal(err)
		}
	}
}
