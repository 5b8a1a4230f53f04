// Package memory is a backend that keeps everything in memory: volumes,
// snapshots and attachments as records, each zone's pool as a byte count.
// It holds to the contract of package backend as the real backends do (the
// suite in package backendtest runs against all of them), so the driver's
// tests of locking, ordering and error paths can run it without root,
// loop devices or an NFS server, with faults injected where they want
// them (Faults).
package memory

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Pool is one zone's storage: Zone "" for the single pool of a backend
// whose volumes every zone reaches (as NFS's).
type Pool struct {
	Zone      string
	SizeBytes int64
}

// Config shapes a Controller.
type Config struct {
	// Backend is whose ids the controller takes; block when empty.
	Backend accessmode.Backend
	// Pools are the zones in the order Zones lists them, or one pool of
	// zone "" for a zoneless backend. One pool of 1 GiB in zone-a when
	// empty.
	Pools []Pool
	// MinimumSize is what MinimumSize reports.
	MinimumSize int64
	// MountOnly refuses access type block, as the NFS backend does.
	MountOnly bool
}

// Controller is a backend.Controller whose storage is a byte count per
// pool. Faults injects errors, delays and hooks into its methods.
type Controller struct {
	Faults

	backend   accessmode.Backend
	pools     []Pool
	minimum   int64
	mountOnly bool

	mu        sync.Mutex
	volumes   map[string]*backend.Volume
	snapshots map[string]*backend.Snapshot
	nodes     backend.NodeIndex
	committed map[string]int64 // zone -> bytes promised to its volumes and snapshots
	health    map[string]backend.Health
}

var _ backend.Controller = (*Controller)(nil)

// New makes an empty Controller. Pools must have distinct zones, and only
// a backend of one pool may have it zoneless.
func New(cfg Config) (*Controller, error) {
	if cfg.Backend == "" {
		cfg.Backend = accessmode.BackendBlock
	}
	if len(cfg.Pools) == 0 {
		cfg.Pools = []Pool{{Zone: "zone-a", SizeBytes: 1 << 30}}
	}
	seen := map[string]bool{}
	for _, p := range cfg.Pools {
		switch {
		case p.Zone == "" && len(cfg.Pools) > 1:
			return nil, status.Error(codes.InvalidArgument, "memory: a zoneless pool must be the only one")
		case p.Zone != "" && !volumeid.ValidZone(p.Zone):
			return nil, status.Errorf(codes.InvalidArgument, "memory: %q is not a zone name", p.Zone)
		case seen[p.Zone]:
			return nil, status.Errorf(codes.InvalidArgument, "memory: zone %q has two pools", p.Zone)
		case p.SizeBytes < 0:
			return nil, status.Errorf(codes.InvalidArgument, "memory: pool of zone %q has a negative size", p.Zone)
		}
		seen[p.Zone] = true
	}
	return &Controller{
		Faults:    newFaults((*backend.Controller)(nil)),
		backend:   cfg.Backend,
		pools:     slices.Clone(cfg.Pools),
		minimum:   cfg.MinimumSize,
		mountOnly: cfg.MountOnly,
		volumes:   map[string]*backend.Volume{},
		snapshots: map[string]*backend.Snapshot{},
		committed: map[string]int64{},
		health:    map[string]backend.Health{},
	}, nil
}

func (c *Controller) Backend() accessmode.Backend { return c.backend }

// Zones lists the pools' zones; nil for a zoneless backend.
func (c *Controller) Zones() []string {
	if c.zoneless() {
		return nil
	}
	zones := make([]string, len(c.pools))
	for i, p := range c.pools {
		zones[i] = p.Zone
	}
	return zones
}

func (c *Controller) zoneless() bool { return len(c.pools) == 1 && c.pools[0].Zone == "" }

func (c *Controller) MinimumSize() int64 { return c.minimum }

