package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/test/testenv"
)

// untilActing waits until p acts as the controller: its calls are no
// longer refused as a standby's.
func untilActing(t *testing.T, p *crashProc) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(200 * time.Millisecond) {
		_, err := csi.NewControllerClient(p.conn).ListVolumes(context.Background(), &csi.ListVolumesRequest{})
		if status.Code(err) != codes.Unavailable {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not take over: %v", p.name, err)
		}
	}
}

// TestNFSServedByATarget: the NFS volumes are served by a storage target
// (ganesha, the data and the records on its host); controllers keep
// nothing of them. A controller dies, and another, started with nothing
// of the first's, takes over the volumes, their attachments and the
// fences; the nodes' I/O never went through either. Each controller also
// holds a block zone's target, so the election spans both kinds.
func TestNFSServedByATarget(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nsenter", "mkfs.xfs")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 2, Prefix: "mgn"})
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	target := testenv.StartNFSTarget(ctx, t, bin, net.Server.Path, net.Server.Addr.String(), "--nfs-pool-size", "1Gi")
	nfsArg := "--nfs-target=" + target.Endpoint()
	blockArgs, _ := zoneTargets(t, bin, work, "zone-a")
	// A controller is given its targets and nothing else: no directory
	// of its own.
	controller := func(name string) *crashProc {
		return runController(t, bin, work, name, append(blockArgs, nfsArg)...)
	}
	nodeID := func(i int) string {
		return nodeid.Node{Name: fmt.Sprintf("node-%d", i+1), Zone: "zone-a", Address: net.Nodes[i].Addr.String()}.String()
	}
	payload := filepath.Join(work, "payload")
	if err := os.WriteFile(payload, []byte("written over NFS"), 0o644); err != nil {
		t.Fatal(err)
	}
	rwo := nfsCapability(accessmode.SingleNodeWriter)
	var share string
	write := func(node int, file string) error {
		return net.Nodes[node].NFSCopy(ctx, payload, net.NFSURL(share, file))
	}
	mustWrite := func(node int, file, when string) {
		t.Helper()
		if err := write(node, file); err != nil {
			t.Fatalf("%s: node-%d could not write %s: %v", when, node+1, file, err)
		}
	}
	mustNotWrite := func(node int, file, when string) {
		t.Helper()
		if err := write(node, file); err == nil {
			t.Fatalf("%s: node-%d wrote %s", when, node+1, file)
		}
	}
	fenceOf := func(node int) []*fence.CIDR { return []*fence.CIDR{{Cidr: net.Nodes[node].Addr.String() + "/32"}} }
	kill := func(p *crashProc) {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
	}

	first := controller("first")
	resp, err := csi.NewControllerClient(first.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "served-by-the-target", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{rwo}, Parameters: map[string]string{"backend": "nfs"},
	})
	if err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	vol := resp.GetVolume()
	share = vol.GetVolumeContext()[nfs.ContextShare]
	if got := vol.GetVolumeContext()[nfs.ContextServer]; got != net.Server.Addr.String() {
		t.Errorf("the volume is served from %q, want the target's --nfs-server %s", got, net.Server.Addr)
	}
	if _, err := csi.NewControllerClient(first.conn).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: vol.GetVolumeId(), NodeId: nodeID(0), VolumeCapability: rwo}); err != nil {
		t.Fatalf("publishing to node-1: %v", err)
	}
	mustWrite(0, "before", "published to node-1")
	mustNotWrite(1, "not-node-2", "published to node-1 only")

	// No controller: the data path does not need one.
	kill(first)
	mustWrite(0, "no-controller", "with no controller running")

	second := controller("second")
	untilActing(t, second)
	listed, err := csi.NewControllerClient(second.conn).ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatalf("ListVolumes: %v", err)
	}
	if got := listed.GetEntries(); len(got) != 1 || got[0].GetVolume().GetVolumeId() != vol.GetVolumeId() ||
		!slices.Equal(got[0].GetStatus().GetPublishedNodeIds(), []string{nodeID(0)}) {
		t.Fatalf("the controller that took over lists %v, want %s published to node-1", got, vol.GetVolumeId())
	}
	// The fence is set on the target's export, and stays there with no
	// controller at all.
	if _, err := fence.NewFenceControllerClient(second.conn).FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Cidrs: fenceOf(0)}); err != nil {
		t.Fatalf("FenceClusterNetwork: %v", err)
	}
	if _, err := os.Stat(filepath.Join(target.ExportRoot, ".modeguard-fences.json")); err != nil {
		t.Errorf("the NFS target holds no fence list: %v", err)
	}
	mustNotWrite(0, "fenced", "node-1 fenced")
	kill(second)
	mustNotWrite(0, "fenced-no-controller", "node-1 fenced, no controller")

	third := controller("third")
	untilActing(t, third)
	fences, err := fence.NewFenceControllerClient(third.conn).ListClusterFence(ctx, &fence.ListClusterFenceRequest{})
	if err != nil {
		t.Fatalf("ListClusterFence: %v", err)
	}
	if got := fences.GetCidrs(); len(got) != 1 || got[0].GetCidr() != fenceOf(0)[0].GetCidr() {
		t.Fatalf("the third controller lists the fences %v, want node-1's", got)
	}
	if _, err := fence.NewFenceControllerClient(third.conn).UnfenceClusterNetwork(ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: fenceOf(0)}); err != nil {
		t.Fatalf("UnfenceClusterNetwork: %v", err)
	}
	mustWrite(0, "lifted", "node-1's fence lifted")
	cc := csi.NewControllerClient(third.conn)
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: nodeID(0)}); err != nil {
		t.Fatalf("unpublishing from node-1: %v", err)
	}
	if _, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: vol.GetVolumeId(), NodeId: nodeID(1), VolumeCapability: rwo}); err != nil {
		t.Fatalf("publishing to node-2: %v", err)
	}
	mustNotWrite(0, "moved", "moved to node-2")
	mustRead := func(file, when string) {
		t.Helper()
		got, err := net.Nodes[1].NFSCat(ctx, net.NFSURL(share, file))
		if err != nil || string(got) != "written over NFS" {
			t.Errorf("%s: node-2 reads %s as %q, %v; want what node-1 wrote", when, file, got, err)
		}
	}
	for _, file := range []string{"before", "no-controller", "lifted"} {
		mustRead(file, "moved to node-2")
	}

	// The target dies, and its ganesha with it; started again, it serves
	// the attachments its records hold, to the acting controller too.
	ganeshaPID, busPID := testenv.NFSServerPIDs(t, target.GaneshaDir)
	target.Kill()
	testenv.WaitNFSServerGone(t, target.GaneshaDir, ganeshaPID, busPID)
	target.Start(ctx)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Second) {
		// New clients wait out ganesha's grace period.
		if err := write(1, "after-the-target-restart"); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("node-2 could not write after the target's restart: %v", err)
		}
	}
	mustRead("before", "after the target's restart")
	mustNotWrite(0, "after-the-target-restart-1", "after the target's restart, published to node-2")
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: nodeID(1)}); err != nil {
		t.Fatal(err)
	}
	if _, err := cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatalf("DeleteVolume: %v", err)
	}
}

