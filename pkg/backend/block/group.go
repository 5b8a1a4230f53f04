package block

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// groupCapturePrefix names a group's capture of the volumes subvolume, in
// the pool's directory, while its members are cloned out of it. It holds
// tempMarker: a capture a crash left is removed at the next start.
const groupCapturePrefix = ".group" + tempMarker

// layOutOnBtrfs makes a new pool on btrfs with its volumes in a subvolume
// of their own and copy-on-write off for the images (btrfs.go). A pool
// made before, or elsewhere, is left as it is: its group snapshots take
// one member after the other.
func (p *pool) layOutOnBtrfs() error {
	btrfs, err := onBtrfs(p.dir)
	if err != nil || !btrfs {
		return err
	}
	dirs := []string{filepath.Join(p.dir, volumesDir), filepath.Join(p.dir, snapshotsDir), p.templatesDir()}
	for _, d := range dirs {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			return err // there already (or unreadable): not a new pool
		}
	}
	if err := createSubvolume(p.dir, volumesDir); err != nil {
		return err
	}
	for i, d := range dirs {
		if i > 0 {
			if err := os.Mkdir(d, 0o700); err != nil {
				return err
			}
		}
		if err := os.Chmod(d, 0o700); err != nil {
			return err
		}
		if err := setNoCOW(d); err != nil {
			return err
		}
	}
	klog.InfoS("Laid out a new block pool on btrfs: volumes in a subvolume, so that a group snapshot is of one instant", "zone", p.zone, "dir", p.dir)
	return fsutil.SyncDir(p.dir)
}

// groupsAtOnce says whether the pool takes a group at one instant.
func (p *pool) groupsAtOnce() (bool, error) {
	return isSubvolume(filepath.Join(p.dir, volumesDir))
}

// dropGroupCaptures removes the captures a crash left in the pool.
func (p *pool) dropGroupCaptures() error {
	entries, err := os.ReadDir(p.dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), groupCapturePrefix) {
			klog.InfoS("Removing a group snapshot's capture left by an interrupted snapshot", "path", filepath.Join(p.dir, e.Name()))
			if err := deleteSubvolume(p.dir, e.Name()); err != nil {
				return err
			}
		}
	}
	return nil
}

// CreateSnapshotGroup takes every member at one instant where the pool's
// volumes are a btrfs subvolume: one read-only snapshot of the subvolume
// holds every image as of the commit of one transaction, so no member can
// hold a write that was acknowledged after one missing from another, and
// each member is a reflink of its image there. Elsewhere the members are
// taken one after the other (backend.SnapshotOneAtATime), which refuses a
// group of more than one volume being written.
func (c *Controller) CreateSnapshotGroup(ctx context.Context, members []backend.GroupMember) ([]*backend.Snapshot, error) {
	if len(members) == 0 {
		return nil, nil
	}
	p, err := c.poolFor(members[0].Source, volumeid.Volume)
	if err != nil {
		return nil, err
	}
	for _, m := range members {
		if err := backend.CheckSnapshotZone(m.ID, m.Source); err != nil {
			return nil, err
		}
		if m.Source.Zone != p.zone {
			return nil, status.Errorf(codes.InvalidArgument, "a group snapshot is of one zone: %s is not in zone %s", m.Source, p.zone)
		}
	}
	atOnce, err := p.groupsAtOnce()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting the volumes directory of pool %s: %v", p.zone, err)
	}
	if !atOnce {
		return backend.SnapshotOneAtATime(ctx, c, members)
	}
	for _, m := range members {
		if _, err := c.Volume(ctx, m.Source); err != nil {
			return nil, err
		}
	}
	suffix := make([]byte, 8)
	_, _ = rand.Read(suffix)
	capture := groupCapturePrefix + hex.EncodeToString(suffix)
	began := time.Now()
	if err := snapshotSubvolume(filepath.Join(p.dir, volumesDir), p.dir, capture); err != nil {
		return nil, status.Errorf(codes.Internal, "capturing the volumes of pool %s: %v", p.zone, err)
	}
	took := time.Since(began)
	defer func() {
		if err := deleteSubvolume(p.dir, capture); err != nil {
			klog.ErrorS(err, "Removing a group snapshot's capture (the next start removes it)", "path", filepath.Join(p.dir, capture))
		}
	}()
	out := make([]*backend.Snapshot, 0, len(members))
	for _, m := range members {
		image, err := fsutil.JoinWithin(filepath.Join(p.dir, capture), m.Source.FileName()+imageSuffix)
		if err == nil {
			_, err = os.Stat(image)
		}
		if err != nil {
			backend.DropGroup(ctx, c, out)
			return nil, status.Errorf(codes.Internal, "the capture of pool %s has no image of %s: %v", p.zone, m.Source, err)
		}
		snap, err := c.createSnapshot(ctx, m.ID, m.Name, m.Source, image)
		if err != nil {
			backend.DropGroup(ctx, c, out)
			return nil, err
		}
		out = append(out, snap)
	}
	klog.InfoS("Group snapshot taken at one instant", "zone", p.zone, "members", len(out), "captureTook", took)
	return out, nil
}
