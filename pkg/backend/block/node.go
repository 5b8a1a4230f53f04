package block

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

var _ backend.Node = (*Node)(nil)

// Node attaches images from the pools as loop devices and mounts them. It
// never writes to a pool: what it may do is decided by the metadata the
// controller wrote.
type Node struct {
	pools   map[string]*pool
	zones   []string
	mounter *mount.SafeFormatAndMount
	resizer *mount.ResizeFs
	table   mounts.Table
	// iscsi is set on a node that reaches volumes over iSCSI too.
	iscsi *ISCSI
}

// NewNode opens the same pools as the controller, read-only. A pool that
// does not look like the controller's (checkShared) is logged at once; the
// node starts anyway (its controller may be starting too), and says the
// same in every refusal of a volume it cannot find there.
func NewNode(pools map[string]string) (*Node, error) {
	parsed, zones, err := parsePools(pools)
	if err != nil {
		return nil, err
	}
	for _, z := range zones {
		if err := parsed[z].checkShared(); err != nil {
			klog.ErrorS(err, "Block volumes of this zone cannot be staged on this node", "zone", z)
		}
	}
	return newNode(parsed, zones), nil
}

func newNode(pools map[string]*pool, zones []string) *Node {
	exec := utilexec.New()
	return &Node{
		pools:   pools,
		zones:   zones,
		mounter: mount.NewSafeFormatAndMount(mount.New(""), exec),
		resizer: mount.NewResizeFs(exec),
	}
}

// Backend names the backend.
func (n *Node) Backend() accessmode.Backend { return accessmode.BackendBlock }

// locate finds a volume's pool and image on this node. A zone without a
// pool here is a scheduling problem, not a missing volume.
func (n *Node) locate(id volumeid.ID) (*pool, string, error) {
	if id.Backend != accessmode.BackendBlock || id.Kind != volumeid.Volume {
		return nil, "", status.Errorf(codes.InvalidArgument, "%s is not a block volume id", id)
	}
	p, ok := n.pools[id.Zone]
	if !ok {
		return nil, "", status.Errorf(codes.FailedPrecondition,
			"this node has no block pool for zone %q (it has: %s); the volume can only be staged on nodes in its zone", id.Zone, strings.Join(n.zones, ", "))
	}
	image, err := p.imagePath(id)
	if err != nil {
		return nil, "", status.Error(codes.Internal, err.Error())
	}
	return p, image, nil
}

func (n *Node) readVolume(p *pool, id volumeid.ID) (*backend.Volume, error) {
	metaPath, err := p.metaPath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	var v backend.Volume
	if err := fsutil.ReadJSON(metaPath, &v); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			if serr := p.checkShared(); serr != nil {
				return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not in this node's pool: %v", id, serr)
			}
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", id)
		}
		return nil, status.Errorf(codes.Internal, "reading metadata of %s: %v", id, err)
	}
	return &v, nil
}

