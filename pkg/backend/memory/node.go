package memory

// The node side: stages are records, checked against the controller's
// attachments as the block node checks its pool's, with no kernel
// involved but the staging directory it creates.

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Node is a backend.Node whose stages are records. It reads the volumes
// and their attachments from its Controller, as a block node reads the
// pool it shares with its controller. Faults injects into its methods.
type Node struct {
	Faults

	ctrl *Controller
	// table and devices, when set, are the node's "kernel" (see
	// WithMounts).
	table   *mounts.Memory
	devices string

	mu     sync.Mutex
	staged map[string]*backend.Staged // by staging path
}

var _ backend.Node = (*Node)(nil)

// NodeOption adjusts a Node.
type NodeOption func(*Node)

// WithMounts makes the node's stages visible as the kernel's would be to a
// node plugin that reads table: a stage of access type mount mounts the
// volume's Source at its staging path, and one of access type block makes
// a device node (a plain file) for it in devices, so that a plugin's bind
// mounts of either (mounts.Memory's Bind) show whose they are, and Check
// compares its records with the table as the real backends compare theirs
// with the kernel's.
func WithMounts(table *mounts.Memory, devices string) NodeOption {
	return func(n *Node) { n.table, n.devices = table, devices }
}

// NewNode makes a node of the volumes ctrl holds.
func NewNode(ctrl *Controller, opts ...NodeOption) *Node {
	n := &Node{Faults: newFaults((*backend.Node)(nil)), ctrl: ctrl, staged: map[string]*backend.Staged{}}
	for _, o := range opts {
		o(n)
	}
	return n
}

func (n *Node) Backend() accessmode.Backend { return n.ctrl.backend }

// ReadOnlyDevices is nil: a node without devices has none to give.
func (n *Node) ReadOnlyDevices() backend.ReadOnlyDevices { return nil }

// Source is what a stage of volume id has "mounted", as Owns recognises it.
func Source(id string) string { return "memory:" + id }

