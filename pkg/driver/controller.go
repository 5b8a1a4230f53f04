package driver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

const (
	mib = int64(1) << 20
	gib = int64(1) << 30
	// DefaultVolumeSize is used when a CreateVolume names no capacity.
	DefaultVolumeSize = 1 * gib
)

// minimumSize is the smallest filesystem mkfs accepts, per type.
var minimumSize = map[string]int64{"ext4": 1 * mib, "xfs": 300 * mib}

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

// sizeFor picks the capacity of a new volume from the request's range,
// rounded up to whole MiB where the limit allows.
func sizeFor(r *csi.CapacityRange, fsType string, minimum int64) (int64, error) {
	required, limit := r.GetRequiredBytes(), r.GetLimitBytes()
	if required < 0 || limit < 0 {
		return 0, status.Error(codes.InvalidArgument, "capacity range must not be negative")
	}
	if limit > 0 && required > limit {
		return 0, status.Errorf(codes.InvalidArgument, "capacity range: required %d bytes exceeds limit %d bytes", required, limit)
	}
	// need is what the volume must hold; size is what it gets when the
	// range allows (the default when nothing is required).
	need := max(required, minimumSize[fsType], minimum, 1)
	size := required
	if size == 0 {
		size = DefaultVolumeSize
		if limit > 0 && limit < size {
			size = limit
		}
	}
	size = max(size, need)
	rounded := (size + mib - 1) / mib * mib
	if limit > 0 && rounded > limit {
		rounded = limit / 4096 * 4096 // loop devices need whole sectors; stay within the limit
	}
	if rounded < need || (limit > 0 && rounded > limit) {
		return 0, status.Errorf(codes.OutOfRange,
			"capacity range [%d, %d] cannot hold %d bytes in whole 4096-byte blocks (the minimum for %s, or the content source's size)",
			required, limit, need, fsTypeOrRaw(fsType))
	}
	return rounded, nil
}

func zoneName(z string) string {
	if z == "" {
		return "the pool"
	}
	return "zone " + z
}

func fsTypeOrRaw(fs string) string {
	if fs == "" {
		return "a raw block volume"
	}
	return fs
}

