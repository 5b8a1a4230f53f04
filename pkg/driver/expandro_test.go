package driver_test

import (
	"io"
	"os"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// deviceBytes is the size of the block device at path (a raw target or a
// staged device).
func deviceBytes(t *testing.T, path string) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	size, err := f.Seek(0, io.SeekEnd) // a block device's end is its size
	if err != nil {
		t.Fatalf("seeking to the end of %s: %v", path, err)
	}
	return size
}

func (e *env) expand(t *testing.T, volID string, c *csi.VolumeCapability, bytes int64) *csi.ControllerExpandVolumeResponse {
	t.Helper()
	r, err := e.ctrl.ControllerExpandVolume(ctx(t), &csi.ControllerExpandVolumeRequest{VolumeId: volID,
		CapacityRange: &csi.CapacityRange{RequiredBytes: bytes}, VolumeCapability: c})
	if err != nil {
		t.Fatalf("ControllerExpandVolume %s to %d bytes: %v", volID, bytes, err)
	}
	return r
}

// TestReadOnlyStagesFollowAnExpansion: a read-only stage of a raw block
// volume (a ROX reader; the readers of MULTI_NODE_SINGLE_WRITER alike)
// picks up the new size when NodeExpandVolume is called for it, as a
// writer's does; a read-only filesystem stage answers OK (its device
// refreshed, the filesystem the writer's to grow) rather than a refusal
// the kubelet would retry for ever; and a filesystem no node may ever
// write is not expanded at all, since no node could grow it.
func TestReadOnlyStagesFollowAnExpansion(t *testing.T) {
	e := newEnv(t, 0)

	raw := blockCap(accessmode.MultiNodeReaderOnly)
	rawID, rawStaging, pc := e.setup(t, "ro-raw-grows", raw)
	target := e.targetPath("ro-raw-grows")
	if err := e.publish(t, rawID, rawStaging, target, raw, pc, true); err != nil {
		t.Fatal(err)
	}
	if r := e.expand(t, rawID, raw, 2*volumeSize); !r.GetNodeExpansionRequired() {
		t.Fatal("a raw block expansion must ask the nodes to refresh their devices")
	}
	resp, err := e.node.NodeExpandVolume(ctx(t), &csi.NodeExpandVolumeRequest{VolumeId: rawID, VolumePath: target,
		StagingTargetPath: rawStaging, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * volumeSize}, VolumeCapability: raw})
	if err != nil {
		t.Fatalf("NodeExpandVolume on a read-only raw block stage: %v", err)
	}
	if got := deviceBytes(t, target); got != 2*volumeSize || resp.GetCapacityBytes() != 2*volumeSize {
		t.Fatalf("the reader's device has %d bytes (answer %d) after the expansion, want %d", got, resp.GetCapacityBytes(), 2*volumeSize)
	}

	// A filesystem, formatted by a writer, then attached and staged
	// read-only (a PersistentVolume marked readOnly).
	fs := mountCap(accessmode.SingleNodeWriter)
	fsID := e.createVolume(t, "ro-fs-grows", fs)
	w, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: fsID, NodeId: e.nodeID(), VolumeCapability: fs})
	if err != nil {
		t.Fatal(err)
	}
	staging := e.stagingPath("ro-fs-grows")
	if _, err := e.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{VolumeId: fsID, StagingTargetPath: staging, VolumeCapability: fs,
		PublishContext: w.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: fsID, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: fsID, NodeId: e.nodeID()}); err != nil {
		t.Fatal(err)
	}
	r, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: fsID, NodeId: e.nodeID(), VolumeCapability: fs, Readonly: true})
	if err != nil {
		t.Fatal(err)
	}
	e.cleanupControllerUnpublish(t, fsID, e.nodeID())
	roStaging := e.stage(t, fsID, "ro-fs-grows-reader", fs, r.GetPublishContext())
	e.expand(t, fsID, fs, 2*volumeSize)
	if _, err := e.node.NodeExpandVolume(ctx(t), &csi.NodeExpandVolumeRequest{VolumeId: fsID, VolumePath: roStaging,
		StagingTargetPath: roStaging, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * volumeSize}, VolumeCapability: fs}); err != nil {
		t.Fatalf("NodeExpandVolume on a read-only filesystem stage: %v, want OK (the writer grows the filesystem)", err)
	}

	// Read-only everywhere: no node can grow its filesystem.
	rox := mountCap(accessmode.MultiNodeReaderOnly)
	roxID := e.createVolume(t, "rox-fs", rox)
	_, err = e.ctrl.ControllerExpandVolume(ctx(t), &csi.ControllerExpandVolumeRequest{VolumeId: roxID,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * volumeSize}, VolumeCapability: rox})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("ControllerExpandVolume of a ReadOnlyMany filesystem: %v, want FAILED_PRECONDITION", err)
	}
}
