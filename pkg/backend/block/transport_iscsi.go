// This file holds the iSCSI transport: a node logs in with open-iscsi to
// the storage target that serves a volume (package served) and uses the
// disk it gets. The target's access list lets the node in only while the
// volume is attached to it, so the node's own checks are about the disk
// it got (found by the serial derived from the volume id), not about
// whether it may have it; and every later question is answered from the
// kernel's sessions, so that a session a crash left is found and ended.

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
	"github.com/modeguard/modeguard/pkg/iqn"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

var _ transport = (*iscsiTransport)(nil)

// ISCSI is what a node needs to reach the volumes a storage target
// serves it over iSCSI.
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
	n.network[iscsi.TransportName] = &iscsiTransport{cfg}
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

// iscsiTransport reaches the volumes storage targets serve over iSCSI.
type iscsiTransport struct {
	ISCSI
}

// fpStageLoggedIn is the step after the login, before anything records
// it: a crash there leaves a session only the kernel knows of.
var fpStageLoggedIn = faultpoint.New("block.stage.iscsi-logged-in")

// volume reads where the volume's disk is from the stage request's volume
// context.
func (t *iscsiTransport) volume(req backend.StageRequest) (iscsi.Volume, error) {
	v, _, err := iscsi.FromContext(req.VolumeID.String(), req.VolumeContext)
	if err != nil {
		return iscsi.Volume{}, status.Error(codes.InvalidArgument, err.Error())
	}
	return v, nil
}

// admit needs the volume's coordinates and the capacity its disk must
// have; whether this node may have the volume is the target's to say.
// Whether any node may ever write the volume is the controller's to know;
// a volume no node may write is write-protected at the target, and a
// read-only mount that skips the journal is right for both.
func (t *iscsiTransport) admit(req backend.StageRequest) (admission, error) {
	v, err := t.volume(req)
	if err != nil {
		return admission{}, err
	}
	if req.CapacityBytes <= 0 {
		return admission{}, status.Errorf(codes.FailedPrecondition,
			"the publish context of volume %s names no capacity, which its disk must have; ControllerPublishVolume of this driver must succeed for this node first", req.VolumeID)
	}
	return admission{writable: true, record: v.Context()}, nil
}

// attach logs in to the volume's target, finds its disk by serial and
// checks it against the attachment. Whatever fails after the login logs
// out again, so a refused stage leaves no session.
func (t *iscsiTransport) attach(ctx context.Context, req backend.StageRequest) (string, error) {
	v, err := t.volume(req)
	if err != nil {
		return "", err
	}
	secret, err := readCHAPSecret(t.SecretFile)
	if err != nil {
		return "", status.Error(codes.FailedPrecondition, err.Error())
	}
	in := &t.Initiator
	if err := in.Login(ctx, iscsi.Target{IQN: v.Target, Portal: v.Portal, User: t.User, Secret: secret}); err != nil {
		if errors.Is(err, iscsi.ErrLoginRefused) {
			return "", status.Errorf(codes.FailedPrecondition,
				"the storage target refused this node's login to volume %s: the volume is not attached to it there, or its CHAP secret is not the target's: %v", req.VolumeID, err)
		}
		return "", status.Errorf(codes.Unavailable, "logging in to volume %s's target: %v", req.VolumeID, err)
	}
	undo := func(reason error) error {
		if lerr := in.Logout(context.WithoutCancel(ctx), v.Target, v.Portal); lerr != nil {
			klog.ErrorS(lerr, "Logging out after a failed stage", "volumeID", req.VolumeID, "target", v.Target)
		}
		return reason
	}
	wait, cancel := context.WithTimeout(ctx, t.DiskTimeout)
	disk, err := in.WaitDisk(wait, v.Target, v.Portal, v.Serial)
	cancel()
	if err != nil {
		return "", undo(status.Errorf(codes.Unavailable, "volume %s's disk: %v", req.VolumeID, err))
	}
	fpStageLoggedIn.Hit()
	if disk, err = in.CheckAttached(disk, req.CapacityBytes, req.AttachedReadOnly); err != nil {
		return "", undo(status.Errorf(codes.FailedPrecondition, "volume %s: %v", req.VolumeID, err))
	}
	if req.ReadOnly && !disk.ReadOnly {
		// Staged read-only by a mode within a writable attachment: the
		// kernel's flag keeps this node's own writes off the disk, for a
		// raw block stage too, where no mount option could.
		if err := setKernelReadOnly(disk.Device); err != nil {
			return "", undo(status.Errorf(codes.Internal, "making %s read-only: %v", disk.Device, err))
		}
	}
	return disk.Device, nil
}

// setKernelReadOnly sets the kernel's read-only flag of a disk (BLKROSET).
func setKernelReadOnly(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 1)
}

// disk finds volume id's disk among the kernel's iSCSI sessions; with
// want set, it must be that device. More than one disk with the volume's
// serial is an error: only one session to its target is ever made.
func (t *iscsiTransport) disk(id volumeid.ID, want string) (iscsi.Disk, error) {
	disks, _, err := t.Initiator.DisksWithSerial(iscsi.VolumeSerial(id.String()))
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

// release logs out of every session that leads to the volume: the one the
// record names and any a crash left (found by the disk's serial). Logout
// flushes first.
func (t *iscsiTransport) release(ctx context.Context, id volumeid.ID, staged *backend.Staged) error {
	type session struct {
		target string
		portal netip.AddrPort
	}
	var ends []session
	if v, ok, err := iscsi.FromContext(id.String(), staged.Transport); ok && err == nil {
		ends = append(ends, session{v.Target, v.Portal})
	}
	_, sessions, err := t.Initiator.DisksWithSerial(iscsi.VolumeSerial(id.String()))
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
		if err := t.Initiator.Logout(ctx, s.target, s.portal); err != nil {
			return status.Errorf(codes.Internal, "logging out of volume %s's target: %v", id, err)
		}
	}
	return nil
}

