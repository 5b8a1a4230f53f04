// This file holds what a node does with a volume's block device whatever
// the transport that brought it (transport.go): the checks of a stage
// request that need no device, the filesystem (made on first use, grown,
// mounted at the staging path), and the comparison of a stage record with
// the mount table. Written once, it behaves the same over every transport.

package block

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

var _ backend.Node = (*Node)(nil)

// Node stages volumes of the block backend: it gets each volume's device
// from a transport and puts the volume's filesystem on it.
type Node struct {
	mounter *mount.SafeFormatAndMount
	resizer *mount.ResizeFs
	table   mounts.Table
	// loop reaches the volumes of the zones whose pools this node shares.
	loop *loopTransport
	// network holds the transports this node reaches volumes over the
	// network with, by the name volume contexts and stage records give
	// them (networkTransports).
	network map[string]transport
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
		mounter: mount.NewSafeFormatAndMount(mount.New(""), exec),
		resizer: mount.NewResizeFs(exec),
		loop:    &loopTransport{pools: pools, zones: zones},
		network: map[string]transport{},
	}
}

// Backend names the backend.
func (n *Node) Backend() accessmode.Backend { return accessmode.BackendBlock }

// Stage gets the volume's device from its transport (read-only when the
// stage is) and, for access type mount, formats it on first use and mounts
// it at the staging path.
func (n *Node) Stage(ctx context.Context, req backend.StageRequest) (*backend.Staged, error) {
	if req.VolumeID.Backend != accessmode.BackendBlock || req.VolumeID.Kind != volumeid.Volume {
		return nil, status.Errorf(codes.InvalidArgument, "%s is not a block volume id", req.VolumeID)
	}
	t, err := n.stageTransport(req.VolumeID, req.VolumeContext)
	if err != nil {
		return nil, err
	}
	adm, err := t.admit(req)
	if err != nil {
		return nil, err
	}
	// Empty means "whatever the volume holds, ext4 if it holds nothing";
	// it is settled once the device can be probed.
	fsType := ""
	if req.AccessType == accessmode.Mount {
		fsType = req.FsType
		if fsType == "" {
			fsType = adm.fsType
		}
		if err := backend.CheckFsType(fsType); err != nil {
			return nil, err
		}
		if err := fsutil.CheckCOPath("staging path", req.StagingPath); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		if staged, err := n.alreadyStaged(t, req, fsType, adm.record); err != nil {
			return nil, err
		} else if staged != nil {
			if err := setReadAhead(adm, staged); err != nil {
				return nil, err
			}
			return staged, nil
		}
	}
	dev, err := t.attach(ctx, req)
	if err != nil {
		return nil, err
	}
	staged := &backend.Staged{
		VolumeID:    req.VolumeID.String(),
		StagingPath: req.StagingPath,
		AccessType:  req.AccessType,
		FsType:      fsType,
		ReadOnly:    req.ReadOnly,
		Device:      dev,
		Transport:   adm.record,
		Since:       time.Now().UTC(),
	}
	if err := setReadAhead(adm, staged); err != nil {
		return nil, releaseFailedStage(ctx, t, req.VolumeID, staged, err)
	}
	if req.AccessType == accessmode.Block {
		return staged, nil
	}
	if err := n.mountStaged(ctx, staged, adm.writable, req.MountFlags); err != nil {
		return nil, releaseFailedStage(ctx, t, req.VolumeID, staged, err)
	}
	return staged, nil
}

// Steps a test can kill the node plugin at (package faultpoint).
var (
	fpUnstageUnmounted = faultpoint.New("block.unstage.unmounted")
	fpExpandRefreshed  = faultpoint.New("block.expand.device-refreshed")
)

// releaseFailedStage gives up the device of a stage that failed after its
// transport got it, and returns why the stage failed.
func releaseFailedStage(ctx context.Context, t transport, id volumeid.ID, staged *backend.Staged, reason error) error {
	if err := t.release(context.WithoutCancel(ctx), id, staged); err != nil {
		klog.ErrorS(err, "Releasing the device of a failed stage", "volumeID", id, "device", staged.Device)
	}
	return reason
}

// setReadAhead gives the staged device the read-ahead the volume's
// attributes name, and leaves the kernel's default where they name none.
func setReadAhead(adm admission, staged *backend.Staged) error {
	if !adm.hasReadAhead {
		return nil
	}
	if err := loop.SetReadAhead(staged.Device, adm.readAheadKiB); err != nil {
		return status.Errorf(codes.Internal, "setting the read-ahead of volume %s on %s to %d KiB: %v", staged.VolumeID, staged.Device, adm.readAheadKiB, err)
	}
	return nil
}