// NodeExpansionRequired answers as the real backend of the same name
// does: a block volume needs its node unless it is a filesystem no node
// may write; an NFS volume's new size is seen at once.
func (c *Controller) NodeExpansionRequired(v *backend.Volume) bool {
	if c.backend != accessmode.BackendBlock {
		return false
	}
	return v.AccessType == accessmode.Block || !accessmode.AllReadOnly(v.Modes)
}

func (c *Controller) pool(zone string) (Pool, error) {
	for _, p := range c.pools {
		if p.Zone == zone {
			return p, nil
		}
	}
	if c.zoneless() {
		return Pool{}, status.Errorf(codes.InvalidArgument, "%s volumes have no zone; got %q", c.backend, zone)
	}
	return Pool{}, status.Errorf(codes.InvalidArgument, "zone %q has no %s pool here (configured zones: %s)",
		zone, c.backend, strings.Join(c.Zones(), ", "))
}

// checkID refuses an id of another backend or kind, or of a zone without
// a pool, and returns its pool.
func (c *Controller) checkID(id volumeid.ID, kind volumeid.Kind) (Pool, error) {
	if id.Backend != c.backend {
		return Pool{}, status.Errorf(codes.InvalidArgument, "id %s is not a %s backend id", id, c.backend)
	}
	if id.Kind != kind {
		return Pool{}, status.Errorf(codes.InvalidArgument, "id %s names a %s, not a %s", id, id.Kind, kind)
	}
	return c.pool(id.Zone)
}

// snapshotPool is the pool a snapshot id of volume source goes in, which
// must be its source's.
func (c *Controller) snapshotPool(id, source volumeid.ID) (Pool, error) {
	p, err := c.checkID(id, volumeid.Snapshot)
	if err == nil {
		_, err = c.checkID(source, volumeid.Volume)
	}
	if err == nil {
		err = backend.CheckSnapshotZone(id, source)
	}
	return p, err
}

// spare is what zone's pool has not promised. Called with c.mu held.
func (c *Controller) spare(p Pool) int64 { return max(0, p.SizeBytes-c.committed[p.Zone]) }

// promise commits bytes of p, or refuses as the real backends do when
// they are not there. Called with c.mu held.
func (c *Controller) promise(p Pool, bytes int64, what string) error {
	if spare := c.spare(p); spare < bytes {
		return status.Errorf(codes.ResourceExhausted, "the pool of zone %q has no room for %s: asked for %d bytes, %d bytes available",
			p.Zone, what, bytes, spare)
	}
	c.committed[p.Zone] += bytes
	return nil
}

func (c *Controller) Capacity(ctx context.Context, zone string) (int64, error) {
	if err := c.enter(ctx, "Capacity"); err != nil {
		return 0, err
	}
	p, err := c.pool(zone)
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.spare(p), nil
}

// Pools reports each pool; its free bytes are those not promised, as
// nothing else takes room in memory.
func (c *Controller) Pools(ctx context.Context) ([]backend.PoolStats, error) {
	if err := c.enter(ctx, "Pools"); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]backend.PoolStats, len(c.pools))
	for i, p := range c.pools {
		out[i] = backend.PoolStats{Zone: p.Zone, SizeBytes: p.SizeBytes, FreeBytes: c.spare(p), CommittedBytes: c.committed[p.Zone]}
	}
	return out, nil
}

func (c *Controller) CreateVolume(ctx context.Context, spec backend.VolumeSpec) (*backend.Volume, error) {
	if err := c.enter(ctx, "CreateVolume"); err != nil {
		return nil, err
	}
	p, err := c.checkSpec(spec)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	id := spec.ID.String()
	if _, exists := c.volumes[id]; exists {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s already exists", id)
	}
	source, err := c.checkSource(spec.Source, spec.CapacityBytes)
	if err != nil {
		return nil, err
	}
	if err := c.promise(p, spec.CapacityBytes, "volume "+spec.Name); err != nil {
		return nil, err
	}
	v := &backend.Volume{
		ID: id, Name: spec.Name, CapacityBytes: spec.CapacityBytes, Zone: spec.ID.Zone,
		AccessType: spec.AccessType, FsType: spec.FsType, Modes: slices.Clone(spec.Modes),
		Parameters: maps.Clone(spec.Parameters), MutableParameters: maps.Clone(spec.MutableParameters),
		Source: source, CreatedAt: time.Now().UTC(),
	}
	c.volumes[id] = v
	return v.Clone(), nil
}

