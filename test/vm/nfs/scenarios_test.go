// Package nfs checks the NFS backend with the kernel's own NFS client: the
// node plugin runs inside small VMs (Debian's kernel under qemu) that are
// nodes on a bridge next to the controller and its ganesha, and every mount
// is a real `mount -t nfs4`.
package nfs

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// env is the cluster the scenarios share: a controller (with its ganesha)
// in the server namespace and node plugins in the VMs.
type env struct {
	t     *testing.T
	ctx   context.Context
	c     *vmtest.Cluster
	ctrl  *testenv.Controller
	nodes map[string]csi.NodeClient
}

func setup(t *testing.T, vms int) *env {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	c := vmtest.Start(t, vmtest.Options{VMs: vms, Binary: bin})
	ctx := testenv.Context(t, 10*time.Minute)
	// With a fence list, for the network fence of TestKernelNFSFenceOfAMountedClient.
	ctrl := testenv.StartNFSController(ctx, t, bin, c.ServerNS, c.Server.String(), "--max-volumes-per-node", "8",
		"--fence-file", filepath.Join(t.TempDir(), "fences", "fences.json"))
	e := &env{t: t, ctx: ctx, c: c, ctrl: ctrl, nodes: map[string]csi.NodeClient{}}
	for _, vm := range c.VMs {
		if err := vm.StartPlugin(ctx, "--max-volumes-per-node", "8"); err != nil {
			t.Fatal(err)
		}
		e.nodes[vm.Name] = vm.NodeClient(t)
	}
	return e
}

func (e *env) vm(name string) *vmtest.VM {
	for _, v := range e.c.VMs {
		if v.Name == name {
			return v
		}
	}
	e.t.Fatalf("no VM %s", name)
	return nil
}

func (e *env) nodeID(name string) string { return e.vm(name).NodeID() }

func capability(mode accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
}

// volume is a volume a scenario uses, with what it takes to mount it.
type volume struct {
	e         *env
	v         *csi.Volume
	mode      accessmode.Mode
	published map[string]map[string]string
}

func (e *env) create(name string, mode accessmode.Mode, src *csi.VolumeContentSource) *volume {
	e.t.Helper()
	resp, err := e.ctrl.CSI.CreateVolume(e.ctx, &csi.CreateVolumeRequest{
		Name: name, VolumeCapabilities: []*csi.VolumeCapability{capability(mode)},
		Parameters: map[string]string{"backend": "nfs"}, VolumeContentSource: src,
	})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return &volume{e: e, v: resp.GetVolume(), mode: mode, published: map[string]map[string]string{}}
}

func (v *volume) attach(node string, readOnly bool) error {
	resp, err := v.e.ctrl.CSI.ControllerPublishVolume(v.e.ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.v.GetVolumeId(), NodeId: v.e.nodeID(node), VolumeCapability: capability(v.mode), Readonly: readOnly,
	})
	if err == nil {
		v.published[node] = resp.GetPublishContext()
	}
	return err
}

func (v *volume) staging(node string) string { return v.e.vm(node).Path("staging", v.v.GetVolumeId()) }
func (v *volume) target(node, pod string) string {
	return v.e.vm(node).Path("pods", pod, "volume")
}

func (v *volume) stage(node string) error {
	_, err := v.e.nodes[node].NodeStageVolume(v.e.ctx, &csi.NodeStageVolumeRequest{
		VolumeId: v.v.GetVolumeId(), StagingTargetPath: v.staging(node), VolumeCapability: capability(v.mode),
		PublishContext: v.published[node], VolumeContext: v.v.GetVolumeContext(),
	})
	return err
}

func (v *volume) mountPod(node, pod string, readOnly bool) error {
	_, err := v.e.nodes[node].NodePublishVolume(v.e.ctx, &csi.NodePublishVolumeRequest{
		VolumeId: v.v.GetVolumeId(), StagingTargetPath: v.staging(node), TargetPath: v.target(node, pod),
		VolumeCapability: capability(v.mode), Readonly: readOnly, PublishContext: v.published[node],
		VolumeContext: map[string]string{"csi.storage.k8s.io/pod.name": pod, "csi.storage.k8s.io/pod.namespace": "default"},
	})
	return err
}

