package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
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

// TestNetworkFenceOverNFS: csi-addons NetworkFence against the real
// ganesha, with clients in network namespaces. A fence on a node's address
// takes it out of every export it is in (an export whose only client it
// was goes), as ganesha reports over its bus and as the node finds when it
// reads or writes; the CO's record is unchanged (the volume is still
// published there, and still not free for another writer); attaches to
// the node are refused, under any address; the fence survives a restart
// of the controller; a force-detach while fenced frees the volume; lifting
// the fence gives the node back what it still holds.
func TestNetworkFenceOverNFS(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nsenter", "mkfs.xfs", "xfs_quota")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 3, Prefix: "mgf"})
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	fenceFile := filepath.Join(work, "controller-state", "fences.json")
	ctrl := testenv.StartNFSController(ctx, t, bin, net.Server.Path, net.Server.Addr.String(), "--nfs-pool-size", "1Gi", "--fence-file", fenceFile)
	clients := func(volID string) []string { t.Helper(); return exportClients(ctx, t, ctrl.GaneshaDir, volID) }
	fc := func() fence.FenceControllerClient { return fence.NewFenceControllerClient(ctrl.Conn()) }
	listed := func() []string {
		t.Helper()
		resp, err := fc().ListClusterFence(ctx, &fence.ListClusterFenceRequest{})
		if err != nil {
			t.Fatalf("ListClusterFence: %v", err)
		}
		out := []string{}
		for _, c := range resp.GetCidrs() {
			out = append(out, c.GetCidr())
		}
		return out
	}
	n1, n2, n3 := net.Nodes[0], net.Nodes[1], net.Nodes[2]
	node1 := nodeid.Node{Name: "node-1", Zone: "zone-a", Address: n1.Addr.String()}.String()
	node2 := nodeid.Node{Name: "node-2", Zone: "zone-a", Address: n2.Addr.String()}.String()
	node3 := nodeid.Node{Name: "node-3", Zone: "zone-a", Address: n3.Addr.String()}.String()
	block := []*fence.CIDR{{Cidr: n1.Addr.String() + "/32"}}

	create := func(name string, mode accessmode.Mode) *csi.Volume {
		t.Helper()
		resp, err := ctrl.CSI.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(mode)}, Parameters: map[string]string{"backend": "nfs"},
		})
		if err != nil {
			t.Fatal(err)
		}
		id := resp.GetVolume().GetVolumeId()
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ctrl.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id})
			if _, err := ctrl.CSI.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Errorf("cleanup: DeleteVolume %s: %v", id, err)
			}
		})
		return resp.GetVolume()
	}
	publish := func(vol *csi.Volume, node string, mode accessmode.Mode) error {
		_, err := ctrl.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: vol.GetVolumeId(), NodeId: node, VolumeCapability: nfsCapability(mode)})
		return err
	}
	rwo := create("fenced-rwo", accessmode.SingleNodeWriter)
	rwx := create("fenced-rwx", accessmode.MultiNodeMultiWriter)
	spare := create("fenced-spare", accessmode.SingleNodeWriter)
	for _, p := range []struct {
		vol  *csi.Volume
		node string
		mode accessmode.Mode
	}{{rwo, node1, accessmode.SingleNodeWriter}, {rwx, node1, accessmode.MultiNodeMultiWriter}, {rwx, node2, accessmode.MultiNodeMultiWriter}} {
		if err := publish(p.vol, p.node, p.mode); err != nil {
			t.Fatal(err)
		}
	}
	payload := filepath.Join(work, "payload")
	if err := os.WriteFile(payload, []byte("written before the fence"), 0o644); err != nil {
		t.Fatal(err)
	}
	url := func(vol *csi.Volume, file string) string {
		return net.NFSURL(vol.GetVolumeContext()[nfs.ContextShare], file)
	}
	if err := n1.NFSCopy(ctx, payload, url(rwo, "before")); err != nil {
		t.Fatalf("node-1 writing before the fence: %v", err)
	}
	wantExports := func(when string, want map[*csi.Volume][]string) {
		t.Helper()
		for v, w := range want {
			if got := clients(v.GetVolumeId()); !slices.Equal(got, w) {
				t.Errorf("%s: the export of %s serves %v, want %v", when, v.GetVolumeId(), got, w)
			}
		}
	}
	rw := func(n ganeshatest.Namespace) string { return n.Addr.String() + " RW" }
	served := map[*csi.Volume][]string{rwo: {rw(n1)}, rwx: {rw(n1), rw(n2)}, spare: {}}
	wantExports("before the fence", served)

	// The fence.
	if _, err := fc().FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Cidrs: block}); err != nil {
		t.Fatalf("FenceClusterNetwork: %v", err)
	}
	fencedOff := map[*csi.Volume][]string{rwo: {}, rwx: {rw(n2)}, spare: {}}
	checks := 0
	checkFenced := func(when string) {
		t.Helper()
		if got := listed(); !slices.Equal(got, []string{block[0].Cidr}) {
			t.Errorf("%s: ListClusterFence = %v, want %s", when, got, block[0].Cidr)
		}
		wantExports(when, fencedOff)
		if got, err := n1.NFSCat(ctx, url(rwo, "before")); err == nil || strings.Contains(err.Error(), "GRACE") {
			t.Errorf("%s: the fenced node reading its RWO volume: %q, %v; want a refusal", when, got, err)
		}
		if err := n1.NFSCopy(ctx, payload, url(rwx, "from-fenced")); err == nil || strings.Contains(err.Error(), "GRACE") {
			t.Errorf("%s: the fenced node writing the RWX volume: %v; want a refusal", when, err)
		}
		checks++
		if err := n2.NFSCopy(ctx, payload, url(rwx, fmt.Sprintf("from-node-2-%d", checks))); err != nil {
			t.Errorf("%s: node-2 no longer writes the RWX volume: %v", when, err)
		}
		for _, v := range []*csi.Volume{rwo, rwx} {
			if got := publishedTo(t, ctrl.CSI, v.GetVolumeId()); !slices.Contains(got, node1) {
				t.Errorf("%s: volume %s is published to %v: the fence changed the CO's record", when, v.GetVolumeId(), got)
			}
		}
		for _, id := range []string{node1, nodeid.Node{Name: "node-1", Zone: "zone-a", Address: "192.0.2.99"}.String()} {
			err := publish(spare, id, accessmode.SingleNodeWriter)
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), "fenced") {
				t.Errorf("%s: publish to the fenced node as %s: %v, want FAILED_PRECONDITION saying it is fenced", when, id, err)
			}
		}
		// A fence does not free a single-writer volume.
		if err := publish(rwo, node3, accessmode.SingleNodeWriter); status.Code(err) != codes.FailedPrecondition {
			t.Errorf("%s: publish of the fenced node's RWO volume to node-3: %v, want FAILED_PRECONDITION", when, err)
		}
	}
	checkFenced("fenced")
	// An operator asking why node-1's pod sees nothing is told.
	exportRoot := ctrl.Args[slices.Index(ctrl.Args, "--nfs-export-root")+1]
	out, err := exec.CommandContext(ctx, bin, "inspect", "--nfs-export-root", exportRoot, rwo.GetVolumeId()).CombinedOutput()
	if want := "attached to: " + node1 + " (SINGLE_NODE_WRITER, read/write, fenced"; err != nil || !strings.Contains(string(out), want) {
		t.Errorf("modeguard inspect of the fenced node's volume (%v) lacks %q:\n%s", err, want, out)
	}
	// Fencing the same block again changes nothing.
	if _, err := fc().FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Cidrs: block}); err != nil {
		t.Fatalf("FenceClusterNetwork again: %v", err)
	}

	// The controller restarts: the fence holds.
	ctrl.Stop()
	ctrl.Start(ctx)
	// Until its grace period ends ganesha refuses every new open, which
	// would pass for a fence.
	testenv.WaitGraceEnded(ctx, t, ctrl.GaneshaDir)
	checkFenced("after a restart of the controller")

	// The controller comes up without its list (started on another
	// machine, the file gone): the attachments it marked fenced rebuild
	// it, and node-1 stays cut off.
	ctrl.Stop()
	if err := os.Remove(fenceFile); err != nil {
		t.Fatal(err)
	}
	ctrl.Start(ctx)
	testenv.WaitGraceEnded(ctx, t, ctrl.GaneshaDir)
	checkFenced("after a restart without the fence list")

	// Lifted: node-1 is served what it holds.
	if _, err := fc().UnfenceClusterNetwork(ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: block}); err != nil {
		t.Fatalf("UnfenceClusterNetwork: %v", err)
	}
	if got := listed(); len(got) != 0 {
		t.Errorf("after the lift ListClusterFence = %v", got)
	}
	wantExports("after the lift", served)
	if got, err := n1.NFSCat(ctx, url(rwo, "before")); err != nil || string(got) != "written before the fence" {
		t.Errorf("node-1 reading its RWO volume after the lift: %q, %v", got, err)
	}

	// Fenced again, then force-detached: the volume moves to node-3,
	// which reads what node-1 wrote; the lift gives node-1 back only the
	// RWX volume it still holds.
	if _, err := fc().FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Cidrs: block}); err != nil {
		t.Fatalf("FenceClusterNetwork: %v", err)
	}
	if _, err := ctrl.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: rwo.GetVolumeId(), NodeId: node1}); err != nil {
		t.Fatalf("force-detach of the fenced node: %v", err)
	}
	if err := publish(rwo, node3, accessmode.SingleNodeWriter); err != nil {
		t.Fatalf("publish of the force-detached volume to node-3: %v", err)
	}
	wantExports("moved while fenced", map[*csi.Volume][]string{rwo: {rw(n3)}, rwx: {rw(n2)}})
	if got, err := n3.NFSCat(ctx, url(rwo, "before")); err != nil || string(got) != "written before the fence" {
		t.Errorf("node-3 reading the moved volume: %q, %v", got, err)
	}
	if _, err := fc().UnfenceClusterNetwork(ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: block}); err != nil {
		t.Fatalf("UnfenceClusterNetwork: %v", err)
	}
	wantExports("lifted after the move", map[*csi.Volume][]string{rwo: {rw(n3)}, rwx: {rw(n1), rw(n2)}})
	if got, err := n1.NFSCat(ctx, url(rwo, "before")); err == nil {
		t.Errorf("node-1 reads the volume it was force-detached from: %q", got)
	}
}