// Stage attaches the volume's image as a loop device (read-only when the
// stage is) and, for access type mount, formats it on first use and mounts
// it at the staging path. It refuses a node the controller has not
// attached: the pool is shared, so this check is what keeps a node from
// using a volume ControllerPublishVolume never granted it.
func (n *Node) Stage(ctx context.Context, req backend.StageRequest) (*backend.Staged, error) {
	if req.VolumeID.Backend != accessmode.BackendBlock || req.VolumeID.Kind != volumeid.Volume {
		return nil, status.Errorf(codes.InvalidArgument, "%s is not a block volume id", req.VolumeID)
	}
	// The volume context is the storage target's word on where the volume
	// is, and wins over a pool this node may also have for the zone.
	if v, ok, err := iscsi.FromContext(req.VolumeID.String(), req.VolumeContext); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	} else if ok {
		return n.stageISCSI(ctx, req, v)
	}
	p, image, err := n.locate(req.VolumeID)
	if err != nil {
		return nil, err
	}
	vol, err := n.readVolume(p, req.VolumeID)
	if err != nil {
		return nil, err
	}
	att, attached := attachmentOf(vol.Attachments, req.Node)
	if !attached {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is not attached to node %s (attached to: %s); ControllerPublishVolume must succeed first",
			vol.ID, req.Node, describeAttachments(vol.Attachments))
	}
	if !req.ReadOnly && (att.ReadOnly || accessmode.IsReadOnly(att.Mode)) {
		// The servers combine this already; refusing here as well keeps a
		// read-only attachment read-only even if a caller gets it wrong.
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is attached to node %s read-only (%s); a read/write stage is refused", vol.ID, req.Node, accessmode.Name(att.Mode))
	}
	if req.Mode != 0 && !accessmode.Within(req.Mode, att.Mode) {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is attached to node %s as %s; a stage as %s would allow more than that", vol.ID, req.Node,
			accessmode.Name(att.Mode), accessmode.Name(req.Mode))
	}
	if req.AccessType != vol.AccessType {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s was created for access type %s, not %s", vol.ID, vol.AccessType, req.AccessType)
	}
	// Empty means "whatever the volume holds, ext4 if it holds nothing";
	// it is settled once the device can be probed.
	fsType := ""
	if req.AccessType == accessmode.Mount {
		fsType = req.FsType
		if fsType == "" {
			fsType = vol.FsType
		}
		if err := backend.CheckFsType(fsType); err != nil {
			return nil, err
		}
		if err := fsutil.CheckCOPath("staging path", req.StagingPath); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		if staged, err := n.alreadyStaged(req, image, fsType); err != nil {
			return nil, err
		} else if staged != nil {
			if err := setReadAhead(vol, staged.Device); err != nil {
				return nil, err
			}
			return staged, nil
		}
	}
	if _, err := os.Stat(image); err != nil {
		return nil, status.Errorf(codes.Internal, "image of volume %s: %v", vol.ID, err)
	}

	// A stage interrupted between attaching and recording (the plugin
	// killed) leaves a device bound to the image that nothing uses; the
	// retry detaches it rather than binding the image once more and
	// leaking it. Only then: where several node plugins share one kernel
	// (tests), another's staged raw block device looks unused too.
	if req.Recover {
		if err := detachUnused(ctx, vol.ID, image); err != nil {
			return nil, err
		}
	}
	dev, err := loop.Attach(ctx, image, req.ReadOnly)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "attaching volume %s: %v", vol.ID, err)
	}
	fpStageAttached.Hit()
	if err := setReadAhead(vol, dev.Path); err != nil {
		if _, derr := loop.DetachIfBackedBy(context.WithoutCancel(ctx), dev.Path, image); derr != nil {
			klog.ErrorS(derr, "Detaching loop device after a failed stage", "volumeID", vol.ID, "device", dev.Path)
		}
		return nil, err
	}
	staged := &backend.Staged{
		VolumeID:    vol.ID,
		StagingPath: req.StagingPath,
		AccessType:  req.AccessType,
		FsType:      fsType,
		ReadOnly:    req.ReadOnly,
		Device:      dev.Path,
		Since:       time.Now().UTC(),
	}
	if req.AccessType == accessmode.Block {
		return staged, nil
	}
	if err := n.mountStaged(ctx, staged, !accessmode.AllReadOnly(vol.Modes), req.MountFlags); err != nil {
		if _, derr := loop.DetachIfBackedBy(context.WithoutCancel(ctx), dev.Path, image); derr != nil {
			klog.ErrorS(derr, "Detaching loop device after a failed stage", "volumeID", vol.ID, "device", dev.Path)
		}
		return nil, err
	}
	return staged, nil
}

// Steps a test can kill the node plugin at (package faultpoint).
var (
	fpStageAttached    = faultpoint.New("block.stage.attached")
	fpUnstageUnmounted = faultpoint.New("block.unstage.unmounted")
	fpExpandRefreshed  = faultpoint.New("block.expand.device-refreshed")
)

// setReadAhead gives dev the read-ahead the volume's attributes name
// (readAheadKiB, a VolumeAttributesClass parameter), and leaves the
// kernel's default where they name none.
func setReadAhead(vol *backend.Volume, dev string) error {
	kib, ok := vol.ReadAheadKiB()
	if !ok {
		return nil
	}
	if err := loop.SetReadAhead(dev, kib); err != nil {
		return status.Errorf(codes.Internal, "setting the read-ahead of volume %s on %s to %d KiB: %v", vol.ID, dev, kib, err)
	}
	return nil
}

