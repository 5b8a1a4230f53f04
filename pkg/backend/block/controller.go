package block

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/keylock"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

var _ backend.Controller = (*Controller)(nil)

// Controller creates, copies, grows and deletes images in the pools and is
// the only writer of their metadata.
type Controller struct {
	pools map[string]*pool
	zones []string

	// objects serialises work on one volume or snapshot id. The servers
	// already hold a lock per volume; this one keeps the index and the
	// metadata file consistent even if a caller does not.
	objects keylock.Set

	// capacityMu makes "is there room?" and "promise it" a single step, so
	// two creations cannot both be granted the last free bytes.
	capacityMu sync.Mutex

	mu        sync.Mutex
	volumes   map[string]*backend.Volume   // by id string
	snapshots map[string]*backend.Snapshot // by id string
	// nodes finds the volumes a node holds; usage keeps what each zone's
	// volumes have promised (usage.go). Both change with volumes, under mu.
	nodes backend.NodeIndex
	usage usage
	// reserved is, per zone, space promised to creations, expansions and
	// snapshots still copying: not yet visible as an image in the index.
	reserved map[string]int64
	// copies are the snapshots still being copied, by id (under mu).
	copies map[string]*copyJob
	// writers, when set, says who may write an image in place of the loop
	// devices bound to it (SetWriters).
	writers func(id volumeid.ID, image string) (string, error)

	// mounter replays the journal of copied filesystems (replayJournal).
	mounter *mount.SafeFormatAndMount
	// templates are the pools' formatted filesystems new volumes copy.
	templates templateSet
}

// NewController opens the pools (zone -> directory), creates their
// subdirectories, removes what a crash left behind and loads the index.
func NewController(pools map[string]string) (*Controller, error) {
	parsed, zones, err := parsePools(pools)
	if err != nil {
		return nil, err
	}
	c := &Controller{
		pools:     parsed,
		zones:     zones,
		volumes:   map[string]*backend.Volume{},
		snapshots: map[string]*backend.Snapshot{},
		reserved:  map[string]int64{},
		usage:     newUsage(),
		copies:    map[string]*copyJob{},
		mounter:   mount.NewSafeFormatAndMount(mount.New(""), utilexec.New()),
	}
	for _, zone := range zones {
		if err := c.load(parsed[zone]); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *Controller) load(p *pool) error {
	if err := p.mark(); err != nil {
		return fmt.Errorf("block pool %q: %w", p.zone, err)
	}
	if err := p.layOutOnBtrfs(); err != nil {
		return fmt.Errorf("block pool %q: %w", p.zone, err)
	}
	if err := p.dropGroupCaptures(); err != nil {
		return fmt.Errorf("block pool %q: %w", p.zone, err)
	}
	if err := c.templates.loadTemplates(p); err != nil {
		return fmt.Errorf("block pool %q: %w", p.zone, err)
	}
	for _, kind := range []volumeid.Kind{volumeid.Volume, volumeid.Snapshot} {
		dir := p.kindDir(kind)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("block pool %q: %w", p.zone, err)
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("block pool %q: %w", p.zone, err)
		}
		hasMeta := map[string]bool{}
		removed := false
		for _, e := range entries {
			name := e.Name()
			path, err := fsutil.JoinWithin(dir, name)
			if err != nil {
				return err
			}
			if strings.HasPrefix(name, ".") && strings.Contains(name, tempMarker) {
				klog.InfoS("Removing a temporary file left by an interrupted operation", "path", path)
				if e.IsDir() {
					// A journal replay's mount point: the mount goes first
					// (lazily, so a busy one cannot stop the start), which
					// also releases its loop device.
					if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
						return fmt.Errorf("unmounting leftover %s: %w", path, err)
					}
				}
				if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
					return fmt.Errorf("removing leftover %s: %w", path, err)
				}
				removed = true
				continue
			}
			id, ok := p.idForFile(kind, name, metaSuffix)
			if !ok {
				continue
			}
			if err := c.loadMeta(id, path); err != nil {
				return err
			}
			hasMeta[id.String()] = true
		}
		for _, e := range entries {
			id, ok := p.idForFile(kind, e.Name(), imageSuffix)
			if !ok || hasMeta[id.String()] {
				continue
			}
			// Metadata is written after the image is in place and removed
			// before it, so an image without metadata is a creation that
			// never finished or a deletion that never finished.
			path, err := fsutil.JoinWithin(dir, e.Name())
			if err != nil {
				return err
			}
			klog.InfoS("Removing an image that has no metadata", "path", path)
			if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("removing leftover %s: %w", path, err)
			}
			removed = true
		}
		for _, e := range entries {
			if _, meta := p.idForFile(kind, e.Name(), metaSuffix); meta {
				continue
			}
			if _, img := p.idForFile(kind, e.Name(), imageSuffix); img {
				continue
			}
			if !strings.Contains(e.Name(), tempMarker) {
				klog.InfoS("Ignoring a file the block backend did not create", "path", filepath.Join(dir, e.Name()))
			}
		}
		if removed {
			if err := fsutil.SyncDir(dir); err != nil {
				return err
			}
		}
	}
	return nil
}

