package driver

// The Node service: stage, publish, unpublish, unstage, expand and stats
// on this node, with the workload holders (the on-node lock files) that
// decide which workloads may hold a volume, kept in package nodestate and
// checked against the mount table before they are trusted.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/nodestate"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Volume context keys Kubernetes sets when the CSIDriver has podInfoOnMount.
const (
	podNameKey      = "csi.storage.k8s.io/pod.name"
	podNamespaceKey = "csi.storage.k8s.io/pod.namespace"
	podUIDKey       = "csi.storage.k8s.io/pod.uid"
)

// statsTimeout bounds NodeGetVolumeStats on a filesystem that does not
// answer (a network mount whose server is gone).
const statsTimeout = 10 * time.Second

type nodeServer struct {
	csi.UnimplementedNodeServer
	d *Driver
}

func (s *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: s.d.nodeCapabilities()}, nil
}

func (s *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:            s.d.node.String(),
		MaxVolumesPerNode: s.d.cfg.MaxVolumesPerNode,
		// The zone alone: volumes live in a zone's pool, never on one
		// node, so a node key would only split what a CO derives per
		// topology segment (Kubernetes' CSIStorageCapacity objects, one
		// per class and segment, each a GetCapacity per poll) by node.
		AccessibleTopology: &csi.Topology{Segments: map[string]string{
			TopologyZoneKey: s.d.cfg.Zone,
		}},
	}, nil
}

// fingerprint condenses call arguments into one comparable string.
func fingerprint(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

func sortedMap(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		b.WriteString(k + "=" + m[k] + ";")
	}
	return b.String()
}

func mountFlags(c *csi.VolumeCapability) []string {
	return c.GetMount().GetMountFlags()
}

// nodeVolume parses the id and finds the node backend for it.
func (d *Driver) nodeVolume(raw string) (volumeid.ID, backend.Node, error) {
	id, err := volumeid.ParseKind(raw, volumeid.Volume)
	if err != nil {
		return id, nil, status.Errorf(codes.NotFound, "volume %q does not exist: %v", raw, err)
	}
	nb, ok := d.cfg.Nodes[id.Backend]
	if !ok {
		return id, nil, status.Errorf(codes.FailedPrecondition,
			"volume %s uses backend %s, which this node plugin does not serve", id, id.Backend)
	}
	return id, nb, nil
}

// lockRecord takes the volume's operation lock and reads its lock file; the
// caller releases the lock when done with the record.
func (d *Driver) lockRecord(id volumeid.ID) (func(), *nodestate.Record, error) {
	release, err := d.locks.acquire(id.String())
	if err != nil {
		return nil, nil, err
	}
	rec, err := d.state.Load(id)
	if err != nil {
		release()
		return nil, nil, status.Error(codes.Internal, err.Error())
	}
	rec.NodeID = d.node.String()
	return release, rec, nil
}

func publishedReadOnly(ctx map[string]string) bool {
	ro, _ := strconv.ParseBool(ctx[PublishContextReadOnly])
	return ro
}

// publishedCapacity is the volume's size as ControllerPublishVolume
// answered it; 0 when the publish context does not say.
func publishedCapacity(ctx map[string]string) int64 {
	n, err := strconv.ParseInt(ctx[PublishContextCapacity], 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// attachedMode is the mode ControllerPublishVolume attached the volume to
// this node with, as its publish context tells. Without it the node cannot
// know what it may allow, so it allows nothing.
func attachedMode(publishContext map[string]string) (accessmode.Mode, error) {
	raw, ok := publishContext[PublishContextMode]
	if !ok {
		return 0, status.Errorf(codes.FailedPrecondition,
			"the publish context names no attached access mode (key %q); ControllerPublishVolume of this driver must succeed for this node first", PublishContextMode)
	}
	m, err := accessmode.Parse(raw)
	if err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "publish context %s: %v", PublishContextMode, err)
	}
	return m, nil
}

// stageArgs is a NodeStageVolume request, checked.
type stageArgs struct {
	path         string
	accessType   accessmode.AccessType
	fsType       string
	flags        []string
	mode         accessmode.Mode
	attachedMode accessmode.Mode
	readOnly     bool // effective: the mode and the attachment combined
	fingerprint  string
}

