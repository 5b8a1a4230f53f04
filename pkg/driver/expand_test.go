package driver_test

import (
	"os"
	"strings"
	"testing"
	"unsafe"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// deviceBytes is the size of the block device at p (a device node, or a
// raw block target bound to one) as the BLKGETSIZE64 ioctl gives it: what
// a workload using it sees.
func deviceBytes(t *testing.T, p string) int64 {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var size uint64
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&size))); errno != 0 {
		t.Fatalf("BLKGETSIZE64 on %s: %v", p, errno)
	}
	return int64(size)
}

// writeDevice writes one block at the start of the device at p.
func writeDevice(p string) error {
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = f.Write(make([]byte, 4096))
	return err
}

func (e *env) controllerExpand(t *testing.T, volID string, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error) {
	t.Helper()
	return e.ctrl.ControllerExpandVolume(ctx(t), &csi.ControllerExpandVolumeRequest{VolumeId: volID, CapacityRange: r})
}

func nodeExpand(t *testing.T, nc csi.NodeClient, volID, staging string, c *csi.VolumeCapability, bytes int64) (*csi.NodeExpandVolumeResponse, error) {
	t.Helper()
	return nc.NodeExpandVolume(ctx(t), &csi.NodeExpandVolumeRequest{
		VolumeId: volID, VolumePath: staging, StagingTargetPath: staging, VolumeCapability: c,
		CapacityRange: &csi.CapacityRange{RequiredBytes: bytes},
	})
}

// TestReadersOfAGrownRawBlockVolumeSeeTheNewSize: a MULTI_NODE_SINGLE_WRITER
// raw block volume staged read/write on one node and read-only on another.
// After ControllerExpandVolume, NodeExpandVolume on the reader answers OK
// with the new size, and the reader's workload sees it on a device that is
// still read-only; the reader needs nothing from the writer, whose device
// grows with its own node's NodeExpandVolume.
func TestReadersOfAGrownRawBlockVolumeSeeTheNewSize(t *testing.T) {
	e := newEnv(t, 0)
	rd := e.addNode(t, "node-2")
	c := blockCap(accessmode.MultiNodeSingleWriter)
	volID := e.createVolume(t, "mnsw-raw", c)

	wpc := e.controllerPublish(t, volID, c)
	wStaging := e.stage(t, volID, "mnsw-writer", c, wpc)
	wTarget := e.targetPath("mnsw-writer")
	if err := e.publish(t, volID, wStaging, wTarget, c, wpc, false); err != nil {
		t.Fatal(err)
	}
	rpc := e.controllerPublishTo(t, volID, rd.id, c, true)
	rStaging := rd.stage(t, volID, "mnsw-reader", c, rpc)
	rTarget := rd.targetPath("mnsw-reader")
	if err := rd.publish(t, volID, rStaging, rTarget, c, rpc, true); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{wTarget, rTarget} {
		if got := deviceBytes(t, p); got != volumeSize {
			t.Fatalf("%s shows %d bytes before the expansion, want %d", p, got, volumeSize)
		}
	}

	resp, err := e.controllerExpand(t, volID, &csi.CapacityRange{RequiredBytes: 2 * volumeSize})
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetCapacityBytes() != 2*volumeSize || !resp.GetNodeExpansionRequired() {
		t.Fatalf("ControllerExpandVolume = %v; want %d bytes and node expansion required", resp, 2*volumeSize)
	}

	nresp, err := nodeExpand(t, rd.node, volID, rStaging, c, 2*volumeSize)
	if err != nil {
		t.Fatalf("NodeExpandVolume on the read-only node: %v, want OK", err)
	}
	if nresp.GetCapacityBytes() != 2*volumeSize {
		t.Errorf("NodeExpandVolume on the read-only node reports %d bytes, want %d", nresp.GetCapacityBytes(), 2*volumeSize)
	}
	if got := deviceBytes(t, rTarget); got != 2*volumeSize {
		t.Errorf("the reader's workload sees %d bytes after NodeExpandVolume, want %d", got, 2*volumeSize)
	}
	if got := deviceBytes(t, wTarget); got != volumeSize {
		t.Errorf("the writer's device changed to %d bytes through the reader's NodeExpandVolume", got)
	}
	if err := writeDevice(rTarget); err == nil {
		t.Errorf("the reader's refreshed device took a write")
	}

	if nresp, err = nodeExpand(t, e.node, volID, wStaging, c, 2*volumeSize); err != nil || nresp.GetCapacityBytes() != 2*volumeSize {
		t.Fatalf("NodeExpandVolume on the writer's node: %v, %v; want %d bytes", nresp, err, 2*volumeSize)
	}
	if got := deviceBytes(t, wTarget); got != 2*volumeSize {
		t.Errorf("the writer's workload sees %d bytes after NodeExpandVolume, want %d", got, 2*volumeSize)
	}
	if err := writeDevice(wTarget); err != nil {
		t.Errorf("the writer cannot write after the expansion: %v", err)
	}
}

