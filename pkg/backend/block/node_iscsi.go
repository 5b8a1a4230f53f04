package block

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/iqn"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// ISCSI is what a node needs to reach the volumes a storage target
// serves it over iSCSI (package served): the target's access list lets
// the node in only while the volume is attached to it, so the node's own
// checks are about the disk it got, not about whether it may have it.
type ISCSI struct {
	Initiator iscsi.Initiator
	// User is this node's CHAP user name: its node key, under which the
	// target keeps its secret.
	User string
	// SecretFile holds this node's CHAP secret; it is read at every login,
	// so a rotated secret needs no restart.
	SecretFile string
	// DiskTimeout bounds the wait for the volume's disk after the login
	// (the kernel scans a new session's LUNs by itself); 0 is 30 s.
	DiskTimeout time.Duration
}

// NewNetworkNode is NewNode for a node that also reaches volumes over
// iSCSI; pools may be empty (no zone shares its pool with this node).
func NewNetworkNode(pools map[string]string, cfg ISCSI) (*Node, error) {
	if !iscsi.ValidCHAPUser(cfg.User) {
		return nil, fmt.Errorf("the node key %q cannot be a CHAP user name (1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-')", cfg.User)
	}
	if _, err := readCHAPSecret(cfg.SecretFile); err != nil {
		return nil, err
	}
	if cfg.DiskTimeout <= 0 {
		cfg.DiskTimeout = 30 * time.Second
	}
	n := newNode(map[string]*pool{}, nil)
	if len(pools) > 0 {
		var err error
		if n, err = NewNode(pools); err != nil {
			return nil, err
		}
	}
	n.iscsi = &cfg
	return n, nil
}

func readCHAPSecret(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("reading this node's CHAP secret: %w", err)
	}
	secret := strings.TrimRight(string(data), "\r\n")
	if !iscsi.ValidCHAPSecret(secret) {
		return "", fmt.Errorf("this node's CHAP secret in %s is not 12 to 255 printable ASCII characters without blanks", path)
	}
	return secret, nil
}

// overISCSI tells whether a stage of volume id is reached over iSCSI: its
// record says so, or this node has no pool for the volume's zone and
// reaches volumes over iSCSI (a stage interrupted before it was recorded).
func (n *Node) overISCSI(id volumeid.ID, transport map[string]string) bool {
	if transport[iscsi.ContextTransport] != "" {
		return true
	}
	_, shared := n.pools[id.Zone]
	return !shared && n.iscsi != nil
}