func (c *Controller) loadMeta(id volumeid.ID, path string) error {
	switch id.Kind {
	case volumeid.Volume:
		var v backend.Volume
		if err := fsutil.ReadJSON(path, &v); err != nil {
			return fmt.Errorf("loading volume metadata: %w", err)
		}
		if v.ID != id.String() {
			return fmt.Errorf("volume metadata %s records id %q; its name says %q", path, v.ID, id)
		}
		c.putVolume(&v)
	case volumeid.Snapshot:
		var s backend.Snapshot
		if err := fsutil.ReadJSON(path, &s); err != nil {
			return fmt.Errorf("loading snapshot metadata: %w", err)
		}
		if s.ID != id.String() {
			return fmt.Errorf("snapshot metadata %s records id %q; its name says %q", path, s.ID, id)
		}
		c.snapshots[s.ID] = &s
	}
	return nil
}

// Backend names the backend.
func (c *Controller) Backend() accessmode.Backend { return accessmode.BackendBlock }

// Zones lists the zones that have a pool, sorted.
// MinimumSize is 0: the filesystem's own minimum (see the driver) is the
// only floor, and raw block volumes have none.
func (c *Controller) MinimumSize() int64 { return 0 }

// NodeExpansionRequired: a node must refresh its loop device (and grow the
// filesystem) before a workload sees a bigger volume. Raw block readers
// need the refresh as much as the writer. A filesystem no node may ever
// write is the exception: no node can grow it, so there is nothing to ask
// of one (and ExpandVolume refuses to grow its image).
func (c *Controller) NodeExpansionRequired(v *backend.Volume) bool {
	return v.AccessType == accessmode.Block || !accessmode.AllReadOnly(v.Modes)
}

func (c *Controller) Zones() []string { return slices.Clone(c.zones) }

// ZonesFillableFrom is every zone for a source in one of them: the
// controller copies between any two of its pools (sourceImage).
func (c *Controller) ZonesFillableFrom(_ context.Context, sourceZone string) ([]string, error) {
	if !slices.Contains(c.zones, sourceZone) {
		return nil, nil
	}
	return slices.Clone(c.zones), nil
}

func (c *Controller) poolFor(id volumeid.ID, kind volumeid.Kind) (*pool, error) {
	return poolFor(c.pools, c.zones, id, kind)
}

// Capacity is the space a new volume in zone could get.
func (c *Controller) Capacity(ctx context.Context, zone string) (int64, error) {
	p, ok := c.pools[zone]
	if !ok {
		return 0, status.Errorf(codes.InvalidArgument, "zone %q has no block pool here (configured zones: %s)", zone, strings.Join(c.zones, ", "))
	}
	return c.spareIn(p)
}

// Pools reports each zone's pool: the size and free space of the
// filesystem its directory is on, and the capacities of its volumes.
func (c *Controller) Pools(ctx context.Context) ([]backend.PoolStats, error) {
	committed := map[string]int64{}
	c.mu.Lock()
	for _, v := range c.volumes {
		if id, err := volumeid.Parse(v.ID); err == nil {
			committed[id.Zone] += v.CapacityBytes
		}
	}
	c.mu.Unlock()
	out := make([]backend.PoolStats, 0, len(c.zones))
	for _, zone := range c.zones {
		size, free, err := poolSpace(c.pools[zone].dir)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "statfs of block pool %q: %v", zone, err)
		}
		out = append(out, backend.PoolStats{Zone: zone, SizeBytes: size, FreeBytes: free, CommittedBytes: committed[zone]})
	}
	return out, nil
}