// Stage checks the request against the volume's attachment to the node,
// creates the staging directory (access type mount) and records the stage.
// A stage repeated with the same arguments returns the record; another
// volume's, or other arguments, at the same path are ALREADY_EXISTS.
func (n *Node) Stage(ctx context.Context, req backend.StageRequest) (*backend.Staged, error) {
	if err := n.enter(ctx, "Stage"); err != nil {
		return nil, err
	}
	if req.VolumeID.Backend != n.ctrl.backend || req.VolumeID.Kind != volumeid.Volume {
		return nil, status.Errorf(codes.InvalidArgument, "%s is not a %s volume id", req.VolumeID, n.ctrl.backend)
	}
	if _, err := n.ctrl.pool(req.VolumeID.Zone); err != nil {
		// As with a block node: a zone this node has no pool of is a
		// matter of where the volume was scheduled.
		return nil, status.Errorf(codes.FailedPrecondition, "this node cannot stage volume %s: %v", req.VolumeID, status.Convert(err).Message())
	}
	vol, err := n.ctrl.volume(req.VolumeID)
	if err != nil {
		return nil, err
	}
	if err := checkStage(vol, req); err != nil {
		return nil, err
	}
	staged := &backend.Staged{
		VolumeID: vol.ID, StagingPath: req.StagingPath, AccessType: req.AccessType, ReadOnly: req.ReadOnly,
		Mode: req.Mode, Source: Source(vol.ID), Fingerprint: fingerprint(req), Since: time.Now().UTC(),
	}
	if req.AccessType == accessmode.Mount {
		staged.FsType = req.FsType
		if staged.FsType == "" {
			staged.FsType = vol.FsType
		}
		if staged.FsType == "" {
			staged.FsType = "ext4"
		}
		if err := backend.CheckFsType(staged.FsType); err != nil {
			return nil, err
		}
		if err := fsutil.CheckCOPath("staging path", req.StagingPath); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	} else {
		staged.Device = n.devicePath(req.VolumeID)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if have, ok := n.staged[req.StagingPath]; ok {
		if have.VolumeID != vol.ID || have.Fingerprint != staged.Fingerprint {
			return nil, status.Errorf(codes.AlreadyExists, "staging path %s already holds volume %s (%s), not volume %s as asked",
				req.StagingPath, have.VolumeID, have.Fingerprint, vol.ID)
		}
		out := *have
		return &out, nil
	}
	if err := n.attach(staged); err != nil {
		return nil, err
	}
	n.staged[req.StagingPath] = staged
	out := *staged
	return &out, nil
}

// devicePath is where a block stage of id has its device: a name under
// /dev that nothing else uses, or a file in the node's device directory.
func (n *Node) devicePath(id volumeid.ID) string {
	if n.devices == "" {
		return "/dev/" + Source(id.String())
	}
	return filepath.Join(n.devices, id.FileName())
}

// attach makes what a stage leaves in the "kernel": the staging directory
// and, with a table, the volume mounted there, or its device file.
func (n *Node) attach(staged *backend.Staged) error {
	if staged.AccessType == accessmode.Block {
		if n.devices == "" {
			return nil
		}
		if err := os.WriteFile(staged.Device, nil, 0o600); err != nil {
			return status.Errorf(codes.Internal, "making the device of %s: %v", staged.VolumeID, err)
		}
		return nil
	}
	if err := os.MkdirAll(staged.StagingPath, 0o750); err != nil {
		return status.Errorf(codes.Internal, "creating staging path: %v", err)
	}
	if n.table != nil {
		if err := n.table.Mount(staged.Source, staged.StagingPath, "memory", staged.ReadOnly); err != nil {
			return status.Errorf(codes.Internal, "mounting %s at %s: %v", staged.VolumeID, staged.StagingPath, err)
		}
	}
	return nil
}

// detach undoes attach; what is already gone is fine.
func (n *Node) detach(staged *backend.Staged) error {
	if staged.AccessType == accessmode.Block {
		if n.devices != "" {
			if err := os.Remove(staged.Device); err != nil && !errors.Is(err, os.ErrNotExist) {
				return status.Errorf(codes.Internal, "removing the device of %s: %v", staged.VolumeID, err)
			}
		}
		return nil
	}
	if n.table == nil {
		return nil
	}
	m, err := n.table.Table().At(staged.StagingPath)
	if err != nil {
		return status.Errorf(codes.Internal, "reading the mount table: %v", err)
	}
	if m == nil || m.Source != staged.Source {
		return nil
	}
	if err := n.table.Unmount(staged.StagingPath); err != nil {
		return status.Errorf(codes.Internal, "unmounting %s: %v", staged.StagingPath, err)
	}
	return nil
}

// checkStage refuses a stage the volume's attachment to the node does not
// allow, as the block node does.
func checkStage(vol *backend.Volume, req backend.StageRequest) error {
	var att *accessmode.Attachment
	for i := range vol.Attachments {
		if vol.Attachments[i].Node.Name == req.Node.Name {
			att = &vol.Attachments[i]
		}
	}
	switch {
	case att == nil:
		return status.Errorf(codes.FailedPrecondition, "volume %s is not attached to node %s", vol.ID, req.Node)
	case !req.ReadOnly && (att.ReadOnly || accessmode.IsReadOnly(att.Mode)):
		return status.Errorf(codes.FailedPrecondition, "volume %s is attached to node %s read-only (%s); a read/write stage is refused",
			vol.ID, req.Node, accessmode.Name(att.Mode))
	case req.Mode != 0 && !accessmode.Within(req.Mode, att.Mode):
		return status.Errorf(codes.FailedPrecondition, "volume %s is attached to node %s as %s; a stage as %s would allow more than that",
			vol.ID, req.Node, accessmode.Name(att.Mode), accessmode.Name(req.Mode))
	case req.AccessType != vol.AccessType:
		return status.Errorf(codes.FailedPrecondition, "volume %s was created for access type %s, not %s", vol.ID, vol.AccessType, req.AccessType)
	}
	return nil
}

// fingerprint is what a repeated stage must repeat.
func fingerprint(req backend.StageRequest) string {
	ro := "rw"
	if req.ReadOnly {
		ro = "ro"
	}
	return string(req.AccessType) + "," + req.FsType + "," + ro
}

// Unstage forgets the stage; one already gone is fine. The staging
// directory stays, as an unmount leaves it.
func (n *Node) Unstage(ctx context.Context, staged *backend.Staged) error {
	if err := n.enter(ctx, "Unstage"); err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if have, ok := n.staged[staged.StagingPath]; ok && have.VolumeID == staged.VolumeID {
		if err := n.detach(have); err != nil {
			return err
		}
		delete(n.staged, staged.StagingPath)
	}
	return nil
}

// Expand reports the volume's recorded size: a stage here sees it at once.
func (n *Node) Expand(ctx context.Context, staged *backend.Staged) (int64, error) {
	if err := n.enter(ctx, "Expand"); err != nil {
		return 0, err
	}
	if _, ok := n.stage(staged); !ok {
		return 0, status.Errorf(codes.FailedPrecondition, "volume %s is not staged at %s", staged.VolumeID, staged.StagingPath)
	}
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	vol, err := n.ctrl.volume(id)
	if err != nil {
		return 0, err
	}
	return vol.CapacityBytes, nil
}

// stage finds the record of staged, if it is still this volume's.
func (n *Node) stage(staged *backend.Staged) (*backend.Staged, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	have, ok := n.staged[staged.StagingPath]
	return have, ok && have.VolumeID == staged.VolumeID
}

// Health is normal while the stage is recorded and its volume exists.
func (n *Node) Health(ctx context.Context, staged *backend.Staged) backend.Health {
	if _, ok := n.stage(staged); !ok {
		return backend.Health{Abnormal: true, Condition: backend.Inaccessible, Reason: "NotStaged",
			Message: "the volume is not staged at " + staged.StagingPath}
	}
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err == nil {
		_, err = n.ctrl.volume(id)
	}
	if err != nil {
		return backend.Health{Abnormal: true, Condition: backend.DataLoss, Reason: "VolumeMissing", Message: err.Error()}
	}
	return backend.Health{Message: "staged in memory"}
}

// Check answers from the records: intact while the stage is recorded,
// gone once it is not, broken when another volume's is at its path.
func (n *Node) Check(ctx context.Context, staged *backend.Staged) (backend.StageCheck, error) {
	if err := n.enter(ctx, "Check"); err != nil {
		return backend.StageCheck{}, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	have, ok := n.staged[staged.StagingPath]
	switch {
	case !ok:
		return backend.StageCheck{State: backend.StageGone, Detail: "nothing is staged at " + staged.StagingPath}, nil
	case have.VolumeID != staged.VolumeID:
		return backend.StageCheck{State: backend.StageBroken, Detail: "volume " + have.VolumeID + " is staged at " + staged.StagingPath}, nil
	case n.table != nil && have.AccessType == accessmode.Mount:
		m, err := n.table.Table().At(have.StagingPath)
		switch {
		case err != nil:
			return backend.StageCheck{}, err
		case m == nil:
			return backend.StageCheck{State: backend.StageGone, Detail: "nothing is mounted at " + have.StagingPath}, nil
		case m.Source != have.Source:
			return backend.StageCheck{State: backend.StageBroken, Detail: m.Source + " is mounted at " + have.StagingPath}, nil
		}
	}
	return backend.StageCheck{State: backend.StageIntact}, nil
}

// Owns recognises what a stage of id records: its source, at one of its
// staging paths or anywhere it was bind mounted.
func (n *Node) Owns(ctx context.Context, id volumeid.ID, m *mounts.Mount) (bool, error) {
	if err := n.enter(ctx, "Owns"); err != nil {
		return false, err
	}
	if m.Source == Source(id.String()) || (n.devices != "" && m.Root == n.devicePath(id)) {
		return true, nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	have, ok := n.staged[m.Mountpoint]
	return ok && have.VolumeID == id.String(), nil
}

// Lose forgets every stage, as a reboot of the node would: Check then
// finds them gone.
func (n *Node) Lose() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.staged)
}