// stageISCSI logs in to the volume's target, finds its disk by serial,
// checks it against the attachment, and then formats and mounts it (or
// hands it over) as a loop device is. Whatever fails after the login logs
// out again, so a refused stage leaves no session.
func (n *Node) stageISCSI(ctx context.Context, req backend.StageRequest, v iscsi.Volume) (*backend.Staged, error) {
	if n.iscsi == nil {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is served over iSCSI and this node plugin has no iSCSI initiator; start it with --iscsi-initiator-name-file and --iscsi-chap-secret-file", req.VolumeID)
	}
	if req.CapacityBytes <= 0 {
		return nil, status.Errorf(codes.FailedPrecondition,
			"the publish context of volume %s names no capacity, which its disk must have; ControllerPublishVolume of this driver must succeed for this node first", req.VolumeID)
	}
	fsType := ""
	if req.AccessType == accessmode.Mount {
		fsType = req.FsType
		if err := backend.CheckFsType(fsType); err != nil {
			return nil, err
		}
		if err := fsutil.CheckCOPath("staging path", req.StagingPath); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		if staged, err := n.alreadyStagedISCSI(req, v, fsType); err != nil || staged != nil {
			return staged, err
		}
	}
	secret, err := readCHAPSecret(n.iscsi.SecretFile)
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	in := &n.iscsi.Initiator
	if err := in.Login(ctx, iscsi.Target{IQN: v.Target, Portal: v.Portal, User: n.iscsi.User, Secret: secret}); err != nil {
		if errors.Is(err, iscsi.ErrLoginRefused) {
			return nil, status.Errorf(codes.FailedPrecondition,
				"the storage target refused this node's login to volume %s: the volume is not attached to it there, or its CHAP secret is not the target's: %v", req.VolumeID, err)
		}
		return nil, status.Errorf(codes.Unavailable, "logging in to volume %s's target: %v", req.VolumeID, err)
	}
	undo := func(reason error) error {
		if lerr := in.Logout(context.WithoutCancel(ctx), v.Target, v.Portal); lerr != nil {
			klog.ErrorS(lerr, "Logging out after a failed stage", "volumeID", req.VolumeID, "target", v.Target)
		}
		return reason
	}
	wait, cancel := context.WithTimeout(ctx, n.iscsi.DiskTimeout)
	disk, err := in.WaitDisk(wait, v.Target, v.Portal, v.Serial)
	cancel()
	if err != nil {
		return nil, undo(status.Errorf(codes.Unavailable, "volume %s's disk: %v", req.VolumeID, err))
	}
	fpStageLoggedIn.Hit()
	if err := disk.Check(req.CapacityBytes, req.AttachedReadOnly); err != nil {
		return nil, undo(status.Errorf(codes.FailedPrecondition, "volume %s: %v", req.VolumeID, err))
	}
	if req.ReadOnly && !disk.ReadOnly {
		// Staged read-only by a mode within a writable attachment: the
		// kernel's flag keeps this node's own writes off the disk, for a
		// raw block stage too, where no mount option could.
		if err := setKernelReadOnly(disk.Device); err != nil {
			return nil, undo(status.Errorf(codes.Internal, "making %s read-only: %v", disk.Device, err))
		}
	}
	staged := &backend.Staged{
		VolumeID:    req.VolumeID.String(),
		StagingPath: req.StagingPath,
		AccessType:  req.AccessType,
		FsType:      fsType,
		ReadOnly:    req.ReadOnly,
		Device:      disk.Device,
		Transport:   v.Context(),
		Since:       time.Now().UTC(),
	}
	if req.AccessType == accessmode.Block {
		return staged, nil
	}
	// Whether any node may ever write the volume is the controller's to
	// know; a volume no node may write is write-protected at the target,
	// and a read-only mount that skips the journal is right for both.
	if err := n.mountStaged(ctx, staged, true, req.MountFlags); err != nil {
		return nil, undo(err)
	}
	return staged, nil
}

// fpStageLoggedIn is the step after the login, before anything records
// it: a crash there leaves a session only the kernel knows of.
var fpStageLoggedIn = faultpoint.New("block.stage.iscsi-logged-in")

// setKernelReadOnly sets the kernel's read-only flag of a disk (BLKROSET).
func setKernelReadOnly(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 1)
}

// alreadyStagedISCSI is alreadyStaged for a disk reached over iSCSI: what
// is mounted at the staging path is this volume's only if it is a disk
// with the volume's serial.
func (n *Node) alreadyStagedISCSI(req backend.StageRequest, v iscsi.Volume, fsType string) (*backend.Staged, error) {
	m, err := n.table.At(req.StagingPath)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting staging path %s: %v", req.StagingPath, err)
	}
	if m == nil {
		return nil, nil
	}
	name, err := mounts.BlockDeviceName(m.Major, m.Minor)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting staging path %s: %v", req.StagingPath, err)
	}
	if name == "" || n.iscsi.Initiator.SerialOf(name) != v.Serial {
		return nil, status.Errorf(codes.AlreadyExists, "staging path %s already has %s (%s) mounted on it, not volume %s", req.StagingPath, m.Source, m.FSType, req.VolumeID)
	}
	disk, err := n.iscsiDisk(req.VolumeID, "/dev/"+name)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting staging path %s: %v", req.StagingPath, err)
	}
	if disk.ReadOnly != req.ReadOnly {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s is already staged at %s with readonly=%t", req.VolumeID, req.StagingPath, disk.ReadOnly)
	}
	existing, err := n.mounter.GetDiskFormat(disk.Device)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "probing %s: %v", disk.Device, err)
	}
	if fsType != "" && existing != fsType {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s is already staged at %s as %s, not %s", req.VolumeID, req.StagingPath, existing, fsType)
	}
	return &backend.Staged{
		VolumeID: req.VolumeID.String(), StagingPath: req.StagingPath, AccessType: req.AccessType,
		FsType: existing, ReadOnly: req.ReadOnly, Device: disk.Device, Transport: v.Context(), Since: time.Now().UTC(),
	}, nil
}