// candidateZones orders the zones a new volume may go to: preferred
// segments first (in order), then the other requisite segments, then, when
// no requisite is given, every zone the backend has. A segment without a
// zone key allows every zone.
//
// A segment that names a node but no zone stands for that node's zone
// (nodeZones: the zones of the nodes the controller knows, from their ids),
// and for no zone when the node is unknown: a volume must never land in a
// zone its node is not in. A segment with neither stands for every zone.
func candidateZones(req *csi.TopologyRequirement, available []string, nodeZones map[string]string) ([]string, error) {
	if req == nil || (len(req.GetRequisite()) == 0 && len(req.GetPreferred()) == 0) {
		return available, nil
	}
	zonesOf := func(segs []*csi.Topology) ([]string, error) {
		var out []string
		for _, t := range segs {
			z, ok := t.GetSegments()[TopologyZoneKey]
			if node, named := t.GetSegments()[TopologyNodeKey]; !ok && named {
				if z, known := nodeZones[node]; known {
					out = append(out, z)
				}
				continue
			}
			if !ok {
				// Every zone, after (not instead of) the segments before it.
				out = append(out, available...)
				continue
			}
			if !volumeid.ValidZone(z) {
				return nil, status.Errorf(codes.InvalidArgument, "topology segment %s=%q is not a valid zone", TopologyZoneKey, z)
			}
			out = append(out, z)
		}
		return out, nil
	}
	allowed := available
	if len(req.GetRequisite()) > 0 {
		r, err := zonesOf(req.GetRequisite())
		if err != nil {
			return nil, err
		}
		allowed = r
	}
	preferred, err := zonesOf(req.GetPreferred())
	if err != nil {
		return nil, err
	}
	var out []string
	add := func(z string) {
		if slices.Contains(available, z) && slices.Contains(allowed, z) && !slices.Contains(out, z) {
			out = append(out, z)
		}
	}
	for _, z := range preferred {
		add(z)
	}
	for _, z := range allowed {
		add(z)
	}
	return out, nil
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

func contentSource(src *csi.VolumeContentSource) (*backend.Source, error) {
	if src == nil {
		return nil, nil
	}
	switch t := src.GetType().(type) {
	case *csi.VolumeContentSource_Snapshot:
		if t.Snapshot.GetSnapshotId() == "" {
			return nil, status.Error(codes.InvalidArgument, "content source snapshot needs a snapshot id")
		}
		return &backend.Source{SnapshotID: t.Snapshot.GetSnapshotId()}, nil
	case *csi.VolumeContentSource_Volume:
		if t.Volume.GetVolumeId() == "" {
			return nil, status.Error(codes.InvalidArgument, "content source volume needs a volume id")
		}
		return &backend.Source{VolumeID: t.Volume.GetVolumeId()}, nil
	}
	return nil, status.Error(codes.InvalidArgument, "content source must be a snapshot or a volume")
}

// sourceFacts is what a new volume takes from its content source: at least
// its size, and its kind (empty when a record made before snapshots kept
// it does not say).
type sourceFacts struct {
	size       int64
	accessType accessmode.AccessType
	fsType     string
}

// sourceOf finds the content source and what the new volume must match.
func (s *controllerServer) sourceOf(ctx context.Context, src *backend.Source) (sourceFacts, error) {
	if src == nil {
		return sourceFacts{}, nil
	}
	if src.SnapshotID != "" {
		id, err := volumeid.ParseKind(src.SnapshotID, volumeid.Snapshot)
		if err != nil {
			return sourceFacts{}, status.Errorf(codes.NotFound, "content source snapshot %q does not exist: %v", src.SnapshotID, err)
		}
		ctrl, err := s.d.controllerFor(id)
		if err != nil {
			return sourceFacts{}, err
		}
		snap, err := ctrl.Snapshot(ctx, id)
		if err != nil {
			return sourceFacts{}, err
		}
		return sourceFacts{size: snap.SizeBytes, accessType: snap.AccessType, fsType: snap.FsType}, nil
	}
	_, _, vol, err := s.d.lookupVolume(ctx, src.VolumeID)
	if err != nil {
		return sourceFacts{}, err
	}
	return sourceFacts{size: vol.CapacityBytes, accessType: vol.AccessType, fsType: vol.FsType}, nil
}

// checkRestore refuses a new volume of another kind than its content
// source: a raw device's bytes are no filesystem (and the reverse), and a
// filesystem keeps its type. fsType is what the request named ("" for
// nothing); it returns the filesystem the volume gets.
func checkRestore(src *backend.Source, facts sourceFacts, accessType accessmode.AccessType, fsType string) (string, error) {
	if src == nil || facts.accessType == "" {
		return fsType, nil
	}
	what := "snapshot " + src.SnapshotID
	if src.VolumeID != "" {
		what = "volume " + src.VolumeID
	}
	if facts.accessType != accessType {
		return "", status.Errorf(codes.InvalidArgument,
			"content source %s holds a %s volume; it can only be restored with access type %s, not %s",
			what, describeKind(facts), facts.accessType, accessType)
	}
	if fsType != "" && facts.fsType != "" && fsType != facts.fsType {
		return "", status.Errorf(codes.InvalidArgument,
			"content source %s holds a %s filesystem; a restore keeps it, so the requested filesystem %s is refused", what, facts.fsType, fsType)
	}
	if fsType == "" {
		return facts.fsType, nil
	}
	return fsType, nil
}

// volumeFsType decides a new volume's filesystem: the capability's or the
// class's (which must agree), else its content source's, else the default.
// An NFS volume has none a CO could choose: the server's filesystem is the
// server's business. sourceKnown is false when the source could not be
// found (the caller decides what that means).
func volumeFsType(b accessmode.Backend, caps capabilityRequest, params Params, src *backend.Source, source sourceFacts, sourceKnown bool) (string, error) {
	fsType := caps.fsType
	if b == accessmode.BackendNFS || caps.accessType != accessmode.Mount {
		fsType = ""
	} else {
		if fsType == "" {
			fsType = params.FsType
		}
		if params.FsType != "" && params.FsType != fsType {
			return "", status.Errorf(codes.InvalidArgument,
				"parameter fsType=%s disagrees with the capability's filesystem %s", params.FsType, fsType)
		}
	}
	if sourceKnown {
		restored, err := checkRestore(src, source, caps.accessType, fsType)
		if err != nil {
			return "", err
		}
		if b != accessmode.BackendNFS {
			fsType = restored
		}
	}
	if b != accessmode.BackendNFS && caps.accessType == accessmode.Mount && fsType == "" {
		fsType = DefaultFsType
	}
	return fsType, nil
}

func describeKind(f sourceFacts) string {
	if f.accessType == accessmode.Block {
		return "raw block"
	}
	if f.fsType != "" {
		return f.fsType + " filesystem"
	}
	return "filesystem"
}

func (s *controllerServer) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	caps, err := parseCapabilities(req.GetVolumeCapabilities())
	if err != nil {
		return nil, err
	}
	params, err := ParseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	src, err := contentSource(req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}
	ctrl, err := s.chooseBackend(params, caps)
	if err != nil {
		return nil, err
	}
	mutable, err := ParseMutableParams(ctrl.Backend(), req.GetMutableParameters())
	if err != nil {
		return nil, err
	}
	// A source that is gone is an error only for a volume not made yet:
	// a retry of a create that succeeded before the source was deleted
	// still finds its volume below.
	source, sourceErr := s.sourceOf(ctx, src)
	if sourceErr != nil && status.Code(sourceErr) != codes.NotFound {
		return nil, sourceErr
	}
	if caps.fsType, err = volumeFsType(ctrl.Backend(), caps, params, src, source, sourceErr == nil); err != nil {
		return nil, err
	}
	nodeZones, err := s.d.nodeZonesFor(ctx, req.GetAccessibilityRequirements())
	if err != nil {
		return nil, err
	}
	key := volumeid.KeyFor(s.d.cfg.DriverName, volumeid.Volume, req.GetName())
	release, err := s.d.locks.acquire("volume name " + req.GetName())
	if err != nil {
		return nil, err
	}
	defer release()

	check := func(v *backend.Volume) error { return compatible(v, req, caps, mutable, src, nodeZones) }
	if existing, err := s.findByKeyAnywhere(ctx, key); err != nil {
		return nil, err
	} else if existing != nil {
		if !strings.HasPrefix(existing.ID, string(ctrl.Backend())+":") {
			return nil, status.Errorf(codes.AlreadyExists,
				"a volume named %q exists already in another backend (%s); this request would make a %s volume; delete it first or choose another name",
				req.GetName(), existing.ID, ctrl.Backend())
		}
		if err := check(existing); err != nil {
			return nil, err
		}
		return &csi.CreateVolumeResponse{Volume: csiVolume(existing)}, nil
	}

	if sourceErr != nil {
		return nil, sourceErr
	}
	size, err := sizeFor(req.GetCapacityRange(), caps.fsType, max(source.size, ctrl.MinimumSize()))
	if err != nil {
		return nil, err
	}
	specFor := func(id volumeid.ID) backend.VolumeSpec {
		return backend.VolumeSpec{ID: id, Name: req.GetName(), CapacityBytes: size, AccessType: caps.accessType,
			FsType: caps.fsType, Modes: caps.modes, Parameters: req.GetParameters(), MutableParameters: mutable, Source: src}
	}
	if id, ok, err := creatingIn(ctx, ctrl, key); err != nil {
		return nil, err
	} else if ok {
		return resumeCreation(ctx, ctrl, specFor(id), check)
	}
	zones := []string{""} // a backend reachable from every zone satisfies any topology
	if len(ctrl.Zones()) > 0 {
		if zones, err = candidateZones(req.GetAccessibilityRequirements(), ctrl.Zones(), nodeZones); err != nil {
			return nil, err
		}
	}
	if len(zones) == 0 {
		return nil, status.Errorf(codes.ResourceExhausted,
			"no pool of backend %s is in the requested topology (pools in zones: %s)",
			ctrl.Backend(), strings.Join(ctrl.Zones(), ", "))
	}
	return createInZones(ctx, ctrl, zones, key, size, specFor)
}

