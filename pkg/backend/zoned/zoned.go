// Package zoned joins the controllers of several zones into one: a block
// backend whose zones are served by different storage targets (and, on one
// machine, by pools of its own) looks like one backend to the driver. A
// call about a volume goes to the controller of the volume's zone; a
// listing asks every one of them and merges.
package zoned

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Controller is the join.
type Controller struct {
	backend accessmode.Backend
	zones   []string                      // in the order of the parts, each part's in its order
	byZone  map[string]backend.Controller // zone -> its part
	parts   []backend.Controller
}

var _ backend.Controller = (*Controller)(nil)

// New joins parts, which must be of one backend and serve disjoint zones
// (none of them zoneless).
func New(parts ...backend.Controller) (*Controller, error) {
	if len(parts) == 0 {
		return nil, fmt.Errorf("no controllers to join")
	}
	c := &Controller{backend: parts[0].Backend(), byZone: map[string]backend.Controller{}, parts: parts}
	for _, p := range parts {
		if p.Backend() != c.backend {
			return nil, fmt.Errorf("cannot join a %s controller with a %s one", p.Backend(), c.backend)
		}
		if len(p.Zones()) == 0 {
			return nil, fmt.Errorf("a %s controller without zones cannot be joined by zone", p.Backend())
		}
		for _, z := range p.Zones() {
			if _, dup := c.byZone[z]; dup {
				return nil, fmt.Errorf("zone %s is served twice (two pools or targets of one zone)", z)
			}
			c.byZone[z] = p
			c.zones = append(c.zones, z)
		}
	}
	return c, nil
}

func (c *Controller) Backend() accessmode.Backend { return c.backend }
func (c *Controller) Zones() []string             { return slices.Clone(c.zones) }

// MinimumSize is the largest of the parts': a size every zone can make.
func (c *Controller) MinimumSize() int64 {
	var m int64
	for _, p := range c.parts {
		m = max(m, p.MinimumSize())
	}
	return m
}

func (c *Controller) part(zone string) (backend.Controller, error) {
	p, ok := c.byZone[zone]
	if !ok {
		return nil, status.Errorf(codes.InvalidArgument, "zone %q has no %s pool here (configured zones: %s)", zone, c.backend, strings.Join(c.zones, ", "))
	}
	return p, nil
}

func (c *Controller) NodeExpansionRequired(v *backend.Volume) bool {
	p, err := c.part(v.Zone)
	return err != nil || p.NodeExpansionRequired(v)
}

func (c *Controller) Capacity(ctx context.Context, zone string) (int64, error) {
	p, err := c.part(zone)
	if err != nil {
		return 0, err
	}
	return p.Capacity(ctx, zone)
}

func (c *Controller) Pools(ctx context.Context) ([]backend.PoolStats, error) {
	var all []backend.PoolStats
	for _, p := range c.parts {
		stats, err := p.Pools(ctx)
		if err != nil {
			return nil, err
		}
		all = append(all, stats...)
	}
	return all, nil
}

func (c *Controller) CreateVolume(ctx context.Context, spec backend.VolumeSpec) (*backend.Volume, error) {
	p, err := c.part(spec.ID.Zone)
	if err != nil {
		return nil, err
	}
	return p.CreateVolume(ctx, spec)
}

// Creating asks the controller of the volume's zone, where its creation
// would be going on.
func (c *Controller) Creating(ctx context.Context, id volumeid.ID) (bool, error) {
	p, err := c.part(id.Zone)
	if err != nil {
		return false, err
	}
	return p.Creating(ctx, id)
}

// ZonesFillableFrom asks the controller of the source's zone: the parts
// are separate machines (storage targets), and none of them can copy what
// another one holds.
func (c *Controller) ZonesFillableFrom(ctx context.Context, sourceZone string) ([]string, error) {
	p, ok := c.byZone[sourceZone]
	if !ok {
		return nil, nil
	}
	return p.ZonesFillableFrom(ctx, sourceZone)
}

// SnapshotBlocks asks the controller of the target snapshot's zone; a base
// snapshot in another zone cannot be of the same volume.
func (c *Controller) SnapshotBlocks(ctx context.Context, req backend.BlockRangesRequest) (*backend.BlockRanges, error) {
	if req.Delta() && req.Base.Zone != req.Target.Zone {
		return nil, status.Errorf(codes.InvalidArgument,
			"base snapshot %s is in zone %q and target snapshot %s in zone %q; changes are known only between two snapshots of one volume",
			req.Base, req.Base.Zone, req.Target, req.Target.Zone)
	}
	p, err := c.part(req.Target.Zone)
	if err != nil {
		return nil, err
	}
	return p.SnapshotBlocks(ctx, req)
}

func (c *Controller) Volume(ctx context.Context, id volumeid.ID) (*backend.Volume, error) {
	p, err := c.part(id.Zone)
	if err != nil {
		return nil, err
	}
	return p.Volume(ctx, id)
}

