package stories

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// Node names every story expects: two nodes in zone-a, one in zone-b.
const (
	NodeA1 = "node-a1"
	NodeA2 = "node-a2"
	NodeB1 = "node-b1"
)

// All lists the stories in the order they are told.
func All() []*Story {
	return []*Story{
		{Name: "rwo-deployment", Summary: "A Deployment's three replicas share one ReadWriteOnce claim: pods on the first node run, the pod scheduled to a second node is refused at attach.", Run: rwoDeployment},
		{Name: "rwop-single-pod", Summary: "ReadWriteOncePod: a second pod pinned to the same node (spec.nodeName, no scheduler) is refused by the driver, also after the node plugin is killed and restarted.", Run: rwopSinglePod},
		{Name: "rwop-stale-holder", Summary: "A pod vanishes while the node plugin is down: on restart its lock is dropped, so the volume is not locked forever.", Run: rwopStaleHolder},
		{Name: "rox-from-snapshot", Summary: "ReadOnlyMany from a snapshot: pods on two nodes read the data, no pod can write, even when it asks for read/write.", Run: roxFromSnapshot},
		{Name: "multi-node-single-writer", Summary: "MULTI_NODE_SINGLE_WRITER (Nomad): one node writes, the others attach read-only and read what it wrote.", Run: multiNodeSingleWriter},
		{Name: "rwx-needs-shared-fs", Summary: "ReadWriteMany: a local filesystem cannot be shared safely, so block refuses it with a reason; raw block devices can be shared.", Run: rwxNeedsSharedFS},
		{Name: "zonal-volume", Summary: "A zonal volume is created where the request says and pulls its pods there: a node in another zone cannot attach it.", Run: zonalVolume},
	}
}

func rwoDeployment(ctx context.Context, e *Env) error {
	vol, err := e.createVolume(ctx, "data", accessmode.SingleNodeMultiWriter, accessmode.Mount, "zone-a", nil)
	if err := e.expect("create an RWO (SINGLE_NODE_MULTI_WRITER) volume in zone-a", err, codes.OK); err != nil {
		return err
	}
	steps := []struct {
		what      string
		node, pod string
		want      codes.Code
		thenWrite string
	}{
		{"replica web-1 starts on node-a1", NodeA1, "web-1", codes.OK, "written by web-1"},
		{"replica web-2 starts on node-a1 too (RWO means one node, not one pod)", NodeA1, "web-2", codes.OK, ""},
		{"replica web-3 is scheduled to node-a2", NodeA2, "web-3", codes.FailedPrecondition, ""},
	}
	for _, s := range steps {
		if err := e.expect(s.what, e.start(ctx, vol, s.node, s.pod, false), s.want); err != nil {
			return err
		}
		if s.thenWrite != "" {
			if err := e.expectWrite(vol, s.node, s.pod, s.thenWrite, true); err != nil {
				return err
			}
		}
	}
	if err := e.expect("deleting the claim while pods use it", e.deleteVolume(ctx, vol), codes.FailedPrecondition); err != nil {
		return err
	}
	if err := e.expect("rolling update: both replicas leave node-a1", e.stop(ctx, vol, NodeA1, "web-1", "web-2"), codes.OK); err != nil {
		return err
	}
	if err := e.expect("replica web-3 starts on node-a2 now", e.start(ctx, vol, NodeA2, "web-3", false), codes.OK); err != nil {
		return err
	}
	if err := e.expectRead(vol, NodeA2, "web-3", "written by web-1"); err != nil {
		return err
	}
	if err := e.expect("clean up", e.stop(ctx, vol, NodeA2, "web-3"), codes.OK); err != nil {
		return err
	}
	return e.expect("delete the claim", e.deleteVolume(ctx, vol), codes.OK)
}

func rwopSinglePod(ctx context.Context, e *Env) error {
	vol, err := e.createVolume(ctx, "db", accessmode.SingleNodeSingleWriter, accessmode.Mount, "zone-a", nil)
	if err := e.expect("create an RWOP (SINGLE_NODE_SINGLE_WRITER) volume", err, codes.OK); err != nil {
		return err
	}
	if err := e.expect("pod db-0 starts on node-a1", e.start(ctx, vol, NodeA1, "db-0", false), codes.OK); err != nil {
		return err
	}
	if err := e.expect("pod db-1, pinned to node-a1 with spec.nodeName, mounts the same claim",
		e.start(ctx, vol, NodeA1, "db-1", false), codes.FailedPrecondition); err != nil {
		return err
	}
	if restart := e.node(NodeA1).Restart; restart != nil {
		if err := e.expect("the node plugin on node-a1 is killed (SIGKILL) and restarted", restart(ctx), codes.OK); err != nil {
			return err
		}
		if err := e.expect("pod db-1 tries again after the restart", e.mountPod(ctx, vol, NodeA1, "db-1", false), codes.FailedPrecondition); err != nil {
			return err
		}
	}
	if err := e.expect("pod db-0 goes away", e.unmountPod(ctx, vol, NodeA1, "db-0"), codes.OK); err != nil {
		return err
	}
	if err := e.expect("pod db-1 starts now", e.mountPod(ctx, vol, NodeA1, "db-1", false), codes.OK); err != nil {
		return err
	}
	if err := e.expect("clean up", e.stop(ctx, vol, NodeA1, "db-1"), codes.OK); err != nil {
		return err
	}
	return e.expect("delete the claim", e.deleteVolume(ctx, vol), codes.OK)
}