// createInZones makes the volume in the first of zones whose pool can hold
// it, or says why none could.
func createInZones(ctx context.Context, ctrl backend.Controller, zones []string, key string, size int64, specFor func(volumeid.ID) backend.VolumeSpec) (*csi.CreateVolumeResponse, error) {
	var tried []string
	for _, zone := range zones {
		free, err := ctrl.Capacity(ctx, zone)
		if err != nil {
			return nil, err
		}
		if free < size {
			tried = append(tried, fmt.Sprintf("%s has %d bytes free", zoneName(zone), free))
			continue
		}
		id, err := volumeid.New(ctrl.Backend(), zone, volumeid.Volume, key)
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		vol, err := ctrl.CreateVolume(ctx, specFor(id))
		if status.Code(err) == codes.ResourceExhausted {
			tried = append(tried, fmt.Sprintf("%s: %s", zoneName(zone), status.Convert(err).Message()))
			continue
		}
		if err != nil {
			return nil, err
		}
		klog.InfoS("Volume created", "volumeID", vol.ID, "name", vol.Name, "zone", zone, "bytes", size,
			"accessType", vol.AccessType, "modes", accessmode.Names(vol.Modes))
		return &csi.CreateVolumeResponse{Volume: csiVolume(vol)}, nil
	}
	return nil, status.Errorf(codes.ResourceExhausted,
		"no allowed pool can hold %d bytes: %s", size, strings.Join(tried, "; "))
}

