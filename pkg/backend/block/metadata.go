package block

import (
	"context"
	"errors"
	"os"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// extentWindow is how much of an image one pass over its extent map
// covers: the most extents held in memory at once is what a window can
// hold, whatever the size of the image.
const extentWindow = int64(1) << 30

// SnapshotBlocks answers from the extent maps of the snapshots' images
// (extents.go), at the granularity the pool's filesystem allocates in: its
// block (4 KiB on ext4 and xfs as the pools make them) or page (tmpfs).
// Changes are exact between reflink clones (an xfs pool with reflinks);
// where snapshots are byte copies, every stored range of either snapshot
// counts as changed.
func (c *Controller) SnapshotBlocks(ctx context.Context, req backend.BlockRangesRequest) (*backend.BlockRanges, error) {
	target, targetImage, err := c.openSnapshot(ctx, req.Target, "target ")
	if err != nil {
		return nil, err
	}
	defer targetImage.Close()
	var baseImage *os.File
	if req.Delta() {
		var base *backend.Snapshot
		base, baseImage, err = c.openSnapshot(ctx, req.Base, "base ")
		if err != nil {
			return nil, err
		}
		defer baseImage.Close()
		if base.SourceVolumeID != target.SourceVolumeID {
			return nil, status.Errorf(codes.InvalidArgument,
				"base snapshot %s is of volume %s and target snapshot %s of volume %s; changes are known only between two snapshots of one volume",
				base.ID, base.SourceVolumeID, target.ID, target.SourceVolumeID)
		}
	}
	if req.From < 0 || req.From > target.SizeBytes {
		return nil, status.Errorf(codes.OutOfRange,
			"starting offset %d is outside snapshot %s of %d bytes; accepted: 0 to %d", req.From, target.ID, target.SizeBytes, target.SizeBytes)
	}
	if req.Limit < 1 {
		return nil, status.Errorf(codes.InvalidArgument, "a page must hold at least one range, not %d", req.Limit)
	}
	page := &backend.BlockRanges{CapacityBytes: target.SizeBytes}
	for pos := req.From; pos < target.SizeBytes; {
		if err := ctx.Err(); err != nil {
			return nil, status.FromContextError(err).Err()
		}
		end := min(pos+extentWindow, target.SizeBytes)
		targetExtents, err := extentsIn(targetImage, pos, end)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "reading the extents of snapshot %s: %v", target.ID, err)
		}
		var baseExtents []extent
		if baseImage != nil {
			if baseExtents, err = extentsIn(baseImage, pos, end); err != nil {
				return nil, status.Errorf(codes.Internal, "reading the extents of snapshot %s: %v", req.Base, err)
			}
		}
		for _, r := range differing(baseExtents, targetExtents) {
			page.Ranges = appendRange(page.Ranges, r)
		}
		pos = end
		// One range more than the page holds: the last one it holds has
		// a gap after it, so it is complete.
		if len(page.Ranges) > req.Limit {
			page.Ranges = page.Ranges[:req.Limit]
			return page, nil
		}
	}
	page.Done = true
	return page, nil
}

// openSnapshot finds a snapshot whose data is complete and opens its image;
// the open file keeps the data readable should the snapshot be deleted
// meanwhile. role names the snapshot in messages ("base ", "target ").
func (c *Controller) openSnapshot(ctx context.Context, id volumeid.ID, role string) (*backend.Snapshot, *os.File, error) {
	p, err := c.poolFor(id, volumeid.Snapshot)
	if err != nil {
		return nil, nil, err
	}
	defer c.objects.Hold(id.String())()
	snap, err := c.Snapshot(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	if snap.Cutting {
		return nil, nil, status.Errorf(codes.Unavailable, "%ssnapshot %s is still being copied; ask again once it is ready to use", role, id)
	}
	path, err := p.imagePath(id)
	if err != nil {
		return nil, nil, status.Error(codes.Internal, err.Error())
	}
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil, status.Errorf(codes.NotFound, "%ssnapshot %s does not exist", role, id)
	}
	if err != nil {
		return nil, nil, status.Errorf(codes.Internal, "opening the image of %ssnapshot %s: %v", role, id, err)
	}
	return snap, f, nil
}