// checkSpec refuses what no pool here can make and returns the pool.
func (c *Controller) checkSpec(spec backend.VolumeSpec) (Pool, error) {
	p, err := c.checkID(spec.ID, volumeid.Volume)
	if err != nil {
		return Pool{}, err
	}
	if spec.CapacityBytes <= 0 {
		return Pool{}, status.Errorf(codes.InvalidArgument, "capacity must be positive, got %d bytes", spec.CapacityBytes)
	}
	switch {
	case spec.AccessType == accessmode.Mount:
		return p, backend.CheckFsType(spec.FsType)
	case spec.AccessType == accessmode.Block && c.mountOnly:
		return Pool{}, status.Errorf(codes.InvalidArgument, "backend %s serves filesystems only", c.backend)
	case spec.AccessType == accessmode.Block:
		return p, nil
	}
	return Pool{}, status.Errorf(codes.InvalidArgument, "access type %q is not one of mount, block", spec.AccessType)
}

// checkSource finds a new volume's source, which must exist, be ready
// and fit. Called with c.mu held.
func (c *Controller) checkSource(src *backend.Source, capacity int64) (*backend.Source, error) {
	if src == nil || *src == (backend.Source{}) {
		return nil, nil
	}
	raw, kind, err := src.Object()
	if err != nil {
		return nil, err
	}
	id, err := volumeid.ParseKind(raw, kind)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "source %s: %v", kind, err)
	}
	if id.Backend != c.backend {
		return nil, status.Errorf(codes.InvalidArgument, "source %s belongs to backend %s, not %s", raw, id.Backend, c.backend)
	}
	var size int64
	if kind == volumeid.Snapshot {
		s, ok := c.snapshots[raw]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "source snapshot %s does not exist", raw)
		}
		if s.Cutting {
			return nil, status.Errorf(codes.Unavailable, "source snapshot %s is still being copied; retry once it is ready to use", raw)
		}
		size = s.SizeBytes
	} else {
		v, ok := c.volumes[raw]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "source volume %s does not exist", raw)
		}
		size = v.CapacityBytes
	}
	if size > capacity {
		return nil, status.Errorf(codes.OutOfRange, "source %s is %d bytes, more than the %d bytes requested", raw, size, capacity)
	}
	out := *src
	return &out, nil
}

// Creating answers false: this backend's creations end with their call.
// A fault set on it (FailNext) is how a test makes it unable to tell.
func (c *Controller) Creating(ctx context.Context, id volumeid.ID) (bool, error) {
	if err := c.enter(ctx, "Creating"); err != nil {
		return false, err
	}
	return false, nil
}

// ZonesFillableFrom is every zone for a source in one of them, as the
// block controller it stands for answers with its pools at hand.
func (c *Controller) ZonesFillableFrom(ctx context.Context, sourceZone string) ([]string, error) {
	if err := c.enter(ctx, "ZonesFillableFrom"); err != nil {
		return nil, err
	}
	zones := c.Zones()
	if !slices.Contains(zones, sourceZone) {
		return nil, nil
	}
	return zones, nil
}

// CreateSnapshotGroup takes the members one after the other, as the
// backends it stands for do on pools that cannot take a group at once.
func (c *Controller) CreateSnapshotGroup(ctx context.Context, members []backend.GroupMember) ([]*backend.Snapshot, error) {
	if err := c.enter(ctx, "CreateSnapshotGroup"); err != nil {
		return nil, err
	}
	return backend.SnapshotOneAtATime(ctx, c, members)
}

