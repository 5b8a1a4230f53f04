package backend

// What backends that keep their records in memory share: deep copies, so
// that no caller changes a record through what it is given, the lookup
// of a volume, and what a new volume's source names.

import (
	"maps"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Clone copies v deeply: no map, slice or source of the copy is v's.
func (v *Volume) Clone() *Volume {
	out := *v
	out.Modes = slices.Clone(v.Modes)
	out.Parameters = maps.Clone(v.Parameters)
	out.MutableParameters = maps.Clone(v.MutableParameters)
	out.Attachments = slices.Clone(v.Attachments)
	out.Context = maps.Clone(v.Context)
	if v.Source != nil {
		s := *v.Source
		out.Source = &s
	}
	return &out
}

// Object is what a volume is filled from: the id as given and whether it
// names a snapshot or a volume. Both at once, or neither, is
// INVALID_ARGUMENT.
func (s *Source) Object() (string, volumeid.Kind, error) {
	switch {
	case s.SnapshotID != "" && s.VolumeID != "":
		return "", "", status.Error(codes.InvalidArgument, "a volume has one source: a snapshot or a volume, not both")
	case s.SnapshotID != "":
		return s.SnapshotID, volumeid.Snapshot, nil
	case s.VolumeID != "":
		return s.VolumeID, volumeid.Volume, nil
	}
	return "", "", status.Error(codes.InvalidArgument, "a source names a snapshot or a volume; this one names neither")
}

// RecordedVolume returns a copy of volume id from a backend's records by
// id, or the NotFound status Controller.Volume answers for an absent one.
// The caller holds whatever lock guards volumes.
func RecordedVolume(volumes map[string]*Volume, id volumeid.ID) (*Volume, error) {
	v, ok := volumes[id.String()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist", id)
	}
	return v.Clone(), nil
}

// RecordedSnapshot is RecordedVolume for snapshots.
func RecordedSnapshot(snapshots map[string]*Snapshot, id volumeid.ID) (*Snapshot, error) {
	s, ok := snapshots[id.String()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", id)
	}
	out := *s
	return &out, nil
}

// CheckSnapshotZone refuses a snapshot in a zone other than its source
// volume's: a snapshot lives in its source's pool.
func CheckSnapshotZone(id, source volumeid.ID) error {
	if source.Zone != id.Zone {
		return status.Errorf(codes.InvalidArgument, "snapshot %s must be in the zone of its source volume %s", id, source)
	}
	return nil
}
