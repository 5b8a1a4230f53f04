package integration

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/volumeid"
)

var stressSnapshots atomic.Int64

// snapshotRestore is the snapshot step of TestStressInvariants: with the
// volume's model frozen, a workload that may write (a read/write target)
// writes a token and fsyncs it: an acknowledged write. Then the volume is
// snapshotted and the snapshot restored, and the restore must hold the
// token. Where the pool has no reflinks a volume attached read-write must
// be refused instead (FAILED_PRECONDITION).
func (s *stress) snapshotRestore(v *stressVol, reflinks bool) bool {
	unlock := v.lockAll()
	defer unlock()
	if !v.formatted.Load() {
		return false
	}
	attachedRW := false
	for _, a := range v.attach {
		if a != nil && !a.ro {
			attachedRW = true
		}
	}
	// An acknowledged write through a read/write target, if there is one.
	token, offset, wrote := "", int64(0), false
	for n := range s.nodes {
		for target, held := range v.targets[n] {
			if wrote || held.ro {
				continue
			}
			buf := make([]byte, 16)
			_, _ = rand.Read(buf)
			token = hex.EncodeToString(buf)
			offset = int64(buf[0]) * 4096
			if err := writeAcknowledged(target, v.block, token, offset); err != nil {
				s.violate("write through a read/write target", "%s at %s: %v", v.name, target, err)
				return false
			}
			wrote = true
		}
	}
	n := stressSnapshots.Add(1)
	what := fmt.Sprintf("%s (attached read-write: %t, pool with reflinks: %t)", v.name, attachedRW, reflinks)
	var snapID string
	code, err := s.call("CreateSnapshot", func(ctx context.Context) error {
		r, err := s.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: fmt.Sprintf("stress-snap-%d", n), SourceVolumeId: v.id})
		snapID = r.GetSnapshot().GetSnapshotId()
		return err
	})
	if !reflinks && attachedRW {
		if code != codes.FailedPrecondition {
			s.violate("snapshot of a volume in use on a pool without reflinks", "%s: got %v, want FAILED_PRECONDITION", what, err)
		} else {
			s.passed("no byte copy of a volume in use", 1)
		}
		return false
	}
	if code != codes.OK {
		s.violate("snapshot refused", "%s: %v", what, err)
		return false
	}
	defer s.call("DeleteSnapshot", func(ctx context.Context) error {
		_, err := s.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapID})
		return err
	})
	var restored string
	code, err = s.call("CreateVolume", func(ctx context.Context) error {
		r, err := s.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("stress-restore-%d", n),
			CapacityRange: &csi.CapacityRange{RequiredBytes: v.size}, VolumeCapabilities: []*csi.VolumeCapability{v.capability()},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}}})
		restored = r.GetVolume().GetVolumeId()
		return err
	})
	if code != codes.OK {
		s.violate("restore refused", "%s: %v", what, err)
		return false
	}
	defer s.call("DeleteVolume", func(ctx context.Context) error {
		_, err := s.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: restored})
		return err
	})
	if !wrote {
		return false
	}
	id, err := volumeid.Parse(restored)
	if err != nil {
		s.violate("restore id", "%s: %v", restored, err)
		return false
	}
	got, err := readAcknowledged(filepath.Join(v.pool, "volumes", id.FileName()+".img"), v.block, offset, len(token), s.work)
	if err != nil || got != token {
		s.violate("a restore misses an acknowledged write", "%s: read %q (%v), want %q", what, got, err, token)
		return false
	}
	s.passed("no restore misses an acknowledged write", 1)
	return false
}

// writeAcknowledged writes token where a workload would and fsyncs it: a
// file in a filesystem target, or at offset of a raw block target.
func writeAcknowledged(target string, block bool, token string, offset int64) error {
	path, flags := filepath.Join(target, "acknowledged"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC
	if block {
		path, flags = target, os.O_WRONLY
	} else {
		offset = 0
	}
	f, err := os.OpenFile(path, flags, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt([]byte(token), offset); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// readAcknowledged reads the token back from a restored image: at offset
// for raw block, else from the file in its filesystem, mounted the way a
// ROX stage mounts it: a read-only device (mount sets the loop device up
// read-only for "ro"), nothing skipped, so a journal left to replay would
// fail the mount.
func readAcknowledged(image string, block bool, offset int64, n int, work string) (string, error) {
	if block {
		f, err := os.Open(image)
		if err != nil {
			return "", err
		}
		defer f.Close()
		buf := make([]byte, n)
		if _, err := f.ReadAt(buf, offset); err != nil {
			return "", err
		}
		return string(buf), nil
	}
	dir, err := os.MkdirTemp(work, "restore-check-")
	if err != nil {
		return "", err
	}
	defer os.Remove(dir)
	if out, err := exec.Command("mount", "-o", "ro,loop", image, dir).CombinedOutput(); err != nil {
		return "", fmt.Errorf("mounting the restore read-only: %v: %s", err, strings.TrimSpace(string(out)))
	}
	data, err := os.ReadFile(filepath.Join(dir, "acknowledged"))
	if uerr := unmountSettled(dir); uerr != nil && err == nil {
		err = uerr
	}
	return string(data), err
}

// unmountSettled unmounts dir, waiting out a moment of EBUSY (something
// else on the machine looking at the filesystem as it goes), then lazily
// as a last resort so that nothing stays mounted; the error says so.
func unmountSettled(dir string) error {
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if err = unix.Unmount(dir, 0); err == nil || !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		return fmt.Errorf("unmounting the restore at %s: %w", dir, err)
	}
	return nil
}
