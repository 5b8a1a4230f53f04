package lio

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/test/certs"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// csiEnv is the driver as a cluster runs it with a storage target: the
// target role in the target VM serving its pool over iSCSI, a controller
// process on the host (in the VMs' network namespace) that reaches it over
// mutual TLS and holds no pool, and node plugins in the node VMs that
// reach their volumes with the kernel's initiator. Every call is a CSI
// call (or a csi-addons NetworkFence call), as the CO makes it.
type csiEnv struct {
	*env
	role    *targetRole
	pool    string // the target's pool directory, in the target VM
	ctrl    *testenv.Controller
	plugins map[string]csi.NodeClient
	nodeID  map[string]string // as each node plugin reports it
	// secretFile is each node's own CHAP secret; replacement is how long
	// the nodes' I/O waits for a lost session.
	secretFile  map[string]string
	replacement string
	pluginArgs  []string // more flags for the node plugins
	bin         string   // the modeguard binary every role runs
	// fence is the controller's csi-addons FenceController, on its CSI
	// endpoint; it keeps its fences in a directory of the test's.
	fence fence.FenceControllerClient
}

// setupCSI starts it all with nodes node VMs, named as the VMs are, whose
// I/O waits replacement for a lost session before it fails, and whose
// node plugins get pluginArgs too.
func setupCSI(t testing.TB, nodes int, replacement string, pluginArgs ...string) *csiEnv {
	requireInitiatorTools(t)
	bin := testenv.BuildBinary(t)
	e := &csiEnv{env: setupWith(t, nodes, bin), plugins: map[string]csi.NodeClient{}, nodeID: map[string]string{},
		secretFile: map[string]string{}, replacement: replacement, pluginArgs: pluginArgs, bin: bin}
	dir := t.TempDir()
	chap := filepath.Join(dir, "chap") // the target's CHAP Secret: a key per node
	if err := os.Mkdir(chap, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, vm := range e.env.nodes {
		secret := "chap-secret-of-" + vm.Name
		e.secretFile[vm.Name] = filepath.Join(dir, "secret-"+vm.Name) // the node's own key only
		for _, f := range []string{filepath.Join(chap, vm.Name), e.secretFile[vm.Name]} {
			if err := os.WriteFile(f, []byte(secret+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}

	authority := certs.NewCA(t, "modeguard")
	server, client := authority.Server(e.vm.Addr.String()), authority.Client("controller")
	api := net.JoinHostPort(e.vm.Addr.String(), "9443")
	e.pool = e.vm.Path("csi-pool")
	e.inVM("mkdir", "-p", e.pool)
	dialer := e.c.Dialer()
	e.role = &targetRole{e: e.env, log: filepath.Join(dir, "target.log"),
		args: []string{bin, "--roles", "target", "--block-pool", "zone-a=" + e.pool, "--block-pool-filesystem=direct",
			"--target-endpoint", "tcp://" + api, "--tls-cert", server.Cert, "--tls-key", server.Key, "--tls-ca", server.CA,
			"--iscsi-portal", e.portal, "--iscsi-iqn-prefix", prefix, "--iscsi-chap-dir", chap, "-v", "2"},
		api: remote.Target{Address: api, TLS: remote.TLSFiles(client),
			Dial: func(ctx context.Context, _, addr string) (net.Conn, error) { return dialer(ctx, addr) }},
	}
	e.role.launch().Close()
	t.Cleanup(func() {
		e.role.kill()
		if t.Failed() {
			t.Logf("target role log:\n%s", testenv.ReadFile(e.role.log))
		}
	})

	ctrlDir := t.TempDir()
	e.ctrl = testenv.NewController(t, bin, e.c.ServerNS, ctrlDir, "--roles", "controller", "-v", "2",
		"--block-target", "zone-a="+api, "--tls-cert", client.Cert, "--tls-key", client.Key, "--tls-ca", client.CA,
		"--fence-file", filepath.Join(ctrlDir, "fences", "fences.json"))
	e.ctrl.Start(e.ctx)
	t.Cleanup(func() {
		e.ctrl.Stop()
		if t.Failed() {
			t.Logf("controller log:\n%s", testenv.ReadFile(e.ctrl.Log))
		}
	})
	// csi-addons' sidecar dials the controller's CSI endpoint.
	conn, err := grpc.NewClient(e.ctrl.Endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e.fence = fence.NewFenceControllerClient(conn)

	for _, vm := range e.env.nodes {
		e.startNode(vm)
		e.plugins[vm.Name] = vm.NodeClient(t)
		info, err := e.plugins[vm.Name].NodeGetInfo(e.ctx, &csi.NodeGetInfoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		e.nodeID[vm.Name] = info.GetNodeId()
	}
	return e
}

// startNode starts vm's iscsid (its initiator named after the VM) and
// its node plugin, as the node's boot does.
func (e *csiEnv) startNode(vm *vmtest.VM) {
	e.t.Helper()
	if err := vm.StartISCSIInitiator(e.ctx, "iqn.2026-11.io.modeguard.node:"+vm.Name); err != nil {
		e.t.Fatal(err)
	}
	e.startPlugin(vm, nil)
}

// startPlugin (re)starts vm's node plugin with env added to its
// environment.
func (e *csiEnv) startPlugin(vm *vmtest.VM, env []string) {
	e.t.Helper()
	args := append([]string{"--iscsi-initiator-name-file", iscsi.InitiatorNameFile,
		"--iscsi-chap-secret-file", e.secretFile[vm.Name], "--iscsi-replacement-timeout", e.replacement}, e.pluginArgs...)
	if err := vm.StartPluginEnv(e.ctx, env, args...); err != nil {
		e.t.Fatal(err)
	}
}

// waitPlugin waits until node's plugin answers on the test's connection,
// which a restart of the plugin or its VM reset, and reports the node id
// it had at the start.
func (e *csiEnv) waitPlugin(node string) {
	e.t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		info, err := e.plugins[node].NodeGetInfo(e.ctx, &csi.NodeGetInfoRequest{})
		if err == nil {
			if info.GetNodeId() != e.nodeID[node] {
				e.t.Fatalf("node id of %s after its restart %q, want %q", node, info.GetNodeId(), e.nodeID[node])
			}
			return
		}
		if status.Code(err) != codes.Unavailable || time.Now().After(deadline) {
			e.t.Fatalf("NodeGetInfo of %s after its restart: %v", node, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// csiVolume is one volume and what the CO keeps of it.
type csiVolume struct {
	e         *csiEnv
	v         *csi.Volume
	cap       *csi.VolumeCapability
	published map[string]map[string]string
}

func mountCapability(mode accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}}}
}

func blockCapability(mode accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}
}

func (e *csiEnv) create(name string, capability *csi.VolumeCapability) *csiVolume {
	e.t.Helper()
	resp, err := e.ctrl.CSI.CreateVolume(e.ctx, &csi.CreateVolumeRequest{
		Name: name, VolumeCapabilities: []*csi.VolumeCapability{capability},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, Parameters: map[string]string{"backend": "block"},
	})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	if resp.GetVolume().GetVolumeContext()[iscsi.ContextTransport] != iscsi.TransportName {
		e.t.Fatalf("volume %s is not served over iSCSI: context %v", name, resp.GetVolume().GetVolumeContext())
	}
	return &csiVolume{e: e, v: resp.GetVolume(), cap: capability, published: map[string]map[string]string{}}
}

func (v *csiVolume) id() string                 { return v.v.GetVolumeId() }
func (v *csiVolume) staging(node string) string { return v.e.node(node).Path("staging", v.id()) }
func (v *csiVolume) target(node, pod string) string {
	return v.e.node(node).Path("pods", pod, "volume")
}

func (e *csiEnv) node(name string) *vmtest.VM {
	for _, vm := range e.env.nodes {
		if vm.Name == name {
			return vm
		}
	}
	e.t.Fatalf("no node VM %s", name)
	return nil
}

func (v *csiVolume) attach(node string, readOnly bool) error {
	resp, err := v.e.ctrl.CSI.ControllerPublishVolume(v.e.ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.id(), NodeId: v.e.nodeID[node], VolumeCapability: v.cap, Readonly: readOnly})
	if err == nil {
		v.published[node] = resp.GetPublishContext()
	}
	return err
}

func (v *csiVolume) detach(node string) {
	v.e.t.Helper()
	if _, err := v.e.ctrl.CSI.ControllerUnpublishVolume(v.e.ctx, &csi.ControllerUnpublishVolumeRequest{
		VolumeId: v.id(), NodeId: v.e.nodeID[node]}); err != nil {
		v.e.t.Fatalf("ControllerUnpublish from %s: %v", node, err)
	}
	delete(v.published, node)
}

// stageWith stages on node with the given publish context: the one the
// CO got for node, or, for a check of the target, another node's.
func (v *csiVolume) stageWith(node string, publishContext map[string]string) error {
	_, err := v.e.plugins[node].NodeStageVolume(v.e.ctx, &csi.NodeStageVolumeRequest{
		VolumeId: v.id(), StagingTargetPath: v.staging(node), VolumeCapability: v.cap,
		PublishContext: publishContext, VolumeContext: v.v.GetVolumeContext()})
	return err
}

func (v *csiVolume) unstage(node string) {
	v.e.t.Helper()
	if _, err := v.e.plugins[node].NodeUnstageVolume(v.e.ctx, &csi.NodeUnstageVolumeRequest{
		VolumeId: v.id(), StagingTargetPath: v.staging(node)}); err != nil {
		v.e.t.Fatalf("NodeUnstage on %s: %v", node, err)
	}
}

func (v *csiVolume) publish(node, pod string, readOnly bool) error {
	_, err := v.e.plugins[node].NodePublishVolume(v.e.ctx, &csi.NodePublishVolumeRequest{
		VolumeId: v.id(), StagingTargetPath: v.staging(node), TargetPath: v.target(node, pod),
		VolumeCapability: v.cap, Readonly: readOnly, PublishContext: v.published[node],
		VolumeContext: map[string]string{"csi.storage.k8s.io/pod.name": pod, "csi.storage.k8s.io/pod.namespace": "default"}})
	return err
}

func (v *csiVolume) unpublish(node, pod string) {
	v.e.t.Helper()
	if _, err := v.e.plugins[node].NodeUnpublishVolume(v.e.ctx, &csi.NodeUnpublishVolumeRequest{
		VolumeId: v.id(), TargetPath: v.target(node, pod)}); err != nil {
		v.e.t.Fatalf("NodeUnpublish %s on %s: %v", pod, node, err)
	}
}

// start is what the CO does for a pod on node: attach, stage, publish.
func (v *csiVolume) start(node, pod string, readOnly bool) {
	v.e.t.Helper()
	if err := v.attach(node, readOnly); err != nil {
		v.e.t.Fatalf("ControllerPublish to %s: %v", node, err)
	}
	if err := v.stageWith(node, v.published[node]); err != nil {
		v.e.t.Fatalf("NodeStage on %s: %v", node, err)
	}
	if err := v.publish(node, pod, readOnly); err != nil {
		v.e.t.Fatalf("NodePublish %s on %s: %v", pod, node, err)
	}
}

// stop is the CO's way back: unpublish, unstage, detach.
func (v *csiVolume) stop(node, pod string) {
	v.e.t.Helper()
	v.unpublish(node, pod)
	v.unstage(node)
	v.detach(node)
}

func (v *csiVolume) delete() {
	v.e.t.Helper()
	if _, err := v.e.ctrl.CSI.DeleteVolume(v.e.ctx, &csi.DeleteVolumeRequest{VolumeId: v.id()}); err != nil {
		v.e.t.Fatalf("DeleteVolume: %v", err)
	}
}

// image is the volume's image in the target's pool, where the target
// writes what the nodes write.
func (v *csiVolume) image() string {
	v.e.t.Helper()
	out := strings.Fields(v.e.inVM("sh", "-c", `ls "$1"/volumes/*.img`, "sh", v.e.pool))
	if len(out) != 1 {
		v.e.t.Fatalf("the target's pool holds %d images, want this test's one: %v", len(out), out)
	}
	return out[0]
}

// fsBytes is the size of the filesystem pod on node sees (statfs).
func (v *csiVolume) fsBytes(node, pod string) int64 {
	v.e.t.Helper()
	out, code, err := v.e.node(node).Run(v.e.ctx, "stat", "-f", "-c", "%b %S", v.target(node, pod))
	var blocks, size int64
	if err != nil || code != 0 {
		v.e.t.Fatalf("statfs of %s on %s: exit %d, %v: %s", pod, node, code, err, out)
	}
	if _, err := fmt.Sscanf(out, "%d %d", &blocks, &size); err != nil {
		v.e.t.Fatalf("statfs of %s on %s: %q: %v", pod, node, out, err)
	}
	return blocks * size
}

// wantNoISCSI checks that node has no session and no node record left.
func (e *csiEnv) wantNoISCSI(node string) {
	e.t.Helper()
	vm := e.node(node)
	// iscsiadm's "no records found" and "no active sessions" are exit 21.
	for _, mode := range []string{"session", "node"} {
		if out, code, err := vm.Run(e.ctx, "iscsiadm", "-m", mode); err != nil || code != 21 {
			e.t.Fatalf("%s has iSCSI %ss left: exit %d, %v: %s", node, mode, code, err, out)
		}
	}
}

func wantCSICode(t *testing.T, what string, err error, code codes.Code, says string) {
	t.Helper()
	if status.Code(err) != code || !strings.Contains(status.Convert(err).Message(), says) {
		t.Fatalf("%s: got %v, want %s saying %q", what, err, code, says)
	}
}

// TestCSIOverISCSIFencesAForceDetachedWriter: a single-node-writer ext4
// volume, served over iSCSI, is staged on node A and written with
// fsync; the second node is refused by the controller and, with A's
// publish context forged, by the target itself. Then the CO force-detaches
// A (ControllerUnpublishVolume, no node call, as after a dead node's
// timeout): from the answer on, A's writes fail; B is attached and stages
// (its mount replays the journal A left), reads exactly what A fsync'd
// (and at most the write in flight at the fence), and writes on. A's late
// unpublish and unstage are clean and leave no session. After B leaves,
// the filesystem in the target's image checks clean, and a new stage on B
// sees every write B had fsync'd.
func TestCSIOverISCSIFencesAForceDetachedWriter(t *testing.T) {
	e := setupCSI(t, 2, replacementTimeout)
	a, b := e.env.nodes[0].Name, e.env.nodes[1].Name
	v := e.create("fenced", mountCapability(accessmode.SingleNodeWriter))
	v.start(a, "writer", false)
	if got := v.published[a]["capacityBytes"]; got != strconv.Itoa(64<<20) {
		t.Fatalf("publish context capacityBytes = %q, want %d", got, 64<<20)
	}

	t.Run("the other node is refused at attach and at the target", func(t *testing.T) {
		wantCSICode(t, "ControllerPublish to "+b, v.attach(b, false), codes.FailedPrecondition, "")
		// B, told it is attached with A's publish context, tries itself:
		// the target's access list has no place for it.
		wantCSICode(t, "NodeStage on "+b+" with A's publish context", v.stageWith(b, v.published[a]),
			codes.FailedPrecondition, "refused this node's login")
		e.wantNoISCSI(b)
		if out, code, err := e.node(b).Run(e.ctx, "sh", "-c", "cat /proc/mounts | grep -c staging || true"); err != nil || code != 0 || strings.TrimSpace(out) != "0" {
			t.Fatalf("%s mounts a staging path after the refusal: %s", b, out)
		}
	})

	holder, err := e.node(a).HoldLock(e.ctx, filepath.Join(v.target(a, "writer"), "journal"), 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	w, err := vmtest.WriteThroughFence(e.ctx, holder, nil, func() error {
		t.Logf("the CO force-detaches %s: ControllerUnpublishVolume, no node call", a)
		_, err := e.ctrl.CSI.ControllerUnpublishVolume(e.ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id(), NodeId: e.nodeID[a]})
		return err
	})
	if err != nil {
		t.Fatalf("%s: %v", a, err)
	}
	delete(v.published, a)
	t.Logf("records %s fsync'd: %d; the write in flight at the fence: %v", a, w.Acked, w.InFlight)

	// B goes on where A stopped (over A's failed record, if it got
	// there), and A, still trying, gets nowhere.
	next := v.takeOver(t, a, b, w)
	const bRecords = 20
	for n := w.Acked; n < w.Acked+bRecords; n++ {
		if err := next.Write(e.ctx, int64(n*len(vmtest.FenceRecord(n))), []byte(vmtest.FenceRecord(n))); err != nil {
			t.Fatalf("%s writing record %d: %v", b, n, err)
		}
		if n == w.Acked+bRecords/2 {
			if err := w.Write(e.ctx, n); err == nil {
				t.Fatalf("%s, fenced, wrote record %d", a, n)
			}
		}
	}
	if err := next.Release(e.ctx); err != nil {
		t.Fatal(err)
	}

	t.Run("the fenced node comes back and cleans up", func(t *testing.T) {
		v.fencedComesBack(t, a, holder)
	})

	v.stop(b, "next")
	e.wantNoISCSI(b)
	if out, code, err := e.env.vm.Run(e.ctx, "e2fsck", "-fn", v.image()); err != nil || code != 0 {
		t.Fatalf("the filesystem in the target's image does not check clean: exit %d, %v:\n%s", code, err, out)
	}
	v.start(b, "again", true)
	got, err := e.node(b).ReadFile(e.ctx, filepath.Join(v.target(b, "again"), "journal"))
	if err != nil {
		t.Fatal(err)
	}
	if err := w.CheckJournal(got, bRecords); err != nil {
		t.Fatalf("after a new stage, %s reads: %v", b, err)
	}
	v.stop(b, "again")
	e.wantNoISCSI(b)
	v.delete()
	if out := e.inVM("sh", "-c", fmt.Sprintf("ls %s/iscsi | grep -c '^%s:' || true", lio.DefaultRoot, prefix)); strings.TrimSpace(out) != "0" {
		t.Fatalf("LIO still serves %s targets after the delete", out)
	}
}

// takeOver starts the volume on b (pod "next") after a, which held the
// journal w wrote, was fenced: b must read exactly what a fsync'd (and at
// most the record in flight). It returns b holding the journal's lock.
func (v *csiVolume) takeOver(t *testing.T, a, b string, w *vmtest.FencedWriter) *vmtest.LockHolder {
	t.Helper()
	v.start(b, "next", false)
	journal := filepath.Join(v.target(b, "next"), "journal")
	got, err := v.e.node(b).ReadFile(v.e.ctx, journal)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.CheckJournal(got, 0); err != nil {
		t.Fatalf("%s reads what %s wrote: %v", b, a, err)
	}
	holder, err := v.e.node(b).HoldLock(v.e.ctx, journal, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	return holder
}

// fencedComesBack is node a, fenced and force-detached while its writer
// (pod "writer") held the journal, coming back: the writer lets go, the
// CO's late NodeUnpublish and NodeUnstage succeed and leave no session,
// and its own ControllerUnpublish of a succeeds.
func (v *csiVolume) fencedComesBack(t *testing.T, a string, writer *vmtest.LockHolder) {
	t.Helper()
	if err := writer.Release(v.e.ctx); err != nil {
		t.Logf("%s's writer letting go after the fence: %v", a, err)
	}
	v.unpublish(a, "writer")
	v.unstage(a)
	v.e.wantNoISCSI(a)
	v.detach(a)
}

// imageBlock reads 4 KiB block n of the volume's image on the target.
func (v *csiVolume) imageBlock(n int) []byte {
	v.e.t.Helper()
	return []byte(v.e.inVM("dd", "if="+v.image(), "bs=4096", fmt.Sprintf("skip=%d", n), "count=1", "status=none"))
}

// mustWriteBlock writes block n of a published raw block volume on node.
func (v *csiVolume) mustWriteBlock(node, pod string, n int, fill byte) {
	v.e.t.Helper()
	if out, code := writeBlock(v.e.env, v.e.node(node), v.target(node, pod), n, fill); code != 0 {
		v.e.t.Fatalf("%s on %s writing block %d: exit %d: %s", pod, node, n, code, out)
	}
}

// mustNotWriteBlock checks that neither the node's kernel nor, around
// it, the target takes a write of block n from pod on node.
func (v *csiVolume) mustNotWriteBlock(node, pod string, n int) {
	v.e.t.Helper()
	dev := v.target(node, pod)
	if out, code := writeBlock(v.e.env, v.e.node(node), dev, n, 'X'); code == 0 || !strings.Contains(out, "Read-only file system") {
		v.e.t.Fatalf("%s on %s opened the volume for writing: exit %d: %s", pod, node, code, out)
	}
	if out, code := sgWrite(v.e.env, v.e.node(node), dev, n, 'X'); code == 0 || !strings.Contains(out, "Data Protect") {
		v.e.t.Fatalf("the target took a write of %s on %s around its kernel: exit %d: %s", pod, node, code, out)
	}
	if !filled(v.imageBlock(n), 0) {
		v.e.t.Fatalf("a refused write of %s on %s reached the image", pod, node)
	}
}

func (v *csiVolume) mustReadBlock(node, pod string, n int, fill byte) {
	v.e.t.Helper()
	if got := readBlock(v.e.env, v.e.node(node), v.target(node, pod), n); !filled(got, fill) {
		v.e.t.Fatalf("%s on %s reads %q at block %d, want %q", pod, node, got[:16], n, fill)
	}
}

// wantNoLoopDevices checks that node has no loop device left.
func (e *csiEnv) wantNoLoopDevices(node string) {
	e.t.Helper()
	if out, code, err := e.node(node).Run(e.ctx, "losetup", "-a"); err != nil || code != 0 || strings.TrimSpace(out) != "" {
		e.t.Fatalf("%s has loop devices left: exit %d, %v: %s", node, code, err, out)
	}
}

// TestCSIOverISCSIModesOnTwoNodes: raw block volumes served over iSCSI,
// staged and published through CSI on two node VMs. A reader of
// MULTI_NODE_SINGLE_WRITER, and every node of MULTI_NODE_READER_ONLY, is
// refused by its own kernel and, when it writes around it (SG_IO), by
// the target; a read-only publish on the writer's node gets a read-only
// device of its own over the disk; MULTI_NODE_MULTI_WRITER lets both
// nodes write. Each stop leaves no session, record or loop device.
func TestCSIOverISCSIModesOnTwoNodes(t *testing.T) {
	e := setupCSI(t, 2, replacementTimeout)
	a, b := e.env.nodes[0].Name, e.env.nodes[1].Name
	done := func(v *csiVolume) {
		t.Helper()
		for _, node := range []string{a, b} {
			e.wantNoISCSI(node)
			e.wantNoLoopDevices(node)
		}
		v.delete()
	}

	t.Run("MULTI_NODE_SINGLE_WRITER", func(t *testing.T) {
		v := e.create("mnsw", blockCapability(accessmode.MultiNodeSingleWriter))
		v.start(a, "writer", false)
		v.start(b, "reader", true)
		wantCSICode(t, "a second writer", v.attach(b, false), codes.AlreadyExists, "")
		v.mustWriteBlock(a, "writer", 3, 'W')
		v.mustReadBlock(b, "reader", 3, 'W')
		v.mustNotWriteBlock(b, "reader", 4)
		// A read-only publish next to the writer on its own node.
		if err := v.publish(a, "viewer", true); err != nil {
			t.Fatalf("read-only publish on the writer's node: %v", err)
		}
		v.mustReadBlock(a, "viewer", 3, 'W')
		if out, code := writeBlock(e.env, e.node(a), v.target(a, "viewer"), 5, 'V'); code == 0 {
			t.Fatalf("the read-only publish on the writer's node took a write: %s", out)
		}
		v.unpublish(a, "viewer")
		v.mustWriteBlock(a, "writer", 6, 'W')
		v.stop(b, "reader")
		v.stop(a, "writer")
		if !filled(v.imageBlock(6), 'W') || !filled(v.imageBlock(5), 0) {
			t.Fatal("the image does not hold exactly the writer's blocks")
		}
		done(v)
	})

	t.Run("MULTI_NODE_READER_ONLY", func(t *testing.T) {
		v := e.create("rox", blockCapability(accessmode.MultiNodeReaderOnly))
		v.start(a, "one", true)
		v.start(b, "two", true)
		v.mustNotWriteBlock(a, "one", 1)
		v.mustNotWriteBlock(b, "two", 2)
		v.stop(a, "one")
		v.stop(b, "two")
		done(v)
	})

	t.Run("MULTI_NODE_MULTI_WRITER", func(t *testing.T) {
		v := e.create("rwx", blockCapability(accessmode.MultiNodeMultiWriter))
		v.start(a, "one", false)
		v.start(b, "two", false)
		v.mustWriteBlock(a, "one", 1, 'A')
		v.mustWriteBlock(b, "two", 2, 'B')
		v.mustReadBlock(b, "two", 1, 'A')
		v.mustReadBlock(a, "one", 2, 'B')
		v.stop(a, "one")
		v.stop(b, "two")
		if !filled(v.imageBlock(1), 'A') || !filled(v.imageBlock(2), 'B') {
			t.Fatal("the image lacks a node's write")
		}
		done(v)
	})
}

// TestCSIOverISCSISurvivesATargetRestartAndANodeReboot: a node writes an
// ext4 volume served over iSCSI with fsync. The target's host goes down
// (the role killed, LIO emptied, as a reboot leaves it) while a write
// waits: the restarted target exports the volume again to the attached
// node, iscsid logs in again by itself, and the write completes. Then the
// node loses power: after its boot the CO stages and publishes again
// (the driver's records checked against a kernel that has nothing), the
// node logs in again, and every record it had fsync'd is there.
func TestCSIOverISCSISurvivesATargetRestartAndANodeReboot(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestCSIOverISCSIFencesAForceDetachedWriter and TestCSIOverISCSIModesOnTwoNodes (iSCSI)")
	e := setupCSI(t, 1, "120s")
	a := e.env.nodes[0].Name
	v := e.create("lives", mountCapability(accessmode.SingleNodeWriter))
	v.start(a, "app", false)
	journal := filepath.Join(v.target(a, "app"), "journal")
	holder, err := e.node(a).HoldLock(e.ctx, journal, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	w := &vmtest.FencedWriter{Holder: holder}
	for n := range 10 {
		if err := w.Write(e.ctx, n); err != nil {
			t.Fatalf("%s writing record %d: %v", a, n, err)
		}
	}

	e.role.kill()
	lun := strings.TrimPrefix(v.v.GetVolumeContext()[iscsi.ContextTarget], prefix+":")
	e.target("unexport", lun)
	waiting := make(chan error, 1)
	go func() { waiting <- w.Write(e.ctx, 10) }()
	time.Sleep(3 * time.Second)
	select {
	case err := <-waiting:
		t.Fatalf("a write while the target is down ended before it came back: %v", err)
	default:
	}
	e.role.launch().Close()
	if err := <-waiting; err != nil {
		t.Fatalf("the write that waited for the target's restart: %v", err)
	}
	for n := 11; n < 20; n++ {
		if err := w.Write(e.ctx, n); err != nil {
			t.Fatalf("%s writing record %d after the target's restart: %v", a, n, err)
		}
	}
	w.Acked = 20
	if err := holder.Release(e.ctx); err != nil {
		t.Fatal(err)
	}

	if err := e.node(a).Reboot(e.ctx); err != nil {
		t.Fatal(err)
	}
	e.startNode(e.node(a))
	e.waitPlugin(a)
	// The kubelet after the node's boot: the volume is still attached, so
	// it stages and publishes again with the publish context it kept.
	if err := v.stageWith(a, v.published[a]); err != nil {
		t.Fatalf("NodeStage after the reboot: %v", err)
	}
	if err := v.publish(a, "app", false); err != nil {
		t.Fatalf("NodePublish after the reboot: %v", err)
	}
	got, err := e.node(a).ReadFile(e.ctx, journal)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.CheckJournal(got, 0); err != nil {
		t.Fatalf("after the reboot: %v", err)
	}

	// Online expansion: the target grows the image and its device, the
	// node rescans its disk and grows the mounted filesystem.
	before := v.fsBytes(a, "app")
	if _, err := e.ctrl.CSI.ControllerExpandVolume(e.ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v.id(),
		CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}, VolumeCapability: v.cap}); err != nil {
		t.Fatalf("ControllerExpandVolume: %v", err)
	}
	resp, err := e.plugins[a].NodeExpandVolume(e.ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id(), VolumePath: v.target(a, "app"),
		StagingTargetPath: v.staging(a), CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}, VolumeCapability: v.cap})
	if err != nil || resp.GetCapacityBytes() != 128<<20 {
		t.Fatalf("NodeExpandVolume: %v, %v", resp, err)
	}
	if after := v.fsBytes(a, "app"); after < before+48<<20 {
		t.Fatalf("the mounted filesystem has %d bytes after growing to 128 MiB (it had %d)", after, before)
	}
	if got, err := e.node(a).ReadFile(e.ctx, journal); err != nil || w.CheckJournal(got, 0) != nil {
		t.Fatalf("the journal after the expansion: %v, %v", err, w.CheckJournal(got, 0))
	}
	v.stop(a, "app")
	e.wantNoISCSI(a)
	if out, code, err := e.env.vm.Run(e.ctx, "e2fsck", "-fn", v.image()); err != nil || code != 0 {
		t.Fatalf("the filesystem in the target's image does not check clean: exit %d, %v:\n%s", code, err, out)
	}
	v.delete()
}

// TestCSIOverISCSIEndsASessionACrashLeft: the node plugin is killed
// (SIGKILL) right after its login to a volume's target, before anything
// records the stage: only the kernel knows the session. Restarted, the
// plugin's NodeUnstageVolume ends it (found by the disk's serial) and
// leaves no node record; after a second such crash, the CO's retried
// NodeStageVolume reuses the session rather than logging in twice, and
// the volume is used and released as usual.
func TestCSIOverISCSIEndsASessionACrashLeft(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestCSIOverISCSIFencesAForceDetachedWriter and TestCSIOverISCSIModesOnTwoNodes (iSCSI)")
	e := setupCSI(t, 1, replacementTimeout)
	a := e.env.nodes[0].Name
	vm := e.node(a)
	v := e.create("crashed", mountCapability(accessmode.SingleNodeWriter))
	if err := v.attach(a, false); err != nil {
		t.Fatalf("ControllerPublish: %v", err)
	}
	sessions := func() int {
		t.Helper()
		out, code, err := vm.Run(e.ctx, "iscsiadm", "-m", "session")
		switch {
		case err != nil:
			t.Fatal(err)
		case code == 21: // no active sessions
			return 0
		case code != 0:
			t.Fatalf("iscsiadm -m session: exit %d: %s", code, out)
		}
		return len(strings.Split(strings.TrimSpace(out), "\n"))
	}
	crash := func() {
		t.Helper()
		e.startPlugin(vm, []string{faultpoint.EnvVar + "=block.stage.iscsi-logged-in"})
		e.waitPlugin(a)
		if err := v.stageWith(a, v.published[a]); status.Code(err) != codes.Unavailable {
			t.Fatalf("NodeStage with the plugin killed after its login: %v, want UNAVAILABLE", err)
		}
		if n := sessions(); n != 1 {
			t.Fatalf("%s has %d sessions after the crash, want the one the crash left", a, n)
		}
		e.startPlugin(vm, nil)
		e.waitPlugin(a)
	}

	crash()
	v.unstage(a)
	e.wantNoISCSI(a)

	crash()
	if err := v.stageWith(a, v.published[a]); err != nil {
		t.Fatalf("NodeStage retried after the crash: %v", err)
	}
	if n := sessions(); n != 1 {
		t.Fatalf("%s has %d sessions after the retried stage, want 1", a, n)
	}
	if err := v.publish(a, "app", false); err != nil {
		t.Fatalf("NodePublish: %v", err)
	}
	if err := vm.WriteFile(e.ctx, filepath.Join(v.target(a, "app"), "after-the-crash"), []byte("written\n")); err != nil {
		t.Fatal(err)
	}
	v.stop(a, "app")
	e.wantNoISCSI(a)
	v.delete()
}

// TestCSIOverISCSISnapshotAndCloneCarryData: on a target whose pool has no
// reflinks, a snapshot of a volume attached for writing is refused with
// the reason (a byte copy of an image in use could be torn), and one of
// the same volume at rest is taken; a volume restored from it into a
// larger size, and a clone of the origin, are served over iSCSI with the
// origin's data, the restored one's filesystem grown at its first stage.
func TestCSIOverISCSISnapshotAndCloneCarryData(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestCSIOverISCSIFencesAForceDetachedWriter and TestCSIOverISCSIModesOnTwoNodes (iSCSI)")
	e := setupCSI(t, 1, replacementTimeout)
	a := e.env.nodes[0].Name
	c := mountCapability(accessmode.SingleNodeWriter)
	origin := e.create("origin", c)
	origin.start(a, "app", false)
	const data = "written before the snapshot\n"
	if err := e.node(a).WriteFile(e.ctx, filepath.Join(origin.target(a, "app"), "data"), []byte(data)); err != nil {
		t.Fatal(err)
	}
	if out, code, err := e.node(a).Run(e.ctx, "sync"); err != nil || code != 0 {
		t.Fatalf("sync: exit %d, %v: %s", code, err, out)
	}
	_, err := e.ctrl.CSI.CreateSnapshot(e.ctx, &csi.CreateSnapshotRequest{SourceVolumeId: origin.id(), Name: "busy"})
	wantCSICode(t, "a snapshot of a volume attached for writing", err, codes.FailedPrecondition, "attached read-write")
	origin.stop(a, "app")

	snap, err := e.ctrl.CSI.CreateSnapshot(e.ctx, &csi.CreateSnapshotRequest{SourceVolumeId: origin.id(), Name: "at-rest"})
	if err != nil {
		t.Fatalf("CreateSnapshot of the volume at rest: %v", err)
	}
	for deadline := time.Now().Add(2 * time.Minute); !snap.GetSnapshot().GetReadyToUse(); {
		if time.Now().After(deadline) {
			t.Fatal("the snapshot is not ready after 2 minutes")
		}
		time.Sleep(time.Second)
		if snap, err = e.ctrl.CSI.CreateSnapshot(e.ctx, &csi.CreateSnapshotRequest{SourceVolumeId: origin.id(), Name: "at-rest"}); err != nil {
			t.Fatal(err)
		}
	}
	// A restore or a clone is a byte copy here (no reflinks): CreateVolume
	// answers ABORTED while it runs, as the CO's retries expect.
	from := func(name string, src *csi.VolumeContentSource, size int64) *csiVolume {
		t.Helper()
		req := &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{c},
			CapacityRange: &csi.CapacityRange{RequiredBytes: size}, Parameters: map[string]string{"backend": "block"}, VolumeContentSource: src}
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
			resp, err := e.ctrl.CSI.CreateVolume(e.ctx, req)
			switch {
			case err == nil && resp.GetVolume().GetVolumeContext()[iscsi.ContextTransport] != iscsi.TransportName:
				t.Fatalf("volume %s is not served over iSCSI: %v", name, resp.GetVolume().GetVolumeContext())
			case err == nil:
				return &csiVolume{e: e, v: resp.GetVolume(), cap: c, published: map[string]map[string]string{}}
			case status.Code(err) != codes.Aborted || time.Now().After(deadline):
				t.Fatalf("CreateVolume %s: %v", name, err)
			}
		}
	}
	// One at a time: the target's disk in the VM holds 256 MiB.
	check := func(v *csiVolume, minFs int64) {
		t.Helper()
		v.start(a, "reader", false)
		got, err := e.node(a).ReadFile(e.ctx, filepath.Join(v.target(a, "reader"), "data"))
		if err != nil || string(got) != data {
			t.Fatalf("%s reads %q, %v; want the origin's %q", v.v.GetVolumeId(), got, err, data)
		}
		if size := v.fsBytes(a, "reader"); size < minFs {
			t.Fatalf("%s's filesystem has %d bytes, want at least %d (grown at its first stage)", v.v.GetVolumeId(), size, minFs)
		}
		v.stop(a, "reader")
		v.delete()
	}
	check(from("restored", &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}}, 96<<20), 80<<20)
	check(from("clone", &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: origin.id()}}}, 64<<20), 48<<20)
	if _, err := e.ctrl.CSI.DeleteSnapshot(e.ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
		t.Fatal(err)
	}
	origin.delete()
	e.wantNoISCSI(a)
}
