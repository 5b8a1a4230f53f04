package driver

// CreateVolume and DeleteVolume: sizing, placement in a zone the request
// allows, content sources, the idempotency of a name (a retry finds its
// volume, in whichever zone and backend, or its creation in progress).

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
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
	id         volumeid.ID // where the source is: its backend and zone
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
		return sourceFacts{id: id, size: snap.SizeBytes, accessType: snap.AccessType, fsType: snap.FsType}, nil
	}
	id, _, vol, err := s.d.lookupVolume(ctx, src.VolumeID)
	if err != nil {
		return sourceFacts{}, err
	}
	return sourceFacts{id: id, size: vol.CapacityBytes, accessType: vol.AccessType, fsType: vol.FsType}, nil
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
	if src != nil && len(ctrl.Zones()) > 0 {
		if zones, err = fillableZones(ctx, ctrl, source.id, zones); err != nil {
			return nil, err
		}
	}
	return createInZones(ctx, ctrl, zones, key, size, specFor)
}

// fillableZones keeps the candidate zones in which a volume can be filled
// from the source id. A zone served by a storage target of its own copies only the
// images that target holds, so a restore or a clone of a source there is
// made in the source's zone, and its pod follows it there (the volume's
// accessible topology). Where the request allows no such zone, the answer
// is RESOURCE_EXHAUSTED, the code that lets a CO which chose a node in
// another zone choose again rather than retry the same request.
func fillableZones(ctx context.Context, ctrl backend.Controller, id volumeid.ID, candidates []string) ([]string, error) {
	if id.Backend != ctrl.Backend() {
		return candidates, nil // refused by the backend, which says why
	}
	able, err := ctrl.ZonesFillableFrom(ctx, id.Zone)
	if err != nil {
		return nil, err
	}
	var kept []string
	for _, z := range candidates {
		if slices.Contains(able, z) {
			kept = append(kept, z)
		}
	}
	if len(kept) == 0 {
		can := "no zone"
		if len(able) > 0 {
			can = "zones " + strings.Join(able, ", ")
		}
		return nil, status.Errorf(codes.ResourceExhausted,
			"content source %s is in %s, whose storage copies only what it holds: a volume filled from it can be made in %s, and the requested topology allows only zones %s; schedule the workload in %s",
			id, zoneName(id.Zone), can, strings.Join(candidates, ", "), zoneName(id.Zone))
	}
	return kept, nil
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

// idsOfKey are the ids a volume of key may have in the backend: one in
// each of its zones (one without a zone for a backend that has none).
func idsOfKey(ctrl backend.Controller, key string) []volumeid.ID {
	zones := ctrl.Zones()
	if len(zones) == 0 {
		zones = []string{""}
	}
	var ids []volumeid.ID
	for _, zone := range zones {
		if id, err := volumeid.New(ctrl.Backend(), zone, volumeid.Volume, key); err == nil {
			ids = append(ids, id)
		}
	}
	return ids
}

// creatingIn finds the volume of key that the backend is creating in the
// background, if any: a retry goes to it, in its zone whatever room the
// copy itself now takes there, rather than make another. A backend that
// cannot tell fails the call: guessing "no" could make a second volume.
func creatingIn(ctx context.Context, ctrl backend.Controller, key string) (volumeid.ID, bool, error) {
	for _, id := range idsOfKey(ctrl, key) {
		creating, err := ctrl.Creating(ctx, id)
		if err != nil {
			return volumeid.ID{}, false, withContext(err, "cannot tell whether volume %s is being created in %s, so none is made elsewhere meanwhile", id, zoneName(id.Zone))
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
	for _, id := range idsOfKey(ctrl, key) {
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
