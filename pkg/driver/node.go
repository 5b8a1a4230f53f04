package driver

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
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/holders"
	"github.com/modeguard/modeguard/pkg/metrics"
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
		NodeId:            s.d.nodeID,
		MaxVolumesPerNode: s.d.cfg.MaxVolumesPerNode,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{
			TopologyZoneKey: s.d.cfg.Zone,
			TopologyNodeKey: s.d.cfg.NodeName,
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
func (d *Driver) lockRecord(id volumeid.ID) (func(), *holders.Record, error) {
	release, err := d.locks.acquire(id.String())
	if err != nil {
		return nil, nil, err
	}
	rec, err := d.holders.Load(id)
	if err != nil {
		release()
		return nil, nil, status.Error(codes.Internal, err.Error())
	}
	rec.NodeID = d.nodeID
	return release, rec, nil
}

func publishedReadOnly(ctx map[string]string) bool {
	ro, _ := strconv.ParseBool(ctx[PublishContextReadOnly])
	return ro
}

func (s *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if err := fsutil.CheckCOPath("staging target path", req.GetStagingTargetPath()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := fsutil.CheckNotSymlink("staging target path", req.GetStagingTargetPath()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	accessType, fsType, mode, err := parseCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
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
	readOnly := accessmode.EffectiveReadOnly(mode, false, publishedReadOnly(req.GetPublishContext()))
	flags := mountFlags(req.GetVolumeCapability())
	fp := fingerprint(req.GetStagingTargetPath(), string(accessType), fsType, strings.Join(flags, ","),
		strconv.FormatBool(readOnly), accessmode.Name(mode))
	if st := rec.Staged; st != nil {
		if st.StagingPath == req.GetStagingTargetPath() && st.Fingerprint == fp {
			return &csi.NodeStageVolumeResponse{}, nil
		}
		return nil, status.Errorf(codes.AlreadyExists,
			"volume %s is already staged on this node at %s with other arguments; unstage it first", id, st.StagingPath)
	}
	// The stage is recorded as begun before anything is attached or
	// mounted: a crash from here on leaves a record saying so, and the retry
	// (or an unstage) cleans up what the crash left.
	interrupted := rec.StagePending != ""
	rec.StagePending = req.GetStagingTargetPath()
	if err := s.d.holders.Save(id, rec); err != nil {
		return nil, status.Errorf(codes.Internal, "recording the stage of %s as begun: %v", id, err)
	}
	staged, err := nb.Stage(ctx, backend.StageRequest{
		VolumeID: id, NodeID: s.d.nodeID, StagingPath: req.GetStagingTargetPath(),
		AccessType: accessType, FsType: fsType, MountFlags: flags, ReadOnly: readOnly,
		PublishContext: req.GetPublishContext(), VolumeContext: req.GetVolumeContext(),
		Recover: interrupted,
	})
	if err != nil {
		// The backend undid its part of a failed stage.
		rec.StagePending = ""
		if serr := s.d.holders.Save(id, rec); serr != nil {
			klog.ErrorS(serr, "Clearing the record of a failed stage", "volumeID", id)
		}
		return nil, err
	}
	fpStageBackendDone.Hit()
	staged.Fingerprint = fp
	staged.Since = time.Now().UTC()
	rec.Staged = staged
	rec.StagePending = ""
	if err := s.d.holders.Save(id, rec); err != nil {
		if uerr := nb.Unstage(ctx, staged); uerr != nil {
			klog.ErrorS(uerr, "Undoing a stage whose record could not be written", "volumeID", id)
		}
		return nil, status.Errorf(codes.Internal, "recording the stage of %s: %v", id, err)
	}
	fpStageRecorded.Hit()
	klog.InfoS("Volume staged", "volumeID", id, "stagingPath", staged.StagingPath, "device", staged.Device,
		"readOnly", staged.ReadOnly)
	return &csi.NodeStageVolumeResponse{}, nil
}

func (s *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if err := fsutil.CheckCOPath("staging target path", req.GetStagingTargetPath()); err != nil {
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
	if rec.Staged == nil && rec.StagePending != "" {
		// A stage was interrupted and never retried: undo what it may have
		// done. The device is unknown, which tells the backend to look for
		// one bound to the volume that nothing uses.
		if err := nb.Unstage(ctx, &backend.Staged{VolumeID: id.String(), StagingPath: rec.StagePending, AccessType: accessmode.Mount}); err != nil {
			return nil, err
		}
		rec.StagePending = ""
		if err := s.d.holders.Save(id, rec); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		klog.InfoS("Cleaned up after an interrupted stage", "volumeID", id, "stagingPath", req.GetStagingTargetPath())
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if rec.Staged == nil {
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if rec.Staged.StagingPath != req.GetStagingTargetPath() {
		return nil, status.Errorf(codes.NotFound,
			"volume %s is staged at %s, not at %s", id, rec.Staged.StagingPath, req.GetStagingTargetPath())
	}
	if pruned, _ := holders.DropUnmounted(rec, s.d.isMounted); len(pruned.Holders) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is still published at %s; unpublish it first", id, pruned.Holders[0].TargetPath)
	}
	if err := nb.Unstage(ctx, rec.Staged); err != nil {
		return nil, err
	}
	fpUnstageBackendDone.Hit()
	if err := s.d.holders.Save(id, &holders.Record{}); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	klog.InfoS("Volume unstaged", "volumeID", id, "stagingPath", req.GetStagingTargetPath())
	return &csi.NodeUnstageVolumeResponse{}, nil
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

func (s *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if err := fsutil.CheckCOPath("target path", req.GetTargetPath()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := fsutil.CheckCOPath("staging target path", req.GetStagingTargetPath()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := fsutil.CheckNotSymlink("target path", req.GetTargetPath()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	accessType, fsType, mode, err := parseCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
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
	staged := rec.Staged
	if staged == nil || staged.StagingPath != req.GetStagingTargetPath() {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is not staged at %s on this node; NodeStageVolume must succeed first", id, req.GetStagingTargetPath())
	}
	if accessType != staged.AccessType {
		return nil, status.Errorf(codes.InvalidArgument,
			"volume %s is staged with access type %s, not %s", id, staged.AccessType, accessType)
	}
	readOnly := accessmode.EffectiveReadOnly(mode, req.GetReadonly(),
		publishedReadOnly(req.GetPublishContext()) || staged.ReadOnly)
	want := accessmode.Holder{
		TargetPath: req.GetTargetPath(),
		Mode:       mode,
		ReadOnly:   readOnly,
		Fingerprint: fingerprint(req.GetStagingTargetPath(), string(accessType), fsType,
			strings.Join(mountFlags(req.GetVolumeCapability()), ","), accessmode.Name(mode),
			strconv.FormatBool(req.GetReadonly()), sortedMap(req.GetPublishContext()), sortedMap(req.GetVolumeContext())),
		Workload: workloadOf(req.GetVolumeContext()),
		Since:    time.Now().UTC(),
	}
	before := rec
	rec, dropped := holders.DropUnmounted(rec, func(p string) bool { return p == want.TargetPath || s.d.isMounted(p) })
	// Devices of dropped holders go now, before a new device is named: a
	// device recorded but never bound (a crash in between) could otherwise
	// be named again, bound, and then released as the dropped one's.
	s.d.releaseDropped(ctx, before, rec)
	decision := accessmode.CheckPublish(rec.Holders, want)
	if !decision.Allowed() {
		s.d.refused(metrics.StagePublish, mode, decision.Reason)
		if dropped {
			_ = s.d.holders.Save(id, rec)
		}
		klog.InfoS("Publish refused by the access-mode rules", "volumeID", id, "targetPath", want.TargetPath,
			"workload", want.Workload.String(), "mode", accessmode.Name(mode), "code", decision.Code, "reason", decision.Message)
		return nil, status.Errorf(decision.Code, "volume %s: %s", id, decision.Message)
	}
	if decision.Idempotent && s.d.isMounted(want.TargetPath) {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if prev, ok := rec.Holder(want.TargetPath); ok && prev.Device != "" {
		// A publish interrupted after its device was made: start afresh.
		s.d.releaseHolderDevice(ctx, id.String(), prev)
	}
	if staged.AccessType == accessmode.Block && readOnly && !staged.ReadOnly {
		// The kernel ignores the read-only flag of a bind mount of a device
		// node: a read-only publish of a device staged read/write needs a
		// device that is itself read-only.
		if err := s.readOnlyDevice(ctx, id, nb, staged, rec, &want); err != nil {
			return nil, err
		}
	} else if !decision.Idempotent || dropped {
		// The holder is recorded before the mount is made: a crash in
		// between leaves a holder without a mount, which Reconcile drops,
		// and never a mount nobody accounts for.
		if err := s.d.holders.Save(id, rec.WithHolder(want)); err != nil {
			return nil, status.Errorf(codes.Internal, "recording the holder of %s: %v", id, err)
		}
		fpPublishHolderRecorded.Hit()
	}
	if err := s.bindMount(staged, want.TargetPath, readOnly, want.Device); err != nil {
		s.d.releaseHolderDevice(ctx, id.String(), want)
		if serr := s.d.holders.Save(id, rec.WithoutHolder(want.TargetPath)); serr != nil {
			klog.ErrorS(serr, "Removing the holder of a failed publish", "volumeID", id)
		}
		return nil, err
	}
	fpPublishMounted.Hit()
	klog.InfoS("Volume published", "volumeID", id, "targetPath", want.TargetPath, "workload", want.Workload.String(),
		"mode", accessmode.Name(mode), "readOnly", readOnly)
	return &csi.NodePublishVolumeResponse{}, nil
}

// readOnlyDevice gives want a read-only device of its own. The device is
// named and recorded with the holder before anything is bound to it, so a
// crash at any point leaves a holder that names its device, which dropping
// the holder releases (a device never bound, or bound to another image
// since, is left alone). Another process may take the named device before
// it is bound; then the next free one is tried.
func (s *nodeServer) readOnlyDevice(ctx context.Context, id volumeid.ID, nb backend.Node, staged *backend.Staged, rec *holders.Record, want *accessmode.Holder) error {
	rd, ok := nb.(readOnlyDevices)
	if !ok {
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
		if err := s.d.holders.Save(id, rec.WithHolder(*want)); err != nil {
			return status.Errorf(codes.Internal, "recording the holder of %s: %v", id, err)
		}
		fpPublishHolderRecorded.Hit()
		if lastErr = rd.ReadOnlyDevice(ctx, staged, dev); lastErr == nil {
			return nil
		}
	}
	want.Device = ""
	if err := s.d.holders.Save(id, rec.WithoutHolder(want.TargetPath)); err != nil {
		klog.ErrorS(err, "Removing the holder of a failed publish", "volumeID", id)
	}
	return lastErr
}

// bindMount makes the staged volume visible at target: the staging mount for
// a filesystem, the device for raw block. It calls mount(2) itself rather
// than running mount(8): a bind mount needs nothing the command adds (no
// helper, no fstab, no mtab), and the command costs a fork and exec on every
// publish. A read-only bind takes a second call (the kernel ignores
// MS_RDONLY on the first) and is undone if that fails.
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
	if err := unix.Mount(source, target, "", unix.MS_BIND, ""); err != nil {
		return status.Errorf(codes.Internal, "bind-mounting %s at %s: %v", source, target, err)
	}
	if readOnly {
		if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			if uerr := unix.Unmount(target, unix.UMOUNT_NOFOLLOW); uerr != nil {
				klog.ErrorS(uerr, "Undoing a bind mount that could not be made read-only", "target", target)
			}
			return status.Errorf(codes.Internal, "making the bind mount at %s read-only: %v", target, err)
		}
	}
	return nil
}

// unmountAll removes every mount stacked at p and then p itself, with
// umount(2) directly (see bindMount); UMOUNT_NOFOLLOW so that a symlink put
// at p cannot redirect the unmount.
func (d *Driver) unmountAll(p string) error {
	for i := 0; i < 16 && d.isMounted(p); i++ {
		if err := unix.Unmount(p, unix.UMOUNT_NOFOLLOW); err != nil {
			return fmt.Errorf("umount %s: %w", p, err)
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
	if err := fsutil.CheckCOPath("target path", req.GetTargetPath()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	id, _, err := s.d.nodeVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	release, rec, err := s.d.lockRecord(id)
	if err != nil {
		return nil, err
	}
	defer release()
	h, held := rec.Holder(req.GetTargetPath())
	if !held {
		// Nothing of ours is there; a mount we did not make is not ours to remove.
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	// A device of the holder's own goes first: a bind mount of a device
	// node does not keep the device, and a crash after this leaves a
	// holder whose device is gone, which a retry handles.
	s.d.releaseHolderDevice(ctx, id.String(), h)
	if err := s.d.unmountAll(req.GetTargetPath()); err != nil {
		return nil, status.Errorf(codes.Internal, "unmounting %s: %v", req.GetTargetPath(), err)
	}
	fpUnpublishUnmounted.Hit()
	if err := s.d.holders.Save(id, rec.WithoutHolder(req.GetTargetPath())); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	klog.InfoS("Volume unpublished", "volumeID", id, "targetPath", req.GetTargetPath())
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// stagedAt finds the volume's stage record and checks that path is its
// staging path or one of its target paths.
func (s *nodeServer) stagedAt(raw, path string) (volumeid.ID, backend.Node, *holders.Record, error) {
	id, nb, err := s.d.nodeVolume(raw)
	if err != nil {
		return id, nil, nil, err
	}
	rec, err := s.d.holders.Load(id)
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
	if _, err := os.Stat(req.GetVolumePath()); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume path %s: %v", req.GetVolumePath(), err)
	}
	if rec.Staged.AccessType == accessmode.Block {
		size, err := deviceSize(rec.Staged.Device)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "reading the size of %s: %v", rec.Staged.Device, err)
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
	}
	st, err := fsutil.StatfsWithin(req.GetVolumePath(), statsTimeout)
	if err != nil {
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
	rec, err := s.d.holders.Load(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if rec.Staged == nil {
		return nil, status.Errorf(codes.NotFound, "volume %s is not staged on this node", id)
	}
	h := nb.Health(ctx, rec.Staged)
	if p := req.GetVolumePublishPath(); !h.Abnormal && p != "" {
		if _, held := rec.Holder(p); held && !s.d.isMounted(p) {
			h = backend.Health{Abnormal: true, Reason: "TargetNotMounted",
				Message: "the volume is no longer mounted at " + p}
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
	if rec.Staged.ReadOnly {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is staged read-only on this node; its filesystem cannot be grown here", id)
	}
	size, err := nb.Expand(ctx, rec.Staged)
	if err != nil {
		return nil, err
	}
	if r := req.GetCapacityRange().GetRequiredBytes(); size > 0 && r > 0 && size < r {
		return nil, status.Errorf(codes.OutOfRange,
			"volume %s is %d bytes on this node, less than the %d asked for; expand it in the controller first", id, size, r)
	}
	klog.InfoS("Volume expanded on node", "volumeID", id, "bytes", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}
