package backend

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/volumeid"
)

// GroupMember is one snapshot of a group: its id and name, and the volume
// it is of.
type GroupMember struct {
	ID     volumeid.ID `json:"id"`
	Name   string      `json:"name"`
	Source volumeid.ID `json:"source"`
}

// Writers names the nodes a volume is attached to read/write (an
// attachment's ReadOnly already counts its mode, as ControllerPublishVolume
// records it).
func Writers(vol *Volume) []string {
	var out []string
	for _, a := range vol.Attachments {
		if !a.ReadOnly {
			out = append(out, a.Node.Name)
		}
	}
	return out
}

// SnapshotOneAtATime is CreateSnapshotGroup for a backend that captures
// one volume at a time: each snapshot is of its own instant, so a group is
// of one instant only if at most one member is being written while they
// are taken. A group of several volumes attached read/write is refused
// rather than answered with members that only look consistent. The
// caller holds the members' locks, so no attach slips in between.
func SnapshotOneAtATime(ctx context.Context, c Controller, members []GroupMember) ([]*Snapshot, error) {
	var writing []string
	for _, m := range members {
		vol, err := c.Volume(ctx, m.Source)
		if err != nil {
			return nil, err
		}
		if w := Writers(vol); len(w) > 0 {
			writing = append(writing, fmt.Sprintf("%s (read/write on %s)", m.Source, strings.Join(w, ", ")))
		}
	}
	if len(writing) > 1 {
		return nil, status.Errorf(codes.FailedPrecondition,
			"%d volumes of the group are attached read/write: %s; their storage takes one snapshot after the other, not all at one point in time, while both are written. "+
				"Detach all but one of them (stop their writers) and retry, or keep their pool on btrfs, where a group is taken at one instant "+
				"(a block pool directory on btrfs, or one started empty with --block-pool-filesystem=btrfs, or with auto where the machine has btrfs)",
			len(writing), strings.Join(writing, "; "))
	}
	out := make([]*Snapshot, 0, len(members))
	for _, m := range members {
		snap, err := c.CreateSnapshot(ctx, m.ID, m.Name, m.Source)
		if err != nil {
			DropGroup(ctx, c, out)
			return nil, err
		}
		out = append(out, snap)
	}
	return out, nil
}

// DropGroup removes the members of a group that could not be made whole:
// no group id reaches the CO, so they would leak.
func DropGroup(ctx context.Context, c Controller, made []*Snapshot) {
	for _, s := range made {
		id, err := volumeid.ParseKind(s.ID, volumeid.Snapshot)
		if err == nil {
			err = c.DeleteSnapshot(context.WithoutCancel(ctx), id)
		}
		if err != nil {
			klog.ErrorS(err, "Removing a member of a group snapshot that failed", "snapshotID", s.ID)
		}
	}
}
