// This file holds what a transport is to a node, and which one a call
// takes. A transport is how a node gets hold of a volume's block device;
// everything done with the device once it is there (the filesystem, the
// staging path, the checks of the mount) is the same for every transport
// and is Node's (node.go). So a call picks its transport once, here, and
// adding a transport is a type of its own and a line in networkTransports.

package block

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// transport obtains, checks, refreshes and releases the block device of a
// volume on this node: a loop device on the volume's image in a pool this
// node shares (loopTransport), or a disk a storage target serves over the
// network (iscsiTransport). Errors are gRPC statuses, ready for the CO.
type transport interface {
	// admit checks a stage request against what the transport knows of
	// the volume, before anything is attached.
	admit(req backend.StageRequest) (admission, error)
	// attach obtains the device of an admitted stage request. What fails
	// on the way is undone before it returns.
	attach(ctx context.Context, req backend.StageRequest) (device string, err error)
	// release gives up the device of a stage whose filesystem is no longer
	// mounted: staged.Device, and whatever of the volume an interrupted
	// stage left. A device that is not the volume's is left alone.
	release(ctx context.Context, id volumeid.ID, staged *backend.Staged) error
	// bound tells whether device (empty: none was recorded) is the
	// volume's device now, and the kernel's read-only flag of it.
	bound(id volumeid.ID, device string) (bound, readOnly bool, err error)
	// owns tells whether the block device of that name (under /dev) is the
	// volume's, or a read-only device made over it (viewSource).
	owns(id volumeid.ID, name string) (bool, error)
	// health checks the device of a stage; an abnormal answer says what
	// is wrong with it.
	health(id volumeid.ID, staged *backend.Staged) backend.Health
	// refresh makes the staged device take the volume's size now, and
	// returns it in bytes.
	refresh(ctx context.Context, id volumeid.ID, staged *backend.Staged) (int64, error)
	// modes are the access modes the volume was created with, or nil
	// where the transport cannot tell.
	modes(id volumeid.ID) []accessmode.Mode
	// viewSource is what a read-only loop device for a publish of the
	// stage is bound to (ReadOnlyDevice): the kernel ignores the read-only
	// flag of a bind mount of a device node, so only a device that is
	// itself read-only keeps such a workload from writing.
	viewSource(id volumeid.ID, staged *backend.Staged) (string, error)
	// releaseView detaches a read-only device made over viewSource, if it
	// still is this transport's view of the volume; any other device it
	// leaves alone.
	releaseView(ctx context.Context, id volumeid.ID, device string) error
}

// admission is a transport's yes to a stage request, with what it knows
// of the volume.
type admission struct {
	// fsType is the volume's filesystem for a request that names none;
	// empty where the transport cannot tell.
	fsType string
	// readAheadKiB is the read-ahead the volume's attributes name
	// (readAheadKiB, a VolumeAttributesClass parameter), if hasReadAhead;
	// without one the device keeps the kernel's default.
	readAheadKiB uint64
	hasReadAhead bool
	// writable says whether any node may ever write the volume
	// (mountOptions); true where the transport cannot tell.
	writable bool
	// record is what the stage record keeps of the transport
	// (backend.Staged.Transport), so that the stage can be checked and
	// undone without the CO's request.
	record map[string]string
}

// networkTransports are the transports a volume context or a stage record
// can name (key iscsi.ContextTransport), with what a node plugin is started
// with to reach volumes over each. A volume context that names none is
// reached through the zone's pool.
var networkTransports = map[string]string{
	iscsi.TransportName: "--iscsi-initiator-name-file and --iscsi-chap-secret-file",
}

// stageTransport picks the transport of a stage: the one the volume
// context names, which is the storage target's word on where the volume
// is and wins over a pool this node may also have for the zone; without
// one, the zone's pool.
func (n *Node) stageTransport(id volumeid.ID, volumeContext map[string]string) (transport, error) {
	name := volumeContext[iscsi.ContextTransport]
	if name == "" {
		return n.loop, nil
	}
	if t, ok := n.network[name]; ok {
		return t, nil
	}
	if flags, known := networkTransports[name]; known {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is served over %s and this node plugin does not reach volumes over it; start it with %s", id, name, flags)
	}
	return nil, status.Errorf(codes.InvalidArgument, "volume context %s=%q: %s", iscsi.ContextTransport, name, describeNetworkTransports())
}

// recordedTransport picks the transport a stage was made with: the one its
// record names, or else the zone's pool where this node has it. A record
// that names neither is a stage interrupted before the transport was
// recorded; without the zone's pool here, it was made over the network
// transport this node has. A record this node cannot read as one of its
// transports is refused, never guessed at: what undoes a stage on one
// transport could take another volume's device on another.
func (n *Node) recordedTransport(id volumeid.ID, record map[string]string) (transport, error) {
	name := record[iscsi.ContextTransport]
	switch {
	case name != "":
		if t, ok := n.network[name]; ok {
			return t, nil
		}
		if flags, known := networkTransports[name]; known {
			return nil, status.Errorf(codes.FailedPrecondition,
				"volume %s was staged over %s and this node plugin does not reach volumes over it now; it needs %s", id, name, flags)
		}
		return nil, status.Errorf(codes.FailedPrecondition,
			"the stage of volume %s was made over transport %q, which this node plugin does not know (%s); it can neither check nor undo it", id, name, describeNetworkTransports())
	case n.loop.shares(id.Zone) || len(n.network) == 0:
		return n.loop, nil
	case len(n.network) == 1:
		for _, t := range n.network {
			return t, nil
		}
	}
	return nil, status.Errorf(codes.FailedPrecondition,
		"the stage of volume %s names no transport, this node has no pool for zone %q, and it reaches volumes over several networks (%s): which one it was made over cannot be told",
		id, id.Zone, strings.Join(slices.Sorted(maps.Keys(n.network)), ", "))
}

// reaching lists the transports that may have made a device of volume id
// on this node: every network transport it has, and the loop transport
// where it has the zone's pool. A node with neither gets the loop
// transport, whose answers say that the pool is not here. The calls that come with a device and no record of how it was
// made (Owns, ReleaseDevice, RefreshDevice) ask each of them: what the
// device is decides, not what this node is configured for.
func (n *Node) reaching(id volumeid.ID) []transport {
	var ts []transport
	for _, name := range slices.Sorted(maps.Keys(n.network)) {
		ts = append(ts, n.network[name])
	}
	if n.loop.shares(id.Zone) || len(ts) == 0 {
		ts = append(ts, n.loop)
	}
	return ts
}

// boundTo tells whether loop device dev is bound to the very file (same
// inode) that is at path now, which both transports ask before they use,
// refresh or release a loop device: the kernel reuses loop device names.
func boundTo(dev, path string) (bool, error) {
	ours, err := loop.BoundTo(dev, path)
	if err != nil {
		return false, status.Errorf(codes.Internal, "inspecting %s: %v", dev, err)
	}
	return ours, nil
}

// describeNetworkTransports names the network transports a volume context
// can name.
func describeNetworkTransports() string {
	names := slices.Sorted(maps.Keys(networkTransports))
	if len(names) == 1 {
		return fmt.Sprintf("the only network transport is %q", names[0])
	}
	return fmt.Sprintf("the network transports are %q", names)
}
