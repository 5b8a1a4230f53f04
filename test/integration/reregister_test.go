package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/test/testenv"
)

// publishedTo lists the node ids the controller reports a volume published to.
func publishedTo(t *testing.T, cc csi.ControllerClient, volID string) []string {
	t.Helper()
	resp, err := cc.ControllerGetVolume(context.Background(), &csi.ControllerGetVolumeRequest{VolumeId: volID})
	if err != nil {
		t.Fatalf("ControllerGetVolume %s: %v", volID, err)
	}
	return resp.GetStatus().GetPublishedNodeIds()
}

// exportClients asks the ganesha of a controller (its --nfs-ganesha-dir)
// over its bus which clients the volume's export has, as "address RW|RO",
// sorted: none when there is no export, as for a volume no node holds.
func exportClients(ctx context.Context, t *testing.T, ganeshaDir, volID string) []string {
	t.Helper()
	control, err := ganesha.Dial("unix:path=" + filepath.Join(ganeshaDir, ganesha.BusSocketName))
	if err != nil {
		t.Fatal(err)
	}
	defer control.Close()
	exports, err := control.Exports(ctx)
	if err != nil {
		t.Fatal(err)
	}
	dir := strings.NewReplacer(":", "_").Replace(volID)
	for _, e := range exports {
		if filepath.Base(e.Path) == dir {
			out := []string{}
			for _, c := range e.Clients {
				out = append(out, c.Address.String()+" "+c.Access)
			}
			slices.Sort(out)
			return out
		}
	}
	return []string{}
}

// TestBlockNodeComesBackUnderANewAddress: the node plugin restarts with
// another --node-address, so its id changes. The kubelet's replayed calls
// find the volume's data; the controller matches the node by its name, so
// unpublish under the new id lets go of what was attached under the old one
// (before, it answered OK and removed nothing, and the volume was refused to
// every node from then on), and the volume can move to another node.
func TestBlockNodeComesBackUnderANewAddress(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	l := startNodeLife(t, bin)
	ctx := context.Background()
	c := capability(accessmode.SingleNodeSingleWriter, "ext4")
	a := l.createAttached(ctx, "moved-a", 32<<20, c)
	b := l.createAttached(ctx, "moved-b", 32<<20, c)
	oldID := l.nodeID
	target := filepath.Join(l.kubelet, "pods", "p1", "moved-a")
	if err := l.stage(ctx, a); err != nil {
		t.Fatal(err)
	}
	if err := l.publish(ctx, a, target); err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 4096)
	rand.Read(data)
	putData(t, target, false, data)

	// The node comes back under an address (NFS enabled later, or a new
	// lease): the same name, another id.
	l.node.args = append(l.node.args, "--node-address", "192.0.2.7")
	l.restartNode()
	info, err := l.nc().NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	newID := info.GetNodeId()
	if newID == oldID || nodeid.KeyOf(newID) != nodeid.KeyOf(oldID) {
		t.Fatalf("node id %q after the restart, %q before: want the same name under another id", newID, oldID)
	}
	l.nodeID = newID
	// The kubelet replays its calls: the data is there.
	if err := l.stage(ctx, a); err != nil {
		t.Fatalf("NodeStageVolume after the node's id changed: %v", err)
	}
	if err := l.publish(ctx, a, target); err != nil {
		t.Fatalf("NodePublishVolume after the node's id changed: %v", err)
	}
	if got, err := getData(target, false, len(data)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the pod's data after the node's id changed: %v (equal: %t)", err, bytes.Equal(got, data))
	}

	// Unpublish of b under the new id removes the attachment made under
	// the old one.
	if _, err := l.cc().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: b.id, NodeId: newID}); err != nil {
		t.Fatal(err)
	}
	if got := publishedTo(t, l.cc(), b.id); len(got) != 0 {
		t.Fatalf("volume %s still published to %v after ControllerUnpublishVolume under the node's new id", b.id, got)
	}
	// ... and moved a's attachment to the id it named, in the same step.
	if got := publishedTo(t, l.cc(), a.id); !slices.Equal(got, []string{newID}) {
		t.Errorf("volume %s is published to %v, want [%s]", a.id, got, newID)
	}
	other := "other-node@zone-a"
	if _, err := l.cc().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: b.id, NodeId: other, VolumeCapability: c}); err != nil {
		t.Fatalf("publish of the released volume to another node: %v", err)
	}
	if _, err := l.cc().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: b.id, NodeId: other}); err != nil {
		t.Fatal(err)
	}
	// a stays the node's: another node is refused while it holds it.
	_, err = l.cc().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: a.id, NodeId: other, VolumeCapability: c})
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("publish to another node while the moved node holds the volume: %v, want FAILED_PRECONDITION", err)
	}
	// A node does not change zones silently.
	_, err = l.cc().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: b.id, NodeId: "life-node@zone-b", VolumeCapability: c})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), "zone-b") {
		t.Errorf("publish under the node's name in another zone: %v, want FAILED_PRECONDITION naming the zone", err)
	}

	if err := l.unpublish(ctx, a, target); err != nil {
		t.Fatal(err)
	}
	if err := l.unstage(ctx, a); err != nil {
		t.Fatal(err)
	}
	l.remove(ctx, a)
	if _, err := l.cc().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: b.id}); err != nil {
		t.Fatal(err)
	}
	if m := localcluster.MountsUnder(l.kubelet); len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
}