// iscsiDisk finds volume id's disk among the kernel's iSCSI sessions; with
// want set, it must be that device. More than one disk with the volume's
// serial is an error: only one session to its target is ever made.
func (n *Node) iscsiDisk(id volumeid.ID, want string) (iscsi.Disk, error) {
	disks, _, err := n.iscsi.Initiator.DisksWithSerial(iscsi.VolumeSerial(id.String()))
	if err != nil {
		return iscsi.Disk{}, err
	}
	switch {
	case len(disks) == 0:
		return iscsi.Disk{}, fmt.Errorf("%w: no iSCSI session leads to volume %s's disk", iscsi.ErrNoDisk, id)
	case len(disks) > 1:
		return iscsi.Disk{}, fmt.Errorf("%d disks have volume %s's serial; there should be one", len(disks), id)
	case want != "" && disks[0].Device != want:
		return iscsi.Disk{}, fmt.Errorf("%w: volume %s's disk is %s now, not %s", iscsi.ErrNoDisk, id, disks[0].Device, want)
	}
	return disks[0], nil
}

// unstageISCSI unmounts the staging path if it holds the volume's disk,
// then logs out of every session that leads to the volume: the one the
// record names and any a crash left (found by the disk's serial).
// Logout flushes first.
func (n *Node) unstageISCSI(ctx context.Context, id volumeid.ID, staged *backend.Staged) error {
	if n.iscsi == nil {
		return status.Errorf(codes.FailedPrecondition, "volume %s was staged over iSCSI and this node plugin has no iSCSI initiator now", id)
	}
	if err := n.unmountIfOurs(ctx, id, staged); err != nil {
		return err
	}
	type session struct {
		target string
		portal netip.AddrPort
	}
	var ends []session
	if v, ok, err := iscsi.FromContext(id.String(), staged.Transport); ok && err == nil {
		ends = append(ends, session{v.Target, v.Portal})
	}
	_, sessions, err := n.iscsi.Initiator.DisksWithSerial(iscsi.VolumeSerial(id.String()))
	if err != nil {
		return status.Errorf(codes.Internal, "looking for sessions to volume %s: %v", id, err)
	}
	for _, s := range sessions {
		if !iqn.Valid(s.Target) {
			continue
		}
		ends = append(ends, session{s.Target, s.Portal})
	}
	for _, s := range ends {
		if err := n.iscsi.Initiator.Logout(ctx, s.target, s.portal); err != nil {
			return status.Errorf(codes.Internal, "logging out of volume %s's target: %v", id, err)
		}
	}
	return nil
}

// unmountIfOurs unmounts a mount stage's staging path if what is mounted
// there is the volume's (Owns).
func (n *Node) unmountIfOurs(ctx context.Context, id volumeid.ID, staged *backend.Staged) error {
	if staged.AccessType != accessmode.Mount || staged.StagingPath == "" {
		return nil
	}
	m, err := n.table.At(staged.StagingPath)
	if err != nil {
		return status.Errorf(codes.Internal, "inspecting staging path %s: %v", staged.StagingPath, err)
	}
	if m == nil {
		return nil
	}
	ours, err := n.Owns(ctx, id, m)
	if err != nil {
		return err
	}
	if !ours {
		// Not this volume's: it is not ours to unmount, and the volume's
		// own mount is not there to undo.
		klog.InfoS("Leaving a mount that is not the volume's at its staging path", "volumeID", staged.VolumeID,
			"stagingPath", staged.StagingPath, "source", m.Source, "fsType", m.FSType)
		return nil
	}
	if err := n.mounter.Unmount(staged.StagingPath); err != nil {
		return status.Errorf(codes.Internal, "unmounting %s: %v", staged.StagingPath, err)
	}
	return nil
}