func (c *Controller) spareIn(p *pool) (int64, error) {
	idle, held := c.promised(p)
	c.mu.Lock()
	reserved := c.reserved[p.zone]
	c.mu.Unlock()

	free, err := freeBytes(p.dir)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "statfs of block pool %q: %v", p.zone, err)
	}
	promised := make([]int64, 0, len(held)+1)
	promised = append(promised, idle)
	for _, cm := range held {
		allocated, err := allocatedBytes(cm.image)
		if err != nil {
			return 0, status.Errorf(codes.Internal, "block pool %q: %v", p.zone, err)
		}
		promised = append(promised, outstanding(cm.capacity, allocated))
	}
	return spare(free, promised, reserved), nil
}

// reserve promises bytes in p's zone for an operation in flight. The
// returned release must run only after the result is in the index (or
// has failed), so the space is counted at every moment.
func (c *Controller) reserve(p *pool, bytes int64, what string) (release func(), err error) {
	c.capacityMu.Lock()
	defer c.capacityMu.Unlock()
	available, err := c.spareIn(p)
	if err != nil {
		return nil, err
	}
	if available < bytes {
		return nil, status.Errorf(codes.ResourceExhausted,
			"block pool of zone %q has no room for %s: asked for %d bytes, %d bytes available", p.zone, what, bytes, available)
	}
	c.mu.Lock()
	c.reserved[p.zone] += bytes
	c.mu.Unlock()
	return func() {
		c.mu.Lock()
		c.reserved[p.zone] -= bytes
		c.mu.Unlock()
	}, nil
}

// CreateVolume creates spec's image (empty, or a copy of a snapshot or
// volume) and records it. A byte copy that outlasts the call goes on in the
// background (see copy.go): the call answers ABORTED until it is done, and
// a retry waits for the same copy.
func (c *Controller) CreateVolume(ctx context.Context, spec backend.VolumeSpec) (*backend.Volume, error) {
	p, source, err := c.checkVolumeSpec(spec)
	if err != nil {
		return nil, err
	}
	id := spec.ID.String()
	defer c.objects.Hold(id)()
	if job := c.copyJobFor(id); job != nil {
		if !sameCreation(job.vol, spec) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is being created with other parameters (capacity %d bytes, source %+v)", id, job.vol.CapacityBytes, job.vol.Source)
		}
		return c.awaitVolumeCopy(ctx, job)
	}
	if _, err := c.Volume(ctx, spec.ID); err == nil {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s already exists", id)
	}
	var sourceImage string
	if source != nil {
		if sourceImage, err = c.sourceImage(source, spec.CapacityBytes); err != nil {
			return nil, err
		}
	}
	m, err := c.startImage(p, spec.ID, spec.CapacityBytes, "volume "+spec.Name)
	if err != nil {
		return nil, err
	}
	defer m.abandon()
	byteCopy := false
	if sourceImage != "" {
		unlock, cloned, err := c.cloneSource(ctx, source, sourceImage, m.tmp)
		if err != nil {
			return nil, err
		}
		m.hold(unlock)
		byteCopy = !cloned
	}
	vol := newVolumeRecord(spec, source)
	finish := func(ctx context.Context) error {
		if byteCopy {
			if err := copyImage(ctx, sourceImage, m.tmp); err != nil {
				return err
			}
		}
		return c.completeVolume(ctx, p, m, vol, spec.Modes)
	}
	if !byteCopy {
		if err := finish(ctx); err != nil {
			return nil, err
		}
		return vol.Clone(), nil
	}
	return c.awaitVolumeCopy(ctx, c.startCopy(id, &copyJob{vol: vol.Clone()}, finish, m))
}

// checkVolumeSpec refuses what no pool here can make and returns the pool
// and the volume's content source (nil for an empty volume).
func (c *Controller) checkVolumeSpec(spec backend.VolumeSpec) (*pool, *backend.Source, error) {
	p, err := c.poolFor(spec.ID, volumeid.Volume)
	if err != nil {
		return nil, nil, err
	}
	if spec.CapacityBytes <= 0 {
		return nil, nil, status.Errorf(codes.InvalidArgument, "capacity must be positive, got %d bytes", spec.CapacityBytes)
	}
	switch spec.AccessType {
	case accessmode.Mount:
		if err := backend.CheckFsType(spec.FsType); err != nil {
			return nil, nil, err
		}
	case accessmode.Block:
	default:
		return nil, nil, status.Errorf(codes.InvalidArgument, "access type %q is not one of mount, block", spec.AccessType)
	}
	source := spec.Source
	if source != nil && source.SnapshotID == "" && source.VolumeID == "" {
		source = nil
	}
	return p, source, nil
}

