package driver_test

import (
	"io/fs"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// TestStateFilesArePrivate drives real volumes through create, attach,
// stage and publish (a filesystem, a raw block device, a snapshot and a
// volume restored from it) under umask 0, so that no mode can come from the
// umask, and then walks the block pool (images and metadata) and the node
// plugin's state directory (lock files): every file the driver wrote must
// be 0600 and no directory may be writable by anyone but root.
func TestStateFilesArePrivate(t *testing.T) {
	old := syscall.Umask(0)
	t.Cleanup(func() { syscall.Umask(old) }) // runs last: after every volume is gone
	e := newEnv(t, 0, onReflinkPool(t))      // snapshots and clones a volume in use

	fsCap := mountCap(accessmode.SingleNodeSingleWriter)
	fsVol, staging, pc := e.setup(t, "private-fs", fsCap)
	if err := e.publish(t, fsVol, staging, e.targetPath("private-fs"), fsCap, pc, false); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	rawCap := blockCap(accessmode.SingleNodeMultiWriter)
	rawVol, rawStaging, rawPC := e.setup(t, "private-raw", rawCap)
	if err := e.publish(t, rawVol, rawStaging, e.targetPath("private-raw"), rawCap, rawPC, false); err != nil {
		t.Fatalf("NodePublishVolume (block): %v", err)
	}
	snap, err := e.ctrl.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "private-snap", SourceVolumeId: fsVol})
	if err != nil {
		t.Fatalf("CreateSnapshot: %v", err)
	}
	snapID := snap.GetSnapshot().GetSnapshotId()
	t.Cleanup(func() {
		if _, err := e.ctrl.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: snapID}); err != nil {
			t.Errorf("cleanup: DeleteSnapshot: %v", err)
		}
	})
	clone, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
		Name: "private-clone", CapacityRange: &csi.CapacityRange{RequiredBytes: volumeSize},
		VolumeCapabilities: []*csi.VolumeCapability{fsCap},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}},
	})
	if err != nil {
		t.Fatalf("CreateVolume from a snapshot: %v", err)
	}
	cloneID := clone.GetVolume().GetVolumeId()
	t.Cleanup(func() {
		if _, err := e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: cloneID}); err != nil {
			t.Errorf("cleanup: DeleteVolume %s: %v", cloneID, err)
		}
	})

	files := map[string]int{} // by suffix
	for _, root := range []string{e.pool, e.stateDir} {
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			mode := fi.Mode()
			switch {
			case mode.IsDir():
				if mode.Perm()&0o022 != 0 {
					t.Errorf("directory %s is %v: writable by group or others", p, mode)
				}
			case mode.IsRegular():
				if mode.Perm() != 0o600 {
					t.Errorf("file %s is %v, want -rw-------", p, mode)
				}
				files[filepath.Ext(p)]++
			default:
				t.Errorf("%s is %v: the driver keeps only directories and regular files here", p, mode)
			}
			t.Logf("%v %s", mode, strings.TrimPrefix(p, e.root))
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// Three volumes and a snapshot, each an image and its metadata; the
	// template the ext4 volume's filesystem was copied from; two lock files
	// (the clone is neither staged nor published); the pool's marker.
	if files[".img"] != 5 || files[".json"] != 7 {
		t.Errorf("walked %d images and %d JSON files, want 5 and 7: the walk missed what the driver wrote", files[".img"], files[".json"])
	}
}