// detachUnused detaches the loop devices bound to image that nothing uses
// (no mount of their filesystem, no bind mount of their node).
func detachUnused(ctx context.Context, volumeID, image string) error {
	unused, err := loop.Unused(image)
	if err != nil {
		return status.Errorf(codes.Internal, "looking for loop devices left bound to %s: %v", image, err)
	}
	for _, d := range unused {
		if _, err := loop.DetachIfBackedBy(ctx, d, image); err != nil {
			return status.Errorf(codes.Internal, "detaching %s, left bound to %s: %v", d, image, err)
		}
		klog.InfoS("Detached a loop device an interrupted stage left bound to the volume's image", "volumeID", volumeID, "device", d)
	}
	return nil
}

// alreadyStaged recognises a staging path that already holds this
// volume's filesystem (a stage retried after the node plugin restarted)
// and reports it instead of attaching the image a second time. What is
// mounted there is this volume's only if its device is a loop device bound
// to this very image.
func (n *Node) alreadyStaged(req backend.StageRequest, image, fsType string) (*backend.Staged, error) {
	m, err := n.table.At(req.StagingPath)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting staging path %s: %v", req.StagingPath, err)
	}
	if m == nil {
		return nil, nil // nothing mounted: stage normally
	}
	name, err := mounts.BlockDeviceName(m.Major, m.Minor)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting staging path %s: %v", req.StagingPath, err)
	}
	dev := "/dev/" + name
	if name == "" || !loop.ValidDevice(dev) {
		return nil, status.Errorf(codes.AlreadyExists, "staging path %s already has %s (%s) mounted on it, not volume %s", req.StagingPath, m.Source, m.FSType, req.VolumeID)
	}
	if ours, err := loop.BoundTo(dev, image); err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting %s: %v", dev, err)
	} else if !ours {
		return nil, status.Errorf(codes.AlreadyExists, "staging path %s already has another volume mounted on it (%s), not volume %s", req.StagingPath, dev, req.VolumeID)
	}
	if ro, err := loop.ReadOnly(dev); err != nil || ro != req.ReadOnly {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s is already staged at %s with readonly=%t", req.VolumeID, req.StagingPath, ro)
	}
	existing, err := n.mounter.GetDiskFormat(dev)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "probing %s: %v", dev, err)
	}
	if fsType != "" && existing != fsType {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s is already staged at %s as %s, not %s", req.VolumeID, req.StagingPath, existing, fsType)
	}
	return &backend.Staged{
		VolumeID: req.VolumeID.String(), StagingPath: req.StagingPath, AccessType: req.AccessType,
		FsType: existing, ReadOnly: req.ReadOnly, Device: dev, Since: time.Now().UTC(),
	}, nil
}

// mountStaged formats (first use only) and mounts the staged device.
// writable says whether any node may ever write the volume (mountOptions).
func (n *Node) mountStaged(ctx context.Context, staged *backend.Staged, writable bool, mountFlags []string) error {
	existing, err := n.mounter.GetDiskFormat(staged.Device)
	if err != nil {
		return status.Errorf(codes.Internal, "probing volume %s: %v", staged.VolumeID, err)
	}
	switch {
	case existing == "" && staged.ReadOnly:
		return status.Errorf(codes.FailedPrecondition,
			"volume %s has no filesystem yet and this stage is read-only; stage it once read/write so it can be formatted", staged.VolumeID)
	case existing == "":
		staged.FsType = fsOrDefault(staged.FsType)
	case staged.FsType == "" && backend.CheckFsType(existing) == nil:
		staged.FsType = existing
	case existing != staged.FsType:
		return status.Errorf(codes.FailedPrecondition,
			"volume %s holds a %s filesystem, not %s", staged.VolumeID, existing, fsOrDefault(staged.FsType))
	}
	if existing == fsExt4 && !staged.ReadOnly {
		// A volume restored or cloned into a larger capacity brings a
		// filesystem sized for its source. ext4 grows before the mount,
		// because growing it mounted needs CAP_SYS_RESOURCE, which node
		// plugins often run without.
		if err := growExt4Offline(ctx, staged.Device); err != nil {
			return status.Errorf(codes.Internal, "growing filesystem of volume %s: %v", staged.VolumeID, err)
		}
	}
	if err := os.MkdirAll(staged.StagingPath, 0o750); err != nil {
		return status.Errorf(codes.Internal, "creating staging path: %v", err)
	}
	if err := n.mounter.FormatAndMount(staged.Device, staged.StagingPath, staged.FsType, mountOptions(staged.FsType, staged.ReadOnly, writable, mountFlags)); err != nil {
		return status.Errorf(codes.Internal, "mounting volume %s at %s: %v", staged.VolumeID, staged.StagingPath, err)
	}
	if staged.ReadOnly || existing != fsXFS {
		return nil
	}
	// xfs can only grow mounted (and needs no extra capability for it).
	if _, err := n.resizer.Resize(staged.Device, staged.StagingPath); err != nil {
		if uerr := n.mounter.Unmount(staged.StagingPath); uerr != nil {
			klog.ErrorS(uerr, "Unmounting after a failed resize", "stagingPath", staged.StagingPath)
		}
		return status.Errorf(codes.Internal, "growing filesystem of volume %s: %v", staged.VolumeID, err)
	}
	return nil
}