func newVolumeRecord(spec backend.VolumeSpec, source *backend.Source) *backend.Volume {
	vol := &backend.Volume{
		ID:            spec.ID.String(),
		Name:          spec.Name,
		CapacityBytes: spec.CapacityBytes,
		Zone:          spec.ID.Zone,
		AccessType:    spec.AccessType,
		FsType:        spec.FsType,
		Modes:         slices.Clone(spec.Modes),
		Parameters:    maps.Clone(spec.Parameters),
		// The node reads them from the record when it stages the volume.
		MutableParameters: maps.Clone(spec.MutableParameters),
	}
	if source != nil {
		s := *source
		vol.Source = &s
	}
	return vol
}

// completeVolume turns the image under construction (empty, or holding its
// source's bytes) into the volume: an empty ext4 volume's filesystem copied
// from its pool's template (template.go), sized, its copied journal replayed
// or an xfs filesystem made where no node may ever write it, published, and
// recorded, in that order, so that a crash at any step leaves a leftover
// the next start removes and never a record without its image.
func (c *Controller) completeVolume(ctx context.Context, p *pool, m *imageInProgress, vol *backend.Volume, modes []accessmode.Mode) error {
	templated := formatsFromTemplate(vol)
	if templated {
		if err := c.templates.fillFromTemplate(ctx, p, fsExt4, vol.CapacityBytes, m.tmp); err != nil {
			return err
		}
	}
	if err := growAndSync(m.tmp, vol.CapacityBytes); err != nil {
		return status.Errorf(codes.Internal, "sizing image of %s: %v", vol.ID, err)
	}
	// Each sync is a journal commit of the pool's filesystem, the largest
	// part of a create's cost: the second one only where something wrote.
	rewritten := false
	if vol.Source != nil && vol.AccessType == accessmode.Mount {
		if err := replayJournal(ctx, c.mounter, m.tmp); err != nil {
			return status.Errorf(codes.Internal, "preparing the filesystem copied into %s: %v", vol.ID, err)
		}
		rewritten = true
	}
	if !templated && formatsAtCreate(vol.AccessType, modes, vol.Source) {
		if err := mkfs(ctx, fsOrDefault(vol.FsType), m.tmp); err != nil {
			return err
		}
		rewritten = true
	}
	if rewritten {
		if err := growAndSync(m.tmp, vol.CapacityBytes); err != nil { // a replay's or mkfs's writes, to disk
			return status.Errorf(codes.Internal, "syncing image of %s: %v", vol.ID, err)
		}
	}
	fpCreateImageWritten.Hit()
	vol.CreatedAt = time.Now().UTC()
	if perr, rerr := m.publishAndRecord(vol, fpCreateImagePublished.Hit); perr != nil {
		return status.Errorf(codes.Internal, "publishing image of %s: %v", vol.ID, perr)
	} else if rerr != nil {
		return status.Errorf(codes.Internal, "recording volume %s: %v", vol.ID, rerr)
	}
	fpCreateRecorded.Hit()
	c.mu.Lock()
	c.putVolume(vol)
	c.mu.Unlock()
	return nil
}

// Steps a test can kill the controller at (package faultpoint): after each,
// a crash leaves a different state for the restart and the CO's retries.
var (
	fpCreateImageWritten   = faultpoint.New("block.create.image-written")
	fpCreateImagePublished = faultpoint.New("block.create.image-published")
	fpCreateRecorded       = faultpoint.New("block.create.recorded")
	fpDeleteMetaRemoved    = faultpoint.New("block.delete.meta-removed")
	fpVolumeUpdated        = faultpoint.New("block.volume.updated")
	fpSnapshotCopied       = faultpoint.New("block.snapshot.copied")
	fpExpandImageGrown     = faultpoint.New("block.expand.image-grown")
)

// formatsAtCreate is true for filesystem volumes no node will ever be
// allowed to write: a read-only node cannot format, so nobody could. A
// copied volume brings its filesystem along.
func formatsAtCreate(t accessmode.AccessType, modes []accessmode.Mode, source *backend.Source) bool {
	return t == accessmode.Mount && source == nil && accessmode.AllReadOnly(modes)
}

