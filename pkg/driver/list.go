package driver

// What the controller reports without changing anything: ListVolumes,
// ControllerGetVolume, volume health, GetCapacity, and the paging they
// share.

import (
	"context"
	"maps"
	"slices"
	"sort"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// allVolumes lists every volume of every backend, sorted by id.
func (d *Driver) allVolumes(ctx context.Context) ([]*backend.Volume, error) {
	var all []*backend.Volume
	for _, b := range slices.Sorted(maps.Keys(d.cfg.Controllers)) {
		vols, err := d.cfg.Controllers[b].ListVolumes(ctx)
		if err != nil {
			return nil, err
		}
		all = append(all, vols...)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].ID < all[j].ID })
	return all, nil
}

// page cuts one page from a list sorted by id. The token is the id of the
// last entry of the previous page, so a page costs the same at any offset
// (a binary search) and a deletion between pages does not skip entries.
func page[T any](items []T, idOf func(T) string, token string, max int32, isValid func(string) bool) ([]T, string, error) {
	if max < 0 {
		return nil, "", status.Error(codes.InvalidArgument, "max_entries must not be negative")
	}
	start := 0
	if token != "" {
		if !isValid(token) {
			return nil, "", status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token)
		}
		start = sort.Search(len(items), func(i int) bool { return idOf(items[i]) > token })
	}
	end := len(items)
	if max > 0 && start+int(max) < end {
		end = start + int(max)
	}
	next := ""
	if end < len(items) && end > start {
		next = idOf(items[end-1])
	}
	return items[start:end], next, nil
}

func validVolumeToken(t string) bool {
	_, err := volumeid.ParseKind(t, volumeid.Volume)
	return err == nil
}

func publishedNodes(vol *backend.Volume) []string {
	out := make([]string, 0, len(vol.Attachments))
	for _, a := range vol.Attachments {
		out = append(out, a.Node.String())
	}
	return out
}

func (s *controllerServer) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	all, err := s.d.allVolumes(ctx)
	if err != nil {
		return nil, err
	}
	vols, next, err := page(all, func(v *backend.Volume) string { return v.ID }, req.GetStartingToken(), req.GetMaxEntries(), validVolumeToken)
	if err != nil {
		return nil, err
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, v := range vols {
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: csiVolume(v),
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: publishedNodes(v)},
		})
	}
	return resp, nil
}

func (s *controllerServer) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	_, _, vol, err := s.d.lookupVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csi.ControllerGetVolumeResponse{
		Volume: csiVolume(vol),
		Status: &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: publishedNodes(vol)},
	}, nil
}

func volumeHealth(id string, h backend.Health) *csi.VolumeHealth {
	vh := &csi.VolumeHealth{VolumeId: id}
	if h.Abnormal {
		vh.HealthStatuses = []*csi.VolumeHealth_VolumeHealthEntry{{
			Status: healthErrorType(h.Condition), Reason: h.Reason, Message: h.Message,
		}}
	}
	return vh
}

// healthErrorType is CSI's name for a condition; one a backend did not
// name is taken as inaccessible, the cautious reading.
func healthErrorType(c backend.Condition) csi.VolumeHealthErrorType {
	switch c {
	case backend.Degraded:
		return csi.VolumeHealthErrorType_DEGRADED
	case backend.DataLoss:
		return csi.VolumeHealthErrorType_DATA_LOSS
	}
	return csi.VolumeHealthErrorType_INACCESSIBLE
}

func (s *controllerServer) ControllerGetVolumeHealth(ctx context.Context, req *csi.ControllerGetVolumeHealthRequest) (*csi.ControllerGetVolumeHealthResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	id, ctrl, vol, err := s.d.lookupVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	h, err := ctrl.VolumeHealth(ctx, id)
	if err != nil {
		return nil, err
	}
	return &csi.ControllerGetVolumeHealthResponse{VolumeHealth: volumeHealth(vol.ID, h)}, nil
}

// ControllerListVolumeHealth lists the volumes that are not healthy, by
// id; a token is the last id of a page, so paging goes on past volumes
// that became healthy (or unwell) in between.
func (s *controllerServer) ControllerListVolumeHealth(ctx context.Context, req *csi.ControllerListVolumeHealthRequest) (*csi.ControllerListVolumeHealthResponse, error) {
	if token := req.GetStartingToken(); token != "" && !validVolumeToken(token) {
		return nil, status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token)
	}
	all, err := s.d.allVolumes(ctx)
	if err != nil {
		return nil, err
	}
	var unwell []*csi.VolumeHealth
	for _, v := range all {
		if req.GetStartingToken() != "" && v.ID <= req.GetStartingToken() {
			continue // before the page: not checked at all
		}
		id := mustParse(v.ID)
		ctrl, err := s.d.controllerFor(id)
		if err != nil {
			return nil, err
		}
		h, err := ctrl.VolumeHealth(ctx, id)
		if err != nil {
			return nil, err
		}
		if h.Abnormal {
			unwell = append(unwell, volumeHealth(v.ID, h))
		}
		if m := req.GetMaxEntries(); m > 0 && len(unwell) > int(m) {
			break // one more than the page: there is a next one
		}
	}
	entries, next, err := page(unwell, func(h *csi.VolumeHealth) string { return h.VolumeId }, "", req.GetMaxEntries(), validVolumeToken)
	if err != nil {
		return nil, err
	}
	return &csi.ControllerListVolumeHealthResponse{Entries: entries, NextToken: next}, nil
}

func (s *controllerServer) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	params, err := ParseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	var caps capabilityRequest
	if len(req.GetVolumeCapabilities()) > 0 {
		if caps, err = parseCapabilities(req.GetVolumeCapabilities()); err != nil {
			return nil, err
		}
	} else {
		caps = capabilityRequest{accessType: accessmode.Mount, modes: []accessmode.Mode{accessmode.SingleNodeWriter}}
	}
	ctrl, err := s.chooseBackend(params, caps)
	if err != nil {
		// Volumes of this kind cannot be made here: there is no room for them.
		return &csi.GetCapacityResponse{AvailableCapacity: 0}, nil
	}
	zones := ctrl.Zones()
	if len(zones) == 0 {
		zones = []string{""} // one pool, reachable from every zone
	} else if z, ok := req.GetAccessibleTopology().GetSegments()[TopologyZoneKey]; ok {
		if !slices.Contains(zones, z) {
			return &csi.GetCapacityResponse{AvailableCapacity: 0}, nil
		}
		zones = []string{z}
	}
	var total, largest int64
	for _, z := range zones {
		free, err := ctrl.Capacity(ctx, z)
		if err != nil {
			return nil, err
		}
		total += free
		largest = max(largest, free)
	}
	return &csi.GetCapacityResponse{
		AvailableCapacity: total,
		MaximumVolumeSize: wrapInt64(largest),
		// What CreateVolume would make at the least: the filesystem's
		// minimum and the backend's (NFS image storage: 300 MiB).
		MinimumVolumeSize: wrapInt64(max(minimumSize[caps.fsType], ctrl.MinimumSize())),
	}, nil
}