// TestNFSTargetTakesOverAControllersExportRoot: an install whose
// controller served NFS itself (its export root, ganesha directory and
// fence file on its node) moves to an NFS target on the same node and
// directories. Every volume is served at the address its volume context
// names, to the nodes it was published to, with its data; the fence list
// moves onto the target.
func TestNFSTargetTakesOverAControllersExportRoot(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nsenter", "mkfs.xfs")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 2, Prefix: "mgu"})
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	fenceFile := filepath.Join(work, "fences", "fences.json")
	old, gdir := startNFSControllerIn(ctx, t, bin, net, work, "--nfs-pool-size", "1Gi", "--fence-file", fenceFile)
	nodeID := func(i int) string {
		return nodeid.Node{Name: fmt.Sprintf("node-%d", i+1), Zone: "zone-a", Address: net.Nodes[i].Addr.String()}.String()
	}
	payload := filepath.Join(work, "payload")
	if err := os.WriteFile(payload, []byte("written over NFS"), 0o644); err != nil {
		t.Fatal(err)
	}
	rwo := nfsCapability(accessmode.SingleNodeWriter)
	resp, err := old.CSI.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "made-by-the-controller", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{rwo}, Parameters: map[string]string{"backend": "nfs"},
	})
	if err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	vol := resp.GetVolume()
	share := vol.GetVolumeContext()[nfs.ContextShare]
	if _, err := old.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: vol.GetVolumeId(), NodeId: nodeID(0), VolumeCapability: rwo}); err != nil {
		t.Fatalf("publishing to node-1: %v", err)
	}
	write := func(node int, file string) error {
		return net.Nodes[node].NFSCopy(ctx, payload, net.NFSURL(share, file))
	}
	if err := write(0, "before"); err != nil {
		t.Fatalf("node-1 writing before the move: %v", err)
	}
	fenced := net.Nodes[1].Addr.String() + "/32"
	if _, err := fence.NewFenceControllerClient(old.Conn()).FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{
		Cidrs: []*fence.CIDR{{Cidr: fenced}}}); err != nil {
		t.Fatalf("FenceClusterNetwork: %v", err)
	}
	old.Stop()

	// The same directories, now the target's; the controller keeps only
	// the fence file it hands over.
	target := testenv.NewTarget(t, bin, net.Server.Path, filepath.Join(work, "nfs-target.sock"), filepath.Join(work, "nfs-target.log"),
		"--roles", "target", "-v", "2", "--nfs-export-root", filepath.Join(work, "nfs"), "--nfs-pool-size", "1Gi",
		"--nfs-server", net.Server.Addr.String(), "--nfs-ganesha-dir", gdir)
	target.Start(ctx)
	t.Cleanup(func() {
		target.Stop()
		if t.Failed() {
			t.Logf("NFS target log:\n%s", testenv.ReadFile(target.Log))
		}
	})
	ctrl := runController(t, bin, work, "after-the-move", "--nfs-target="+target.Endpoint(), "--fence-file", fenceFile)
	untilActing(t, ctrl)
	listed, err := csi.NewControllerClient(ctrl.conn).ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatalf("ListVolumes: %v", err)
	}
	if got := listed.GetEntries(); len(got) != 1 || got[0].GetVolume().GetVolumeId() != vol.GetVolumeId() ||
		got[0].GetVolume().GetVolumeContext()[nfs.ContextServer] != vol.GetVolumeContext()[nfs.ContextServer] ||
		!slices.Equal(got[0].GetStatus().GetPublishedNodeIds(), []string{nodeID(0)}) {
		t.Fatalf("after the move the controller lists %v, want %s at %s published to node-1", got, vol.GetVolumeId(), vol.GetVolumeContext()[nfs.ContextServer])
	}
	fences, err := fence.NewFenceControllerClient(ctrl.conn).ListClusterFence(ctx, &fence.ListClusterFenceRequest{})
	if err != nil {
		t.Fatalf("ListClusterFence: %v", err)
	}
	if got := fences.GetCidrs(); len(got) != 1 || got[0].GetCidr() != fenced {
		t.Errorf("after the move the fences are %v, want %s from the controller's file", got, fenced)
	}
	if _, err := os.Stat(filepath.Join(work, "nfs", ".modeguard-fences.json")); err != nil {
		t.Errorf("the fence list was not moved onto the target: %v", err)
	}
	// The restarted ganesha is in grace: new opens wait for it.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Second) {
		got, err := net.Nodes[0].NFSCat(ctx, net.NFSURL(share, "before"))
		if err == nil && string(got) == "written over NFS" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node-1 reads %q, %v after the move; want what it wrote before", got, err)
		}
	}
	if err := write(0, "after"); err != nil {
		t.Errorf("node-1 writing after the move: %v", err)
	}
	if err := write(1, "not-node-2"); err == nil {
		t.Errorf("node-2, never published to, wrote after the move")
	}
}