// bound asks the kernel's sessions which disk is the volume's now.
func (t *iscsiTransport) bound(id volumeid.ID, device string) (bool, bool, error) {
	if device == "" {
		return false, false, nil
	}
	disk, err := t.disk(id, device)
	if errors.Is(err, iscsi.ErrNoDisk) {
		return false, false, nil
	}
	if err != nil {
		return false, false, status.Errorf(codes.Internal, "inspecting volume %s's disk: %v", id, err)
	}
	return true, disk.ReadOnly, nil
}

// owns takes a disk with the volume's serial, and a loop device bound to
// one (a read-only publish).
func (t *iscsiTransport) owns(id volumeid.ID, name string) (bool, error) {
	serial := iscsi.VolumeSerial(id.String())
	dev := "/dev/" + name
	if !loop.ValidDevice(dev) {
		return t.Initiator.SerialOf(name) == serial, nil
	}
	backing, err := loop.BackingFile(dev)
	if err != nil {
		return false, status.Errorf(codes.Internal, "inspecting %s: %v", dev, err)
	}
	if !strings.HasPrefix(backing, "/dev/") || t.Initiator.SerialOf(filepath.Base(backing)) != serial {
		return false, nil
	}
	return boundTo(dev, backing)
}

// health checks that the volume's disk is still the recorded device and
// its session is logged in.
func (t *iscsiTransport) health(id volumeid.ID, staged *backend.Staged) backend.Health {
	disks, sessions, err := t.Initiator.DisksWithSerial(iscsi.VolumeSerial(id.String()))
	switch {
	case err != nil:
		return backend.Health{Abnormal: true, Reason: "SessionUnreadable", Message: err.Error()}
	case len(disks) == 0:
		return backend.Health{Abnormal: true, Reason: "DiskGone", Message: "no iSCSI session leads to the volume's disk any more"}
	case len(disks) > 1 || disks[0].Device != staged.Device:
		return backend.Health{Abnormal: true, Reason: "DiskReassigned", Message: fmt.Sprintf("the volume's disk is not %s any more", staged.Device)}
	case sessions[0].State != "LOGGED_IN":
		return backend.Health{Abnormal: true, Reason: "SessionFailed",
			Message: fmt.Sprintf("the iSCSI session to %s is %s: the target does not answer, or it no longer lets this node in", sessions[0].Target, sessions[0].State)}
	}
	return backend.Health{}
}

// refresh has the kernel read the disk's capacity again: the target grew
// the volume.
func (t *iscsiTransport) refresh(ctx context.Context, id volumeid.ID, staged *backend.Staged) (int64, error) {
	disk, err := t.disk(id, staged.Device)
	if errors.Is(err, iscsi.ErrNoDisk) {
		return 0, status.Errorf(codes.FailedPrecondition, "volume %s is not attached at %s any more; stage it again: %v", id, staged.Device, err)
	}
	if err != nil {
		return 0, status.Errorf(codes.Internal, "inspecting volume %s's disk: %v", id, err)
	}
	if disk, err = t.Initiator.Rescan(disk); err != nil {
		return 0, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	return disk.Size, nil
}

// modes are the controller's to know: the target enforces them.
func (t *iscsiTransport) modes(volumeid.ID) []accessmode.Mode { return nil }

// viewSource is the recorded disk, checked to be the volume's now. The
// disk's own read-only flag is the stage's, which other publishes of it
// write through, so a read-only view is a loop device over it.
func (t *iscsiTransport) viewSource(id volumeid.ID, staged *backend.Staged) (string, error) {
	disk, err := t.disk(id, staged.Device)
	if err != nil {
		return "", status.Errorf(codes.FailedPrecondition, "volume %s: %v; stage it again", id, err)
	}
	return disk.Device, nil
}

// releaseView detaches a read-only loop device over the volume's disk.
// With the disk gone (its session ended), a device still bound to a disk
// node that is no longer there is released too: what it showed is gone,
// and the driver recorded this device for the volume. A device over a
// file, or over nothing, is not a view of a disk and stays.
func (t *iscsiTransport) releaseView(ctx context.Context, id volumeid.ID, device string) error {
	backing, err := loop.BackingFile(device)
	if err != nil {
		return status.Errorf(codes.Internal, "inspecting %s: %v", device, err)
	}
	if !strings.HasPrefix(backing, "/dev/") {
		return nil
	}
	if disk, err := t.disk(id, ""); err == nil {
		if _, err := loop.DetachIfBackedBy(ctx, device, disk.Device); err != nil {
			return status.Errorf(codes.Internal, "detaching %s: %v", device, err)
		}
		return nil
	} else if !errors.Is(err, iscsi.ErrNoDisk) {
		return status.Errorf(codes.Internal, "inspecting volume %s's disk: %v", id, err)
	}
	if live, err := boundTo(device, backing); err != nil {
		return err
	} else if live {
		// The disk node there now is the one bound: another disk's.
		return nil
	}
	if _, err := loop.DetachIfBackedBy(ctx, device, backing); err != nil {
		return status.Errorf(codes.Internal, "detaching %s: %v", device, err)
	}
	return nil
}