// start attaches, stages and mounts for one pod.
func (v *volume) start(node, pod string, readOnly bool) error {
	if _, ok := v.published[node]; !ok {
		if err := v.attach(node, readOnly); err != nil {
			return err
		}
		if err := v.stage(node); err != nil {
			return err
		}
	}
	return v.mountPod(node, pod, readOnly)
}

// stop unmounts the pods, unstages and detaches.
func (v *volume) stop(node string, pods ...string) {
	v.e.t.Helper()
	for _, pod := range pods {
		if _, err := v.e.nodes[node].NodeUnpublishVolume(v.e.ctx, &csi.NodeUnpublishVolumeRequest{
			VolumeId: v.v.GetVolumeId(), TargetPath: v.target(node, pod)}); err != nil {
			v.e.t.Fatalf("NodeUnpublish %s on %s: %v", pod, node, err)
		}
	}
	if _, err := v.e.nodes[node].NodeUnstageVolume(v.e.ctx, &csi.NodeUnstageVolumeRequest{
		VolumeId: v.v.GetVolumeId(), StagingTargetPath: v.staging(node)}); err != nil {
		v.e.t.Fatalf("NodeUnstage on %s: %v", node, err)
	}
	if _, err := v.e.ctrl.CSI.ControllerUnpublishVolume(v.e.ctx, &csi.ControllerUnpublishVolumeRequest{
		VolumeId: v.v.GetVolumeId(), NodeId: v.e.nodeID(node)}); err != nil {
		v.e.t.Fatalf("ControllerUnpublish from %s: %v", node, err)
	}
	delete(v.published, node)
}

func (v *volume) delete() {
	v.e.t.Helper()
	if _, err := v.e.ctrl.CSI.DeleteVolume(v.e.ctx, &csi.DeleteVolumeRequest{VolumeId: v.v.GetVolumeId()}); err != nil {
		v.e.t.Fatalf("DeleteVolume: %v", err)
	}
}

func (v *volume) write(node, pod, file, data string) error {
	return v.e.vm(node).WriteFile(v.e.ctx, filepath.Join(v.target(node, pod), file), []byte(data))
}

func (v *volume) mustWrite(node, pod, file, data string) {
	v.e.t.Helper()
	if err := v.write(node, pod, file, data); err != nil {
		v.e.t.Fatalf("%s on %s writing %s: %v", pod, node, file, err)
	}
}

func (v *volume) mustNotWrite(node, pod, file string) {
	v.e.t.Helper()
	err := v.write(node, pod, file, "must not land")
	if err == nil {
		v.e.t.Fatalf("%s on %s wrote %s through a read-only publish", pod, node, file)
	}
	if !strings.Contains(err.Error(), "read-only") {
		v.e.t.Fatalf("%s on %s: the write failed, but not with EROFS: %v", pod, node, err)
	}
}

func (v *volume) mustRead(node, pod, file, want string) {
	v.e.t.Helper()
	got, err := v.e.vm(node).ReadFile(v.e.ctx, filepath.Join(v.target(node, pod), file))
	if err != nil || string(got) != want {
		v.e.t.Fatalf("%s on %s reading %s: %q, %v; want %q", pod, node, file, got, err, want)
	}
}

func wantCode(t *testing.T, what string, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("%s: got %v, want %s", what, err, code)
	}
}

// byHand is what a user with root on a node could try: mount the export
// themselves, outside the driver.
func (v *volume) mountByHand(node string) (string, int) {
	v.e.t.Helper()
	vm := v.e.vm(node)
	dir := vm.Path("by-hand", fmt.Sprint(time.Now().UnixNano()))
	if out, code, err := vm.Run(v.e.ctx, "mkdir", "-p", dir); err != nil || code != 0 {
		v.e.t.Fatalf("mkdir in %s: %s %v", node, out, err)
	}
	src := v.v.GetVolumeContext()[nfs.ContextServer] + ":" + v.v.GetVolumeContext()[nfs.ContextShare]
	out, code, err := vm.Run(v.e.ctx, "mount", "-t", "nfs4", "-o",
		"vers=4.2,soft,timeo=50,retrans=1,addr="+v.v.GetVolumeContext()[nfs.ContextServer]+",clientaddr="+vm.Addr.String(), src, dir)
	if err != nil {
		v.e.t.Fatal(err)
	}
	if code == 0 {
		_, _, _ = vm.Run(v.e.ctx, "umount", dir)
	}
	return out, code
}

