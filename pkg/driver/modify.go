package driver

// What changes a volume once it exists: ControllerExpandVolume (its size)
// and ControllerModifyVolume (its mutable parameters).

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

func (s *controllerServer) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if req.GetCapacityRange() == nil {
		return nil, status.Error(codes.InvalidArgument, "capacity range is required")
	}
	id, ctrl, vol, release, err := s.d.lockedVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	// A range that requires nothing asks for no growth: the default size
	// sizeFor fills in is for new volumes, and would grow a 16 MiB volume
	// to DefaultVolumeSize.
	size := vol.CapacityBytes
	if r := req.GetCapacityRange(); r.GetRequiredBytes() != 0 || r.GetLimitBytes() < 0 {
		if size, err = sizeFor(r, vol.FsType, vol.CapacityBytes); err != nil {
			return nil, err
		}
	}
	if r := req.GetCapacityRange(); r.GetLimitBytes() > 0 && vol.CapacityBytes > r.GetLimitBytes() {
		return nil, status.Errorf(codes.OutOfRange,
			"volume %s already has %d bytes, more than the limit %d; volumes do not shrink", vol.ID, vol.CapacityBytes, r.GetLimitBytes())
	}
	if size > vol.CapacityBytes {
		if vol, err = ctrl.ExpandVolume(ctx, id, size); err != nil {
			return nil, err
		}
		klog.InfoS("Volume expanded", "volumeID", vol.ID, "bytes", vol.CapacityBytes)
	}
	return &csi.ControllerExpandVolumeResponse{
		CapacityBytes:         vol.CapacityBytes,
		NodeExpansionRequired: ctrl.NodeExpansionRequired(vol),
	}, nil
}

// ControllerModifyVolume changes a volume's mutable parameters (Kubernetes:
// a claim's VolumeAttributesClass). Keys it is not given keep their values;
// every key is checked before anything changes, so a request with one bad
// key changes nothing.
func (s *controllerServer) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	id, ctrl, vol, release, err := s.d.lockedVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	mutable, err := ParseMutableParams(ctrl.Backend(), req.GetMutableParameters())
	if err != nil {
		return nil, err
	}
	if len(mutable) == 0 {
		return &csi.ControllerModifyVolumeResponse{}, nil
	}
	if vol, err = ctrl.ModifyVolume(ctx, id, mutable); err != nil {
		return nil, err
	}
	klog.InfoS("Volume modified", "volumeID", vol.ID, "mutableParameters", vol.MutableParameters)
	return &csi.ControllerModifyVolumeResponse{}, nil
}