// mountOptions puts the driver's options after the CO's, so that "ro" wins
// over a stray "rw" in the mount flags. A read-only stage of a writable
// volume mounts without replaying the journal: a writer may hold the
// volume elsewhere (the readers of MULTI_NODE_SINGLE_WRITER, a read-only
// publish of a read/write volume), and a read-only device cannot replay its
// live journal. A volume no node may ever write needs no such thing: it was
// formatted at creation, or the controller replayed the journal of the
// filesystem it was copied from before handing it out, so it mounts
// read-only with everything its source had fsync'd, nothing hidden.
func mountOptions(fsType string, readOnly, writable bool, mountFlags []string) []string {
	opts := slices.Clone(mountFlags)
	if fsType == fsXFS {
		// Clones and snapshots keep their source's filesystem UUID, and XFS
		// refuses to mount a second filesystem with a UUID already mounted.
		opts = append(opts, "nouuid")
	}
	if readOnly {
		opts = append(opts, "ro")
		if writable {
			switch fsType {
			case fsExt4:
				opts = append(opts, "noload")
			case fsXFS:
				opts = append(opts, "norecovery")
			}
		}
	}
	return opts
}

// attachmentOf finds this node's attachment by its key: the controller
// records the id the node had when it was attached, and the node may have
// restarted under a new address since.
func attachmentOf(attachments []accessmode.Attachment, node nodeid.Node) (accessmode.Attachment, bool) {
	for _, a := range attachments {
		if a.Node.Name == node.Name {
			return a, true
		}
	}
	return accessmode.Attachment{}, false
}

func describeAttachments(attachments []accessmode.Attachment) string {
	if len(attachments) == 0 {
		return "no node"
	}
	names := make([]string, 0, len(attachments))
	for _, a := range attachments {
		names = append(names, a.Node.String())
	}
	return strings.Join(names, ", ")
}