// TestKernelNFSAccessModes tells the access-mode scenarios with the
// kernel's NFS client on two VM nodes.
func TestKernelNFSAccessModes(t *testing.T) {
	e := setup(t, 2)

	t.Run("single node writer: one node; the server refuses the other even by hand", func(t *testing.T) {
		e.t = t
		v := e.create("rwo", accessmode.SingleNodeWriter, nil)
		wantCode(t, "start on vm1", v.start("vm1", "app", false), codes.OK)
		v.mustWrite("vm1", "app", "data", "from vm1")
		wantCode(t, "ControllerPublish to vm2", v.attach("vm2", false), codes.FailedPrecondition)
		if out, code := v.mountByHand("vm2"); code == 0 {
			t.Fatalf("vm2 mounted the export by hand although the volume is not published to it: %s", out)
		}
		v.stop("vm1", "app")
		wantCode(t, "start on vm2 after vm1 let go", v.start("vm2", "app", false), codes.OK)
		v.mustRead("vm2", "app", "data", "from vm1")
		v.stop("vm2", "app")
		v.delete()
	})

	t.Run("read only many: every node reads, the kernel refuses writes", func(t *testing.T) {
		e.t = t
		src := e.create("rox-src", accessmode.SingleNodeMultiWriter, nil)
		wantCode(t, "fill on vm1", src.start("vm1", "loader", false), codes.OK)
		src.mustWrite("vm1", "loader", "ref", "reference data")
		src.stop("vm1", "loader")
		snap, err := e.ctrl.CSI.CreateSnapshot(e.ctx, &csi.CreateSnapshotRequest{Name: "rox-snap", SourceVolumeId: src.v.GetVolumeId()})
		if err != nil {
			t.Fatal(err)
		}
		v := e.create("rox", accessmode.MultiNodeReaderOnly, &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}})
		for _, n := range []string{"vm1", "vm2"} {
			wantCode(t, "start ROX on "+n+" asking for read/write", v.start(n, "reader", false), codes.OK)
			v.mustRead(n, "reader", "ref", "reference data")
			v.mustNotWrite(n, "reader", "ref")
		}
		v.stop("vm1", "reader")
		v.stop("vm2", "reader")
		v.delete()
		if _, err := e.ctrl.CSI.DeleteSnapshot(e.ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
			t.Fatal(err)
		}
		src.delete()
	})

	t.Run("multi node single writer: one writes, the other reads what it wrote", func(t *testing.T) {
		e.t = t
		v := e.create("mnsw", accessmode.MultiNodeSingleWriter, nil)
		wantCode(t, "writer on vm1", v.start("vm1", "writer", false), codes.OK)
		wantCode(t, "second writer on vm2", v.attach("vm2", false), codes.FailedPrecondition)
		wantCode(t, "reader on vm2", v.start("vm2", "reader", true), codes.OK)
		v.mustWrite("vm1", "writer", "log", "entry 1")
		v.mustRead("vm2", "reader", "log", "entry 1")
		v.mustNotWrite("vm2", "reader", "log")
		v.stop("vm2", "reader")
		v.stop("vm1", "writer")
		v.delete()
	})

	t.Run("read write many: both write and see each other's files", func(t *testing.T) {
		e.t = t
		v := e.create("rwx", accessmode.MultiNodeMultiWriter, nil)
		for _, n := range []string{"vm1", "vm2"} {
			wantCode(t, "start on "+n, v.start(n, "app", false), codes.OK)
			v.mustWrite(n, "app", n, "written on "+n)
		}
		v.mustRead("vm1", "app", "vm2", "written on vm2")
		v.mustRead("vm2", "app", "vm1", "written on vm1")
		v.stop("vm1", "app")
		v.stop("vm2", "app")
		v.delete()
	})

	t.Run("read write once pod: a second pod is refused, also after the plugin restarts", func(t *testing.T) {
		e.t = t
		v := e.create("rwop", accessmode.SingleNodeSingleWriter, nil)
		wantCode(t, "pod db-0 on vm1", v.start("vm1", "db-0", false), codes.OK)
		wantCode(t, "pod db-1 on vm1", v.mountPod("vm1", "db-1", false), codes.FailedPrecondition)
		vm1 := e.vm("vm1")
		if err := vm1.KillPlugin(e.ctx); err != nil {
			t.Fatal(err)
		}
		if err := vm1.StartPlugin(e.ctx, "--max-volumes-per-node", "8"); err != nil {
			t.Fatal(err)
		}
		wantCode(t, "pod db-1 on vm1 after the restart", v.mountPod("vm1", "db-1", false), codes.FailedPrecondition)
		v.mustWrite("vm1", "db-0", "still", "writable after the restart")
		v.stop("vm1", "db-0")
		v.delete()
	})

	t.Run("the node plugin killed at every step of an NFS volume's life converges", func(t *testing.T) {
		e.t = t
		vm1 := e.vm("vm1")
		// The node plugin's steps are the driver's, the same for both
		// backends; here the mount underneath is the kernel's NFS client.
		for i, point := range []string{"node.stage.backend-staged", "node.stage.recorded", "node.publish.holder-recorded",
			"node.publish.mounted", "node.unpublish.unmounted", "node.unstage.backend-unstaged"} {
			if err := vm1.StartPluginEnv(e.ctx, []string{faultpoint.EnvVar + "=" + point}, "--max-volumes-per-node", "8"); err != nil {
				t.Fatal(err)
			}
			v := e.create(fmt.Sprintf("crash-%d", i), accessmode.SingleNodeWriter, nil)
			killed := 0
			// retry runs a node call; when the plugin died, it restarts it
			// without the fault and runs the call again, as a CO does.
			retry := func(what string, f func() error) {
				t.Helper()
				for attempt := 0; ; attempt++ {
					err := f()
					if err == nil {
						return
					}
					st, serr := vm1.PluginStatus(e.ctx)
					if serr != nil {
						t.Fatal(serr)
					}
					if !st.Running {
						if !strings.Contains(st.Exit, "killed") {
							t.Fatalf("%s: the plugin ended, not by SIGKILL: %s", what, st.Exit)
						}
						killed++
						if err := vm1.StartPlugin(e.ctx, "--max-volumes-per-node", "8"); err != nil {
							t.Fatal(err)
						}
						continue
					}
					if status.Code(err) == codes.Unavailable && attempt < 50 {
						time.Sleep(200 * time.Millisecond) // reconnecting to the restarted plugin
						continue
					}
					t.Fatalf("%s at %s: %v", what, point, err)
				}
			}
			wantCode(t, "attach to vm1", v.attach("vm1", false), codes.OK)
			retry("NodeStageVolume", func() error { return v.stage("vm1") })
			retry("NodePublishVolume", func() error { return v.mountPod("vm1", "app", false) })
			v.mustWrite("vm1", "app", "data", "written at "+point)
			v.mustRead("vm1", "app", "data", "written at "+point)
			retry("NodeUnpublishVolume", func() error {
				_, err := e.nodes["vm1"].NodeUnpublishVolume(e.ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.v.GetVolumeId(), TargetPath: v.target("vm1", "app")})
				return err
			})
			retry("NodeUnstageVolume", func() error {
				_, err := e.nodes["vm1"].NodeUnstageVolume(e.ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.v.GetVolumeId(), StagingTargetPath: v.staging("vm1")})
				return err
			})
			if killed != 1 {
				t.Fatalf("the plugin died %d times at %s; want once", killed, point)
			}
			if out, _, err := vm1.Run(e.ctx, "cat", "/proc/mounts"); err != nil || strings.Contains(out, " nfs4 ") {
				t.Fatalf("an NFS mount is left on vm1 after %s (err %v):\n%s", point, err, out)
			}
			if _, err := e.ctrl.CSI.ControllerUnpublishVolume(e.ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.v.GetVolumeId(), NodeId: e.nodeID("vm1")}); err != nil {
				t.Fatal(err)
			}
			delete(v.published, "vm1")
			v.delete()
		}
		if err := vm1.StartPlugin(e.ctx, "--max-volumes-per-node", "8"); err != nil {
			t.Fatal(err)
		}
	})
}
