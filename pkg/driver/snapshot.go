package driver

// CreateSnapshot, DeleteSnapshot, ListSnapshots and GetSnapshot.

import (
	"context"
	"maps"
	"slices"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

func csiSnapshot(s *backend.Snapshot) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:     s.ID,
		SourceVolumeId: s.SourceVolumeID,
		SizeBytes:      s.SizeBytes,
		CreationTime:   timestamppb.New(s.CreatedAt),
		ReadyToUse:     !s.Cutting,
	}
}

func (s *controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "source volume id is required")
	}
	if len(req.GetParameters()) > 0 {
		for k := range req.GetParameters() {
			if !strings.HasPrefix(k, kubernetesParamPrefix) {
				return nil, status.Errorf(codes.InvalidArgument,
					"snapshot parameter %q is not known; snapshots accept only keys starting with %q", k, kubernetesParamPrefix)
			}
		}
	}
	srcID, err := volumeid.ParseKind(req.GetSourceVolumeId(), volumeid.Volume)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "source volume %q does not exist: %v", req.GetSourceVolumeId(), err)
	}
	ctrl, err := s.d.controllerFor(srcID)
	if err != nil {
		return nil, err
	}
	key := volumeid.KeyFor(s.d.cfg.DriverName, volumeid.Snapshot, req.GetName())
	release, err := s.d.locks.acquire("snapshot name "+req.GetName(), srcID.String())
	if err != nil {
		return nil, err
	}
	defer release()
	if existing, err := s.findSnapshotByKey(ctx, key); err != nil {
		return nil, err
	} else if existing != nil {
		if existing.SourceVolumeID != req.GetSourceVolumeId() {
			return nil, status.Errorf(codes.AlreadyExists,
				"a snapshot named %q already exists (%s) of another volume, %s", req.GetName(), existing.ID, existing.SourceVolumeID)
		}
		if !existing.Cutting {
			return &csi.CreateSnapshotResponse{Snapshot: s.d.csiSnapshot(existing)}, nil
		}
		// Still copying: the backend waits for the copy, within this
		// call's deadline, rather than answering "not ready" at once.
	}
	if _, err := ctrl.Volume(ctx, srcID); err != nil {
		return nil, err
	}
	snapID, err := volumeid.New(srcID.Backend, srcID.Zone, volumeid.Snapshot, key)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	snap, err := ctrl.CreateSnapshot(ctx, snapID, req.GetName(), srcID)
	if err != nil {
		return nil, err
	}
	if snap.Cutting {
		klog.InfoS("Snapshot still being copied", "snapshotID", snap.ID, "name", snap.Name, "source", snap.SourceVolumeID)
	} else {
		klog.InfoS("Snapshot created", "snapshotID", snap.ID, "name", snap.Name, "source", snap.SourceVolumeID)
	}
	return &csi.CreateSnapshotResponse{Snapshot: s.d.csiSnapshot(snap)}, nil
}

func (s *controllerServer) findSnapshotByKey(ctx context.Context, key string) (*backend.Snapshot, error) {
	for _, b := range slices.Sorted(maps.Keys(s.d.cfg.Controllers)) {
		ctrl := s.d.cfg.Controllers[b]
		zones := ctrl.Zones()
		if len(zones) == 0 {
			zones = []string{""}
		}
		for _, z := range zones {
			id, err := volumeid.New(b, z, volumeid.Snapshot, key)
			if err != nil {
				continue
			}
			snap, err := ctrl.Snapshot(ctx, id)
			if status.Code(err) == codes.NotFound {
				continue
			}
			return snap, err
		}
	}
	return nil, nil
}

func (s *controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if req.GetSnapshotId() == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot id is required")
	}
	id, err := volumeid.ParseKind(req.GetSnapshotId(), volumeid.Snapshot)
	if err != nil {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	ctrl, err := s.d.controllerFor(id)
	if err != nil {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	release, err := s.d.locks.acquire(id.String())
	if err != nil {
		return nil, err
	}
	defer release()
	if snap, err := ctrl.Snapshot(ctx, id); err == nil {
		if group, _, member := s.d.groupMember(snap); member {
			return nil, status.Errorf(codes.InvalidArgument,
				"snapshot %s is a member of group snapshot %s and is deleted with it (DeleteVolumeGroupSnapshot), not alone", id, group)
		}
	}
	if err := ctrl.DeleteSnapshot(ctx, id); err != nil {
		return nil, err
	}
	klog.InfoS("Snapshot deleted", "snapshotID", id)
	return &csi.DeleteSnapshotResponse{}, nil
}

func (s *controllerServer) allSnapshots(ctx context.Context) ([]*backend.Snapshot, error) {
	var all []*backend.Snapshot
	for _, b := range slices.Sorted(maps.Keys(s.d.cfg.Controllers)) {
		snaps, err := s.d.cfg.Controllers[b].ListSnapshots(ctx)
		if err != nil {
			return nil, err
		}
		all = append(all, snaps...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].ID < all[j].ID })
	return all, nil
}

func (s *controllerServer) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	all, err := s.allSnapshots(ctx)
	if err != nil {
		return nil, err
	}
	var matching []*backend.Snapshot
	for _, snap := range all {
		if req.GetSnapshotId() != "" && snap.ID != req.GetSnapshotId() {
			continue
		}
		if req.GetSourceVolumeId() != "" && snap.SourceVolumeID != req.GetSourceVolumeId() {
			continue
		}
		matching = append(matching, snap)
	}
	validToken := func(t string) bool {
		_, err := volumeid.ParseKind(t, volumeid.Snapshot)
		return err == nil
	}
	snaps, next, err := page(matching, func(s *backend.Snapshot) string { return s.ID }, req.GetStartingToken(), req.GetMaxEntries(), validToken)
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, snap := range snaps {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: s.d.csiSnapshot(snap)})
	}
	return resp, nil
}

func (s *controllerServer) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	if req.GetSnapshotId() == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot id is required")
	}
	id, err := volumeid.ParseKind(req.GetSnapshotId(), volumeid.Snapshot)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "snapshot %q does not exist: %v", req.GetSnapshotId(), err)
	}
	ctrl, err := s.d.controllerFor(id)
	if err != nil {
		return nil, err
	}
	snap, err := ctrl.Snapshot(ctx, id)
	if err != nil {
		return nil, err
	}
	return &csi.GetSnapshotResponse{Snapshot: s.d.csiSnapshot(snap)}, nil
}