// Unstage unmounts the staging path and detaches the loop device, but only
// a loop device still bound to this volume's image: the kernel reuses
// device names, and another volume's device must never be taken away.
func (n *Node) Unstage(ctx context.Context, staged *backend.Staged) error {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	if n.overISCSI(id, staged.Transport) {
		return n.unstageISCSI(ctx, id, staged)
	}
	_, image, err := n.locate(id)
	if err != nil {
		return err
	}
	dev := staged.Device
	if staged.AccessType == accessmode.Mount && staged.StagingPath != "" {
		m, err := n.table.At(staged.StagingPath)
		if err != nil {
			return status.Errorf(codes.Internal, "inspecting staging path %s: %v", staged.StagingPath, err)
		}
		if m != nil {
			if ours, err := n.Owns(ctx, id, m); err != nil {
				return err
			} else if !ours {
				// Not this volume's: it is not ours to unmount, and the
				// volume's own mount is not there to undo.
				klog.InfoS("Leaving a mount that is not the volume's at its staging path", "volumeID", staged.VolumeID,
					"stagingPath", staged.StagingPath, "source", m.Source, "fsType", m.FSType)
			} else {
				if dev == "" {
					name, _ := mounts.BlockDeviceName(m.Major, m.Minor)
					dev = "/dev/" + name
				}
				if err := n.mounter.Unmount(staged.StagingPath); err != nil {
					return status.Errorf(codes.Internal, "unmounting %s: %v", staged.StagingPath, err)
				}
			}
		}
	}
	fpUnstageUnmounted.Hit()
	if dev == "" {
		// No device recorded: an interrupted stage being undone.
		return detachUnused(ctx, staged.VolumeID, image)
	}
	if !loop.ValidDevice(dev) {
		return status.Errorf(codes.Internal, "staged device %q is not a loop device; refusing to touch it", dev)
	}
	if _, err := loop.DetachIfBackedBy(ctx, dev, image); err != nil {
		return status.Errorf(codes.Internal, "detaching %s: %v", dev, err)
	}
	return nil
}

// Expand makes the loop device pick up the image's new size and, for a
// read/write mount, grows the filesystem into it. A raw block stage needs
// nothing more, read-only or not: its workloads read the device itself, so
// the readers of a volume another node writes see the new size at once. A
// read-only mount gets its device refreshed, and an answer saying why its
// filesystem did not grow (readOnlyFilesystem).
func (n *Node) Expand(ctx context.Context, staged *backend.Staged) (int64, error) {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	if n.overISCSI(id, staged.Transport) {
		return n.expandISCSI(ctx, id, staged)
	}
	p, image, err := n.locate(id)
	if err != nil {
		return 0, err
	}
	// The image itself, by inode: a device still bound to a deleted image of
	// this name would be refreshed to that file's size.
	ours, err := loop.BoundTo(staged.Device, image)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "inspecting %s: %v", staged.Device, err)
	}
	if !ours {
		return 0, status.Errorf(codes.FailedPrecondition, "volume %s is not attached at %s any more; stage it again", staged.VolumeID, staged.Device)
	}
	// The kernel lets a read-only loop device take a new capacity: the
	// flag forbids writes to the device, not a change of its size.
	if err := loop.Refresh(ctx, staged.Device); err != nil {
		return 0, status.Errorf(codes.Internal, "refreshing size of %s: %v", staged.Device, err)
	}
	fpExpandRefreshed.Hit()
	size, err := loop.Size(staged.Device)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "reading size of %s: %v", staged.Device, err)
	}
	if staged.AccessType != accessmode.Mount {
		return size, nil
	}
	if staged.ReadOnly {
		return 0, n.readOnlyFilesystem(p, id, size)
	}
	if _, err := n.resizer.Resize(staged.Device, staged.StagingPath); err != nil {
		if strings.Contains(err.Error(), "Permission denied to resize filesystem") {
			return 0, status.Errorf(codes.FailedPrecondition,
				"growing the mounted ext4 filesystem of volume %s needs CAP_SYS_RESOURCE, which the node plugin lacks; "+
					"the device has grown, and the filesystem grows when the volume is next staged: %v", staged.VolumeID, err)
		}
		return 0, status.Errorf(codes.Internal, "growing filesystem of volume %s: %v", staged.VolumeID, err)
	}
	return size, nil
}

// readOnlyFilesystem is the answer to expanding a read-only mount. Its
// filesystem cannot grow here: the device refuses writes, and a mounted
// filesystem keeps the size it was mounted with whatever its device does.
// Nor does another node grow it meanwhile: this backend gives a filesystem
// that some node may write to one node at a time (accessmode.Serves,
// accessmode.CheckAttach), so while this node holds it read-only nobody
// writes it. It grows when it is
// next staged read/write (mountStaged), and never if no node may write it
// (ExpandVolume refuses to grow such a volume in the first place).
//
// The answer is FAILED_PRECONDITION, not OK. OK would tell the CO that the
// volume has its new size on this node while the workload here still sees
// the old one (the kubelet would record the claim as resized).
// FAILED_PRECONDITION is the spec's NodeExpandVolume answer for a staged
// volume whose filesystem cannot grow while staged, which the caller must
// not retry: the kubelet records it, stops asking on this node and goes on
// mounting, so a workload that only reads the volume is never held up.
func (n *Node) readOnlyFilesystem(p *pool, id volumeid.ID, size int64) error {
	if vol, err := n.readVolume(p, id); err == nil && accessmode.AllReadOnly(vol.Modes) {
		return status.Errorf(codes.FailedPrecondition,
			"volume %s is a filesystem no node may write (%s): its filesystem cannot grow on any node", id, accessmode.Names(vol.Modes))
	}
	return status.Errorf(codes.FailedPrecondition,
		"volume %s is staged read-only on this node: its device now has %d bytes, but a read-only filesystem cannot grow; "+
			"it grows when the volume is next staged read/write", id, size)
}