func rwopStaleHolder(ctx context.Context, e *Env) error {
	restart := e.node(NodeA1).Restart
	if restart == nil {
		e.say("- skipped: this deployment cannot restart node plugins")
		return nil
	}
	vol, err := e.createVolume(ctx, "cache", accessmode.SingleNodeSingleWriter, accessmode.Mount, "zone-a", nil)
	if err := e.expect("create an RWOP volume", err, codes.OK); err != nil {
		return err
	}
	if err := e.expect("pod cache-0 starts on node-a1", e.start(ctx, vol, NodeA1, "cache-0", false), codes.OK); err != nil {
		return err
	}
	// What the kubelet does when a pod is force-deleted while the plugin
	// is down: the mount goes, the plugin never hears of it.
	target := e.targetPath(vol, NodeA1, "cache-0")
	err = unix.Unmount(target, 0)
	if err := e.expect("while the plugin is down, pod cache-0 is force-deleted and its mount removed", err, codes.OK); err != nil {
		return err
	}
	if err := e.expect("the node plugin restarts", restart(ctx), codes.OK); err != nil {
		return err
	}
	if err := e.expect("pod cache-1 starts on node-a1 (the stale lock was dropped)", e.mountPod(ctx, vol, NodeA1, "cache-1", false), codes.OK); err != nil {
		return err
	}
	if err := e.expect("clean up", e.stop(ctx, vol, NodeA1, "cache-1"), codes.OK); err != nil {
		return err
	}
	return e.expect("delete the claim", e.deleteVolume(ctx, vol), codes.OK)
}

func roxFromSnapshot(ctx context.Context, e *Env) error {
	src, err := e.createVolume(ctx, "source", accessmode.SingleNodeMultiWriter, accessmode.Mount, "zone-a", nil)
	if err := e.expect("create an RWO volume", err, codes.OK); err != nil {
		return err
	}
	if err := e.expect("pod loader fills it on node-a1", e.start(ctx, src, NodeA1, "loader", false), codes.OK); err != nil {
		return err
	}
	if err := e.expectWrite(src, NodeA1, "loader", "reference data", true); err != nil {
		return err
	}
	if err := e.expect("pod loader finishes", e.stop(ctx, src, NodeA1, "loader"), codes.OK); err != nil {
		return err
	}
	snap, err := e.Controller.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: e.story + "-snap", SourceVolumeId: src.ID})
	if err := e.expect("snapshot it", err, codes.OK); err != nil {
		return err
	}
	rox := &csi.CreateVolumeRequest{
		Name:               e.story + "-rox",
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{capability(accessmode.MultiNodeReaderOnly, accessmode.Mount)},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}},
	}
	resp, err := e.Controller.CreateVolume(ctx, rox)
	if err := e.expect("create a ReadOnlyMany volume from the snapshot", err, codes.OK); err != nil {
		return err
	}
	vol := &Volume{ID: resp.GetVolume().GetVolumeId(), Mode: accessmode.MultiNodeReaderOnly, AccessType: accessmode.Mount,
		Context: resp.GetVolume().GetVolumeContext(), published: map[string]map[string]string{}}
	for _, p := range []struct{ node, pod string }{{NodeA1, "reader-1"}, {NodeA2, "reader-2"}} {
		if err := e.expect(fmt.Sprintf("pod %s starts on %s, asking for read/write", p.pod, p.node),
			e.start(ctx, vol, p.node, p.pod, false), codes.OK); err != nil {
			return err
		}
		if err := e.expectRead(vol, p.node, p.pod, "reference data"); err != nil {
			return err
		}
		if err := e.expectWrite(vol, p.node, p.pod, "overwritten", false); err != nil {
			return err
		}
		if err := e.expectRead(vol, p.node, p.pod, "reference data"); err != nil {
			return err
		}
	}
	for _, p := range []struct{ node, pod string }{{NodeA1, "reader-1"}, {NodeA2, "reader-2"}} {
		if err := e.expect("clean up "+p.pod, e.stop(ctx, vol, p.node, p.pod), codes.OK); err != nil {
			return err
		}
	}
	_, err = e.Controller.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()})
	if err := e.expect("delete the snapshot", err, codes.OK); err != nil {
		return err
	}
	if err := e.expect("delete the ReadOnlyMany volume", e.deleteVolume(ctx, vol), codes.OK); err != nil {
		return err
	}
	return e.expect("delete the source volume", e.deleteVolume(ctx, src), codes.OK)
}

