package driver

// The SnapshotMetadata service: which blocks of a block volume's snapshot
// hold data, and which changed between two snapshots of one volume. The
// backend answers in pages (backend.BlockRangesRequest); this server
// streams them, one response per page, until the answer is complete.

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

const (
	// defaultRangesPerResponse is the page size when the CO leaves it to
	// the plugin (max_results 0), and maxRangesPerResponse the most one
	// response carries whatever it asks: about 20 bytes a range keeps a
	// response far below gRPC's 4 MiB message limit.
	defaultRangesPerResponse = 1024
	maxRangesPerResponse     = 16384
)

type snapshotMetadataServer struct {
	csi.UnimplementedSnapshotMetadataServer
	d *Driver
}

func (s *snapshotMetadataServer) GetMetadataAllocated(req *csi.GetMetadataAllocatedRequest, stream csi.SnapshotMetadata_GetMetadataAllocatedServer) error {
	target, err := parseSnapshotID(req.GetSnapshotId(), "snapshot id")
	if err != nil {
		return err
	}
	return s.d.streamBlockRanges(stream.Context(),
		backend.BlockRangesRequest{Target: target, From: req.GetStartingOffset()}, req.GetMaxResults(),
		func(capacity int64, ranges []*csi.BlockMetadata) error {
			return stream.Send(&csi.GetMetadataAllocatedResponse{BlockMetadataType: csi.BlockMetadataType_VARIABLE_LENGTH,
				VolumeCapacityBytes: capacity, BlockMetadata: ranges})
		})
}

func (s *snapshotMetadataServer) GetMetadataDelta(req *csi.GetMetadataDeltaRequest, stream csi.SnapshotMetadata_GetMetadataDeltaServer) error {
	base, err := parseSnapshotID(req.GetBaseSnapshotId(), "base snapshot id")
	if err != nil {
		return err
	}
	target, err := parseSnapshotID(req.GetTargetSnapshotId(), "target snapshot id")
	if err != nil {
		return err
	}
	if base == target {
		return status.Errorf(codes.InvalidArgument, "base and target are the same snapshot, %s; give an earlier snapshot of its volume as the base", base)
	}
	if base.Backend != target.Backend {
		return status.Errorf(codes.InvalidArgument,
			"base snapshot %s is of a %s volume and target snapshot %s of a %s volume; changes are known only between two snapshots of one volume",
			base, base.Backend, target, target.Backend)
	}
	return s.d.streamBlockRanges(stream.Context(),
		backend.BlockRangesRequest{Base: base, Target: target, From: req.GetStartingOffset()}, req.GetMaxResults(),
		func(capacity int64, ranges []*csi.BlockMetadata) error {
			return stream.Send(&csi.GetMetadataDeltaResponse{BlockMetadataType: csi.BlockMetadataType_VARIABLE_LENGTH,
				VolumeCapacityBytes: capacity, BlockMetadata: ranges})
		})
}

// parseSnapshotID reads a snapshot id of a request; what names no snapshot
// this driver could have made is NotFound.
func parseSnapshotID(raw, field string) (volumeid.ID, error) {
	if raw == "" {
		return volumeid.ID{}, status.Errorf(codes.InvalidArgument, "%s is required", field)
	}
	id, err := volumeid.ParseKind(raw, volumeid.Snapshot)
	if err != nil {
		return volumeid.ID{}, status.Errorf(codes.NotFound, "snapshot %q does not exist: %v", raw, err)
	}
	return id, nil
}

// streamBlockRanges asks the backend for req page by page, at most
// maxResults ranges each (0: the plugin's choice), and sends every page.
// A snapshot with no ranges at all from req.From still gets one response,
// which tells the CO the volume's capacity.
func (d *Driver) streamBlockRanges(ctx context.Context, req backend.BlockRangesRequest, maxResults int32,
	send func(capacity int64, ranges []*csi.BlockMetadata) error) error {
	if req.From < 0 {
		return status.Errorf(codes.OutOfRange, "starting offset %d is negative; accepted: 0 up to the volume's capacity", req.From)
	}
	if maxResults < 0 {
		return status.Errorf(codes.InvalidArgument, "max_results %d is negative; accepted: 0 (the plugin's choice) or more", maxResults)
	}
	req.Limit = defaultRangesPerResponse
	if maxResults > 0 {
		req.Limit = min(int(maxResults), maxRangesPerResponse)
	}
	ctrl, err := d.controllerFor(req.Target)
	if err != nil {
		return err
	}
	for sent := 0; ; sent++ {
		if err := ctx.Err(); err != nil {
			return status.FromContextError(err).Err()
		}
		page, err := ctrl.SnapshotBlocks(ctx, req)
		if err != nil {
			return err
		}
		if len(page.Ranges) > 0 || sent == 0 {
			out := make([]*csi.BlockMetadata, len(page.Ranges))
			for i, r := range page.Ranges {
				out[i] = &csi.BlockMetadata{ByteOffset: r.Offset, SizeBytes: r.Length}
			}
			if err := send(page.CapacityBytes, out); err != nil {
				return err
			}
		}
		if page.Done || len(page.Ranges) == 0 {
			return nil
		}
		req.From = page.Ranges[len(page.Ranges)-1].End()
	}
}