// Health checks that the image, the loop device bound to it and (for
// mount) the staging mount on that device are all still in place.
func (n *Node) Health(ctx context.Context, staged *backend.Staged) backend.Health {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return backend.Health{Abnormal: true, Reason: "InvalidVolumeID", Message: err.Error()}
	}
	if n.overISCSI(id, staged.Transport) {
		if h, ok := n.healthISCSI(id, staged); !ok {
			return h
		}
		return n.healthOfMount(staged)
	}
	_, image, err := n.locate(id)
	if err != nil {
		return backend.Health{Abnormal: true, Reason: "NoPool", Message: status.Convert(err).Message()}
	}
	if _, err := os.Stat(image); err != nil {
		return backend.Health{Abnormal: true, Reason: "ImageMissing", Message: fmt.Sprintf("the volume's image is gone: %v", err)}
	}
	backing, err := loop.BackingFile(staged.Device)
	switch {
	case err != nil:
		return backend.Health{Abnormal: true, Reason: "LoopDeviceUnreadable", Message: err.Error()}
	case backing == "":
		return backend.Health{Abnormal: true, Reason: "LoopDeviceDetached", Message: fmt.Sprintf("loop device %s is no longer attached", staged.Device)}
	}
	if ours, err := loop.NamedBy(staged.Device, image); err != nil || !ours {
		return backend.Health{Abnormal: true, Reason: "LoopDeviceReassigned", Message: fmt.Sprintf("loop device %s is now backed by %s, not by the volume's image", staged.Device, backing)}
	}
	if same, err := loop.BoundTo(staged.Device, image); err != nil || !same {
		return backend.Health{Abnormal: true, Reason: "ImageReplaced", Message: fmt.Sprintf("loop device %s is backed by another file of the volume's image name (%s), not by the image there now", staged.Device, backing)}
	}
	return n.healthOfMount(staged)
}

// healthOfMount checks that a mount stage's staging path still holds the
// staged device's filesystem.
func (n *Node) healthOfMount(staged *backend.Staged) backend.Health {
	if staged.AccessType == accessmode.Mount {
		notMnt, err := n.mounter.IsLikelyNotMountPoint(staged.StagingPath)
		if err != nil || notMnt {
			return backend.Health{Abnormal: true, Reason: "StagingPathNotMounted", Message: fmt.Sprintf("staging path %s is no longer a mount point", staged.StagingPath)}
		}
		dev, _, err := mount.GetDeviceNameFromMount(n.mounter, staged.StagingPath)
		if err == nil && dev != staged.Device {
			return backend.Health{Abnormal: true, Reason: "StagingPathMountedElsewhere", Message: fmt.Sprintf("staging path %s has %s mounted, not %s", staged.StagingPath, dev, staged.Device)}
		}
	}
	return backend.Health{Message: fmt.Sprintf("attached at %s", staged.Device)}
}

