package driver

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Volume group snapshots (CSI GroupController): one snapshot of each of a
// set of volumes of one backend and zone, all of one point in time.
//
// A group needs no record of its own: its members are ordinary snapshots
// whose ids derive from the group's and their source's (so a retry finds
// them) and whose names say the group, the number of members and the
// source. A group whose members are not all there is one whose creation
// was interrupted: the next CreateVolumeGroupSnapshot of that name makes it
// again, from one point in time.
//
// One point in time: every member's lock is held while the snapshots are
// taken, so no node can be attached to a member in between, and the backend
// takes them (backend.ControllerCapabilities.CreateSnapshotGroup). A block
// pool whose volumes are a btrfs subvolume, and the NFS quota storage
// with the driver's own ganesha (held still once for every member's
// copy), capture them all at one instant, however many are being written.
// Elsewhere a single snapshot of a
// volume being written is atomic (a reflink, or a frozen filesystem for
// NFS), but two such volumes would be taken one after the other while both
// go on being written, and a workload that writes its log to one and its
// data to the other would find the pair out of step: there a group of more
// than one volume attached read/write is refused (FAILED_PRECONDITION,
// naming the writers) rather than answered with a group that only looks
// consistent.

type groupControllerServer struct {
	csi.UnimplementedGroupControllerServer
	d *Driver
}

var groupControllerRPCs = []csi.GroupControllerServiceCapability_RPC_Type{
	csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,
}

