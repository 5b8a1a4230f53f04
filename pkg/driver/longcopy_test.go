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
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
)

// onDiskPool puts the env's pool on the test's own disk directory: a
// filesystem without reflinks where a copy has real bytes to move.
func onDiskPool(t *testing.T) func(*env) {
	return func(e *env) {
		e.pool = filepath.Join(t.TempDir(), "pool-"+testZone)
	}
}

// createBlock asks for a raw block volume of size bytes, filled from src
// (nil: empty).
func (e *env) createBlock(ctx context.Context, name string, size int64, src *csi.VolumeContentSource) (*csi.CreateVolumeResponse, error) {
	return e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities:  []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)},
		VolumeContentSource: src,
	})
}

// fillImage writes n random bytes into a volume's image: what a copy has
// to move byte by byte where the pool has no reflinks.
func fillImage(t *testing.T, image string, n int64) {
	t.Helper()
	out, err := os.OpenFile(image, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(out, rand.Reader, n); err != nil {
		out.Close()
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// shortCall is the context of a call far shorter than a long copy. An
// answer may still miss its deadline when the machine is busy (the server
// answers a fifth of the time early), and the next call may then find the
// late one still holding the name (ABORTED); a CO retries both like any
// other not-yet, so tests count such answers rather than fail on them.
func shortCall(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	t.Cleanup(cancel)
	return c
}

// TestLongCopiesAnswerInTime: through the CSI API, a snapshot and a
// restore whose byte copies outlast a call's deadline are answered before
// it: the snapshot with ready_to_use=false until the copy is done, the
// restore with ABORTED until its copy is done and then with the volume.
// Retries keep the same snapshot id and start no second copy.
func TestLongCopiesAnswerInTime(t *testing.T) {
	e := newEnv(t, 0, onDiskPool(t))
	const size = 512 * mib
	resp, err := e.createBlock(ctx(t), "long-source", size, nil)
	if err != nil {
		t.Fatal(err)
	}
	srcID := resp.GetVolume().GetVolumeId()
	images, _ := filepath.Glob(filepath.Join(e.pool, "volumes", "*.img"))
	if len(images) != 1 {
		t.Fatalf("images in the pool: %v", images)
	}
	fillImage(t, images[0], 384*mib)

	late := 0
	var snapID string
	notReady := 0
	deadline := time.Now().Add(time.Minute)
	for {
		if time.Now().After(deadline) {
			t.Fatal("the snapshot was not ready within a minute")
		}
		snap, err := e.ctrl.CreateSnapshot(shortCall(t), &csi.CreateSnapshotRequest{Name: "long-snap", SourceVolumeId: srcID})
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
		r, err := e.createBlock(shortCall(t), "long-restore", size, source)
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

// TestRetryDuringACopyGoesToItsCreation: a clone whose byte copy outlasts
// its CreateVolume goes on in the background and holds its room in its
// zone. The CO's retries meanwhile must go to that creation, ABORTED until
// the copy is done and then the volume, although a fresh volume would no
// longer fit in that zone and another zone has room: never a second
// volume in the other zone, never RESOURCE_EXHAUSTED.
func TestRetryDuringACopyGoesToItsCreation(t *testing.T) {
	const (
		size      = 512 * mib
		data      = 384 * mib
		otherZone = "zone-b"
		name      = "clone-in-flight"
	)
	// The copy's zone has a filesystem of its own on the disk, where a
	// copy moves real bytes and a filler can take its room; the other
	// zone's pool is on the disk with room to spare.
	copyFS := testenv.LoopFilesystem(t, 2<<30, "ext4", "-q", "-F", "-m", "0")
	otherPool := filepath.Join(t.TempDir(), "pool-"+otherZone)
	e := newEnv(t, 0, func(e *env) { e.pool = filepath.Join(copyFS, "pool-"+testZone) }, withPool(otherZone, otherPool))

	resp, err := e.createBlock(ctx(t), "clone-source", size, nil)
	if err != nil {
		t.Fatal(err)
	}
	srcID := resp.GetVolume().GetVolumeId()
	t.Cleanup(func() { _, _ = e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: srcID}) })
	if zone := zoneOf(t, srcID); zone != testZone {
		t.Fatalf("the source went to %s, want %s", zone, testZone)
	}
	images, _ := filepath.Glob(filepath.Join(e.pool, "volumes", "*.img"))
	if len(images) != 1 {
		t.Fatalf("images in the pool: %v", images)
	}
	fillImage(t, images[0], data)
	// Room for the clone and half as much again: once the clone's copy
	// holds its room, a fresh volume of its size does not fit.
	room := capacityIn(t, e, testZone)
	if room < 2*size {
		t.Fatalf("zone %s has %d bytes free before the filler; the test needs %d", testZone, room, 2*size)
	}
	filler, err := os.Create(filepath.Join(copyFS, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()
	if err := unix.Fallocate(int(filler.Fd()), 0, 0, room-size-size/2); err != nil {
		t.Fatal(err)
	}
	// Whatever the outcome, no creation of the name is left in either
	// zone (a delete cancels a copy still going).
	t.Cleanup(func() {
		for _, zone := range []string{testZone, otherZone} {
			id, err := volumeid.New(accessmode.BackendBlock, zone, volumeid.Volume, volumeid.KeyFor(driver.DefaultDriverName, volumeid.Volume, name))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id.String()}); err != nil {
				t.Errorf("cleanup: DeleteVolume %s: %v", id, err)
			}
		}
	})

	source := &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: srcID}}}
	copying := func() bool {
		temps, _ := filepath.Glob(filepath.Join(e.pool, "volumes", ".*.img.tmp-*"))
		return len(temps) > 0
	}
	var cloneID string
	calls, retriesWhileCopying, late := 0, 0, 0
	deadline := time.Now().Add(2 * time.Minute)
	for cloneID == "" {
		if time.Now().After(deadline) {
			t.Fatal("the clone was not done within two minutes")
		}
		r, err := e.createBlock(shortCall(t), name, size, source)
		calls++
		switch status.Code(err) {
		case codes.OK:
			cloneID = r.GetVolume().GetVolumeId()
		case codes.Aborted:
			// Answered while the copy still ran: the retry went through
			// every check a creation makes.
			if calls > 1 && copying() {
				retriesWhileCopying++
			}
		case codes.DeadlineExceeded:
			late++
		default:
			t.Fatalf("CreateVolume, call %d, during the copy: %v", calls, err)
		}
		if calls == 1 {
			if free := capacityIn(t, e, testZone); free >= size {
				t.Fatalf("zone %s has room for %d bytes with the copy going; the test needs it too full for a second clone", testZone, free)
			}
			if free := capacityIn(t, e, otherZone); free < size {
				t.Fatalf("zone %s has room for only %d bytes; the test needs room for the clone there", otherZone, free)
			}
		}
	}
	t.Logf("%d calls: %d retries while the copy ran, %d answers past their deadline", calls, retriesWhileCopying, late)
	if retriesWhileCopying == 0 {
		t.Fatalf("no retry was answered while the copy ran (%d late): the test proves nothing on this machine", late)
	}
	if zone := zoneOf(t, cloneID); zone != testZone {
		t.Errorf("the clone is volume %s in %s; its copy ran in %s", cloneID, zone, testZone)
	}
	if left, _ := filepath.Glob(filepath.Join(otherPool, "volumes", "*")); len(left) > 0 {
		t.Errorf("a retry made a second volume in %s: %v", otherZone, left)
	}
	list, err := e.ctrl.ListVolumes(ctx(t), &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 2 {
		t.Errorf("ListVolumes after the clone: %v, %v; want the source and its clone", list, err)
	}
}

// zoneOf is the zone in a volume's id.
func zoneOf(t *testing.T, raw string) string {
	t.Helper()
	id, err := volumeid.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return id.Zone
}

// capacityIn is what GetCapacity says a new raw block volume in zone can get.
func capacityIn(t *testing.T, e *env, zone string) int64 {
	t.Helper()
	resp, err := e.ctrl.GetCapacity(ctx(t), &csi.GetCapacityRequest{
		VolumeCapabilities: []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)},
		AccessibleTopology: &csi.Topology{Segments: map[string]string{driver.TopologyZoneKey: zone}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetAvailableCapacity()
}
