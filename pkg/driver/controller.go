package driver

// The Controller service: its server, the keys it hands to COs and node
// plugins, and the lookups every call begins with (which backend serves a
// volume, the volume's record under its lock). The calls are in the files
// named for what they do: create.go (create and delete), attach.go
// (publish and unpublish), snapshot.go, list.go (listing, health,
// capacity), modify.go (expand and modify) and capabilities.go.

import (
	"context"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Publish context keys: what ControllerPublishVolume tells the node plugin.
const (
	PublishContextReadOnly = "readonly"
	PublishContextMode     = "mode"
	// PublishContextCapacity is the volume's size when it was attached: a
	// node that reaches the volume over the network checks its disk
	// against it.
	PublishContextCapacity = "capacityBytes"
)

// Volume context keys set by CreateVolume.
const (
	VolumeContextBackend = "backend"
	VolumeContextZone    = "zone"
)

type controllerServer struct {
	csi.UnimplementedControllerServer
	d *Driver
}

// chooseBackend picks the backend a new volume goes to.
func (s *controllerServer) chooseBackend(p Params, c capabilityRequest) (backend.Controller, error) {
	name := accessmode.Backend(p.Backend)
	if p.Backend == BackendAuto {
		name = accessmode.BackendBlock
		for _, m := range c.modes {
			if c.accessType == accessmode.Mount && accessmode.Serves(accessmode.BackendBlock, c.accessType, m) != nil {
				name = accessmode.BackendNFS
			}
		}
	}
	for _, m := range c.modes {
		if err := accessmode.Serves(name, c.accessType, m); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	ctrl, ok := s.d.cfg.Controllers[name]
	if !ok {
		return nil, status.Errorf(codes.InvalidArgument,
			"backend %s is not enabled on this controller (enabled: %s)", name, s.d.enabledBackends())
	}
	return ctrl, nil
}

func (d *Driver) enabledBackends() string {
	names := make([]string, 0, len(d.cfg.Controllers))
	for b := range d.cfg.Controllers {
		names = append(names, string(b))
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// controllerFor returns the backend an id belongs to, or NotFound.
func (d *Driver) controllerFor(id volumeid.ID) (backend.Controller, error) {
	ctrl, ok := d.cfg.Controllers[id.Backend]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "%s: backend %s is not enabled on this controller", id, id.Backend)
	}
	return ctrl, nil
}

// lookupVolume parses a volume id and finds the volume; malformed ids are
// NotFound because no such volume can exist.
func (d *Driver) lookupVolume(ctx context.Context, raw string) (volumeid.ID, backend.Controller, *backend.Volume, error) {
	id, err := volumeid.ParseKind(raw, volumeid.Volume)
	if err != nil {
		return id, nil, nil, status.Errorf(codes.NotFound, "volume %q does not exist: %v", raw, err)
	}
	ctrl, err := d.controllerFor(id)
	if err != nil {
		return id, nil, nil, err
	}
	vol, err := ctrl.Volume(ctx, id)
	if err != nil {
		return id, nil, nil, err
	}
	return id, ctrl, vol, nil
}

// lockedVolume takes the volume's lock, then looks it up, for a call that
// changes it; release lets the lock go.
func (d *Driver) lockedVolume(ctx context.Context, raw string) (volumeid.ID, backend.Controller, *backend.Volume, func(), error) {
	id, err := volumeid.ParseKind(raw, volumeid.Volume)
	if err != nil {
		return id, nil, nil, nil, status.Errorf(codes.NotFound, "volume %q does not exist: %v", raw, err)
	}
	release, err := d.locks.acquire(id.String())
	if err != nil {
		return id, nil, nil, nil, err
	}
	_, ctrl, vol, err := d.lookupVolume(ctx, raw)
	if err != nil {
		release()
		return id, nil, nil, nil, err
	}
	return id, ctrl, vol, release, nil
}

func accessibleTopology(vol *backend.Volume) []*csi.Topology {
	if vol.Zone == "" {
		return nil
	}
	return []*csi.Topology{{Segments: map[string]string{TopologyZoneKey: vol.Zone}}}
}

func csiVolume(vol *backend.Volume) *csi.Volume {
	v := &csi.Volume{
		VolumeId:           vol.ID,
		CapacityBytes:      vol.CapacityBytes,
		AccessibleTopology: accessibleTopology(vol),
		VolumeContext: map[string]string{
			VolumeContextBackend: string(mustParse(vol.ID).Backend),
		},
	}
	if vol.Zone != "" {
		v.VolumeContext[VolumeContextZone] = vol.Zone
	}
	for k, val := range vol.Context {
		v.VolumeContext[k] = val
	}
	if src := vol.Source; src != nil {
		switch {
		case src.SnapshotID != "":
			v.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: src.SnapshotID}}}
		case src.VolumeID != "":
			v.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src.VolumeID}}}
		}
	}
	return v
}

// mustParse parses an id the driver itself recorded.
func mustParse(raw string) volumeid.ID {
	id, err := volumeid.Parse(raw)
	if err != nil {
		klog.ErrorS(err, "Recorded id does not parse", "id", raw)
	}
	return id
}

func wrapInt64(v int64) *wrapperspb.Int64Value { return wrapperspb.Int64(v) }