// Check compares a stage record with the kernel (see backend.Node): the
// recorded device must be bound to this volume's image (same inode) with
// the recorded read-only flag, and for access type mount the staging path
// must hold the filesystem of that device.
func (n *Node) Check(ctx context.Context, staged *backend.Staged) (backend.StageCheck, error) {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return backend.StageCheck{}, status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	var bound, ro bool
	if n.overISCSI(id, staged.Transport) {
		if bound, ro, err = n.boundISCSI(id, staged); err != nil {
			return backend.StageCheck{}, err
		}
	} else {
		_, image, err := n.locate(id)
		if err != nil {
			return backend.StageCheck{}, err
		}
		if staged.Device != "" {
			if bound, err = loop.BoundTo(staged.Device, image); err != nil {
				return backend.StageCheck{}, status.Errorf(codes.Internal, "inspecting %s: %v", staged.Device, err)
			}
		}
		if bound {
			if ro, err = loop.ReadOnly(staged.Device); err != nil {
				return backend.StageCheck{}, status.Errorf(codes.Internal, "inspecting %s: %v", staged.Device, err)
			}
		}
	}
	return n.checkStage(staged, bound, ro)
}

// checkStage is Check once the staged device is known to be the volume's
// (bound) or not, with its read-only flag.
func (n *Node) checkStage(staged *backend.Staged, bound, ro bool) (backend.StageCheck, error) {
	gone := func(format string, a ...any) (backend.StageCheck, error) {
		return backend.StageCheck{State: backend.StageGone, Detail: fmt.Sprintf(format, a...)}, nil
	}
	broken := func(format string, a ...any) (backend.StageCheck, error) {
		return backend.StageCheck{State: backend.StageBroken, Detail: fmt.Sprintf(format, a...)}, nil
	}
	if bound && ro != staged.ReadOnly {
		return broken("device %s is the volume's with readonly=%t, but the stage was made with readonly=%t", staged.Device, ro, staged.ReadOnly)
	}
	if staged.AccessType == accessmode.Block {
		if !bound {
			return gone("device %q is no longer the volume's", staged.Device)
		}
		return backend.StageCheck{State: backend.StageIntact}, nil
	}
	m, err := n.table.At(staged.StagingPath)
	if err != nil {
		return backend.StageCheck{}, status.Errorf(codes.Internal, "inspecting staging path %s: %v", staged.StagingPath, err)
	}
	if m == nil {
		if !bound {
			return gone("nothing is mounted at %s and device %q is not the volume's", staged.StagingPath, staged.Device)
		}
		users, err := n.deviceUsers(staged.Device)
		if err != nil {
			return backend.StageCheck{}, err
		}
		if len(users) > 0 {
			return broken("nothing is mounted at %s, but the volume's device %s is still mounted at %s", staged.StagingPath, staged.Device, strings.Join(users, ", "))
		}
		return gone("nothing is mounted at %s; device %s is the volume's and unused", staged.StagingPath, staged.Device)
	}
	if !bound {
		return broken("%s holds %s (%s), and the recorded device %q is not the volume's", staged.StagingPath, m.Source, m.FSType, staged.Device)
	}
	major, minor, err := mounts.DeviceNumbers(staged.Device)
	if err != nil {
		return backend.StageCheck{}, status.Errorf(codes.Internal, "inspecting %s: %v", staged.Device, err)
	}
	if m.Major != major || m.Minor != minor || m.Root != "/" {
		return broken("%s holds %s (%s, device %d:%d), not the filesystem of the volume's device %s", staged.StagingPath, m.Source, m.FSType, m.Major, m.Minor, staged.Device)
	}
	return backend.StageCheck{State: backend.StageIntact}, nil
}

// deviceUsers lists where dev's filesystem or dev's node is mounted.
func (n *Node) deviceUsers(dev string) ([]string, error) {
	major, minor, err := mounts.DeviceNumbers(dev)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting %s: %v", dev, err)
	}
	users, err := n.table.UsersOf(major, minor, filepath.Base(dev))
	if err != nil {
		return nil, status.Errorf(codes.Internal, "%v", err)
	}
	return users, nil
}

