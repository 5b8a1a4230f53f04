package lio

import (
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// fences is what ListClusterFence answers, as strings.
func (e *csiEnv) fences() []string {
	e.t.Helper()
	resp, err := e.fence.ListClusterFence(e.ctx, &fence.ListClusterFenceRequest{})
	if err != nil {
		e.t.Fatalf("ListClusterFence: %v", err)
	}
	var out []string
	for _, c := range resp.GetCidrs() {
		out = append(out, c.GetCidr())
	}
	return out
}

// publishedTo is the node ids ControllerGetVolume lists for the volume.
func (v *csiVolume) publishedTo() []string {
	v.e.t.Helper()
	resp, err := v.e.ctrl.CSI.ControllerGetVolume(v.e.ctx, &csi.ControllerGetVolumeRequest{VolumeId: v.id()})
	if err != nil {
		v.e.t.Fatalf("ControllerGetVolume %s: %v", v.id(), err)
	}
	return resp.GetStatus().GetPublishedNodeIds()
}

// lun is the volume's name on the target (its iSCSI target name less the
// prefix), as iscsitool takes it.
func (v *csiVolume) lun() string {
	return strings.TrimPrefix(v.v.GetVolumeContext()[iscsi.ContextTarget], prefix+":")
}

// imageOf is the volume's image in the target's pool (image, which
// wants the pool to hold this one only, is for tests of one volume).
func (v *csiVolume) imageOf() string {
	v.e.t.Helper()
	id, err := volumeid.Parse(v.id())
	if err != nil {
		v.e.t.Fatal(err)
	}
	return filepath.Join(v.e.pool, "volumes", id.FileName()+".img")
}

// initiator is the access-list entry node gets as a read/write holder.
func initiator(node string) lio.Initiator {
	return lio.Initiator{IQN: "iqn.2026-11.io.modeguard.node:" + node}
}

// wantNoStagingMounts checks that node mounts no staging or pod path.
func (e *csiEnv) wantNoStagingMounts(node string) {
	e.t.Helper()
	out, code, err := e.node(node).Run(e.ctx, "sh", "-c", "grep -c -e /staging/ -e /pods/ /proc/mounts || true")
	if err != nil || code != 0 || strings.TrimSpace(out) != "0" {
		e.t.Fatalf("%s mounts staging or pod paths: exit %d, %v: %s", node, code, err, out)
	}
}

// TestCSIOverISCSINetworkFenceCutsOffANode: csi-addons NetworkFence on
// the controller's endpoint, against a volume served over iSCSI. A
// fence takes a node off every access list of the target (ending its
// sessions) while its attachments stay recorded and still count for the
// access modes; the CO's force-detach frees the volume for another node;
// lifting the fence serves the node again what it still holds, and
// nothing it no longer does.
//
// Node A writes and fsyncs records to an ext4 SINGLE_NODE_WRITER volume
// (and holds a second volume, attached but not staged). A bad block is
// refused first. FenceClusterNetwork on A's address as a /32: the call
// succeeds, ListClusterFence lists exactly that block, A's next write
// fails, the target's access lists no longer name A, A cannot log in to
// the other volume it holds; ControllerGetVolume still lists A; publishes
// to A (a new volume, and one it holds) are FAILED_PRECONDITION saying
// "fenced"; a publish of the writer's volume to B is FAILED_PRECONDITION
// (A still holds it). The CO force-detaches A (ControllerUnpublishVolume,
// no node call): B is attached and staged, reads exactly what A fsync'd
// and writes on. UnfenceClusterNetwork: the list is empty, A is back on
// the access list of the volume it still holds (and stages it) and not on
// the other's, its writes still fail; its late NodeUnpublish and
// NodeUnstage are clean. At the end the image checks clean and nothing
// is left on either node or in LIO.
func TestCSIOverISCSINetworkFenceCutsOffANode(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestCSIOverISCSIFencesAForceDetachedWriter (a fence at the target) and TestNetworkFenceOverNFS")
	e := setupCSI(t, 2, replacementTimeout)
	a, b := e.env.nodes[0].Name, e.env.nodes[1].Name
	block := netip.PrefixFrom(e.node(a).Addr, 32).String()
	fenceA := []*fence.CIDR{{Cidr: block}}

	_, err := e.fence.FenceClusterNetwork(e.ctx, &fence.FenceClusterNetworkRequest{Cidrs: []*fence.CIDR{{Cidr: "10.0.0.5"}}})
	wantCSICode(t, "FenceClusterNetwork of an address without a prefix", err, codes.InvalidArgument, "/32")
	if got := e.fences(); len(got) != 0 {
		t.Fatalf("ListClusterFence after a refused fence: %v, want none", got)
	}

	v := e.create("written", mountCapability(accessmode.SingleNodeWriter))
	held := e.create("held", mountCapability(accessmode.SingleNodeWriter)) // attached to A, not staged
	fresh := e.create("fresh", mountCapability(accessmode.SingleNodeWriter))
	if err := held.attach(a, false); err != nil {
		t.Fatalf("ControllerPublish of %s to %s: %v", held.id(), a, err)
	}
	v.start(a, "writer", false)
	journal := filepath.Join(v.target(a, "writer"), "journal")
	holder, err := e.node(a).HoldLock(e.ctx, journal, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	w, err := vmtest.WriteThroughFence(e.ctx, holder, nil, func() error {
		t.Logf("FenceClusterNetwork %s (%s's address)", block, a)
		_, err := e.fence.FenceClusterNetwork(e.ctx, &fence.FenceClusterNetworkRequest{Cidrs: fenceA})
		return err
	})
	if err != nil {
		t.Fatalf("%s: %v", a, err)
	}
	t.Logf("records %s fsync'd: %d; the write in flight at the fence: %v", a, w.Acked, w.InFlight)

	t.Run("the fenced node is cut off but still holds its volumes", func(t *testing.T) {
		if got := e.fences(); !slices.Equal(got, []string{block}) {
			t.Fatalf("ListClusterFence: %v, want exactly [%s]", got, block)
		}
		// The target serves neither of A's volumes to A any more.
		e.wantAccessList(v.lun())
		e.wantAccessList(held.lun())
		wantCSICode(t, "NodeStage on "+a+" of the volume it holds, fenced", held.stageWith(a, held.published[a]),
			codes.FailedPrecondition, "refused this node's login")
		if got := v.publishedTo(); !slices.Equal(got, []string{e.nodeID[a]}) {
			t.Fatalf("ControllerGetVolume lists %v as published, want the fenced %s", got, e.nodeID[a])
		}
		if got := held.publishedTo(); !slices.Equal(got, []string{e.nodeID[a]}) {
			t.Fatalf("ControllerGetVolume of %s lists %v as published, want the fenced %s", held.id(), got, e.nodeID[a])
		}
		wantCSICode(t, "ControllerPublish of a new volume to the fenced "+a, fresh.attach(a, false), codes.FailedPrecondition, "fenced")
		wantCSICode(t, "ControllerPublish again of the volume the fenced "+a+" holds", v.attach(a, false), codes.FailedPrecondition, "fenced")
		// A fence does not free the volume: A holds it until the CO
		// unpublishes it there.
		wantCSICode(t, "ControllerPublish to "+b+" of the volume the fenced "+a+" holds", v.attach(b, false),
			codes.FailedPrecondition, e.nodeID[a])
		if err := w.Write(e.ctx, w.Acked); err == nil {
			t.Fatalf("%s, fenced, wrote record %d", a, w.Acked)
		}
	})
	if t.Failed() {
		return
	}

	t.Logf("the CO force-detaches %s: ControllerUnpublishVolume, no node call", a)
	v.detach(a)
	if got := v.publishedTo(); len(got) != 0 {
		t.Fatalf("ControllerGetVolume lists %v as published after the force-detach, want none", got)
	}
	bHolder := v.takeOver(t, a, b, w)
	const bRecords = 5
	for n := w.Acked; n < w.Acked+bRecords; n++ {
		if err := bHolder.Write(e.ctx, int64(n*len(vmtest.FenceRecord(n))), []byte(vmtest.FenceRecord(n))); err != nil {
			t.Fatalf("%s writing record %d: %v", b, n, err)
		}
	}
	if err := bHolder.Release(e.ctx); err != nil {
		t.Fatal(err)
	}

	t.Run("the fence is lifted", func(t *testing.T) {
		if _, err := e.fence.UnfenceClusterNetwork(e.ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: fenceA}); err != nil {
			t.Fatalf("UnfenceClusterNetwork %s: %v", block, err)
		}
		if got := e.fences(); len(got) != 0 {
			t.Fatalf("ListClusterFence after the unfence: %v, want none", got)
		}
		// A is served what it still holds, and nothing it let go of.
		e.wantAccessList(held.lun(), initiator(a))
		e.wantAccessList(v.lun(), initiator(b))
		if err := w.Write(e.ctx, w.Acked+bRecords); err == nil {
			t.Fatalf("%s, unfenced but detached from %s, wrote record %d", a, v.id(), w.Acked+bRecords)
		}
	})
	if t.Failed() {
		return
	}

	t.Run("the fenced node comes back and cleans up", func(t *testing.T) {
		v.fencedComesBack(t, a, holder)
		e.wantNoStagingMounts(a)
		// What A still held is served again.
		if err := held.stageWith(a, held.published[a]); err != nil {
			t.Fatalf("NodeStage on %s of %s after the unfence: %v", a, held.id(), err)
		}
		if err := held.publish(a, "app", false); err != nil {
			t.Fatalf("NodePublish on %s of %s after the unfence: %v", a, held.id(), err)
		}
		if err := e.node(a).WriteFile(e.ctx, filepath.Join(held.target(a, "app"), "after-the-unfence"), []byte("written\n")); err != nil {
			t.Fatal(err)
		}
		held.stop(a, "app")
	})
	if t.Failed() {
		return
	}

	v.stop(b, "next")
	if out, code, err := e.env.vm.Run(e.ctx, "e2fsck", "-fn", v.imageOf()); err != nil || code != 0 {
		t.Fatalf("the filesystem in the target's image does not check clean: exit %d, %v:\n%s", code, err, out)
	}
	for _, node := range []string{a, b} {
		e.wantNoISCSI(node)
		e.wantNoLoopDevices(node)
		e.wantNoStagingMounts(node)
	}
	for _, vol := range []*csiVolume{v, held, fresh} {
		vol.delete()
	}
	if out := e.inVM("sh", "-c", "ls "+lio.DefaultRoot+"/iscsi | grep -c '^"+prefix+":' || true"); strings.TrimSpace(out) != "0" {
		t.Fatalf("LIO still serves %s targets after the deletes", out)
	}
}