// alreadyStaged recognises a staging path that already holds this
// volume's filesystem (a stage retried after the node plugin restarted)
// and reports it instead of getting the device a second time. What is
// mounted there is this volume's only if its transport says the device is
// the volume's device now (the kernel reuses device names), with the
// read-only flag the request asks for.
func (n *Node) alreadyStaged(t transport, req backend.StageRequest, fsType string, record map[string]string) (*backend.Staged, error) {
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
	ours := false
	if name != "" {
		if ours, err = t.owns(req.VolumeID, name); err != nil {
			return nil, err
		}
	}
	dev := "/dev/" + name
	var ro bool
	if ours {
		if ours, ro, err = t.bound(req.VolumeID, dev); err != nil {
			return nil, err
		}
	}
	if !ours {
		return nil, status.Errorf(codes.AlreadyExists, "staging path %s already has %s (%s) mounted on it, not volume %s", req.StagingPath, m.Source, m.FSType, req.VolumeID)
	}
	if ro != req.ReadOnly {
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
		FsType: existing, ReadOnly: req.ReadOnly, Device: dev, Transport: record, Since: time.Now().UTC(),
	}, nil
}

// stageFormats counts the filesystems stages made, so that a test can
// tell a volume's first stage that found its filesystem from one that
// formatted.
var stageFormats atomic.Int64