// creatingIn finds the volume of key that the backend is creating in the
// background, if any: a retry goes to it, in its zone whatever room the
// copy itself now takes there, rather than make another. A backend that
// cannot tell fails the call: guessing "no" could make a second volume.
func creatingIn(ctx context.Context, ctrl backend.Controller, key string) (volumeid.ID, bool, error) {
	zones := ctrl.Zones()
	if len(zones) == 0 {
		zones = []string{""}
	}
	for _, zone := range zones {
		id, err := volumeid.New(ctrl.Backend(), zone, volumeid.Volume, key)
		if err != nil {
			continue
		}
		creating, err := ctrl.Creating(ctx, id)
		if err != nil {
			return volumeid.ID{}, false, withContext(err, "cannot tell whether volume %s is being created in %s, so none is made elsewhere meanwhile", id, zoneName(zone))
		}
		if creating {
			return id, true, nil
		}
	}
	return volumeid.ID{}, false, nil
}

// resumeCreation hands a retry to the backend's creation in progress, which
// waits for its copy. If the copy finished in between, the volume is
// recorded by now and is the answer, if it matches the request.
func resumeCreation(ctx context.Context, ctrl backend.Controller, spec backend.VolumeSpec, check func(*backend.Volume) error) (*csi.CreateVolumeResponse, error) {
	vol, err := ctrl.CreateVolume(ctx, spec)
	if status.Code(err) == codes.AlreadyExists {
		existing, lerr := ctrl.Volume(ctx, spec.ID)
		if lerr != nil {
			return nil, err
		}
		if err := check(existing); err != nil {
			return nil, err
		}
		vol, err = existing, nil
	}
	if err != nil {
		return nil, err
	}
	return &csi.CreateVolumeResponse{Volume: csiVolume(vol)}, nil
}

// findByKeyAnywhere looks for a volume with this key in every backend: a
// name names one volume, whichever backend the request would choose.
func (s *controllerServer) findByKeyAnywhere(ctx context.Context, key string) (*backend.Volume, error) {
	for _, b := range slices.Sorted(maps.Keys(s.d.cfg.Controllers)) {
		vol, err := s.findByKey(ctx, s.d.cfg.Controllers[b], key)
		if err != nil || vol != nil {
			return vol, err
		}
	}
	return nil, nil
}

// findByKey looks for a volume with this key in any zone of the backend.
func (s *controllerServer) findByKey(ctx context.Context, ctrl backend.Controller, key string) (*backend.Volume, error) {
	zones := ctrl.Zones()
	if len(zones) == 0 {
		zones = []string{""}
	}
	for _, zone := range zones {
		id, err := volumeid.New(ctrl.Backend(), zone, volumeid.Volume, key)
		if err != nil {
			continue
		}
		vol, err := ctrl.Volume(ctx, id)
		if status.Code(err) == codes.NotFound {
			continue
		}
		return vol, err
	}
	return nil, nil
}

