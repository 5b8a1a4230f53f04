package nfs_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/imagestore"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// TestDeleteHoldsWhatUndeletedDataHolds_RecordingGanesha: on the real
// image storage (xfs images on loop devices), a volume whose data cannot be
// removed (its filesystem busy) is gone for every lookup once DeleteVolume
// is called, but DeleteVolume fails (INTERNAL, saying what stays reserved)
// and its project id and bytes stay taken: a new volume does not get its
// project id and capacity is not given back. A retry once the data can go
// completes the deletion and gives them back; so does the next start.
// ganesha's bus is the recording stand-in (no export is mounted here).
func TestDeleteHoldsWhatUndeletedDataHolds_RecordingGanesha(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: loop devices and mounts")
	}
	ctx := context.Background()
	root, exportDir := t.TempDir(), t.TempDir()
	var storage nfs.Storage
	open := func() *nfs.Controller {
		t.Helper()
		store, err := imagestore.Open(ctx, root, imagestore.XFS)
		if err != nil {
			t.Fatal(err)
		}
		storage = nfs.NewImageStorage(store)
		ctrl, _ := startedController(t, ctx, storage, exportDir)
		return ctrl
	}
	ctrl := open()
	t.Cleanup(func() {
		if err := storage.Release(); err != nil {
			t.Errorf("releasing the image storage: %v", err)
		}
	})
	create := func(name string) (*backend.Volume, uint32) {
		t.Helper()
		id, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
		if err != nil {
			t.Fatal(err)
		}
		v, err := ctrl.CreateVolume(ctx, backend.VolumeSpec{ID: id, Name: name, CapacityBytes: 300 << 20,
			AccessType: accessmode.Mount, Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}})
		if err != nil {
			t.Fatal(err)
		}
		return v, projectOf(t, root, id)
	}
	// What the pool has promised (free space itself moves with whatever
	// else the machine writes).
	committed := func() int64 {
		t.Helper()
		p, err := ctrl.Pools(ctx)
		if err != nil || len(p) != 1 {
			t.Fatalf("Pools: %v, %v", p, err)
		}
		return p[0].CommittedBytes
	}

	doomed, project := create("doomed")
	id, _ := volumeid.Parse(doomed.ID)
	// A file open in the volume keeps its filesystem busy: it cannot be
	// unmounted, so its image cannot go. (An idle volume is not mounted:
	// Ensure mounts it, as a publish would.)
	if err := storage.Ensure(ctx, "volumes/"+id.FileName()); err != nil {
		t.Fatal(err)
	}
	busy, err := os.Open(filepath.Join(root, "volumes", id.FileName()))
	if err != nil {
		t.Fatal(err)
	}
	held := committed()
	err = ctrl.DeleteVolume(ctx, id)
	if status.Code(err) != codes.Internal {
		busy.Close()
		t.Fatalf("DeleteVolume of a volume whose data cannot be removed: %v, want INTERNAL", err)
	}
	if _, err := ctrl.Volume(ctx, id); status.Code(err) != codes.NotFound {
		t.Errorf("the volume whose deletion began: %v, want NotFound", err)
	}
	if got := committed(); got != held {
		t.Errorf("%d bytes committed after the failed deletion, %d before: its bytes were given back while its data is there", got, held)
	}
	if _, p := create("next"); p == project {
		t.Errorf("a new volume got project id %d, still held by the undeleted data", p)
	}
	afterNext := committed()

	// The next start does not resurrect it and does not give back what it holds.
	busy.Close()
	if err := storage.Release(); err != nil {
		t.Fatal(err)
	}
	ctrl = open()
	if _, err := ctrl.Volume(ctx, id); status.Code(err) != codes.NotFound {
		t.Errorf("after a restart the volume whose deletion began: %v, want NotFound", err)
	}
	// The start finished the deletion (nothing holds the data now): its
	// bytes are back, and a retried delete is OK.
	if got := committed(); got != afterNext-doomed.CapacityBytes {
		t.Errorf("%d bytes committed after the restart finished the deletion, %d before: want its %d bytes given back", got, afterNext, doomed.CapacityBytes)
	}
	if err := ctrl.DeleteVolume(ctx, id); err != nil {
		t.Errorf("DeleteVolume retried after the deletion finished: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "meta", "volumes", id.FileName()+".json")); !os.IsNotExist(err) {
		t.Errorf("the record of the deleted volume: %v, want it gone", err)
	}
}