// mountStaged formats (first use only) and mounts the staged device.
// writable says whether any node may ever write the volume (mountOptions).
func (n *Node) mountStaged(ctx context.Context, staged *backend.Staged, writable bool, mountFlags []string) error {
	// An ext4 superblock is read here rather than by blkid and dumpe2fs:
	// it says what the volume holds, how large it is and whether it is
	// clean, without running a program.
	sb, isExt4, err := readExt4Super(staged.Device)
	if err != nil {
		return status.Errorf(codes.Internal, "probing volume %s: %v", staged.VolumeID, err)
	}
	existing := fsExt4
	if !isExt4 {
		if existing, err = n.mounter.GetDiskFormat(staged.Device); err != nil {
			return status.Errorf(codes.Internal, "probing volume %s: %v", staged.VolumeID, err)
		}
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
	grown := false
	if existing == fsExt4 && !staged.ReadOnly {
		// A volume restored or cloned into a larger capacity brings a
		// filesystem sized for its source. ext4 grows before the mount,
		// because growing it mounted needs CAP_SYS_RESOURCE, which node
		// plugins often run without.
		if grown, err = growExt4Offline(ctx, staged.Device, sb); err != nil {
			return status.Errorf(codes.Internal, "growing filesystem of volume %s: %v", staged.VolumeID, err)
		}
	}
	if err := os.MkdirAll(staged.StagingPath, 0o750); err != nil {
		return status.Errorf(codes.Internal, "creating staging path: %v", err)
	}
	opts := mountOptions(staged.FsType, staged.ReadOnly, writable, mountFlags)
	// A clean ext4 is mounted with mount(2): the check FormatAndMount runs
	// before a read/write mount (fsck -a) has nothing to do on it, and
	// mount(8) would only parse the options.
	mounted := false
	if isExt4 && !grown && (staged.ReadOnly || sb.clean()) {
		if mounted, err = mountDirect(staged.Device, staged.StagingPath, fsExt4, opts); err != nil {
			return status.Errorf(codes.Internal, "mounting volume %s at %s: %v", staged.VolumeID, staged.StagingPath, err)
		}
	}
	if !mounted {
		if existing == "" {
			stageFormats.Add(1)
		}
		if err := n.mounter.FormatAndMount(staged.Device, staged.StagingPath, staged.FsType, opts); err != nil {
			return status.Errorf(codes.Internal, "mounting volume %s at %s: %v", staged.VolumeID, staged.StagingPath, err)
		}
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

// mountFlagOptions are the mount options mount(8) turns into mount(2)
// flags: set, or (clear) taken away.
var mountFlagOptions = map[string]struct {
	flag  uintptr
	clear bool
}{
	"defaults": {}, "rw": {unix.MS_RDONLY, true}, "ro": {unix.MS_RDONLY, false},
	"nosuid": {unix.MS_NOSUID, false}, "suid": {unix.MS_NOSUID, true},
	"nodev": {unix.MS_NODEV, false}, "dev": {unix.MS_NODEV, true},
	"noexec": {unix.MS_NOEXEC, false}, "exec": {unix.MS_NOEXEC, true},
	"sync": {unix.MS_SYNCHRONOUS, false}, "async": {unix.MS_SYNCHRONOUS, true},
	"dirsync": {unix.MS_DIRSYNC, false},
	"noatime": {unix.MS_NOATIME, false}, "atime": {unix.MS_NOATIME, true},
	"nodiratime": {unix.MS_NODIRATIME, false}, "diratime": {unix.MS_NODIRATIME, true},
	"relatime": {unix.MS_RELATIME, false}, "norelatime": {unix.MS_RELATIME, true},
	"strictatime": {unix.MS_STRICTATIME, false},
	"lazytime":    {unix.MS_LAZYTIME, false}, "nolazytime": {unix.MS_LAZYTIME, true},
}

// fsDataOptions are the filesystem options the driver itself adds
// (mountOptions), which mount(8) hands to the kernel as they are.
var fsDataOptions = map[string]bool{"noload": true, "norecovery": true, "nouuid": true}

// mountDirect mounts dev at target with mount(2) when every option is one
// it knows (mountFlagOptions, fsDataOptions), as mount(8) would; mounted
// is false, and nothing done, when an option needs mount(8) itself.
func mountDirect(dev, target, fsType string, opts []string) (mounted bool, err error) {
	var flags uintptr
	var data []string
	for _, o := range opts {
		if f, ok := mountFlagOptions[o]; ok {
			if f.clear {
				flags &^= f.flag
			} else {
				flags |= f.flag
			}
			continue
		}
		if !fsDataOptions[o] {
			return false, nil
		}
		data = append(data, o)
	}
	if err := unix.Mount(dev, target, fsType, flags, strings.Join(data, ",")); err != nil {
		return false, fmt.Errorf("mount -t %s -o %s %s %s: %w", fsType, strings.Join(opts, ","), dev, target, err)
	}
	return true, nil
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

// Unstage unmounts the staging path, if what is mounted there is the
// volume's, and has the stage's transport release the device.
func (n *Node) Unstage(ctx context.Context, staged *backend.Staged) error {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	t, err := n.recordedTransport(id, staged.Transport)
	if err != nil {
		return err
	}
	unmounted, err := n.unmountIfOurs(ctx, id, staged)
	if err != nil {
		return err
	}
	fpUnstageUnmounted.Hit()
	if staged.Device == "" && unmounted != "" {
		// A stage recorded before its device was: the mount names it.
		withDevice := *staged
		withDevice.Device = unmounted
		staged = &withDevice
	}
	return t.release(ctx, id, staged)
}

// unmountIfOurs unmounts a mount stage's staging path if what is mounted
// there is the volume's (Owns), and names the device it was on.
func (n *Node) unmountIfOurs(ctx context.Context, id volumeid.ID, staged *backend.Staged) (string, error) {
	if staged.AccessType != accessmode.Mount || staged.StagingPath == "" {
		return "", nil
	}
	m, err := n.table.At(staged.StagingPath)
	if err != nil {
		return "", status.Errorf(codes.Internal, "inspecting staging path %s: %v", staged.StagingPath, err)
	}
	if m == nil {
		return "", nil
	}
	ours, err := n.Owns(ctx, id, m)
	if err != nil {
		return "", err
	}
	if !ours {
		// Not this volume's: it is not ours to unmount, and the volume's
		// own mount is not there to undo.
		klog.InfoS("Leaving a mount that is not the volume's at its staging path", "volumeID", staged.VolumeID,
			"stagingPath", staged.StagingPath, "source", m.Source, "fsType", m.FSType)
		return "", nil
	}
	// umount(2) first: umount(8) costs a program run and does the same
	// for these mounts; it stays the way to handle what umount(2) refuses.
	if err := unix.Unmount(staged.StagingPath, 0); err != nil {
		if err := n.mounter.Unmount(staged.StagingPath); err != nil {
			return "", status.Errorf(codes.Internal, "unmounting %s: %v", staged.StagingPath, err)
		}
	}
	name, _ := mounts.BlockDeviceName(m.Major, m.Minor)
	return "/dev/" + name, nil
}

// Expand makes the staged device take the volume's new size and, for a
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
	t, err := n.recordedTransport(id, staged.Transport)
	if err != nil {
		return 0, err
	}
	size, err := t.refresh(ctx, id, staged)
	if err != nil {
		return 0, err
	}
	fpExpandRefreshed.Hit()
	if staged.AccessType != accessmode.Mount {
		return size, nil
	}
	if staged.ReadOnly {
		return 0, readOnlyFilesystem(t, id, size)
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
func readOnlyFilesystem(t transport, id volumeid.ID, size int64) error {
	if modes := t.modes(id); accessmode.AllReadOnly(modes) {
		return status.Errorf(codes.FailedPrecondition,
			"volume %s is a filesystem no node may write (%s): its filesystem cannot grow on any node", id, accessmode.Names(modes))
	}
	return status.Errorf(codes.FailedPrecondition,
		"volume %s is staged read-only on this node: its device now has %d bytes, but a read-only filesystem cannot grow; "+
			"it grows when the volume is next staged read/write", id, size)
}

// Health checks that the device its transport brought and (for mount)
// the staging mount on that device are all still in place.
func (n *Node) Health(ctx context.Context, staged *backend.Staged) backend.Health {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return backend.Health{Abnormal: true, Reason: "InvalidVolumeID", Message: err.Error()}
	}
	t, err := n.recordedTransport(id, staged.Transport)
	if err != nil {
		return backend.Health{Abnormal: true, Reason: "NoTransport", Message: status.Convert(err).Message()}
	}
	if h := t.health(id, staged); h.Abnormal {
		return h
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
// recorded device must be the volume's now, as its transport tells, with
// the recorded read-only flag, and for access type mount the staging path
// must hold the filesystem of that device.
func (n *Node) Check(ctx context.Context, staged *backend.Staged) (backend.StageCheck, error) {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return backend.StageCheck{}, status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	t, err := n.recordedTransport(id, staged.Transport)
	if err != nil {
		return backend.StageCheck{}, err
	}
	bound, ro, err := t.bound(id, staged.Device)
	if err != nil {
		return backend.StageCheck{}, err
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
// bind mount of the node of, a device of the volume (transport.owns).
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
	return n.ownsDevice(id, name)
}

// ownsDevice tells whether the block device of that name is volume id's,
// asking every transport that may have made it.
func (n *Node) ownsDevice(id volumeid.ID, name string) (bool, error) {
	for _, t := range n.reaching(id) {
		if ours, err := t.owns(id, name); err != nil || ours {
			return ours, err
		}
	}
	return false, nil
}

// ReadOnlyDevices: a read-only publish of a raw block volume staged
// read/write gets a device of its own, bound read-only to the volume.
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

// ReadOnlyDevice binds what the stage's device comes from once more,
// read-only, at device, for one read-only publish of a raw block volume
// staged read/write (transport.viewSource says why).
func (n *Node) ReadOnlyDevice(ctx context.Context, staged *backend.Staged, device string) error {
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	t, err := n.recordedTransport(id, staged.Transport)
	if err != nil {
		return err
	}
	source, err := t.viewSource(id, staged)
	if err != nil {
		return err
	}
	if _, err := loop.AttachAt(ctx, device, source, true); err != nil {
		return status.Errorf(codes.Internal, "attaching volume %s read-only at %s: %v", id, device, err)
	}
	return nil
}

// ReleaseDevice detaches a device ReadOnlyDevice made, if it is still a
// view of the volume (a device since reused for something else stays).
// Whichever transport made it releases it; the others leave it alone.
func (n *Node) ReleaseDevice(ctx context.Context, id volumeid.ID, device string) error {
	if !loop.ValidDevice(device) {
		return status.Errorf(codes.Internal, "%q is not a loop device; refusing to touch it", device)
	}
	for _, t := range n.reaching(id) {
		if err := t.releaseView(ctx, id, device); err != nil {
			return err
		}
	}
	return nil
}

// RefreshDevice makes a device ReadOnlyDevice made pick up the volume's
// new size, as Expand does for the staged device. A device that is no
// longer the volume's (a publish interrupted before binding it, or a
// device since reused) is left alone and reported as not refreshed.
func (n *Node) RefreshDevice(ctx context.Context, id volumeid.ID, device string) (bool, error) {
	if !loop.ValidDevice(device) {
		return false, status.Errorf(codes.Internal, "%q is not a loop device; refusing to touch it", device)
	}
	if ours, err := n.ownsDevice(id, filepath.Base(device)); err != nil || !ours {
		return false, err
	}
	if err := loop.Refresh(ctx, device); err != nil {
		return false, status.Errorf(codes.Internal, "refreshing size of %s: %v", device, err)
	}
	return true, nil
}
