// Package backend is the narrow interface between the CSI servers and the
// storage that holds volumes. The servers check arguments and apply the
// access-mode rules; a backend only stores, attaches and mounts. Errors a
// backend returns carry gRPC status codes where the cause is known (see
// package status), so they reach the CO unchanged.
package backend

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Source is what a new volume is filled from.
type Source struct {
	SnapshotID string `json:"snapshotID,omitempty"`
	VolumeID   string `json:"volumeID,omitempty"`
}

// Volume is everything the controller records about a volume.
type Volume struct {
	ID            string                `json:"id"`
	Name          string                `json:"name"`
	CapacityBytes int64                 `json:"capacityBytes"`
	Zone          string                `json:"zone,omitempty"`
	AccessType    accessmode.AccessType `json:"accessType"`
	FsType        string                `json:"fsType,omitempty"`
	Modes         []accessmode.Mode     `json:"modes"`
	Parameters    map[string]string     `json:"parameters,omitempty"`
	// MutableParameters are the volume's attributes that can change after
	// creation (CSI mutable_parameters; Kubernetes' VolumeAttributesClass):
	// given at CreateVolume, changed by ControllerModifyVolume. Checked
	// and in canonical form (see the Attr keys).
	MutableParameters map[string]string       `json:"mutableParameters,omitempty"`
	Source            *Source                 `json:"source,omitempty"`
	Attachments       []accessmode.Attachment `json:"attachments,omitempty"`
	// Context is what a node needs to reach the volume (for NFS: server and
	// export path); it travels to the node as part of the volume context.
	Context   map[string]string `json:"context,omitempty"`
	CreatedAt time.Time         `json:"createdAt"`
}

// Snapshot is everything the controller records about a snapshot.
type Snapshot struct {
	ID             string    `json:"id"`
	Name           string    `json:"name"`
	SourceVolumeID string    `json:"sourceVolumeID"`
	SizeBytes      int64     `json:"sizeBytes"`
	CreatedAt      time.Time `json:"createdAt"`
	// AccessType and FsType are the source volume's: a restore must be of
	// the same kind (a raw device cannot become a filesystem, nor an ext4
	// an xfs). Empty in records made before they were kept.
	AccessType accessmode.AccessType `json:"accessType,omitempty"`
	FsType     string                `json:"fsType,omitempty"`
	// Cutting is true while the snapshot's data is still being copied: it
	// exists, but is not ready to use (CSI ready_to_use=false). Never
	// recorded: a record is written once the copy is complete.
	Cutting bool `json:"-"`
}

// VolumeSpec is a volume to create. ID is already derived from the name and
// the chosen zone; the caller holds the volume's lock and has made sure no
// volume with this ID exists.
type VolumeSpec struct {
	ID            volumeid.ID
	Name          string
	CapacityBytes int64
	AccessType    accessmode.AccessType
	FsType        string
	Modes         []accessmode.Mode
	Parameters    map[string]string
	// MutableParameters are checked and canonical (see Volume).
	MutableParameters map[string]string
	Source            *Source
}

// Health is what a backend knows about a volume's condition.
type Health struct {
	Abnormal bool
	// Condition says how an abnormal volume is unwell, as CSI's volume
	// health types do. An abnormal health that names none counts as
	// Inaccessible.
	Condition Condition
	Reason    string // CamelCase, for machines
	Message   string // for people
}

// Condition is how a volume is unwell.
type Condition int

const (
	ConditionUnknown Condition = iota
	// Degraded: usable, but something needs attention (its pool or quota
	// is full).
	Degraded
	// Inaccessible: cannot be reached now; the data may well be intact.
	Inaccessible
	// DataLoss: the data, or part of it, is gone.
	DataLoss
)

// PoolStats is one pool's size and use, as metrics report it.
type PoolStats struct {
	// Zone is the pool's zone; "" for a backend whose pool serves every zone.
	Zone string
	// SizeBytes and FreeBytes are the backing filesystem's total and
	// available bytes.
	SizeBytes int64
	FreeBytes int64
	// CommittedBytes is what the pool has promised: the capacities of its
	// volumes (and, where snapshots hold a size limit of their own, as with
	// NFS, their sizes).
	CommittedBytes int64
}

