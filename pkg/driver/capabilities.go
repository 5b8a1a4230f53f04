package driver

// The capabilities the driver advertises (built from its configuration,
// so that what it advertises and what it implements read off one page),
// and the parsing and validation of the volume capabilities COs ask for.

import (
	"context"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
)

// pluginCapabilities describe the plugin (the driver as a whole), not this
// process: a node-only process of a split deployment still belongs to a
// plugin with a controller service, and COs and conformance tests read it so.
func (d *Driver) pluginCapabilities() []*csi.PluginCapability {
	caps := []*csi.PluginCapability{{Type: &csi.PluginCapability_Service_{
		Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}}}
	caps = append(caps,
		&csi.PluginCapability{Type: &csi.PluginCapability_Service_{
			Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE}}},
		&csi.PluginCapability{Type: &csi.PluginCapability_Service_{
			Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS}}},
		// Served for block volumes; NFS snapshots are refused by name.
		&csi.PluginCapability{Type: &csi.PluginCapability_Service_{
			Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_SNAPSHOT_METADATA_SERVICE}}},
		&csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{
			VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE}}},
	)
	return caps
}

var controllerRPCs = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
	csi.ControllerServiceCapability_RPC_GET_CAPACITY,
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
	csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
	csi.ControllerServiceCapability_RPC_GET_VOLUME,
	csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
	csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
}

var nodeRPCs = []csi.NodeServiceCapability_RPC_Type{
	csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
	csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
	csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
	csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
}

func (d *Driver) controllerCapabilities() []*csi.ControllerServiceCapability {
	caps := make([]*csi.ControllerServiceCapability, 0, len(controllerRPCs))
	for _, t := range controllerRPCs {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return caps
}

func (d *Driver) nodeCapabilities() []*csi.NodeServiceCapability {
	caps := make([]*csi.NodeServiceCapability, 0, len(nodeRPCs))
	for _, t := range nodeRPCs {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: t}}})
	}
	return caps
}

func (s *controllerServer) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: s.d.controllerCapabilities()}, nil
}

// capabilityRequest is a set of volume capabilities reduced to what the
// driver acts on. Every capability of one volume must agree on the access
// type and filesystem.
type capabilityRequest struct {
	accessType accessmode.AccessType
	fsType     string
	modes      []accessmode.Mode
}

// parseCapability checks one capability and returns its access type, fs type
// and mode.
func parseCapability(c *csi.VolumeCapability) (accessmode.AccessType, string, accessmode.Mode, error) {
	if c == nil {
		return "", "", 0, status.Error(codes.InvalidArgument, "volume capability is required")
	}
	mode := c.GetAccessMode().GetMode()
	if c.GetAccessMode() == nil || !accessmode.Valid(mode) {
		return "", "", 0, status.Errorf(codes.InvalidArgument,
			"volume capability needs an access mode; accepted: %s", accessmode.Names(accessmode.All))
	}
	switch at := c.GetAccessType().(type) {
	case *csi.VolumeCapability_Mount:
		fs := at.Mount.GetFsType()
		if err := backend.CheckFsType(fs); err != nil {
			return "", "", 0, err
		}
		if err := backend.CheckMountFlags(at.Mount.GetMountFlags()); err != nil {
			return "", "", 0, status.Error(codes.InvalidArgument, err.Error())
		}
		return accessmode.Mount, fs, mode, nil
	case *csi.VolumeCapability_Block:
		return accessmode.Block, "", mode, nil
	}
	return "", "", 0, status.Error(codes.InvalidArgument, "volume capability needs an access type: mount or block")
}

func parseCapabilities(caps []*csi.VolumeCapability) (capabilityRequest, error) {
	if len(caps) == 0 {
		return capabilityRequest{}, status.Error(codes.InvalidArgument, "volume capabilities are required")
	}
	var out capabilityRequest
	for i, c := range caps {
		at, fs, mode, err := parseCapability(c)
		if err != nil {
			return capabilityRequest{}, err
		}
		if i > 0 && at != out.accessType {
			return capabilityRequest{}, status.Error(codes.InvalidArgument,
				"volume capabilities mix access types mount and block; a volume has one")
		}
		if fs != "" && out.fsType != "" && fs != out.fsType {
			return capabilityRequest{}, status.Errorf(codes.InvalidArgument,
				"volume capabilities ask for two filesystems, %s and %s", out.fsType, fs)
		}
		out.accessType = at
		if fs != "" {
			out.fsType = fs
		}
		if !slices.Contains(out.modes, mode) {
			out.modes = append(out.modes, mode)
		}
	}
	return out, nil
}

func (s *controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume capabilities are required")
	}
	_, _, vol, err := s.d.lookupVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if _, err := ParseParams(req.GetParameters()); err != nil {
		return nil, err
	}
	for _, c := range req.GetVolumeCapabilities() {
		accessType, fsType, mode, err := parseCapability(c)
		if err != nil {
			return nil, err
		}
		if d := accessmode.CheckUse(vol.ID, vol.AccessType, vol.FsType, accessType, fsType); !d.Allowed() {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: d.Message}, nil
		}
		if d := accessmode.CheckCreatedModes(vol.ID, vol.Modes, mode); !d.Allowed() {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: d.Message}, nil
		}
		if err := accessmode.Serves(mustParse(vol.ID).Backend, accessType, mode); err != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
		}
	}
	for k, v := range req.GetParameters() {
		if vol.Parameters[k] != v {
			return &csi.ValidateVolumeCapabilitiesResponse{
				Message: fmt.Sprintf("parameter %s=%q differs from the volume's %q", k, v, vol.Parameters[k])}, nil
		}
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}