// compatible decides whether a repeated CreateVolume names the volume that
// already exists (OK) or a different one (ALREADY_EXISTS).
func compatible(vol *backend.Volume, req *csi.CreateVolumeRequest, caps capabilityRequest, mutable map[string]string, src *backend.Source, nodeZones map[string]string) error {
	var diffs []string
	r := req.GetCapacityRange()
	if vol.CapacityBytes < r.GetRequiredBytes() || (r.GetLimitBytes() > 0 && vol.CapacityBytes > r.GetLimitBytes()) {
		diffs = append(diffs, fmt.Sprintf("capacity %d bytes is outside [%d, %d]", vol.CapacityBytes, r.GetRequiredBytes(), r.GetLimitBytes()))
	}
	if vol.AccessType != caps.accessType {
		diffs = append(diffs, fmt.Sprintf("access type is %s", vol.AccessType))
	}
	if caps.accessType == accessmode.Mount && vol.FsType != "" && vol.FsType != caps.fsType {
		diffs = append(diffs, fmt.Sprintf("filesystem is %s", vol.FsType))
	}
	for _, m := range caps.modes {
		if !slices.Contains(vol.Modes, m) {
			diffs = append(diffs, fmt.Sprintf("access modes are %s", accessmode.Names(vol.Modes)))
			break
		}
	}
	if !maps.Equal(vol.Parameters, req.GetParameters()) && !(len(vol.Parameters) == 0 && len(req.GetParameters()) == 0) {
		diffs = append(diffs, "parameters differ")
	}
	if !maps.Equal(vol.MutableParameters, mutable) {
		diffs = append(diffs, "mutable parameters differ")
	}
	if (vol.Source == nil) != (src == nil) || (src != nil && *vol.Source != *src) {
		diffs = append(diffs, "content source differs")
	}
	// A volume without a zone (NFS) is reachable from every zone, so any
	// requisite topology holds it.
	if reqTopo := req.GetAccessibilityRequirements(); vol.Zone != "" && reqTopo != nil && len(reqTopo.GetRequisite()) > 0 {
		zones, err := candidateZones(&csi.TopologyRequirement{Requisite: reqTopo.GetRequisite()}, []string{vol.Zone}, nodeZones)
		if err == nil && len(zones) == 0 {
			diffs = append(diffs, fmt.Sprintf("it lives in zone %s, outside the requisite topology", vol.Zone))
		}
	}
	if len(diffs) > 0 {
		return status.Errorf(codes.AlreadyExists, "a volume named %q already exists (%s) but %s",
			vol.Name, vol.ID, strings.Join(diffs, "; "))
	}
	return nil
}

func (s *controllerServer) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	id, err := volumeid.ParseKind(req.GetVolumeId(), volumeid.Volume)
	if err != nil {
		// No volume can have this id, so it is as deleted as it gets.
		return &csi.DeleteVolumeResponse{}, nil
	}
	ctrl, err := s.d.controllerFor(id)
	if err != nil {
		return &csi.DeleteVolumeResponse{}, nil
	}
	release, err := s.d.locks.acquire(id.String())
	if err != nil {
		return nil, err
	}
	defer release()
	vol, err := ctrl.Volume(ctx, id)
	if status.Code(err) == codes.NotFound {
		// Gone for every lookup, but a deletion begun earlier may still
		// have data to remove, or a creation abandoned may still copy: the
		// backend finishes or cancels it (and answers OK when nothing is
		// left).
		if err := ctrl.DeleteVolume(ctx, id); err != nil {
			return nil, err
		}
		return &csi.DeleteVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if len(vol.Attachments) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is still published to node %s; unpublish it first", vol.ID, attachedNodes(vol))
	}
	if err := ctrl.DeleteVolume(ctx, id); err != nil {
		return nil, err
	}
	klog.InfoS("Volume deleted", "volumeID", vol.ID, "name", vol.Name)
	return &csi.DeleteVolumeResponse{}, nil
}

func attachedNodes(vol *backend.Volume) string {
	var out []string
	for _, a := range vol.Attachments {
		rw := "rw"
		if a.ReadOnly {
			rw = "ro"
		}
		out = append(out, fmt.Sprintf("%s (%s, %s)", a.Node, accessmode.Name(a.Mode), rw))
	}
	return strings.Join(out, ", ")
}