// Controller is the controller-side half of a backend.
type Controller interface {
	ControllerCapabilities

	// Backend names the backend.
	Backend() accessmode.Backend
	// Zones lists the zones this controller may place volumes in, in the
	// order it prefers them. A backend whose volumes are reachable from
	// every zone returns nil: its volumes carry no zone and no topology.
	Zones() []string
	// MinimumSize is the smallest volume the backend can make, in bytes.
	MinimumSize() int64
	// NodeExpansionRequired tells whether a node must act after
	// ExpandVolume before the workload sees the new size of v.
	NodeExpansionRequired(v *Volume) bool
	// Capacity is the number of bytes a new volume in zone could still get.
	Capacity(ctx context.Context, zone string) (int64, error)
	// Pools reports every pool's size, free space and committed bytes, in
	// the order of Zones (one pool with zone "" when Zones is nil).
	Pools(ctx context.Context) ([]PoolStats, error)

	CreateVolume(ctx context.Context, spec VolumeSpec) (*Volume, error)
	// Volume returns the recorded volume, or a NotFound status.
	Volume(ctx context.Context, id volumeid.ID) (*Volume, error)
	// DeleteVolume removes the volume's storage; an absent volume is fine.
	DeleteVolume(ctx context.Context, id volumeid.ID) error
	// SetAttachments records which nodes hold the volume. The caller has
	// applied the access-mode rules; the backend makes them effective
	// (NFS: the export's client list).
	SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*Volume, error)
	// ExpandVolume grows the volume's storage to at least bytes.
	ExpandVolume(ctx context.Context, id volumeid.ID, bytes int64) (*Volume, error)
	// ModifyVolume sets the given mutable parameters (checked and
	// canonical; keys not given keep their values), records them and makes
	// them effective as far as the controller can (NFS: the export, live).
	ModifyVolume(ctx context.Context, id volumeid.ID, mutable map[string]string) (*Volume, error)
	// ListVolumes returns every volume, sorted by ID.
	ListVolumes(ctx context.Context) ([]*Volume, error)
	// VolumesOn returns the volumes with an attachment to node key
	// (accessmode.Attachment.Node), sorted by ID, at a cost that follows
	// their number, not the number of volumes (see NodeIndex).
	VolumesOn(ctx context.Context, node string) ([]*Volume, error)
	// VolumeHealth reports the volume's condition as the controller sees it.
	VolumeHealth(ctx context.Context, id volumeid.ID) (Health, error)

	CreateSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID) (*Snapshot, error)
	// Snapshot returns the recorded snapshot, or a NotFound status.
	Snapshot(ctx context.Context, id volumeid.ID) (*Snapshot, error)
	// DeleteSnapshot removes a snapshot; an absent one is fine.
	DeleteSnapshot(ctx context.Context, id volumeid.ID) error
	// ListSnapshots returns every snapshot, sorted by ID.
	ListSnapshots(ctx context.Context) ([]*Snapshot, error)
}

// StageRequest asks a node backend to make a volume usable on this node.
type StageRequest struct {
	VolumeID volumeid.ID
	// Node is this node, as its id says: the key its attachment is found
	// by, and the address it mounts NFS exports from.
	Node        nodeid.Node
	StagingPath string
	AccessType  accessmode.AccessType
	FsType      string
	MountFlags  []string
	// Mode is the capability's access mode; it must be within the mode the
	// volume is attached to this node with.
	Mode     accessmode.Mode
	ReadOnly bool // effective: the mode, the CO's flag and the attachment combined
	// AttachedReadOnly is the attachment's own read-only flag, as
	// ControllerPublishVolume answered it: what a server that enforces the
	// attachments (a storage target) lets this node do.
	AttachedReadOnly bool
	// CapacityBytes is the volume's size when it was attached to this node
	// (0: not known), which a disk reached over the network must have.
	CapacityBytes  int64
	PublishContext map[string]string
	VolumeContext  map[string]string
	// Recover says an earlier stage of this volume on this node was
	// interrupted after it began: clean up what it may have left (a device
	// bound to the volume that nothing uses) before staging again.
	Recover bool
}

// FsTypes are the filesystems the driver makes and mounts for access type
// mount: the tools for them (mkfs.ext4, mkfs.xfs, resize2fs, xfs_growfs)
// ship with it.
var FsTypes = []string{"ext4", "xfs"}

// CheckFsType refuses a filesystem the driver cannot make or grow; "" (the
// backend's default) passes.
func CheckFsType(fs string) error {
	if fs != "" && !slices.Contains(FsTypes, fs) {
		return status.Errorf(codes.InvalidArgument,
			"filesystem type %q is not supported; accepted: %s", fs, strings.Join(FsTypes, ", "))
	}
	return nil
}

// CheckMountFlags refuses mount flags that could change the options a node
// backend puts after them. mount(8), mount.nfs and the kernel read a comma
// inside double quotes as part of one option, so a quote in a flag could
// join the backend's own options, "ro" among them, to it and make them
// vanish, or hide an option from the backend's own reading of the flags.
// No mount option holds a control character; NUL cannot even reach mount(8).
//
// The one exception is an SELinux context, which the kubelet passes quoted
// because its value holds commas (context="system_u:object_r:x_t:s0:c1,c2"):
// exactly the forms context=, fscontext=, defcontext= and rootcontext= with
// one balanced quoted value of label characters, which opens and closes
// within the flag and so cannot swallow what follows.
func CheckMountFlags(flags []string) error {
	for _, f := range flags {
		if selinuxContextFlag.MatchString(f) {
			continue
		}
		if i := strings.IndexFunc(f, func(r rune) bool { return r == '"' || r < 0x20 || r == 0x7f }); i >= 0 {
			return fmt.Errorf("mount flag %q holds %q; mount flags may hold neither double quotes nor control characters "+
				"(except an SELinux context=, fscontext=, defcontext= or rootcontext= with one quoted label)", f, f[i])
		}
	}
	return nil
}