func multiNodeSingleWriter(ctx context.Context, e *Env) error {
	vol, err := e.createVolume(ctx, "journal", accessmode.MultiNodeSingleWriter, accessmode.Block, "zone-a", nil)
	if err := e.expect("create a MULTI_NODE_SINGLE_WRITER raw block volume", err, codes.OK); err != nil {
		return err
	}
	if err := e.expect("writer starts on node-a1, read/write", e.start(ctx, vol, NodeA1, "writer", false), codes.OK); err != nil {
		return err
	}
	if err := e.expectWrite(vol, NodeA1, "writer", "entry 1", true); err != nil {
		return err
	}
	if err := e.expect("a second writer on node-a2 asks for read/write", e.attach(ctx, vol, NodeA2, false), codes.FailedPrecondition); err != nil {
		return err
	}
	if err := e.expect("a reader on node-a2 asks for read-only", e.start(ctx, vol, NodeA2, "reader", true), codes.OK); err != nil {
		return err
	}
	if err := e.expectRead(vol, NodeA2, "reader", "entry 1"); err != nil {
		return err
	}
	if err := e.expectWrite(vol, NodeA2, "reader", "entry 2", false); err != nil {
		return err
	}
	if err := e.expectRead(vol, NodeA1, "writer", "entry 1"); err != nil {
		return err
	}
	if err := e.expect("clean up the reader", e.stop(ctx, vol, NodeA2, "reader"), codes.OK); err != nil {
		return err
	}
	if err := e.expect("clean up the writer", e.stop(ctx, vol, NodeA1, "writer"), codes.OK); err != nil {
		return err
	}
	return e.expect("delete the volume", e.deleteVolume(ctx, vol), codes.OK)
}

func rwxNeedsSharedFS(ctx context.Context, e *Env) error {
	_, err := e.createVolume(ctx, "shared-fs", accessmode.MultiNodeMultiWriter, accessmode.Mount, "zone-a",
		map[string]string{"backend": "block"})
	if err := e.expect("create an RWX filesystem volume on backend block", err, codes.InvalidArgument); err != nil {
		return err
	}
	vol, err := e.createVolume(ctx, "shared-raw", accessmode.MultiNodeMultiWriter, accessmode.Block, "zone-a", nil)
	if err := e.expect("create an RWX raw block volume (the workloads coordinate writes)", err, codes.OK); err != nil {
		return err
	}
	for _, n := range []string{NodeA1, NodeA2} {
		if err := e.expect("start a writer on "+n, e.start(ctx, vol, n, "rw-"+n, false), codes.OK); err != nil {
			return err
		}
	}
	if err := e.expectWrite(vol, NodeA2, "rw-"+NodeA2, "from a2", true); err != nil {
		return err
	}
	if err := e.expectRead(vol, NodeA1, "rw-"+NodeA1, "from a2"); err != nil {
		return err
	}
	for _, n := range []string{NodeA1, NodeA2} {
		if err := e.expect("clean up on "+n, e.stop(ctx, vol, n, "rw-"+n), codes.OK); err != nil {
			return err
		}
	}
	return e.expect("delete the volume", e.deleteVolume(ctx, vol), codes.OK)
}

func zonalVolume(ctx context.Context, e *Env) error {
	vol, err := e.createVolume(ctx, "zonal", accessmode.SingleNodeMultiWriter, accessmode.Mount, "zone-b", nil)
	if err := e.expect("create a volume whose requisite topology is zone-b", err, codes.OK); err != nil {
		return err
	}
	if vol.Zone != "zone-b" {
		e.say("✗ the volume reports zone %q", vol.Zone)
		return fmt.Errorf("%s: volume landed in zone %q, want zone-b", e.story, vol.Zone)
	}
	e.say("✓ its accessible topology is zone=%s, so a scheduler places its pods there", vol.Zone)
	if err := e.expect("a pod on node-a1 (zone-a) tries to attach it", e.attach(ctx, vol, NodeA1, false), codes.FailedPrecondition); err != nil {
		return err
	}
	if err := e.expect("a pod on node-b1 (zone-b) starts", e.start(ctx, vol, NodeB1, "app", false), codes.OK); err != nil {
		return err
	}
	if err := e.expect("clean up", e.stop(ctx, vol, NodeB1, "app"), codes.OK); err != nil {
		return err
	}
	if err := e.expect("delete the volume", e.deleteVolume(ctx, vol), codes.OK); err != nil {
		return err
	}
	_, err = e.createVolume(ctx, "nowhere", accessmode.SingleNodeMultiWriter, accessmode.Mount, "zone-c", nil)
	if err := e.expect("create a volume whose requisite topology is zone-c, where no pool is", err, codes.ResourceExhausted); err != nil {
		return err
	}
	return nil
}