// sourceImage finds the image a new volume is copied from and checks that
// it fits. The source may live in any zone's pool.
func (c *Controller) sourceImage(src *backend.Source, capacity int64) (string, error) {
	raw, kind, err := src.Object()
	if err != nil {
		return "", err
	}
	id, err := volumeid.ParseKind(raw, kind)
	if err != nil {
		return "", status.Errorf(codes.NotFound, "source %s: %v", kind, err)
	}
	if id.Backend != accessmode.BackendBlock {
		return "", status.Errorf(codes.InvalidArgument, "source %s belongs to backend %s; a block volume can only be filled from the block backend", raw, id.Backend)
	}
	p, ok := c.pools[id.Zone]
	if !ok {
		return "", status.Errorf(codes.NotFound, "source %s: zone %q has no block pool here", raw, id.Zone)
	}
	var size int64
	c.mu.Lock()
	if job, copying := c.copies[raw]; copying && job.vol == nil {
		c.mu.Unlock()
		return "", status.Errorf(codes.Unavailable, "source snapshot %s is still being copied; retry once it is ready to use", raw)
	}
	if kind == volumeid.Snapshot {
		if s, found := c.snapshots[raw]; found {
			size = s.SizeBytes
		} else {
			ok = false
		}
	} else {
		if v, found := c.volumes[raw]; found {
			size = v.CapacityBytes
		} else {
			ok = false
		}
	}
	c.mu.Unlock()
	if !ok {
		return "", status.Errorf(codes.NotFound, "source %s %s does not exist", kind, raw)
	}
	if size > capacity {
		return "", status.Errorf(codes.OutOfRange, "source %s is %d bytes, more than the %d bytes requested", raw, size, capacity)
	}
	image, err := p.imagePath(id)
	if err != nil {
		return "", status.Error(codes.Internal, err.Error())
	}
	return image, nil
}

// Volume returns the recorded volume.
func (c *Controller) Volume(ctx context.Context, id volumeid.ID) (*backend.Volume, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return backend.RecordedVolume(c.volumes, id)
}

// DeleteVolume removes the metadata, then the image, so that a crash in
// between leaves an image without metadata, which the next start removes.
func (c *Controller) DeleteVolume(ctx context.Context, id volumeid.ID) error {
	// A restore or clone still copying is cancelled: the CO gave up on it.
	if err := c.cancelCopy(ctx, id); err != nil {
		return err
	}
	return c.deleteObject(id, volumeid.Volume)
}

func (c *Controller) deleteObject(id volumeid.ID, kind volumeid.Kind) error {
	p, err := c.poolFor(id, kind)
	if err != nil {
		if id.Backend == accessmode.BackendBlock && id.Kind == kind {
			// No pool here, so nothing of it here either. Said loudly
			// because a dropped --block-pool flag also ends up here.
			klog.InfoS("Delete of an object in a zone without a pool here: nothing to delete", "id", id.String())
			return nil
		}
		return err
	}
	defer c.objects.Hold(id.String())()
	metaPath, err := p.metaPath(id)
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	imagePath, err := p.imagePath(id)
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	if err := fsutil.RemoveDurably(metaPath); err != nil {
		return status.Errorf(codes.Internal, "deleting %s: %v", id, err)
	}
	fpDeleteMetaRemoved.Hit()
	c.mu.Lock()
	c.dropVolume(id.String())
	delete(c.snapshots, id.String())
	c.mu.Unlock()
	if err := fsutil.RemoveDurably(imagePath); err != nil {
		return status.Errorf(codes.Internal, "deleting image of %s: %v", id, err)
	}
	return nil
}

// SetAttachments records which nodes hold the volume. Nodes read this at
// stage time, so recording it is what makes an attachment effective.
//
// A fenced attachment is refused: a node reaches a pool's image through
// its own loop device on storage every node of the zone shares, and
// nothing on the storage side can keep it from writing. A storage target
// (package served) can, and records through RecordAttachments.
func (c *Controller) SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
	for _, a := range attachments {
		if a.Fenced {
			return nil, status.Errorf(codes.FailedPrecondition,
				"volume %s cannot be fenced from node %s: it is reached through a loop device on a pool every node of zone %s shares, where nothing but the node itself decides what it writes; serve the zone from a storage target (--block-target) to fence at the storage",
				id, a.Node.Name, id.Zone)
		}
	}
	return c.RecordAttachments(ctx, id, attachments)
}

// RecordAttachments records which nodes hold the volume, fenced or not,
// for a caller that makes them effective itself (a storage target).
func (c *Controller) RecordAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
	return c.updateVolume(ctx, id, func(v *backend.Volume) (bool, error) {
		v.Attachments = slices.Clone(attachments)
		if len(v.Attachments) == 0 {
			v.Attachments = nil
		}
		return true, nil
	})
}