// TestReadOnlyPublishOfAGrownRawBlockVolumeSeesTheNewSize: a read-only
// publish of a raw block volume staged read/write reads through a
// read-only device of its own; NodeExpandVolume refreshes that device as
// well as the staged one, so both workloads see the new size.
func TestReadOnlyPublishOfAGrownRawBlockVolumeSeesTheNewSize(t *testing.T) {
	e := newEnv(t, 0)
	c := blockCap(accessmode.SingleNodeMultiWriter)
	volID, staging, pc := e.setup(t, "ro-publish-grow", c)
	rw, ro := e.targetPath("rw"), e.targetPath("ro")
	if err := e.publish(t, volID, staging, rw, c, pc, false); err != nil {
		t.Fatal(err)
	}
	if err := e.publish(t, volID, staging, ro, c, pc, true); err != nil {
		t.Fatal(err)
	}
	if _, err := e.controllerExpand(t, volID, &csi.CapacityRange{RequiredBytes: 2 * volumeSize}); err != nil {
		t.Fatal(err)
	}
	if _, err := nodeExpand(t, e.node, volID, staging, c, 2*volumeSize); err != nil {
		t.Fatalf("NodeExpandVolume: %v", err)
	}
	for _, p := range []string{rw, ro} {
		if got := deviceBytes(t, p); got != 2*volumeSize {
			t.Errorf("%s shows %d bytes after NodeExpandVolume, want %d", p, got, 2*volumeSize)
		}
	}
	if err := writeDevice(ro); err == nil {
		t.Errorf("the read-only publish's refreshed device took a write")
	}
}

// TestExpandOfAReadOnlyFilesystemStage: a writable filesystem volume
// attached read-only still asks for node expansion, and NodeExpandVolume
// there refreshes the device but answers FAILED_PRECONDITION saying the
// filesystem grows at the next read/write stage, rather than OK for a
// filesystem the workload still sees at its old size.
func TestExpandOfAReadOnlyFilesystemStage(t *testing.T) {
	e := newEnv(t, 0)
	c := mountCap(accessmode.SingleNodeWriter)
	volID := e.createVolume(t, "ro-fs", c)
	// A read-only stage needs a filesystem, which a read/write stage makes.
	pc := e.controllerPublish(t, volID, c)
	staging := e.stagingPath("ro-fs")
	if _, err := e.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: e.nodeID()}); err != nil {
		t.Fatal(err)
	}
	pc = e.controllerPublishTo(t, volID, e.nodeID(), c, true)
	e.stage(t, volID, "ro-fs", c, pc)

	resp, err := e.controllerExpand(t, volID, &csi.CapacityRange{RequiredBytes: 2 * volumeSize})
	if err != nil || !resp.GetNodeExpansionRequired() {
		t.Fatalf("ControllerExpandVolume: %v, %v; want node expansion required", resp, err)
	}
	_, err = nodeExpand(t, e.node, volID, staging, c, 2*volumeSize)
	wantCode(t, "NodeExpandVolume on a read-only filesystem stage", err, codes.FailedPrecondition)
	if m := status.Convert(err).Message(); !strings.Contains(m, "next staged read/write") {
		t.Errorf("NodeExpandVolume's refusal %q does not say when the filesystem grows", m)
	}
	if dev := readLockFile(t, e, volID).Staged.Device; deviceBytes(t, dev) != 2*volumeSize {
		t.Errorf("the read-only stage's device %s has %d bytes, want %d", dev, deviceBytes(t, dev), 2*volumeSize)
	}
}

// TestExpansionOfVolumesNoNodeMayWrite: ControllerExpandVolume refuses to
// grow a filesystem volume whose every mode is read-only (OUT_OF_RANGE, the
// size unchanged), and answers a request for no growth without asking any
// node to expand it; a raw block one grows, with node expansion required,
// and its readers' devices take the new size.
func TestExpansionOfVolumesNoNodeMayWrite(t *testing.T) {
	e := newEnv(t, 0)
	for _, mode := range []accessmode.Mode{accessmode.MultiNodeReaderOnly, accessmode.SingleNodeReaderOnly} {
		name := "ro-only-fs-" + strings.ToLower(strings.ReplaceAll(accessmode.Name(mode), "_", "-"))
		volID := e.createVolume(t, name, mountCap(mode))
		_, err := e.controllerExpand(t, volID, &csi.CapacityRange{RequiredBytes: 2 * volumeSize})
		wantCode(t, accessmode.Name(mode)+" filesystem grown", err, codes.OutOfRange)
		resp, err := e.controllerExpand(t, volID, &csi.CapacityRange{})
		if err != nil || resp.GetCapacityBytes() != volumeSize || resp.GetNodeExpansionRequired() {
			t.Errorf("%s filesystem, no growth asked: %v, %v; want %d bytes and no node expansion", accessmode.Name(mode), resp, err, volumeSize)
		}
	}

	c := blockCap(accessmode.MultiNodeReaderOnly)
	volID, staging, pc := e.setup(t, "ro-only-raw", c)
	target := e.targetPath("ro-only-raw")
	if err := e.publish(t, volID, staging, target, c, pc, true); err != nil {
		t.Fatal(err)
	}
	resp, err := e.controllerExpand(t, volID, &csi.CapacityRange{RequiredBytes: 2 * volumeSize})
	if err != nil || resp.GetCapacityBytes() != 2*volumeSize || !resp.GetNodeExpansionRequired() {
		t.Fatalf("raw block %s grown: %v, %v; want %d bytes and node expansion required",
			accessmode.Name(accessmode.MultiNodeReaderOnly), resp, err, 2*volumeSize)
	}
	if nresp, err := nodeExpand(t, e.node, volID, staging, c, 2*volumeSize); err != nil || nresp.GetCapacityBytes() != 2*volumeSize {
		t.Fatalf("NodeExpandVolume of the raw block reader: %v, %v; want %d bytes", nresp, err, 2*volumeSize)
	}
	if got := deviceBytes(t, target); got != 2*volumeSize {
		t.Errorf("the reader's workload sees %d bytes, want %d", got, 2*volumeSize)
	}
}