// SplitMountOptions splits one comma-separated mount flag into its options
// as mount(8) does: a comma inside double quotes (an SELinux context's
// categories) is part of its option.
func SplitMountOptions(flag string) []string {
	var opts []string
	quoted, start := false, 0
	for i := 0; i < len(flag); i++ {
		switch flag[i] {
		case '"':
			quoted = !quoted
		case ',':
			if !quoted {
				opts = append(opts, flag[start:i])
				start = i + 1
			}
		}
	}
	return append(opts, flag[start:])
}

// selinuxContextFlag is an SELinux context mount option with its label
// quoted: user:role:type:level, where the level may hold categories
// separated by commas and ranges (s0-s0:c0.c1023).
var selinuxContextFlag = regexp.MustCompile(`^(context|fscontext|defcontext|rootcontext)="[A-Za-z0-9_.:,-]+"$`)

// Staged is what a node backend did for a volume, kept in the node's state
// so that unstage, expand and stats undo or inspect exactly that.
type Staged struct {
	VolumeID    string                `json:"volumeID"`
	StagingPath string                `json:"stagingPath"`
	AccessType  accessmode.AccessType `json:"accessType"`
	FsType      string                `json:"fsType,omitempty"`
	ReadOnly    bool                  `json:"readOnly"`
	// Mode is the access mode the volume was staged with; every publish
	// on this node must be within it (accessmode.Within).
	Mode accessmode.Mode `json:"mode,omitempty"`
	// Source is what is mounted at the staging path, as the mount table
	// names it (NFS: server:/export), so that a check can tell this
	// volume's mount from another's.
	Source string `json:"source,omitempty"`
	// Device is the block device for access type block (and the device
	// behind the staging mount for block-backed filesystems).
	Device string `json:"device,omitempty"`
	// Transport holds where a volume reached over the network comes from
	// (its volume context's transport keys), so that the stage can be
	// checked and undone without the CO's request.
	Transport map[string]string `json:"transport,omitempty"`
	// Fingerprint identifies the stage arguments: a second stage with other
	// arguments is ALREADY_EXISTS.
	Fingerprint string    `json:"fingerprint"`
	Since       time.Time `json:"since"`
}

// StageState is what the kernel still holds of a recorded stage.
type StageState int

const (
	// StageIntact: everything the record names is there and is this
	// volume's.
	StageIntact StageState = iota
	// StageGone: nothing of the stage is in use any more (the node
	// rebooted, or someone unmounted and detached it): undoing what may be
	// left of it (Unstage) and staging again is safe.
	StageGone
	// StageBroken: part of the stage is there, or something else is where
	// it should be: neither trusting nor redoing it is safe.
	StageBroken
)

// StageCheck is the outcome of Node.Check: the state and, unless intact,
// what the kernel showed, for messages.
type StageCheck struct {
	State  StageState
	Detail string
}

// Node is the node-side half of a backend.
type Node interface {
	NodeCapabilities

	Backend() accessmode.Backend
	// Stage attaches and mounts the volume at req.StagingPath (mount) or
	// attaches it and reports its device (block). It refuses with
	// FailedPrecondition a volume that is not attached to req.Node.
	Stage(ctx context.Context, req StageRequest) (*Staged, error)
	// Unstage undoes Stage; a volume already unstaged is fine.
	Unstage(ctx context.Context, staged *Staged) error
	// Expand makes the node see the volume's new size (and grows the
	// filesystem, for mount). It returns the new size in bytes, or 0 when
	// the node cannot know it exactly.
	Expand(ctx context.Context, staged *Staged) (int64, error)
	// Health checks that what Stage set up is still in place and working.
	Health(ctx context.Context, staged *Staged) Health
	// Check compares a stage record with the kernel: the mount at the
	// staging path is this volume's (block: its filesystem on a loop
	// device bound to the volume's image, same inode; NFS: this export),
	// and a recorded device is bound to the image. An error means the
	// kernel could not be asked; the caller must then refuse, not guess.
	Check(ctx context.Context, staged *Staged) (StageCheck, error)
	// Owns reports whether m, a line of the mount table, is a mount of
	// volume id as this backend makes them: its filesystem, a bind mount
	// of it, or a bind mount of its device node.
	Owns(ctx context.Context, id volumeid.ID, m *mounts.Mount) (bool, error)
}