// updateVolume applies change to a copy of the volume and, if change says
// so, persists it before the index sees it.
func (c *Controller) updateVolume(ctx context.Context, id volumeid.ID, change func(*backend.Volume) (bool, error)) (*backend.Volume, error) {
	p, err := c.poolFor(id, volumeid.Volume)
	if err != nil {
		return nil, err
	}
	defer c.objects.Hold(id.String())()
	v, err := c.Volume(ctx, id)
	if err != nil {
		return nil, err
	}
	changed, err := change(v)
	if err != nil || !changed {
		return v, err
	}
	metaPath, err := p.metaPath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := fsutil.WriteJSONAtomic(metaPath, v); err != nil {
		return nil, status.Errorf(codes.Internal, "recording volume %s: %v", id, err)
	}
	fpVolumeUpdated.Hit()
	c.mu.Lock()
	c.putVolume(v.Clone())
	c.mu.Unlock()
	return v, nil
}

// ModifyVolume records the volume's new mutable parameters. Nodes read
// them from the record when they stage the volume (the read-ahead of its
// device), so a node that has it staged now keeps its settings until its
// next stage.
func (c *Controller) ModifyVolume(ctx context.Context, id volumeid.ID, mutable map[string]string) (*backend.Volume, error) {
	return c.updateVolume(ctx, id, func(v *backend.Volume) (bool, error) {
		next := backend.WithMutable(v.MutableParameters, mutable)
		if maps.Equal(next, v.MutableParameters) {
			return false, nil
		}
		v.MutableParameters = next
		return true, nil
	})
}

// ExpandVolume grows the image (never shrinks it). The image grows before
// the metadata, so a crash in between leaves a recorded size that is too
// small, which the retry corrects, and never one that is too large.
func (c *Controller) ExpandVolume(ctx context.Context, id volumeid.ID, bytes int64) (*backend.Volume, error) {
	p, err := c.poolFor(id, volumeid.Volume)
	if err != nil {
		return nil, err
	}
	imagePath, err := p.imagePath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	// The promise of the growth is let go only once the index counts the
	// new capacity: released inside the change, it would leave a moment
	// in which the pool promised those bytes to no one.
	release := func() {}
	defer func() { release() }()
	return c.updateVolume(ctx, id, func(v *backend.Volume) (bool, error) {
		if bytes <= v.CapacityBytes {
			return false, nil
		}
		if v.AccessType == accessmode.Mount && accessmode.AllReadOnly(v.Modes) {
			// Every stage of such a volume is read-only, so no node ever
			// grows its filesystem: a bigger image would report a capacity
			// the filesystem never reaches and hold pool space nobody can
			// use. OUT_OF_RANGE is the spec's "capacity range not allowed";
			// the Kubernetes resizer takes it as infeasible, so the claim
			// can be set back to its size, where FAILED_PRECONDITION would
			// have it wait for the volume to be unused and try again in vain.
			return false, status.Errorf(codes.OutOfRange,
				"volume %s is a filesystem no node may write (%s): no node can ever grow it, so it stays at %d bytes; a clone of it into a larger writable volume grows at its first read/write stage",
				id, accessmode.Names(v.Modes), v.CapacityBytes)
		}
		var err error
		if release, err = c.reserve(p, bytes-v.CapacityBytes, "growing volume "+v.Name); err != nil {
			release = func() {}
			return false, err
		}
		if err := growAndSync(imagePath, bytes); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return false, status.Errorf(codes.FailedPrecondition, "image of volume %s is missing", id)
			}
			return false, status.Errorf(codes.Internal, "growing image of %s: %v", id, err)
		}
		fpExpandImageGrown.Hit()
		v.CapacityBytes = bytes
		return true, nil
	})
}

// SetWriters makes f the judge of who may be writing a volume's image
// (besides its read-write attachments) before a byte copy of it, in place
// of the loop devices bound to it here: where a storage target serves the
// images, its own device under each one is a conduit, always read/write,
// and the writers are whom the target lets write. Call it before serving.
func (c *Controller) SetWriters(f func(id volumeid.ID, image string) (string, error)) { c.writers = f }