// boundISCSI tells whether the recorded device is the volume's disk now,
// and the kernel's read-only flag of it.
func (n *Node) boundISCSI(id volumeid.ID, staged *backend.Staged) (bound, readOnly bool, err error) {
	if staged.Device == "" || n.iscsi == nil {
		return false, false, nil
	}
	disk, err := n.iscsiDisk(id, staged.Device)
	if errors.Is(err, iscsi.ErrNoDisk) {
		return false, false, nil
	}
	if err != nil {
		return false, false, status.Errorf(codes.Internal, "inspecting volume %s's disk: %v", id, err)
	}
	return true, disk.ReadOnly, nil
}

// healthISCSI checks that the volume's disk is still the recorded device
// and its session is logged in.
func (n *Node) healthISCSI(id volumeid.ID, staged *backend.Staged) (backend.Health, bool) {
	if n.iscsi == nil {
		return backend.Health{Abnormal: true, Reason: "NoInitiator", Message: "this node plugin has no iSCSI initiator now"}, false
	}
	disks, sessions, err := n.iscsi.Initiator.DisksWithSerial(iscsi.VolumeSerial(id.String()))
	switch {
	case err != nil:
		return backend.Health{Abnormal: true, Reason: "SessionUnreadable", Message: err.Error()}, false
	case len(disks) == 0:
		return backend.Health{Abnormal: true, Reason: "DiskGone", Message: "no iSCSI session leads to the volume's disk any more"}, false
	case len(disks) > 1 || disks[0].Device != staged.Device:
		return backend.Health{Abnormal: true, Reason: "DiskReassigned", Message: fmt.Sprintf("the volume's disk is not %s any more", staged.Device)}, false
	case sessions[0].State != "LOGGED_IN":
		return backend.Health{Abnormal: true, Reason: "SessionFailed",
			Message: fmt.Sprintf("the iSCSI session to %s is %s: the target does not answer, or it no longer lets this node in", sessions[0].Target, sessions[0].State)}, false
	}
	return backend.Health{}, true
}

// ownsDisk tells whether the device named (a disk, or a loop device over
// one for a read-only publish) is volume id's disk reached over iSCSI.
func (n *Node) ownsDisk(id volumeid.ID, name string) (bool, error) {
	if n.iscsi == nil {
		return false, nil
	}
	serial := iscsi.VolumeSerial(id.String())
	dev := "/dev/" + name
	if !loop.ValidDevice(dev) {
		return n.iscsi.Initiator.SerialOf(name) == serial, nil
	}
	backing, err := loop.BackingFile(dev)
	if err != nil || !strings.HasPrefix(backing, "/dev/") {
		return false, err
	}
	if n.iscsi.Initiator.SerialOf(filepath.Base(backing)) != serial {
		return false, nil
	}
	return loop.BoundTo(dev, backing)
}

// viewOfDisk tells whether a read-only device made for a publish of
// volume id (ReadOnlyDevice) is over a disk rather than an image: always on
// a node without a pool for the volume's zone; elsewhere when the device is
// bound to a device node. An unbound device is either, and both ways of
// releasing it leave it alone.
func (n *Node) viewOfDisk(id volumeid.ID, device string) bool {
	if n.iscsi == nil {
		return false
	}
	if n.overISCSI(id, nil) {
		return true
	}
	backing, err := loop.BackingFile(device)
	return err == nil && strings.HasPrefix(backing, "/dev/")
}