// projectOf reads a volume's project id from its record.
func projectOf(t *testing.T, root string, id volumeid.ID) uint32 {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "meta", "volumes", id.FileName()+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		ProjectID uint32 `json:"projectID"`
	}
	if err := json.Unmarshal(data, &rec); err != nil {
		t.Fatal(err)
	}
	return rec.ProjectID
}

// TestNoCopyOfATreeBeingWritten_RecordingGanesha: where the storage copies
// a volume file by file and the server cannot be held still for the copy
// (a ganesha the driver does not run: no Config.Pause; or a storage that
// cannot copy while it is held), a volume attached read-write is neither
// snapshotted nor cloned (FAILED_PRECONDITION, saying why): the copy could
// hold half of what was written and acknowledged. Attached read-only, or
// detached, it copies. (A directory storage that copies file by file
// stands in for the quota storage, which needs a kernel with xfs quota
// support; TestSnapshotOfAVolumeInUseIsOfOneInstant has the quota storage
// with a pause. ganesha's bus is the recording stand-in.)
func TestNoCopyOfATreeBeingWritten_RecordingGanesha(t *testing.T) {
	ctx := context.Background()
	paused := 0
	// Set, but of no use to a storage that cannot copy while it holds.
	pause := func(context.Context, time.Duration) (func() error, error) {
		paused++
		return func() error { return nil }, nil
	}
	ctrl, err := nfs.NewController(ctx, nfs.Config{Storage: walkingStorage{dirStorage{t.TempDir()}}, ExportDir: t.TempDir(), Server: "10.0.0.1",
		Pause: pause})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if paused != 0 {
			t.Errorf("the server was paused %d times for a storage that cannot use it", paused)
		}
	}()
	if err := ctrl.Start(ctx, &recordingGanesha{applied: map[uint16]string{}}); err != nil {
		t.Fatal(err)
	}
	newID := func(kind volumeid.Kind, name string) volumeid.ID {
		id, err := volumeid.New(accessmode.BackendNFS, "", kind, volumeid.KeyFor("test", kind, name))
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	src := newID(volumeid.Volume, "src")
	spec := backend.VolumeSpec{ID: src, Name: "src", CapacityBytes: 64 << 20, AccessType: accessmode.Mount,
		Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}}
	if _, err := ctrl.CreateVolume(ctx, spec); err != nil {
		t.Fatal(err)
	}
	writer := accessmode.Attachment{Node: nodeid.MustParse("n1@zone-a@10.0.0.2"), Mode: accessmode.MultiNodeMultiWriter}
	if _, err := ctrl.SetAttachments(ctx, src, []accessmode.Attachment{writer}); err != nil {
		t.Fatal(err)
	}
	clone := spec
	clone.ID, clone.Name, clone.Source = newID(volumeid.Volume, "clone"), "clone", &backend.Source{VolumeID: src.String()}
	_, err = ctrl.CreateSnapshot(ctx, newID(volumeid.Snapshot, "s1"), "s1", src)
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "file by file") {
		t.Fatalf("snapshot of a volume attached read-write: %v, want FAILED_PRECONDITION saying why", err)
	}
	if _, err := ctrl.CreateVolume(ctx, clone); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("clone of a volume attached read-write: %v, want FAILED_PRECONDITION", err)
	}
	reader := accessmode.Attachment{Node: nodeid.MustParse("n1@zone-a@10.0.0.2"), Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true}
	if _, err := ctrl.SetAttachments(ctx, src, []accessmode.Attachment{reader}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.CreateSnapshot(ctx, newID(volumeid.Snapshot, "s2"), "s2", src); err != nil {
		t.Fatalf("snapshot of a volume attached read-only: %v", err)
	}
	if _, err := ctrl.CreateVolume(ctx, clone); err != nil {
		t.Fatalf("clone of a volume attached read-only: %v", err)
	}
}