func parseStageArgs(req *csi.NodeStageVolumeRequest) (stageArgs, error) {
	var a stageArgs
	if req.GetVolumeId() == "" {
		return a, status.Error(codes.InvalidArgument, "volume id is required")
	}
	a.path = req.GetStagingTargetPath()
	if err := fsutil.CheckCOPath("staging target path", a.path); err != nil {
		return a, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := fsutil.CheckNotSymlink("staging target path", a.path); err != nil {
		return a, status.Error(codes.InvalidArgument, err.Error())
	}
	var err error
	if a.accessType, a.fsType, a.mode, err = parseCapability(req.GetVolumeCapability()); err != nil {
		return a, err
	}
	a.flags = mountFlags(req.GetVolumeCapability())
	a.readOnly = accessmode.EffectiveReadOnly(a.mode, false, publishedReadOnly(req.GetPublishContext()))
	a.fingerprint = fingerprint(a.path, string(a.accessType), a.fsType, strings.Join(a.flags, ","),
		strconv.FormatBool(a.readOnly), accessmode.Name(a.mode))
	return a, nil
}

// NodeStageVolume attaches and mounts the volume once per node. A stage
// already recorded answers the call only if the kernel still holds it; one
// the kernel lost (a reboot, a crash half way through an unstage) is undone
// and made again.
func (s *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	args, err := parseStageArgs(req)
	if err != nil {
		return nil, err
	}
	id, nb, err := s.d.nodeVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if args.attachedMode, err = attachedMode(req.GetPublishContext()); err != nil {
		return nil, err
	}
	release, rec, err := s.d.lockRecord(id)
	if err != nil {
		return nil, err
	}
	defer release()

	// The rule: a node stages a volume only within the mode it is attached with.
	if decision := accessmode.CheckWithinNode(args.attachedMode, "attached", args.mode); !decision.Allowed() {
		return nil, s.d.refuse(metrics.StageStage, id, args.mode, decision)
	}
	if rec.Staged != nil {
		intact, err := s.settleRecordedStage(ctx, id, nb, rec, args)
		if err != nil {
			return nil, err
		}
		if intact {
			return &csi.NodeStageVolumeResponse{}, nil
		}
	}
	if err := s.stage(ctx, id, nb, rec, args, req); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// settleRecordedStage decides what the recorded stage means for a new
// NodeStageVolume: intact and made with the same arguments, it answers the
// call (true); intact with other arguments, or broken, the call is refused;
// gone from the kernel, what is left of it is undone and rec forgets it, so
// the caller stages afresh (false, nil).
func (s *nodeServer) settleRecordedStage(ctx context.Context, id volumeid.ID, nb backend.Node, rec *nodestate.Record, args stageArgs) (bool, error) {
	st := rec.Staged
	check, err := nb.Check(ctx, st)
	if err != nil {
		return false, withContext(err, "checking the recorded stage of volume %s against the kernel", id)
	}
	switch check.State {
	case backend.StageIntact:
		if st.StagingPath == args.path && st.Fingerprint == args.fingerprint {
			return true, nil
		}
		return false, status.Errorf(codes.AlreadyExists,
			"volume %s is already staged on this node at %s with other arguments; unstage it first", id, st.StagingPath)
	case backend.StageBroken:
		return false, status.Errorf(codes.FailedPrecondition,
			"volume %s is recorded as staged at %s, but %s; it is neither used nor staged over as it is: unstage it first", id, st.StagingPath, check.Detail)
	}
	pruned, _, err := nodestate.DropUnmounted(rec, s.d.isMounted)
	if err != nil {
		return false, status.Error(codes.Internal, err.Error())
	}
	if len(pruned.Holders) > 0 {
		return false, status.Errorf(codes.FailedPrecondition,
			"volume %s is still published at %s, but its stage at %s is gone (%s); unpublish it first", id, pruned.Holders[0].TargetPath, st.StagingPath, check.Detail)
	}
	klog.InfoS("The recorded stage is gone from the kernel; staging the volume again", "volumeID", id,
		"stagingPath", st.StagingPath, "device", st.Device, "detail", check.Detail)
	if err := nb.Unstage(ctx, st); err != nil {
		return false, withContext(err, "undoing what is left of the lost stage of volume %s", id)
	}
	s.d.releaseDropped(ctx, rec, pruned)
	rec.Staged, rec.Holders = nil, nil
	if err := s.d.state.Save(id, rec); err != nil {
		return false, status.Errorf(codes.Internal, "forgetting the lost stage of %s: %v", id, err)
	}
	return false, nil
}

// stage makes a new stage and records it. The stage is recorded as begun
// before anything is attached or mounted: a crash from there on leaves a
// record saying so, and the retry (or an unstage) cleans up what it left.
func (s *nodeServer) stage(ctx context.Context, id volumeid.ID, nb backend.Node, rec *nodestate.Record, args stageArgs, req *csi.NodeStageVolumeRequest) error {
	interrupted := rec.StagePending != ""
	rec.StagePending = args.path
	if err := s.d.state.Save(id, rec); err != nil {
		return status.Errorf(codes.Internal, "recording the stage of %s as begun: %v", id, err)
	}
	staged, err := nb.Stage(ctx, backend.StageRequest{
		VolumeID: id, Node: s.d.node, StagingPath: args.path,
		AccessType: args.accessType, FsType: args.fsType, MountFlags: args.flags, Mode: args.mode, ReadOnly: args.readOnly,
		AttachedReadOnly: publishedReadOnly(req.GetPublishContext()), CapacityBytes: publishedCapacity(req.GetPublishContext()),
		PublishContext: req.GetPublishContext(), VolumeContext: req.GetVolumeContext(),
		Recover: interrupted,
	})
	if err != nil {
		// The backend undid its part of a failed stage.
		rec.StagePending = ""
		if serr := s.d.state.Save(id, rec); serr != nil {
			klog.ErrorS(serr, "Clearing the record of a failed stage", "volumeID", id)
		}
		return err
	}
	fpStageBackendDone.Hit()
	staged.Fingerprint = args.fingerprint
	staged.Mode = args.mode
	staged.Since = time.Now().UTC()
	rec.Staged = staged
	rec.StagePending = ""
	if err := s.d.state.Save(id, rec); err != nil {
		if uerr := nb.Unstage(ctx, staged); uerr != nil {
			klog.ErrorS(uerr, "Undoing a stage whose record could not be written", "volumeID", id)
		}
		return status.Errorf(codes.Internal, "recording the stage of %s: %v", id, err)
	}
	fpStageRecorded.Hit()
	klog.InfoS("Volume staged", "volumeID", id, "stagingPath", staged.StagingPath, "device", staged.Device,
		"readOnly", staged.ReadOnly, "mode", accessmode.Name(args.mode))
	return nil
}

// withContext prefixes an error's message, keeping its gRPC code (Internal
// for an error that carries none).
func withContext(err error, format string, a ...any) error {
	st, ok := status.FromError(err)
	if !ok {
		return status.Errorf(codes.Internal, "%s: %v", fmt.Sprintf(format, a...), err)
	}
	return status.Errorf(st.Code(), "%s: %s", fmt.Sprintf(format, a...), st.Message())
}

func (s *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	path := req.GetStagingTargetPath()
	if err := fsutil.CheckCOPath("staging target path", path); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	id, nb, err := s.d.nodeVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	release, rec, err := s.d.lockRecord(id)
	if err != nil {
		return nil, err
	}
	defer release()
	switch {
	case rec.Staged == nil && rec.StagePending != "":
		// A stage was interrupted and never retried: undo what it may have
		// done. The device is unknown, which tells the backend to look for
		// one bound to the volume that nothing uses.
		if err := nb.Unstage(ctx, &backend.Staged{VolumeID: id.String(), StagingPath: rec.StagePending, AccessType: accessmode.Mount}); err != nil {
			return nil, err
		}
		rec.StagePending = ""
		if err := s.d.state.Save(id, rec); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		klog.InfoS("Cleaned up after an interrupted stage", "volumeID", id, "stagingPath", path)
		return &csi.NodeUnstageVolumeResponse{}, nil
	case rec.Staged == nil:
		// Nothing recorded; but the kernel may still hold the volume there
		// (state lost or restored from elsewhere), and success would then
		// be a lie.
		if err := s.unstageUnrecorded(ctx, id, nb, path); err != nil {
			return nil, err
		}
		return &csi.NodeUnstageVolumeResponse{}, nil
	case rec.Staged.StagingPath != path:
		// The spec: NOT_FOUND means the volume does not exist; a volume
		// not staged at this path is unstaged from it already. The
		// recorded stage elsewhere stays; a mount of this volume the
		// kernel still holds at this path (a record that forgot it) goes,
		// but never a workload's: that is NodeUnpublishVolume's.
		if _, held := rec.Holder(path); held {
			return nil, status.Errorf(codes.FailedPrecondition,
				"%s is where volume %s is published to a workload, not a staging path (it is staged at %s); unpublish it there",
				path, id, rec.Staged.StagingPath)
		}
		if err := s.unstageUnrecorded(ctx, id, nb, path); err != nil {
			return nil, err
		}
		klog.V(2).InfoS("Unstage at a path the volume is not staged at; its stage stays", "volumeID", id,
			"stagingPath", path, "stagedAt", rec.Staged.StagingPath)
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if pruned, _, err := nodestate.DropUnmounted(rec, s.d.isMounted); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	} else if len(pruned.Holders) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is still published at %s; unpublish it first", id, pruned.Holders[0].TargetPath)
	}
	if err := nb.Unstage(ctx, rec.Staged); err != nil {
		return nil, err
	}
	fpUnstageBackendDone.Hit()
	if err := s.d.state.Save(id, &nodestate.Record{}); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	klog.InfoS("Volume unstaged", "volumeID", id, "stagingPath", path)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// unstageUnrecorded undoes a stage of the volume at path that the node
// state does not know of, if the mount table shows one.
func (s *nodeServer) unstageUnrecorded(ctx context.Context, id volumeid.ID, nb backend.Node, path string) error {
	m, err := s.d.mountAt(path)
	if err != nil {
		return status.Errorf(codes.Internal, "checking what is mounted at %s: %v", path, err)
	}
	if m == nil {
		return nil
	}
	ours, err := nb.Owns(ctx, id, m)
	if err != nil {
		return withContext(err, "checking what is mounted at %s", path)
	}
	if !ours {
		return nil // not this volume: not ours to remove
	}
	klog.InfoS("Unstaging a mount of the volume the node state did not record", "volumeID", id, "stagingPath", path, "source", m.Source)
	return nb.Unstage(ctx, &backend.Staged{VolumeID: id.String(), StagingPath: path, AccessType: accessmode.Mount})
}

// Steps a test can kill the node plugin at (package faultpoint).
var (
	fpStageBackendDone      = faultpoint.New("node.stage.backend-staged")
	fpStageRecorded         = faultpoint.New("node.stage.recorded")
	fpPublishHolderRecorded = faultpoint.New("node.publish.holder-recorded")
	fpPublishMounted        = faultpoint.New("node.publish.mounted")
	fpUnpublishUnmounted    = faultpoint.New("node.unpublish.unmounted")
	fpUnstageBackendDone    = faultpoint.New("node.unstage.backend-unstaged")
)

func workloadOf(volumeContext map[string]string) accessmode.Workload {
	return accessmode.Workload{
		Name:      volumeContext[podNameKey],
		Namespace: volumeContext[podNamespaceKey],
		UID:       volumeContext[podUIDKey],
	}
}

// publishArgs is a NodePublishVolume request, checked.
type publishArgs struct {
	target, stagingPath string
	accessType          accessmode.AccessType
	fsType              string
	mode                accessmode.Mode
	attachedMode        accessmode.Mode
	requestedReadOnly   bool
	attachedReadOnly    bool
	fingerprint         string
	workload            accessmode.Workload
}

func parsePublishArgs(req *csi.NodePublishVolumeRequest) (publishArgs, error) {
	var a publishArgs
	if req.GetVolumeId() == "" {
		return a, status.Error(codes.InvalidArgument, "volume id is required")
	}
	a.target, a.stagingPath = req.GetTargetPath(), req.GetStagingTargetPath()
	if err := fsutil.CheckCOPath("target path", a.target); err != nil {
		return a, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := fsutil.CheckCOPath("staging target path", a.stagingPath); err != nil {
		return a, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := fsutil.CheckNotSymlink("target path", a.target); err != nil {
		return a, status.Error(codes.InvalidArgument, err.Error())
	}
	var err error
	if a.accessType, a.fsType, a.mode, err = parseCapability(req.GetVolumeCapability()); err != nil {
		return a, err
	}
	a.requestedReadOnly = req.GetReadonly()
	a.attachedReadOnly = publishedReadOnly(req.GetPublishContext())
	a.fingerprint = fingerprint(a.stagingPath, string(a.accessType), a.fsType,
		strings.Join(mountFlags(req.GetVolumeCapability()), ","), accessmode.Name(a.mode),
		strconv.FormatBool(a.requestedReadOnly), sortedMap(req.GetPublishContext()), sortedMap(req.GetVolumeContext()))
	a.workload = workloadOf(req.GetVolumeContext())
	return a, nil
}

// holder is the lock-file entry this publish asks for.
func (a publishArgs) holder(staged *backend.Staged) accessmode.Holder {
	return accessmode.Holder{
		TargetPath:  a.target,
		Mode:        a.mode,
		ReadOnly:    accessmode.EffectiveReadOnly(a.mode, a.requestedReadOnly, a.attachedReadOnly || staged.ReadOnly),
		Fingerprint: a.fingerprint,
		Workload:    a.workload,
		Since:       time.Now().UTC(),
	}
}

// NodePublishVolume makes the staged volume visible at one workload's
// target path, if the access-mode rules let one more workload on this node
// hold it.
func (s *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	args, err := parsePublishArgs(req)
	if err != nil {
		return nil, err
	}
	id, nb, err := s.d.nodeVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if args.attachedMode, err = attachedMode(req.GetPublishContext()); err != nil {
		return nil, err
	}
	release, rec, err := s.d.lockRecord(id)
	if err != nil {
		return nil, err
	}
	defer release()
	staged, err := s.intactStage(ctx, id, nb, rec, args)
	if err != nil {
		return nil, err
	}
	if rec, err = s.dropGoneHolders(ctx, id, rec, args.target); err != nil {
		return nil, err
	}
	want := args.holder(staged)

	stagedMode := staged.Mode
	if stagedMode == 0 {
		stagedMode = args.attachedMode // a stage recorded before stages kept their mode
	}
	// The rule: within the modes the volume was attached and staged with,
	// and the spec's table for the workloads already holding it here.
	decision := accessmode.CheckNodePublish(args.attachedMode, stagedMode, rec.Holders, want)
	if !decision.Allowed() {
		return nil, s.d.refuse(metrics.StagePublish, id, args.mode, decision, "targetPath", want.TargetPath, "workload", want.Workload.String())
	}
	if decision.Idempotent {
		prev, _ := rec.Holder(want.TargetPath)
		done, err := s.publishedAlready(staged, prev)
		if err != nil {
			return nil, err
		}
		if done {
			return &csi.NodePublishVolumeResponse{}, nil
		}
	}
	if err := s.publish(ctx, id, nb, staged, rec, want); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// intactStage returns the stage record at the request's staging path once
// the kernel confirms it: publishing a stage the kernel lost would bind an
// empty directory, or a device that now belongs to another volume, into
// the workload.
func (s *nodeServer) intactStage(ctx context.Context, id volumeid.ID, nb backend.Node, rec *nodestate.Record, args publishArgs) (*backend.Staged, error) {
	staged := rec.Staged
	if staged == nil || staged.StagingPath != args.stagingPath {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is not staged at %s on this node; NodeStageVolume must succeed first", id, args.stagingPath)
	}
	if args.accessType != staged.AccessType {
		return nil, status.Errorf(codes.InvalidArgument,
			"volume %s is staged with access type %s, not %s", id, staged.AccessType, args.accessType)
	}
	check, err := nb.Check(ctx, staged)
	if err != nil {
		return nil, withContext(err, "checking the stage of volume %s against the kernel", id)
	}
	if check.State != backend.StageIntact {
		return nil, status.Errorf(codes.FailedPrecondition,
			"the stage of volume %s at %s is not what the kernel holds (%s); NodeStageVolume must run again", id, staged.StagingPath, check.Detail)
	}
	return staged, nil
}

// dropGoneHolders drops the holders whose mounts the mount table shows
// gone (target, the path being published, stays: its publish is a retry),
// releasing their own devices before a new device is named: a device
// recorded but never bound (a crash in between) could otherwise be named
// again, bound, and then released as the dropped one's. A mount that
// cannot be checked keeps its holder, and the call is refused.
func (s *nodeServer) dropGoneHolders(ctx context.Context, id volumeid.ID, rec *nodestate.Record, target string) (*nodestate.Record, error) {
	pruned, dropped, err := nodestate.DropUnmounted(rec, func(p string) (bool, error) {
		if p == target {
			return true, nil
		}
		return s.d.isMounted(p)
	})
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if !dropped {
		return rec, nil
	}
	s.d.releaseDropped(ctx, rec, pruned)
	if err := s.d.state.Save(id, pruned); err != nil {
		return nil, status.Errorf(codes.Internal, "dropping the holders of %s whose mounts are gone: %v", id, err)
	}
	return pruned, nil
}

// publishedAlready checks a repeated publish against the mount table: the
// target must show the staged volume (its staging mount's filesystem, or
// for raw block the device recorded for it). Nothing mounted there means
// the mount is made again (false); anything else is refused.
func (s *nodeServer) publishedAlready(staged *backend.Staged, h accessmode.Holder) (bool, error) {
	m, err := s.d.mountAt(h.TargetPath)
	if err != nil {
		return false, status.Errorf(codes.Internal, "checking what is mounted at %s: %v", h.TargetPath, err)
	}
	if m == nil {
		return false, nil
	}
	same := false
	if staged.AccessType == accessmode.Block {
		dev := staged.Device
		if h.Device != "" {
			dev = h.Device
		}
		same = mounts.IsDeviceNodeBind(m, filepath.Base(dev))
	} else {
		sm, err := s.d.mountAt(staged.StagingPath)
		if err != nil {
			return false, status.Errorf(codes.Internal, "checking what is mounted at %s: %v", staged.StagingPath, err)
		}
		same = sm != nil && sm.Major == m.Major && sm.Minor == m.Minor && sm.Root == m.Root
	}
	if !same {
		return false, status.Errorf(codes.FailedPrecondition,
			"target path %s holds %s (%s), not volume %s; unpublish it first", h.TargetPath, m.Source, m.FSType, staged.VolumeID)
	}
	return true, nil
}

// publish records the holder and makes the mount. The holder is recorded
// before the mount is made: a crash in between leaves a holder without a
// mount, which is dropped once the mount table shows it, and never a mount
// nobody accounts for.
func (s *nodeServer) publish(ctx context.Context, id volumeid.ID, nb backend.Node, staged *backend.Staged, rec *nodestate.Record, want accessmode.Holder) error {
	if prev, ok := rec.Holder(want.TargetPath); ok && prev.Device != "" {
		// A publish interrupted after its device was made: start afresh.
		s.d.releaseHolderDevice(ctx, id.String(), prev)
	}
	if staged.AccessType == accessmode.Block && want.ReadOnly && !staged.ReadOnly {
		// The kernel ignores the read-only flag of a bind mount of a device
		// node: a read-only publish of a device staged read/write needs a
		// device that is itself read-only.
		if err := s.readOnlyDevice(ctx, id, nb, staged, rec, &want); err != nil {
			return err
		}
	} else {
		if err := s.d.state.Save(id, rec.WithHolder(want)); err != nil {
			return status.Errorf(codes.Internal, "recording the holder of %s: %v", id, err)
		}
		fpPublishHolderRecorded.Hit()
	}
	if err := s.bindMount(staged, want.TargetPath, want.ReadOnly, want.Device); err != nil {
		s.d.releaseHolderDevice(ctx, id.String(), want)
		if serr := s.d.state.Save(id, rec.WithoutHolder(want.TargetPath)); serr != nil {
			klog.ErrorS(serr, "Removing the holder of a failed publish", "volumeID", id)
		}
		return err
	}
	fpPublishMounted.Hit()
	klog.InfoS("Volume published", "volumeID", id, "targetPath", want.TargetPath, "workload", want.Workload.String(),
		"mode", accessmode.Name(want.Mode), "readOnly", want.ReadOnly)
	return nil
}

// readOnlyDevice gives want a read-only device of its own. The device is
// named and recorded with the holder before anything is bound to it, so a
// crash at any point leaves a holder that names its device, which dropping
// the holder releases (a device never bound, or bound to another image
// since, is left alone). Another process may take the named device before
// it is bound; then the next free one is tried.
func (s *nodeServer) readOnlyDevice(ctx context.Context, id volumeid.ID, nb backend.Node, staged *backend.Staged, rec *nodestate.Record, want *accessmode.Holder) error {
	rd := nb.ReadOnlyDevices()
	if rd == nil {
		return status.Errorf(codes.FailedPrecondition,
			"volume %s is staged read/write and its backend cannot make a read-only device for a read-only publish", id)
	}
	var lastErr error
	for range 5 {
		dev, err := rd.FreeDevice(ctx)
		if err != nil {
			return err
		}
		want.Device = dev
		if err := s.d.state.Save(id, rec.WithHolder(*want)); err != nil {
			return status.Errorf(codes.Internal, "recording the holder of %s: %v", id, err)
		}
		fpPublishHolderRecorded.Hit()
		if lastErr = rd.ReadOnlyDevice(ctx, staged, dev); lastErr == nil {
			return nil
		}
	}
	want.Device = ""
	if err := s.d.state.Save(id, rec.WithoutHolder(want.TargetPath)); err != nil {
		klog.ErrorS(err, "Removing the holder of a failed publish", "volumeID", id)
	}
	return lastErr
}

// bindMount makes the staged volume visible at target: the staging mount for
// a filesystem, the device for raw block.
func (s *nodeServer) bindMount(staged *backend.Staged, target string, readOnly bool, device string) error {
	source := staged.StagingPath
	if staged.AccessType == accessmode.Block {
		source = staged.Device
		if device != "" {
			source = device
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return status.Errorf(codes.Internal, "creating the parent of %s: %v", target, err)
		}
		f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY, 0o640)
		if err != nil {
			return status.Errorf(codes.Internal, "creating the target file %s: %v", target, err)
		}
		f.Close()
	} else if err := os.MkdirAll(target, 0o750); err != nil {
		return status.Errorf(codes.Internal, "creating the target directory %s: %v", target, err)
	}
	if err := s.d.mounter().Bind(source, target, readOnly); err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	return nil
}

// unmountAll removes every mount stacked at p and then p itself; the
// Mounter never follows a symbolic link put at p.
func (d *Driver) unmountAll(p string) error {
	for i := 0; ; i++ {
		mounted, err := d.isMounted(p)
		if err != nil {
			return err
		}
		if !mounted {
			break
		}
		if i == 16 {
			return fmt.Errorf("%s is still mounted after 16 unmounts", p)
		}
		if err := d.mounter().Unmount(p); err != nil {
			return err
		}
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

func (s *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	target := req.GetTargetPath()
	if err := fsutil.CheckCOPath("target path", target); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	id, nb, err := s.d.nodeVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	release, rec, err := s.d.lockRecord(id)
	if err != nil {
		return nil, err
	}
	defer release()
	h, held := rec.Holder(target)
	if !held {
		// Nothing recorded there; but if the kernel shows this volume
		// mounted there, success would be a lie. A mount of something
		// else is not ours to remove.
		m, err := s.d.mountAt(target)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "checking what is mounted at %s: %v", target, err)
		}
		if m == nil {
			return &csi.NodeUnpublishVolumeResponse{}, nil
		}
		if ours, err := nb.Owns(ctx, id, m); err != nil {
			return nil, withContext(err, "checking what is mounted at %s", target)
		} else if !ours {
			return &csi.NodeUnpublishVolumeResponse{}, nil
		}
		klog.InfoS("Unmounting a mount of the volume the node state had no holder for", "volumeID", id, "targetPath", target)
	}
	// A device of the holder's own goes first: a bind mount of a device
	// node does not keep the device, and a crash after this leaves a
	// holder whose device is gone, which a retry handles.
	s.d.releaseHolderDevice(ctx, id.String(), h)
	if err := s.d.unmountAll(target); err != nil {
		return nil, status.Errorf(codes.Internal, "unmounting %s: %v", target, err)
	}
	fpUnpublishUnmounted.Hit()
	if held {
		if err := s.d.state.Save(id, rec.WithoutHolder(target)); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	klog.InfoS("Volume unpublished", "volumeID", id, "targetPath", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// stagedAt finds the volume's stage record and checks that path is its
// staging path or one of its target paths.
func (s *nodeServer) stagedAt(raw, path string) (volumeid.ID, backend.Node, *nodestate.Record, error) {
	id, nb, err := s.d.nodeVolume(raw)
	if err != nil {
		return id, nil, nil, err
	}
	rec, err := s.d.state.Load(id)
	if err != nil {
		return id, nil, nil, status.Error(codes.Internal, err.Error())
	}
	if rec.Staged == nil {
		return id, nil, nil, status.Errorf(codes.NotFound, "volume %s is not staged on this node", id)
	}
	if _, held := rec.Holder(path); path != rec.Staged.StagingPath && !held {
		return id, nil, nil, status.Errorf(codes.NotFound, "volume %s is neither staged nor published at %s", id, path)
	}
	return id, nb, rec, nil
}

// refreshHolderDevices gives the read-only devices of the read-only
// publishes of a raw block stage (readOnlyDevice) the volume's new size:
// they are readers of the same image as the staged device, and see only
// what their own device shows.
func (s *nodeServer) refreshHolderDevices(ctx context.Context, id volumeid.ID, nb backend.Node, rec *nodestate.Record) error {
	rd := nb.ReadOnlyDevices()
	if rd == nil {
		return nil
	}
	for _, h := range rec.Holders {
		if h.Device == "" {
			continue
		}
		refreshed, err := rd.RefreshDevice(ctx, id, h.Device)
		if err != nil {
			return withContext(err, "refreshing the read-only device of the publish at %s", h.TargetPath)
		}
		if !refreshed {
			klog.InfoS("Left alone a publish's device that is no longer the volume's", "volumeID", id,
				"targetPath", h.TargetPath, "device", h.Device)
		}
	}
	return nil
}

func deviceSize(dev string) (int64, error) {
	f, err := os.Open(dev)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return f.Seek(0, io.SeekEnd)
}

func (s *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path is required")
	}
	// The path is only compared with the paths this node recorded, never
	// opened before it matched one, so any string is safe here.
	_, _, rec, err := s.stagedAt(req.GetVolumeId(), req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	if rec.Staged.AccessType == accessmode.Block {
		if _, err := os.Stat(req.GetVolumePath()); err != nil {
			return nil, status.Errorf(codes.NotFound, "volume path %s: %v", req.GetVolumePath(), err)
		}
		size, err := deviceSize(rec.Staged.Device)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "reading the size of %s: %v", rec.Staged.Device, err)
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
	}
	// No stat before it: on a mount whose NFS server is gone a stat blocks
	// as long as statfs does, and only StatfsWithin keeps that bounded.
	st, err := fsutil.StatfsWithin(req.GetVolumePath(), statsTimeout)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, status.Errorf(codes.NotFound, "volume path %s: %v", req.GetVolumePath(), err)
	case errors.Is(err, fsutil.ErrNoAnswer):
		return nil, status.Errorf(codes.Unavailable, "volume path %s is unreachable: %v", req.GetVolumePath(), err)
	case err != nil:
		return nil, status.Errorf(codes.Internal, "statfs %s: %v", req.GetVolumePath(), err)
	}
	bs := int64(st.Bsize)
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(st.Blocks) * bs, Available: int64(st.Bavail) * bs,
			Used: int64(st.Blocks-st.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree),
			Used: int64(st.Files - st.Ffree)},
	}}, nil
}

func (s *nodeServer) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	id, nb, err := s.d.nodeVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	rec, err := s.d.state.Load(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if rec.Staged == nil {
		return nil, status.Errorf(codes.NotFound, "volume %s is not staged on this node", id)
	}
	h := nb.Health(ctx, rec.Staged)
	if p := req.GetVolumePublishPath(); !h.Abnormal && p != "" {
		if _, held := rec.Holder(p); held {
			switch mounted, err := s.d.isMounted(p); {
			case err != nil:
				h = backend.Health{Abnormal: true, Reason: "MountTableUnreadable", Message: err.Error()}
			case !mounted:
				h = backend.Health{Abnormal: true, Reason: "TargetNotMounted",
					Message: "the volume is no longer mounted at " + p}
			}
		}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: volumeHealth(id.String(), h)}, nil
}

func (s *nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path is required")
	}
	id, err := volumeid.ParseKind(req.GetVolumeId(), volumeid.Volume)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist: %v", req.GetVolumeId(), err)
	}
	release, err := s.d.locks.acquire(id.String())
	if err != nil {
		return nil, err
	}
	defer release()
	_, nb, rec, err := s.stagedAt(req.GetVolumeId(), req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	// A read-only stage is the backend's to judge: a raw block reader needs
	// its device refreshed like the writer, and only the backend knows
	// whether a read-only filesystem sees the new size (NFS: at once) or
	// cannot (block: FAILED_PRECONDITION, saying when it grows).
	size, err := nb.Expand(ctx, rec.Staged)
	if err != nil {
		return nil, err
	}
	if err := s.refreshHolderDevices(ctx, id, nb, rec); err != nil {
		return nil, err
	}
	if r := req.GetCapacityRange().GetRequiredBytes(); size > 0 && r > 0 && size < r {
		return nil, status.Errorf(codes.OutOfRange,
			"volume %s is %d bytes on this node, less than the %d asked for; expand it in the controller first", id, size, r)
	}
	klog.InfoS("Volume expanded on node", "volumeID", id, "bytes", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}