func (s *controllerServer) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if req.GetNodeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "node id is required")
	}
	accessType, fsType, mode, err := parseCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	id, ctrl, vol, release, err := s.d.lockedVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	node, err := nodeid.Parse(req.GetNodeId())
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "node %q is not known to this driver, whose node plugins report ids of the form %s: %v",
			req.GetNodeId(), nodeid.Format, err)
	}
	unlockNode, err := s.d.nodes.lock(ctx, node.Name)
	if err != nil {
		return nil, err
	}
	defer unlockNode()
	// Read under the node's lock, so that two attaches to the node cannot
	// both pass its volume limit.
	held, err := s.d.heldBy(ctx, node.Name)
	if err != nil {
		return nil, err
	}
	// Until the attachment is recorded, the fence list cannot change.
	s.d.fenceGate.RLock()
	defer s.d.fenceGate.RUnlock()
	fencedBy, err := s.d.fencedBy(node)
	if err != nil {
		return nil, err
	}
	_, overISCSI, _ := iscsi.FromContext(vol.ID, vol.Context)
	decision := accessmode.DecideAttach(accessmode.AttachFacts{
		VolumeID: vol.ID, Backend: id.Backend, ServedOverISCSI: overISCSI, VolumeZone: vol.Zone,
		VolumeAccessType: vol.AccessType, VolumeFsType: vol.FsType, VolumeModes: vol.Modes, Attachments: vol.Attachments,
		AccessType: accessType, FsType: fsType, Mode: mode, ReadOnly: req.GetReadonly(),
		Node:        node,
		NodeVolumes: len(held), NodeHeld: heldZones(node.Name, held),
		FencedBy: fencedBy, FencesInForce: s.d.fenceBlocks(),
	})
	if decision.FollowNode {
		if now, err := s.d.followNode(ctx, node, held, vol.ID); err != nil {
			return nil, err
		} else if now != nil {
			vol = now
		}
	}
	if !decision.Allowed() {
		return nil, s.d.refuseAttach(id, mode, decision.Decision, "node", req.GetNodeId())
	}
	want := decision.Attachment
	if !decision.Idempotent {
		// The others' marks follow the list too, which mends what a
		// fence pass could not reach.
		attachments, _, err := s.d.withFences(append(slices.Clone(vol.Attachments), want))
		if err != nil {
			return nil, err
		}
		if _, err := ctrl.SetAttachments(ctx, id, attachments); err != nil {
			return nil, err
		}
		klog.InfoS("Volume published to node", "volumeID", vol.ID, "node", req.GetNodeId(),
			"mode", accessmode.Name(mode), "readOnly", want.ReadOnly)
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{
		PublishContextReadOnly: strconv.FormatBool(want.ReadOnly),
		PublishContextMode:     accessmode.Name(mode),
		PublishContextCapacity: strconv.FormatInt(vol.CapacityBytes, 10),
	}}, nil
}

func (s *controllerServer) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	id, err := volumeid.ParseKind(req.GetVolumeId(), volumeid.Volume)
	if err != nil {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	release, err := s.d.locks.acquire(id.String())
	if err != nil {
		return nil, err
	}
	defer release()
	_, ctrl, vol, err := s.d.lookupVolume(ctx, req.GetVolumeId())
	if status.Code(err) == codes.NotFound {
		// The spec: a volume that cannot be found is unpublished already.
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if req.GetNodeId() == "" {
		// Every node: nothing to match, no node to follow.
		if len(vol.Attachments) > 0 {
			if _, err := ctrl.SetAttachments(ctx, id, nil); err != nil {
				return nil, err
			}
			klog.InfoS("Volume unpublished from every node", "volumeID", vol.ID)
		}
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	// The node is matched by its key, so a node that came back under a
	// new address can still let go of what it held under the old one,
	// and one whose id this driver cannot parse (a node plugin of another
	// version) of what it held under an id it could.
	node, err := nodeid.Parse(req.GetNodeId())
	parsed := err == nil
	key := node.Name
	if !parsed {
		key = nodeid.KeyOf(req.GetNodeId())
	}
	unlockNode, err := s.d.nodes.lock(ctx, key)
	if err != nil {
		return nil, err
	}
	defer unlockNode()
	// The marks of those who stay follow the fence list, as on publish.
	s.d.fenceGate.RLock()
	defer s.d.fenceGate.RUnlock()
	keep := slices.DeleteFunc(slices.Clone(vol.Attachments), func(a accessmode.Attachment) bool { return a.Node.Name == key })
	if len(keep) < len(vol.Attachments) {
		keep, _, err := s.d.withFences(keep)
		if err != nil {
			return nil, err
		}
		if _, err := ctrl.SetAttachments(ctx, id, keep); err != nil {
			return nil, err
		}
		klog.InfoS("Volume unpublished from node", "volumeID", vol.ID, "node", req.GetNodeId())
	}
	// The id is the node's newest: what else it holds follows it, unless
	// it claims another zone (which its publishes then refuse).
	if !parsed {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	held, err := s.d.heldBy(ctx, key)
	if err != nil {
		return nil, err
	}
	if accessmode.CheckNodeZone(node.Name, node.Zone, heldZones(node.Name, held)).Allowed() {
		if _, err := s.d.followNode(ctx, node, held, vol.ID); err != nil {
			return nil, err
		}
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
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

func wrapInt64(v int64) *wrapperspb.Int64Value { return wrapperspb.Int64(v) }