// ListVolumes returns copies of every volume, sorted by id.
func (c *Controller) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	c.mu.Lock()
	out := make([]*backend.Volume, 0, len(c.volumes))
	for _, v := range c.volumes {
		out = append(out, v.Clone())
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// VolumesOn returns copies of the volumes node holds, sorted by id.
func (c *Controller) VolumesOn(ctx context.Context, node string) ([]*backend.Volume, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes.Volumes(node, func(id string) *backend.Volume { return c.volumes[id].Clone() }), nil
}

// VolumeHealth checks that the image is there and as large as recorded,
// and that the pool can still hold what the volume may write.
func (c *Controller) VolumeHealth(ctx context.Context, id volumeid.ID) (backend.Health, error) {
	p, err := c.poolFor(id, volumeid.Volume)
	if err != nil {
		return backend.Health{}, err
	}
	v, err := c.Volume(ctx, id)
	if err != nil {
		return backend.Health{}, err
	}
	imagePath, err := p.imagePath(id)
	if err != nil {
		return backend.Health{}, status.Error(codes.Internal, err.Error())
	}
	if h := imageHealth(imagePath, v.CapacityBytes); h.Abnormal {
		return h, nil
	}
	return poolHealth(p.dir, imagePath, v.CapacityBytes), nil
}

func imageHealth(imagePath string, capacity int64) backend.Health {
	fi, err := os.Stat(imagePath)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return backend.Health{Abnormal: true, Condition: backend.DataLoss, Reason: "ImageMissing",
			Message: fmt.Sprintf("the volume's image %s is missing", imagePath)}
	case err != nil:
		return backend.Health{Abnormal: true, Condition: backend.Inaccessible, Reason: "ImageUnreadable",
			Message: fmt.Sprintf("cannot inspect the volume's image %s: %v", imagePath, err)}
	case fi.Size() < capacity:
		return backend.Health{Abnormal: true, Condition: backend.DataLoss, Reason: "ImageTooSmall",
			Message: fmt.Sprintf("the volume's image is %d bytes, its capacity is %d bytes", fi.Size(), capacity)}
	}
	return backend.Health{Message: "image present and complete"}
}

// poolHealth says Degraded when the pool has less room than the sparse
// image may still claim: a write into a hole would then fail with ENOSPC
// inside the volume, though it is nowhere near full.
func poolHealth(poolDir, imagePath string, capacity int64) backend.Health {
	free, err := freeBytes(poolDir)
	if err != nil {
		return backend.Health{Abnormal: true, Condition: backend.Inaccessible, Reason: "PoolUnreadable",
			Message: fmt.Sprintf("cannot read the pool's free space: %v", err)}
	}
	allocated, err := allocatedBytes(imagePath)
	if err != nil {
		return backend.Health{Abnormal: true, Condition: backend.Inaccessible, Reason: "ImageUnreadable", Message: err.Error()}
	}
	if want := outstanding(capacity, allocated); free < want {
		return backend.Health{Abnormal: true, Condition: backend.Degraded, Reason: "PoolFull",
			Message: fmt.Sprintf("the pool has %d bytes free and the volume may still write %d more: writes can fail with ENOSPC", free, want)}
	}
	return backend.Health{Message: "image present and complete"}
}

// CreateSnapshot copies the source volume's image. The snapshot lives in
// the source's pool, so the copy can share extents with it.
//
// A reflink clone is instant and done within the call. A byte copy (a pool
// without reflinks, of a volume nobody writes) may take longer than the
// CO's deadline: it goes on in the background, holding the source's lock
// (no attach slips in) and its space reservation, and the call answers
// with the snapshot not ready to use just before its deadline. Retries,
// and Snapshot and ListSnapshots, answer the same until the copy is done;
// a retry never starts the copy again. DeleteSnapshot cancels it.
func (c *Controller) CreateSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID) (*backend.Snapshot, error) {
	return c.createSnapshot(ctx, id, name, source, "")
}