// SnapshotBlocks is unimplemented: this backend keeps no data, so its
// snapshots have no blocks to describe.
func (c *Controller) SnapshotBlocks(ctx context.Context, req backend.BlockRangesRequest) (*backend.BlockRanges, error) {
	if err := c.enter(ctx, "SnapshotBlocks"); err != nil {
		return nil, err
	}
	return nil, status.Errorf(codes.Unimplemented, "snapshot %s: the in-memory backend keeps no data, so it has no block metadata", req.Target)
}

func (c *Controller) Volume(ctx context.Context, id volumeid.ID) (*backend.Volume, error) {
	if err := c.enter(ctx, "Volume"); err != nil {
		return nil, err
	}
	return c.volume(id)
}

// volume is Volume without faults, for the node.
func (c *Controller) volume(id volumeid.ID) (*backend.Volume, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return backend.RecordedVolume(c.volumes, id)
}

// DeleteVolume forgets the volume and gives its bytes back. Its snapshots
// stay: they are copies, as with the real backends.
func (c *Controller) DeleteVolume(ctx context.Context, id volumeid.ID) error {
	if err := c.enter(ctx, "DeleteVolume"); err != nil {
		return err
	}
	return c.deleteObject(id, volumeid.Volume)
}

func (c *Controller) deleteObject(id volumeid.ID, kind volumeid.Kind) error {
	if _, err := c.checkID(id, kind); err != nil {
		if id.Backend == c.backend && id.Kind == kind {
			return nil // a zone without a pool here holds nothing of it
		}
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	key := id.String()
	if v, ok := c.volumes[key]; ok {
		c.nodes.Set(key, v.Attachments, nil)
		c.committed[id.Zone] -= v.CapacityBytes
		delete(c.volumes, key)
		delete(c.health, key)
	}
	if s, ok := c.snapshots[key]; ok {
		c.committed[id.Zone] -= s.SizeBytes
		delete(c.snapshots, key)
	}
	return nil
}

// update applies change to the recorded volume under the lock and returns
// a copy of the result; change reports an error to leave it as it was.
func (c *Controller) update(id volumeid.ID, change func(v *backend.Volume) error) (*backend.Volume, error) {
	if _, err := c.checkID(id, volumeid.Volume); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	next, err := backend.RecordedVolume(c.volumes, id)
	if err != nil {
		return nil, err
	}
	before := c.volumes[next.ID].Attachments
	if err := change(next); err != nil {
		return nil, err
	}
	c.nodes.Set(next.ID, before, next.Attachments)
	c.volumes[next.ID] = next
	return next.Clone(), nil
}

// SetAttachments records the attachments, fenced ones too: there is no
// storage to keep a node from.
func (c *Controller) SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
	if err := c.enter(ctx, "SetAttachments"); err != nil {
		return nil, err
	}
	return c.update(id, func(v *backend.Volume) error {
		v.Attachments = slices.Clone(attachments)
		if len(v.Attachments) == 0 {
			v.Attachments = nil
		}
		return nil
	})
}

// ExpandVolume grows the volume's promise; a smaller size leaves it as it
// is. Like the block backend it refuses to grow a filesystem no node may
// write, which nobody could ever grow.
func (c *Controller) ExpandVolume(ctx context.Context, id volumeid.ID, bytes int64) (*backend.Volume, error) {
	if err := c.enter(ctx, "ExpandVolume"); err != nil {
		return nil, err
	}
	p, err := c.checkID(id, volumeid.Volume)
	if err != nil {
		return nil, err
	}
	return c.update(id, func(v *backend.Volume) error {
		if bytes <= v.CapacityBytes {
			return nil
		}
		if c.backend == accessmode.BackendBlock && v.AccessType == accessmode.Mount && accessmode.AllReadOnly(v.Modes) {
			return status.Errorf(codes.OutOfRange, "volume %s is a filesystem no node may write (%s): no node can ever grow it",
				id, accessmode.Names(v.Modes))
		}
		if err := c.promise(p, bytes-v.CapacityBytes, "growing volume "+v.Name); err != nil {
			return err
		}
		v.CapacityBytes = bytes
		return nil
	})
}