// DeleteVolume of a zone served by no part: nothing here holds it (as
// the block backend answers for a zone it has no pool of), said loudly
// because a dropped --block-target flag also ends up here.
func (c *Controller) DeleteVolume(ctx context.Context, id volumeid.ID) error {
	p, err := c.part(id.Zone)
	if err != nil {
		klog.InfoS("Delete of an object in a zone served here by no pool or target: nothing to delete", "id", id.String())
		return nil
	}
	return p.DeleteVolume(ctx, id)
}

func (c *Controller) SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
	p, err := c.part(id.Zone)
	if err != nil {
		return nil, err
	}
	return p.SetAttachments(ctx, id, attachments)
}

func (c *Controller) ExpandVolume(ctx context.Context, id volumeid.ID, bytes int64) (*backend.Volume, error) {
	p, err := c.part(id.Zone)
	if err != nil {
		return nil, err
	}
	return p.ExpandVolume(ctx, id, bytes)
}

func (c *Controller) ModifyVolume(ctx context.Context, id volumeid.ID, mutable map[string]string) (*backend.Volume, error) {
	p, err := c.part(id.Zone)
	if err != nil {
		return nil, err
	}
	return p.ModifyVolume(ctx, id, mutable)
}

// merge asks every part and sorts the union by ID. One part that cannot
// answer fails the whole: a listing that silently leaves out a zone would
// tell the CO its volumes are gone.
func merge[T any](ctx context.Context, parts []backend.Controller, list func(backend.Controller) ([]T, error), id func(T) string) ([]T, error) {
	var all []T
	for _, p := range parts {
		got, err := list(p)
		if err != nil {
			return nil, err
		}
		all = append(all, got...)
	}
	slices.SortFunc(all, func(a, b T) int { return strings.Compare(id(a), id(b)) })
	return all, nil
}

func volumeID(v *backend.Volume) string     { return v.ID }
func snapshotID(s *backend.Snapshot) string { return s.ID }

func (c *Controller) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	return merge(ctx, c.parts, func(p backend.Controller) ([]*backend.Volume, error) { return p.ListVolumes(ctx) }, volumeID)
}

func (c *Controller) VolumesOn(ctx context.Context, node string) ([]*backend.Volume, error) {
	return merge(ctx, c.parts, func(p backend.Controller) ([]*backend.Volume, error) { return p.VolumesOn(ctx, node) }, volumeID)
}

func (c *Controller) VolumeHealth(ctx context.Context, id volumeid.ID) (backend.Health, error) {
	p, err := c.part(id.Zone)
	if err != nil {
		return backend.Health{}, err
	}
	return p.VolumeHealth(ctx, id)
}

// CreateSnapshot goes to the zone of the snapshot, which is its source's:
// a snapshot lives next to its source's image.
func (c *Controller) CreateSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID) (*backend.Snapshot, error) {
	if id.Zone != source.Zone {
		return nil, status.Errorf(codes.InvalidArgument, "snapshot %s is in zone %s, its source %s in %s", id, id.Zone, source, source.Zone)
	}
	p, err := c.part(id.Zone)
	if err != nil {
		return nil, err
	}
	return p.CreateSnapshot(ctx, id, name, source)
}

// CreateSnapshotGroup goes to the members' zone: a group is of one zone,
// whose storage alone can take its volumes at one instant.
func (c *Controller) CreateSnapshotGroup(ctx context.Context, members []backend.GroupMember) ([]*backend.Snapshot, error) {
	if len(members) == 0 {
		return nil, nil
	}
	zone := members[0].Source.Zone
	for _, m := range members {
		if m.ID.Zone != zone || m.Source.Zone != zone {
			return nil, status.Errorf(codes.InvalidArgument, "a group snapshot is of one zone: member %s of %s is not in zone %s", m.ID, m.Source, zone)
		}
	}
	p, err := c.part(zone)
	if err != nil {
		return nil, err
	}
	return p.CreateSnapshotGroup(ctx, members)
}

func (c *Controller) Snapshot(ctx context.Context, id volumeid.ID) (*backend.Snapshot, error) {
	p, err := c.part(id.Zone)
	if err != nil {
		return nil, err
	}
	return p.Snapshot(ctx, id)
}

func (c *Controller) DeleteSnapshot(ctx context.Context, id volumeid.ID) error {
	p, err := c.part(id.Zone)
	if err != nil {
		klog.InfoS("Delete of an object in a zone served here by no pool or target: nothing to delete", "id", id.String())
		return nil
	}
	return p.DeleteSnapshot(ctx, id)
}

func (c *Controller) ListSnapshots(ctx context.Context) ([]*backend.Snapshot, error) {
	return merge(ctx, c.parts, func(p backend.Controller) ([]*backend.Snapshot, error) { return p.ListSnapshots(ctx) }, snapshotID)
}