// createSnapshot takes a snapshot of source's image, or, when captured is
// set, of that image: a copy of source's as of an instant already past
// (a group's capture), which nobody writes, so it is cloned without asking
// who writes the source.
func (c *Controller) createSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID, captured string) (*backend.Snapshot, error) {
	p, err := c.poolFor(id, volumeid.Snapshot)
	if err != nil {
		return nil, err
	}
	if _, err := c.poolFor(source, volumeid.Volume); err != nil {
		return nil, err
	}
	if err := backend.CheckSnapshotZone(id, source); err != nil {
		return nil, err
	}
	defer c.objects.Hold(id.String())()
	if existing, err := c.Snapshot(ctx, id); err == nil {
		if existing.SourceVolumeID != source.String() {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %s already exists with source volume %s", id, existing.SourceVolumeID)
		}
		if job := c.copyJobFor(id.String()); job != nil {
			return c.awaitSnapshotCopy(ctx, job)
		}
		return existing, nil
	}
	// The source's attachments cannot change while it is copied: an
	// attach waits, so "nobody writes it" stays true to the end.
	unlock := c.objects.Hold(source.String())
	vol, err := c.Volume(ctx, source)
	if err != nil {
		unlock()
		return nil, err
	}
	sourceImage, err := p.imagePath(source)
	if err != nil {
		unlock()
		return nil, status.Error(codes.Internal, err.Error())
	}
	if captured != "" {
		sourceImage = captured
	}
	// Without reflink the copy takes as much as the source occupies.
	need, err := allocatedBytes(sourceImage)
	if err != nil {
		unlock()
		return nil, status.Errorf(codes.Internal, "inspecting image of %s: %v", source, err)
	}
	m, err := c.startImage(p, id, need, "snapshot "+name)
	if err != nil {
		unlock()
		return nil, err
	}
	m.hold(unlock)
	defer m.abandon()
	var cloned bool
	if captured != "" {
		if err := cloneImage(sourceImage, m.tmp); err != nil {
			return nil, status.Errorf(codes.Internal, "cloning the captured image of %s: %v", source, err)
		}
		cloned = true
	} else if cloned, err = c.cloneOrVet(vol, sourceImage, m.tmp); err != nil {
		return nil, err
	}
	snap := &backend.Snapshot{ID: id.String(), Name: name, SourceVolumeID: source.String(), SizeBytes: vol.CapacityBytes,
		CreatedAt: time.Now().UTC(), AccessType: vol.AccessType, FsType: vol.FsType}
	finish := func(ctx context.Context) error {
		if !cloned {
			if err := copyImage(ctx, sourceImage, m.tmp); err != nil {
				return err
			}
		}
		return c.completeSnapshot(m, snap)
	}
	if cloned {
		if err := finish(ctx); err != nil {
			return nil, err
		}
		out := *snap
		return &out, nil
	}
	job := &copyJob{snap: *snap}
	job.snap.Cutting = true
	return c.awaitSnapshotCopy(ctx, c.startCopy(snap.ID, job, finish, m))
}

// completeSnapshot publishes and records a snapshot whose image holds its
// copy, as completeVolume does for volumes.
func (c *Controller) completeSnapshot(m *imageInProgress, snap *backend.Snapshot) error {
	if err := growAndSync(m.tmp, 0); err != nil { // size 0: only mode and fsync
		return status.Errorf(codes.Internal, "syncing image of %s: %v", snap.ID, err)
	}
	fpSnapshotCopied.Hit()
	if perr, rerr := m.publishAndRecord(snap, func() {}); perr != nil {
		return status.Errorf(codes.Internal, "publishing image of %s: %v", snap.ID, perr)
	} else if rerr != nil {
		return status.Errorf(codes.Internal, "recording snapshot %s: %v", snap.ID, rerr)
	}
	c.mu.Lock()
	c.snapshots[snap.ID] = snap
	c.mu.Unlock()
	return nil
}

// Snapshot returns the recorded snapshot, or one still being copied
// (Cutting).
func (c *Controller) Snapshot(ctx context.Context, id volumeid.ID) (*backend.Snapshot, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if job, ok := c.copies[id.String()]; ok && job.vol == nil {
		out := job.snap
		return &out, nil
	}
	return backend.RecordedSnapshot(c.snapshots, id)
}

// DeleteSnapshot removes a snapshot. Volumes restored from it are full
// copies and do not depend on it.
// A snapshot still being copied is cancelled first.
func (c *Controller) DeleteSnapshot(ctx context.Context, id volumeid.ID) error {
	if err := c.cancelCopy(ctx, id); err != nil {
		return err
	}
	return c.deleteObject(id, volumeid.Snapshot)
}

// ListSnapshots returns copies of every snapshot, sorted by id.
func (c *Controller) ListSnapshots(ctx context.Context) ([]*backend.Snapshot, error) {
	c.mu.Lock()
	out := make([]*backend.Snapshot, 0, len(c.snapshots)+len(c.copies))
	for _, s := range c.snapshots {
		cp := *s
		out = append(out, &cp)
	}
	for _, job := range c.copies {
		if job.vol == nil {
			cp := job.snap
			out = append(out, &cp)
		}
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// ImagePath is where the volume's image is in its pool: what a storage
// target serves over the network.
func (c *Controller) ImagePath(id volumeid.ID) (string, error) {
	p, err := c.poolFor(id, volumeid.Volume)
	if err != nil {
		return "", err
	}
	path, err := p.imagePath(id)
	if err != nil {
		return "", status.Error(codes.Internal, err.Error())
	}
	return path, nil
}