// TestNFSNodeComesBackUnderANewAddress: a node's NFS client address
// changes. Its next call moves every export it holds to the new address
// and takes the old one out of each, as ganesha itself reports over its
// bus, and the old address can no longer reach the data.
func TestNFSNodeComesBackUnderANewAddress(t *testing.T) {
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nsenter", "mkfs.xfs", "xfs_quota")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 3, Prefix: "mgr"})
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ctrl := testenv.StartNFSController(ctx, t, bin, net.Server.Path, net.Server.Addr.String(), "--nfs-pool-size", "1Gi")
	gdir := ctrl.GaneshaDir
	clients := func(volID string) []string { t.Helper(); return exportClients(ctx, t, gdir, volID) }
	payload := filepath.Join(work, "payload")
	if err := os.WriteFile(payload, []byte("written over NFS"), 0o644); err != nil {
		t.Fatal(err)
	}
	n1, n2, n3 := net.Nodes[0], net.Nodes[1], net.Nodes[2]
	// node-1 starts at n1's address and comes back at n3's.
	before := nodeid.Node{Name: "node-1", Zone: "zone-a", Address: n1.Addr.String(), MaxVolumes: 8}.String()
	after := nodeid.Node{Name: "node-1", Zone: "zone-a", Address: n3.Addr.String(), MaxVolumes: 8}.String()
	node2 := nodeid.Node{Name: "node-2", Zone: "zone-a", Address: n2.Addr.String()}.String()
	var vols []*csi.Volume
	for i, mode := range []accessmode.Mode{accessmode.MultiNodeMultiWriter, accessmode.SingleNodeWriter, accessmode.MultiNodeMultiWriter} {
		resp, err := ctrl.CSI.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: fmt.Sprintf("moved-%d", i), CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(mode)}, Parameters: map[string]string{"backend": "nfs"},
		})
		if err != nil {
			t.Fatal(err)
		}
		vols = append(vols, resp.GetVolume())
		t.Cleanup(func() {
			ctrl.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: resp.GetVolume().GetVolumeId()})
			ctrl.CSI.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: resp.GetVolume().GetVolumeId()})
		})
		if _, err := ctrl.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: resp.GetVolume().GetVolumeId(), NodeId: before, VolumeCapability: nfsCapability(mode)}); err != nil {
			t.Fatal(err)
		}
	}
	rwx, rwo, shared := vols[0], vols[1], vols[2]
	if _, err := ctrl.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: shared.GetVolumeId(), NodeId: node2, VolumeCapability: nfsCapability(accessmode.MultiNodeMultiWriter), Readonly: true}); err != nil {
		t.Fatal(err)
	}
	url := func(vol *csi.Volume, file string) string {
		return net.NFSURL(vol.GetVolumeContext()[nfs.ContextShare], file)
	}
	if err := n1.NFSCopy(ctx, payload, url(rwo, "before")); err != nil {
		t.Fatalf("node-1 writing at its first address: %v", err)
	}
	for _, v := range vols {
		want := []string{n1.Addr.String() + " RW"}
		if v == shared {
			want = []string{n1.Addr.String() + " RW", n2.Addr.String() + " RO"}
		}
		if got := clients(v.GetVolumeId()); !slices.Equal(got, want) {
			t.Fatalf("export of %s serves %v, want %v", v.GetVolumeId(), got, want)
		}
	}

	// node-1's first call under its new id: a publish of the RWX volume
	// it holds (an attacher's re-sync does this).
	if _, err := ctrl.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: rwx.GetVolumeId(), NodeId: after, VolumeCapability: nfsCapability(accessmode.MultiNodeMultiWriter)}); err != nil {
		t.Fatalf("publish under the node's new id: %v", err)
	}
	for _, v := range vols {
		want := []string{n3.Addr.String() + " RW"}
		if v == shared {
			want = []string{n2.Addr.String() + " RO", n3.Addr.String() + " RW"}
		}
		if got := clients(v.GetVolumeId()); !slices.Equal(got, want) {
			t.Errorf("after the node moved, the export of %s serves %v, want %v (the old address gone from every export)", v.GetVolumeId(), got, want)
		}
		if got := publishedTo(t, ctrl.CSI, v.GetVolumeId()); !slices.Contains(got, after) || slices.Contains(got, before) {
			t.Errorf("volume %s is published to %v, want %s in place of %s", v.GetVolumeId(), got, after, before)
		}
	}
	if got, err := n3.NFSCat(ctx, url(rwo, "before")); err != nil || string(got) != "written over NFS" {
		t.Errorf("node-1 reading at its new address: %q, %v", got, err)
	}
	if got, err := n1.NFSCat(ctx, url(rwo, "before")); err == nil {
		t.Errorf("the node's old address still reads the volume: %q", got)
	}
	if err := n1.NFSCopy(ctx, payload, url(rwx, "stale")); err == nil {
		t.Errorf("the node's old address still writes the RWX volume")
	}

	// Unpublish under the new id lets go of what was published under
	// the old one.
	if _, err := ctrl.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: rwo.GetVolumeId(), NodeId: after}); err != nil {
		t.Fatal(err)
	}
	if got := clients(rwo.GetVolumeId()); len(got) != 0 {
		t.Errorf("after unpublish the export of %s serves %v", rwo.GetVolumeId(), got)
	}
	if _, err := ctrl.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: rwo.GetVolumeId(), NodeId: node2, VolumeCapability: nfsCapability(accessmode.SingleNodeWriter)}); err != nil {
		t.Errorf("the released RWO volume to another node: %v", err)
	}
}