// diskOfStage is the volume's disk for a read-only view of a stage: the
// recorded device, checked to be the volume's now.
func (n *Node) diskOfStage(id volumeid.ID, staged *backend.Staged) (string, error) {
	disk, err := n.iscsiDisk(id, staged.Device)
	if err != nil {
		return "", status.Errorf(codes.FailedPrecondition, "volume %s: %v; stage it again", id, err)
	}
	return disk.Device, nil
}

// releaseDiskView detaches a read-only loop device over the volume's
// disk. With the disk gone (its session ended), a device still bound to
// a disk node that is no longer there is released too: what it showed is
// gone, and the driver recorded this device for the volume.
func (n *Node) releaseDiskView(ctx context.Context, id volumeid.ID, device string) error {
	if disk, err := n.iscsiDisk(id, ""); err == nil {
		if _, err := loop.DetachIfBackedBy(ctx, device, disk.Device); err != nil {
			return status.Errorf(codes.Internal, "detaching %s: %v", device, err)
		}
		return nil
	} else if !errors.Is(err, iscsi.ErrNoDisk) {
		return status.Errorf(codes.Internal, "inspecting volume %s's disk: %v", id, err)
	}
	backing, err := loop.BackingFile(device)
	if err != nil || backing == "" || !strings.HasPrefix(backing, "/dev/") {
		return err
	}
	if live, err := loop.BoundTo(device, backing); err != nil || live {
		// The disk node there now is the one bound: another disk's.
		return err
	}
	if _, err := loop.DetachIfBackedBy(ctx, device, backing); err != nil {
		return status.Errorf(codes.Internal, "detaching %s: %v", device, err)
	}
	return nil
}

// expandISCSI has the kernel read the disk's capacity again (the target
// grew the volume) and, for a read/write mount, grows the filesystem into
// it, as Expand does with a loop device.
func (n *Node) expandISCSI(ctx context.Context, id volumeid.ID, staged *backend.Staged) (int64, error) {
	if n.iscsi == nil {
		return 0, status.Errorf(codes.FailedPrecondition, "volume %s was staged over iSCSI and this node plugin has no iSCSI initiator now", id)
	}
	disk, err := n.iscsiDisk(id, staged.Device)
	if errors.Is(err, iscsi.ErrNoDisk) {
		return 0, status.Errorf(codes.FailedPrecondition, "volume %s is not attached at %s any more; stage it again: %v", id, staged.Device, err)
	}
	if err != nil {
		return 0, status.Errorf(codes.Internal, "inspecting volume %s's disk: %v", id, err)
	}
	if disk, err = n.iscsi.Initiator.Rescan(disk); err != nil {
		return 0, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	if staged.AccessType != accessmode.Mount {
		return disk.Size, nil
	}
	if staged.ReadOnly {
		return 0, status.Errorf(codes.FailedPrecondition,
			"volume %s is staged read-only on this node: its disk now has %d bytes, but a read-only filesystem cannot grow; "+
				"it grows when the volume is next staged read/write", id, disk.Size)
	}
	if _, err := n.resizer.Resize(staged.Device, staged.StagingPath); err != nil {
		return 0, status.Errorf(codes.Internal, "growing filesystem of volume %s: %v", id, err)
	}
	return disk.Size, nil
}

// refreshDiskView makes a read-only loop device over the volume's disk
// pick up the disk's new size (after expandISCSI's rescan). A device that
// is no longer over the volume's disk is left alone and reported as not
// refreshed.
func (n *Node) refreshDiskView(ctx context.Context, id volumeid.ID, device string) (bool, error) {
	ours, err := n.ownsDisk(id, filepath.Base(device))
	if err != nil {
		return false, status.Errorf(codes.Internal, "inspecting %s: %v", device, err)
	}
	if !ours {
		return false, nil
	}
	if err := loop.Refresh(ctx, device); err != nil {
		return false, status.Errorf(codes.Internal, "refreshing size of %s: %v", device, err)
	}
	return true, nil
}