func (s *groupControllerServer) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	caps := make([]*csi.GroupControllerServiceCapability, 0, len(groupControllerRPCs))
	for _, t := range groupControllerRPCs {
		caps = append(caps, &csi.GroupControllerServiceCapability{Type: &csi.GroupControllerServiceCapability_Rpc{
			Rpc: &csi.GroupControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// groupMemberKind derives member keys: a kind no CO name can reach, so a
// member's id never collides with a snapshot a CO named.
const groupMemberKind volumeid.Kind = "grp-member"

// memberID is the id of group's snapshot of source.
func (d *Driver) memberID(group, source volumeid.ID) volumeid.ID {
	key := volumeid.KeyFor(d.cfg.DriverName, groupMemberKind, group.String()+"\x00"+source.String())
	return volumeid.ID{Backend: group.Backend, Zone: group.Zone, Kind: volumeid.Snapshot, Key: key}
}

// memberName is the recorded name of a group's member: the group, how many
// members it has, the source.
func memberName(group volumeid.ID, members int, source volumeid.ID) string {
	return fmt.Sprintf("%s/%d/%s", group, members, source)
}

// groupMember reads a snapshot as a member of a group: its group and the
// group's size, and false for a snapshot that is no group's member (its id
// must be the one its name derives, so a CO's snapshot named like a member
// is not one).
func (d *Driver) groupMember(snap *backend.Snapshot) (group volumeid.ID, members int, ok bool) {
	parts := strings.Split(snap.Name, "/")
	if len(parts) != 3 {
		return volumeid.ID{}, 0, false
	}
	group, err := volumeid.ParseKind(parts[0], volumeid.GroupSnapshot)
	if err != nil {
		return volumeid.ID{}, 0, false
	}
	members, err = strconv.Atoi(parts[1])
	if err != nil || members < 1 {
		return volumeid.ID{}, 0, false
	}
	source, err := volumeid.ParseKind(parts[2], volumeid.Volume)
	if err != nil || source.String() != snap.SourceVolumeID || d.memberID(group, source).String() != snap.ID {
		return volumeid.ID{}, 0, false
	}
	return group, members, true
}

// groupMembers lists the snapshots of group that exist, sorted by source,
// and the number of members the group was made with (0 for none found).
func (d *Driver) groupMembers(ctx context.Context, ctrl backend.Controller, group volumeid.ID) ([]*backend.Snapshot, int, error) {
	all, err := ctrl.ListSnapshots(ctx)
	if err != nil {
		return nil, 0, err
	}
	var out []*backend.Snapshot
	size := 0
	for _, snap := range all {
		if g, n, ok := d.groupMember(snap); ok && g == group {
			out = append(out, snap)
			size = max(size, n)
		}
	}
	slices.SortFunc(out, func(a, b *backend.Snapshot) int { return strings.Compare(a.SourceVolumeID, b.SourceVolumeID) })
	return out, size, nil
}

// csiSnapshot is a snapshot as CSI reports it, with its group for a group's
// member: members are deleted with their group only, which the group id
// tells the CO.
func (d *Driver) csiSnapshot(snap *backend.Snapshot) *csi.Snapshot {
	out := csiSnapshot(snap)
	if group, _, ok := d.groupMember(snap); ok {
		out.GroupSnapshotId = group.String()
	}
	return out
}

// csiGroup answers for a group from its members: ready when every member
// is there and ready, made when its first member was.
func csiGroup(group volumeid.ID, members []*backend.Snapshot, size int) *csi.VolumeGroupSnapshot {
	out := &csi.VolumeGroupSnapshot{GroupSnapshotId: group.String(), ReadyToUse: len(members) == size}
	var made time.Time
	for _, m := range members {
		snap := csiSnapshot(m)
		snap.GroupSnapshotId = group.String()
		out.Snapshots = append(out.Snapshots, snap)
		out.ReadyToUse = out.ReadyToUse && snap.ReadyToUse
		if made.IsZero() || m.CreatedAt.Before(made) {
			made = m.CreatedAt
		}
	}
	out.CreationTime = timestamppb.New(made)
	return out
}

// groupSources checks a request's source volumes: at least one, each a
// volume id once, all of one backend and zone (the spec's "cannot snapshot
// these volumes together": FAILED_PRECONDITION). It returns them sorted.
func groupSources(raw []string) ([]volumeid.ID, error) {
	if len(raw) == 0 {
		return nil, status.Error(codes.InvalidArgument, "source volume ids are required")
	}
	ids := make([]volumeid.ID, 0, len(raw))
	for _, r := range raw {
		id, err := volumeid.ParseKind(r, volumeid.Volume)
		if err != nil {
			return nil, status.Errorf(codes.NotFound, "source volume %q does not exist: %v", r, err)
		}
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b volumeid.ID) int { return strings.Compare(a.String(), b.String()) })
	for i, id := range ids {
		if i > 0 && id == ids[i-1] {
			return nil, status.Errorf(codes.InvalidArgument, "source volume %s is named twice", id)
		}
		if id.Backend != ids[0].Backend || id.Zone != ids[0].Zone {
			return nil, status.Errorf(codes.FailedPrecondition,
				"a group snapshot takes volumes of one backend and zone: %s is %s in zone %q, %s is %s in zone %q",
				ids[0], ids[0].Backend, ids[0].Zone, id, id.Backend, id.Zone)
		}
	}
	return ids, nil
}

// groupDeletionPolicyParam is accepted in a group snapshot's parameters and
// ignored: Kubernetes' e2e framework (test/e2e/storage/utils,
// GenerateVolumeGroupSnapshotClassSpec, v1.35) makes its
// VolumeGroupSnapshotClasses with the class's deletionPolicy copied into
// their parameters too, which csi-snapshotter passes on. What the policy
// asks, deleting or keeping a group with its VolumeGroupSnapshot, Kubernetes
// does; only a value that is no policy is refused.
const groupDeletionPolicyParam = "deletionPolicy"

func (s *groupControllerServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	for k, v := range req.GetParameters() {
		if k == groupDeletionPolicyParam {
			if v != "Delete" && v != "Retain" {
				return nil, status.Errorf(codes.InvalidArgument,
					"group snapshot parameter %s is %q; a class's deletion policy is Delete or Retain", k, v)
			}
			continue
		}
		if !strings.HasPrefix(k, kubernetesParamPrefix) {
			return nil, status.Errorf(codes.InvalidArgument,
				"group snapshot parameter %q is not known; group snapshots accept only keys starting with %q and %s", k, kubernetesParamPrefix, groupDeletionPolicyParam)
		}
	}
	sources, err := groupSources(req.GetSourceVolumeIds())
	if err != nil {
		return nil, err
	}
	ctrl, err := s.d.controllerFor(sources[0])
	if err != nil {
		return nil, err
	}
	group, err := volumeid.New(sources[0].Backend, sources[0].Zone, volumeid.GroupSnapshot,
		volumeid.KeyFor(s.d.cfg.DriverName, volumeid.GroupSnapshot, req.GetName()))
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	keys := []string{"group snapshot name " + req.GetName(), "group snapshot " + group.String()}
	for _, src := range sources {
		keys = append(keys, src.String())
	}
	release, err := s.d.locks.acquire(keys...)
	if err != nil {
		return nil, err
	}
	defer release()

	existing, size, err := s.d.groupMembers(ctx, ctrl, group)
	if err != nil {
		return nil, err
	}
	if len(existing) > 0 {
		same := size == len(sources)
		for _, m := range existing {
			same = same && slices.ContainsFunc(sources, func(id volumeid.ID) bool { return id.String() == m.SourceVolumeID })
		}
		if !same {
			return nil, status.Errorf(codes.AlreadyExists,
				"a group snapshot named %q already exists (%s) of other volumes (%d members)", req.GetName(), group, size)
		}
		if len(existing) == size {
			return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: csiGroup(group, s.waitMembers(ctx, ctrl, existing), size)}, nil
		}
		// Interrupted: the members there are of an earlier moment than
		// the ones still to take. Made again, all at once.
		for _, m := range existing {
			if err := ctrl.DeleteSnapshot(ctx, mustParse(m.ID)); err != nil {
				return nil, status.Errorf(status.Code(err), "removing member %s of the interrupted group snapshot %s: %v", m.ID, group, err)
			}
		}
	}

	want := make([]backend.GroupMember, 0, len(sources))
	for _, src := range sources {
		want = append(want, backend.GroupMember{ID: s.d.memberID(group, src), Name: memberName(group, len(sources), src), Source: src})
	}
	// The backend takes them all at one instant, or one after the other
	// where at most one is being written; on error none is left, since no
	// group id reaches the CO (the spec asks it).
	members, err := ctrl.CreateSnapshotGroup(ctx, want)
	if err != nil {
		return nil, status.Errorf(status.Code(err), "group snapshot %s: %v", group, status.Convert(err).Message())
	}
	out := csiGroup(group, members, len(sources))
	klog.InfoS("Group snapshot created", "groupSnapshotID", group, "name", req.GetName(), "members", len(members), "readyToUse", out.GetReadyToUse())
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: out}, nil
}

// waitMembers refreshes members still being copied, so a retry reports them
// ready once they are.
func (s *groupControllerServer) waitMembers(ctx context.Context, ctrl backend.Controller, members []*backend.Snapshot) []*backend.Snapshot {
	out := make([]*backend.Snapshot, 0, len(members))
	for _, m := range members {
		if m.Cutting {
			if now, err := ctrl.Snapshot(ctx, mustParse(m.ID)); err == nil {
				m = now
			}
		}
		out = append(out, m)
	}
	return out
}

// groupOf parses a group snapshot id and finds its backend; a malformed id
// is reported as not found.
func (s *groupControllerServer) groupOf(raw string) (volumeid.ID, backend.Controller, error) {
	if raw == "" {
		return volumeid.ID{}, nil, status.Error(codes.InvalidArgument, "group snapshot id is required")
	}
	group, err := volumeid.ParseKind(raw, volumeid.GroupSnapshot)
	if err != nil {
		return volumeid.ID{}, nil, status.Errorf(codes.NotFound, "group snapshot %q does not exist: %v", raw, err)
	}
	ctrl, err := s.d.controllerFor(group)
	if err != nil {
		return volumeid.ID{}, nil, err
	}
	return group, ctrl, nil
}

func (s *groupControllerServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	group, ctrl, err := s.groupOf(req.GetGroupSnapshotId())
	if err != nil {
		return nil, err
	}
	members, size, err := s.d.groupMembers(ctx, ctrl, group)
	if err != nil {
		return nil, err
	}
	if len(members) == 0 {
		return nil, status.Errorf(codes.NotFound, "group snapshot %s does not exist", group)
	}
	if err := checkGroupSnapshotIDs(ctx, ctrl, group, members, req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: csiGroup(group, members, size)}, nil
}

func (s *groupControllerServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	group, ctrl, err := s.groupOf(req.GetGroupSnapshotId())
	if status.Code(err) == codes.NotFound {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil // no such group: deleted
	}
	if err != nil {
		return nil, err
	}
	release, err := s.d.locks.acquire("group snapshot " + group.String())
	if err != nil {
		return nil, err
	}
	defer release()
	members, _, err := s.d.groupMembers(ctx, ctrl, group)
	if err != nil {
		return nil, err
	}
	if err := checkGroupSnapshotIDs(ctx, ctrl, group, members, req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	for _, m := range members {
		if err := ctrl.DeleteSnapshot(ctx, mustParse(m.ID)); err != nil {
			return nil, err
		}
	}
	klog.InfoS("Group snapshot deleted", "groupSnapshotID", group, "members", len(members))
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}

// checkGroupSnapshotIDs compares the snapshot ids a CO says make up a group
// with its members: an id of another snapshot that exists is a mismatch
// (INVALID_ARGUMENT); an id no snapshot has any more is a member deleted
// already.
func checkGroupSnapshotIDs(ctx context.Context, ctrl backend.Controller, group volumeid.ID, members []*backend.Snapshot, given []string) error {
	for _, raw := range given {
		if slices.ContainsFunc(members, func(m *backend.Snapshot) bool { return m.ID == raw }) {
			continue
		}
		id, err := volumeid.ParseKind(raw, volumeid.Snapshot)
		if err != nil {
			return status.Errorf(codes.InvalidArgument, "snapshot id %q: %v", raw, err)
		}
		if id.Backend != group.Backend || id.Zone != group.Zone {
			return status.Errorf(codes.InvalidArgument, "snapshot %s is not a member of group snapshot %s (another backend or zone)", raw, group)
		}
		_, err = ctrl.Snapshot(ctx, id)
		switch status.Code(err) {
		case codes.NotFound:
			continue // a member deleted already
		case codes.OK:
			return status.Errorf(codes.InvalidArgument, "snapshot %s is not a member of group snapshot %s", raw, group)
		default:
			return err
		}
	}
	return nil
}