// Owns reports whether m is a mount of volume id: a filesystem on, or a
// bind mount of the node of, a loop device bound to the volume's image.
func (n *Node) Owns(ctx context.Context, id volumeid.ID, m *mounts.Mount) (bool, error) {
	name := strings.TrimPrefix(m.Root, "/")
	if !mounts.IsDeviceNodeBind(m, name) || strings.Contains(name, "/") {
		var err error
		if name, err = mounts.BlockDeviceName(m.Major, m.Minor); err != nil {
			return false, status.Errorf(codes.Internal, "inspecting the mount at %s: %v", m.Mountpoint, err)
		}
	}
	if name == "" {
		return false, nil
	}
	// What the device is decides, not what this node is configured for: a
	// node may reach some volumes through a pool and others over iSCSI.
	if n.iscsi != nil {
		ours, err := n.ownsDisk(id, name)
		if err != nil {
			return false, status.Errorf(codes.Internal, "inspecting /dev/%s: %v", name, err)
		}
		if ours || n.overISCSI(id, nil) {
			return ours, nil
		}
	}
	_, image, err := n.locate(id)
	if err != nil {
		return false, err
	}
	dev := "/dev/" + name
	if !loop.ValidDevice(dev) {
		return false, nil
	}
	ours, err := loop.BoundTo(dev, image)
	if err != nil {
		return false, status.Errorf(codes.Internal, "inspecting %s: %v", dev, err)
	}
	return ours, nil
}

// ReadOnlyDevices: a read-only publish of a raw block volume staged
// read/write gets a loop device of its own, bound read-only to the image.
func (n *Node) ReadOnlyDevices() backend.ReadOnlyDevices { return n }

// FreeDevice names a free loop device for ReadOnlyDevice, so that the
// caller can record it before anything is bound to it.
func (n *Node) FreeDevice(ctx context.Context) (string, error) {
	dev, err := loop.Free(ctx)
	if err != nil {
		return "", status.Errorf(codes.Internal, "finding a free loop device: %v", err)
	}
	return dev, nil
}

// ReadOnlyDevice binds the volume's image once more, read-only, at device,
// for one read-only publish of a raw block volume staged read/write: the
// kernel ignores the read-only flag of a bind mount of a device node, so
// only a device that is itself read-only keeps that workload from writing.
func (n *Node) ReadOnlyDevice(ctx context.Context, staged *backend.Staged, device string) error {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	var image string
	if n.overISCSI(id, staged.Transport) {
		// A read-only loop device over the disk: the disk's own flag is
		// the stage's, which other publishes of it write through.
		image, err = n.diskOfStage(id, staged)
	} else {
		_, image, err = n.locate(id)
	}
	if err != nil {
		return err
	}
	if _, err := loop.AttachAt(ctx, device, image, true); err != nil {
		return status.Errorf(codes.Internal, "attaching volume %s read-only at %s: %v", id, device, err)
	}
	return nil
}

// ReleaseDevice detaches a device ReadOnlyDevice made, if it is still bound
// to the volume's image (a device since reused for another image stays).
func (n *Node) ReleaseDevice(ctx context.Context, id volumeid.ID, device string) error {
	if !loop.ValidDevice(device) {
		return status.Errorf(codes.Internal, "%q is not a loop device; refusing to touch it", device)
	}
	if n.viewOfDisk(id, device) {
		return n.releaseDiskView(ctx, id, device)
	}
	_, image, err := n.locate(id)
	if err != nil {
		return err
	}
	if _, err := loop.DetachIfBackedBy(ctx, device, image); err != nil {
		return status.Errorf(codes.Internal, "detaching %s: %v", device, err)
	}
	return nil
}

// RefreshDevice makes a device ReadOnlyDevice made pick up the image's new
// size, as Expand does for the staged device. A device no longer bound to
// the volume's image (a publish interrupted before binding it, or a device
// since reused) is left alone and reported as not refreshed.
func (n *Node) RefreshDevice(ctx context.Context, id volumeid.ID, device string) (bool, error) {
	if n.viewOfDisk(id, device) {
		return n.refreshDiskView(ctx, id, device)
	}
	_, image, err := n.locate(id)
	if err != nil {
		return false, err
	}
	if !loop.ValidDevice(device) {
		return false, status.Errorf(codes.Internal, "%q is not a loop device; refusing to touch it", device)
	}
	if ours, err := loop.BoundTo(device, image); err != nil {
		return false, status.Errorf(codes.Internal, "inspecting %s: %v", device, err)
	} else if !ours {
		return false, nil
	}
	if err := loop.Refresh(ctx, device); err != nil {
		return false, status.Errorf(codes.Internal, "refreshing size of %s: %v", device, err)
	}
	return true, nil
}
