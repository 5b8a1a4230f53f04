package backend

import (
	"context"

	"github.com/modeguard/modeguard/pkg/volumeid"
)

// What a backend may or may not be able to do beyond the basics is
// declared here, and nowhere else, as methods of the Controller and Node
// interfaces. Every backend answers each of them, a backend without the
// capability explicitly (false, nil), and so does every wrapper (a
// controller joining zones, a client of a storage target): a wrapper that
// does not pass one on does not compile, where a capability found by a
// type assertion on the wrapped value would quietly be lost in it.

// ControllerCapabilities are the optional abilities of a controller.
type ControllerCapabilities interface {
	// Creating reports whether volume id is being created in the
	// background: a CreateVolume whose copy of its source outlasted the
	// call goes on after it, so the volume is not there yet but a retry
	// must go to that creation, in its zone whatever room the copy itself
	// now takes there, rather than make another volume elsewhere. A
	// backend whose creations end with their call answers false. An error
	// means it cannot tell, and the caller must not guess "no".
	Creating(ctx context.Context, id volumeid.ID) (bool, error)
	// SnapshotBlocks answers one page of a snapshot's allocated ranges,
	// or of the ranges that changed between two snapshots of one volume
	// (see BlockRangesRequest), from the storage's own record of where
	// data lies, never by reading the data. A backend that keeps no such
	// record answers with a status saying so (Unimplemented, or
	// InvalidArgument where its snapshots are not of block volumes).
	SnapshotBlocks(ctx context.Context, req BlockRangesRequest) (*BlockRanges, error)
	// CreateSnapshotGroup takes a snapshot of each member's source, all of
	// one instant: no member holds a write acknowledged after a write
	// missing from another member, however many of them are being written.
	// A backend that can capture its volumes only one after the other
	// answers with SnapshotOneAtATime, which refuses (FAILED_PRECONDITION)
	// a group of which more than one volume is attached read/write. The
	// members are of one zone. On error no member is left.
	CreateSnapshotGroup(ctx context.Context, members []GroupMember) ([]*Snapshot, error)
	// ZonesFillableFrom lists the zones, of Zones, in which a new volume
	// can be filled from a content source (a snapshot or a volume) of
	// sourceZone. The bytes are copied by the machine that holds them: a
	// controller with every pool at hand fills a volume in any of its
	// zones, a storage target only in its own. A zone not served here
	// gives nil, and so does a backend without zones.
	ZonesFillableFrom(ctx context.Context, sourceZone string) ([]string, error)
}

// NodeCapabilities are the optional abilities of a node backend.
type NodeCapabilities interface {
	// ReadOnlyDevices returns the node's read-only devices of volumes
	// staged read/write, or nil where the node has none to give.
	ReadOnlyDevices() ReadOnlyDevices
}

// ReadOnlyDevices gives one workload a read-only view of a raw block
// volume staged read/write: the kernel ignores the read-only flag of a
// bind mount of a device node, so only a device that is itself read-only
// keeps that workload from writing (block: a second, read-only loop device
// of the same image).
type ReadOnlyDevices interface {
	// FreeDevice names a free device, so that the caller can record it
	// before anything is bound to it.
	FreeDevice(ctx context.Context) (string, error)
	// ReadOnlyDevice binds the staged volume, read-only, at device.
	ReadOnlyDevice(ctx context.Context, staged *Staged, device string) error
	// ReleaseDevice undoes ReadOnlyDevice, if device is still the
	// volume's (one since reused for something else is left alone).
	ReleaseDevice(ctx context.Context, id volumeid.ID, device string) error
	// RefreshDevice makes such a device see the volume's new size; false
	// means the device is no longer the volume's and was left alone.
	RefreshDevice(ctx context.Context, id volumeid.ID, device string) (bool, error)
}