func (c *Controller) ModifyVolume(ctx context.Context, id volumeid.ID, mutable map[string]string) (*backend.Volume, error) {
	if err := c.enter(ctx, "ModifyVolume"); err != nil {
		return nil, err
	}
	return c.update(id, func(v *backend.Volume) error {
		v.MutableParameters = backend.WithMutable(v.MutableParameters, mutable)
		return nil
	})
}

func (c *Controller) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	if err := c.enter(ctx, "ListVolumes"); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return sortedCopies(c.volumes, (*backend.Volume).Clone), nil
}

func (c *Controller) VolumesOn(ctx context.Context, node string) ([]*backend.Volume, error) {
	if err := c.enter(ctx, "VolumesOn"); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes.Volumes(node, func(id string) *backend.Volume { return c.volumes[id].Clone() }), nil
}

// VolumeHealth reports what SetHealth set for the volume, healthy
// otherwise.
func (c *Controller) VolumeHealth(ctx context.Context, id volumeid.ID) (backend.Health, error) {
	if err := c.enter(ctx, "VolumeHealth"); err != nil {
		return backend.Health{}, err
	}
	if _, err := c.volume(id); err != nil {
		return backend.Health{}, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if h, ok := c.health[id.String()]; ok {
		return h, nil
	}
	return backend.Health{Message: "held in memory"}, nil
}

// SetHealth makes VolumeHealth report h for volume id until the volume is
// deleted.
func (c *Controller) SetHealth(id volumeid.ID, h backend.Health) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.health[id.String()] = h
}

// CreateSnapshot records a snapshot of the source's size in the source's
// pool. A retry with the same source returns the snapshot there is.
func (c *Controller) CreateSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID) (*backend.Snapshot, error) {
	if err := c.enter(ctx, "CreateSnapshot"); err != nil {
		return nil, err
	}
	p, err := c.snapshotPool(id, source)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := c.snapshots[id.String()]; ok {
		if s.SourceVolumeID != source.String() {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %s already exists with source volume %s", id, s.SourceVolumeID)
		}
		out := *s
		return &out, nil
	}
	v, ok := c.volumes[source.String()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist", source)
	}
	if err := c.promise(p, v.CapacityBytes, "snapshot "+name); err != nil {
		return nil, err
	}
	s := &backend.Snapshot{ID: id.String(), Name: name, SourceVolumeID: v.ID, SizeBytes: v.CapacityBytes,
		CreatedAt: time.Now().UTC(), AccessType: v.AccessType, FsType: v.FsType}
	c.snapshots[s.ID] = s
	out := *s
	return &out, nil
}

// SetCutting marks a snapshot as still being copied (not ready to use) or
// done, as a real backend's background copy would: a restore from it is
// refused meanwhile.
func (c *Controller) SetCutting(id volumeid.ID, cutting bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.snapshots[id.String()]
	if !ok {
		return status.Errorf(codes.NotFound, "snapshot %s does not exist", id)
	}
	s.Cutting = cutting
	return nil
}

func (c *Controller) Snapshot(ctx context.Context, id volumeid.ID) (*backend.Snapshot, error) {
	if err := c.enter(ctx, "Snapshot"); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return backend.RecordedSnapshot(c.snapshots, id)
}

func (c *Controller) DeleteSnapshot(ctx context.Context, id volumeid.ID) error {
	if err := c.enter(ctx, "DeleteSnapshot"); err != nil {
		return err
	}
	return c.deleteObject(id, volumeid.Snapshot)
}

func (c *Controller) ListSnapshots(ctx context.Context) ([]*backend.Snapshot, error) {
	if err := c.enter(ctx, "ListSnapshots"); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return sortedCopies(c.snapshots, func(s *backend.Snapshot) *backend.Snapshot { out := *s; return &out }), nil
}

// sortedCopies returns a copy of each record, sorted by id.
func sortedCopies[T any](records map[string]*T, clone func(*T) *T) []*T {
	ids := slices.Sorted(maps.Keys(records))
	out := make([]*T, len(ids))
	for i, id := range ids {
		out[i] = clone(records[id])
	}
	return out
}
