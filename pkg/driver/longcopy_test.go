package driver_test

import (
	"context"
	"crypto/rand"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// onDiskPool puts the env's pool on the test's own disk directory: a
// filesystem without reflinks where a copy has real bytes to move.
func onDiskPool(t *testing.T) func(*env) {
	return func(e *env) {
		e.pool = filepath.Join(t.TempDir(), "pool-"+testZone)
	}
}

// TestLongCopiesAnswerInTime: through the CSI API, a snapshot and a
// restore whose byte copies outlast a call's deadline are answered before
// it: the snapshot with ready_to_use=false until the copy is done, the
// restore with ABORTED until its copy is done and then with the volume.
// Retries keep the same snapshot id and start no second copy.
func TestLongCopiesAnswerInTime(t *testing.T) {
	e := newEnv(t, 0, onDiskPool(t))
	const size = 512 * mib
	create := func(ctx context.Context, name string, src *csi.VolumeContentSource) (*csi.CreateVolumeResponse, error) {
		return e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
			VolumeCapabilities:  []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)},
			VolumeContentSource: src,
		})
	}
	resp, err := create(ctx(t), "long-source", nil)
	if err != nil {
		t.Fatal(err)
	}
	srcID := resp.GetVolume().GetVolumeId()
	images, _ := filepath.Glob(filepath.Join(e.pool, "volumes", "*.img"))
	if len(images) != 1 {
		t.Fatalf("images in the pool: %v", images)
	}
	out, err := os.OpenFile(images[0], os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(out, rand.Reader, 384*mib); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}

	// Calls far shorter than the copy. An answer may still miss its
	// deadline when the machine is busy (the server answers a fifth of the
	// time early), and the next call may then find the late one still
	// holding the name (ABORTED); a CO retries both like any other
	// not-yet, so such answers are counted, not failed.
	short := func() context.Context {
		c, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		t.Cleanup(cancel)
		return c
	}
	late := 0
	var snapID string
	notReady := 0
	deadline := time.Now().Add(time.Minute)
	for {
		if time.Now().After(deadline) {
			t.Fatal("the snapshot was not ready within a minute")
		}
		snap, err := e.ctrl.CreateSnapshot(short(), &csi.CreateSnapshotRequest{Name: "long-snap", SourceVolumeId: srcID})
		if c := status.Code(err); c == codes.DeadlineExceeded || c == codes.Aborted {
			// Late, or the call before it, late, still held the name.
			late++
			continue
		}
		if err != nil {
			t.Fatalf("CreateSnapshot: %v", err)
		}
		if snapID == "" {
			snapID = snap.GetSnapshot().GetSnapshotId()
			t.Cleanup(func() { _, _ = e.ctrl.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: snapID}) })
		} else if snap.GetSnapshot().GetSnapshotId() != snapID {
			t.Fatalf("a retry answered snapshot %s, an earlier call %s", snap.GetSnapshot().GetSnapshotId(), snapID)
		}
		if snap.GetSnapshot().GetReadyToUse() {
			break
		}
		notReady++
		if notReady == 1 {
			list, err := e.ctrl.ListSnapshots(ctx(t), &csi.ListSnapshotsRequest{SnapshotId: snapID})
			if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetSnapshot().GetReadyToUse() {
				t.Fatalf("ListSnapshots during the copy: %v, %v; want the snapshot, not ready", list, err)
			}
		}
	}
	if notReady == 0 {
		t.Fatalf("no answer said not ready (%d late): the copy of 384 MiB was done within 100ms calls, and the test proves nothing on this machine", late)
	}

	source := &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}}
	var restoredID string
	aborted := 0
	for restoredID == "" {
		if time.Now().After(deadline) {
			t.Fatal("the restore was not done within a minute")
		}
		r, err := create(short(), "long-restore", source)
		switch status.Code(err) {
		case codes.OK:
			restoredID = r.GetVolume().GetVolumeId()
		case codes.Aborted:
			aborted++
		case codes.DeadlineExceeded:
			late++
		default:
			t.Fatalf("CreateVolume from the snapshot: %v", err)
		}
	}
	if aborted == 0 {
		t.Fatalf("no answer said ABORTED while the restore copied (%d late): the test proves nothing on this machine", late)
	}
	t.Logf("answers past their deadline on this machine: %d", late)
	t.Cleanup(func() { _, _ = e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: restoredID}) })
	images, _ = filepath.Glob(filepath.Join(e.pool, "volumes", "*.img"))
	if len(images) != 2 {
		t.Fatalf("images in the pool after one restore and its retries: %v, want the source's and the restore's", images)
	}
	t.Cleanup(func() { _, _ = e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: srcID}) })
}
