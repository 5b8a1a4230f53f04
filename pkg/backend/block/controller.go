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
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
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
	objects keyedMutex

	// capacityMu makes "is there room?" and "promise it" a single step, so
	// two creations cannot both be granted the last free bytes.
	capacityMu sync.Mutex

	mu        sync.Mutex
	volumes   map[string]*backend.Volume   // by id string
	snapshots map[string]*backend.Snapshot // by id string
	// reserved is, per zone, space promised to creations, expansions and
	// snapshots still copying: not yet visible as an image in the index.
	reserved map[string]int64

	// mounter replays the journal of copied filesystems (replayJournal).
	mounter *mount.SafeFormatAndMount
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
		c.volumes[v.ID] = &v
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
	return v.AccessType == accessmode.Block || !onlyReadOnly(v.Modes)
}

func (c *Controller) Zones() []string { return slices.Clone(c.zones) }

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
	type commitment struct {
		image    string
		capacity int64
	}
	var commitments []commitment
	c.mu.Lock()
	for _, v := range c.volumes {
		id, err := volumeid.Parse(v.ID)
		if err != nil || id.Zone != p.zone {
			continue
		}
		image, err := p.imagePath(id)
		if err != nil {
			continue
		}
		commitments = append(commitments, commitment{image, v.CapacityBytes})
	}
	reserved := c.reserved[p.zone]
	c.mu.Unlock()

	free, err := freeBytes(p.dir)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "statfs of block pool %q: %v", p.zone, err)
	}
	promised := make([]int64, 0, len(commitments))
	for _, cm := range commitments {
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
// volume) and records it.
func (c *Controller) CreateVolume(ctx context.Context, spec backend.VolumeSpec) (*backend.Volume, error) {
	p, err := c.poolFor(spec.ID, volumeid.Volume)
	if err != nil {
		return nil, err
	}
	if spec.CapacityBytes <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "capacity must be positive, got %d bytes", spec.CapacityBytes)
	}
	switch spec.AccessType {
	case accessmode.Mount:
		if err := checkFsType(spec.FsType); err != nil {
			return nil, err
		}
	case accessmode.Block:
	default:
		return nil, status.Errorf(codes.InvalidArgument, "access type %q is not one of mount, block", spec.AccessType)
	}
	source := spec.Source
	if source != nil && source.SnapshotID == "" && source.VolumeID == "" {
		source = nil
	}

	id := spec.ID.String()
	defer c.objects.lock(id)()
	if _, err := c.Volume(ctx, spec.ID); err == nil {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s already exists", id)
	}
	metaPath, err := p.metaPath(spec.ID)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	imagePath, err := p.imagePath(spec.ID)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	var sourceImage string
	if source != nil {
		if sourceImage, err = c.sourceImage(source, spec.CapacityBytes); err != nil {
			return nil, err
		}
	}
	release, err := c.reserve(p, spec.CapacityBytes, "volume "+spec.Name)
	if err != nil {
		return nil, err
	}
	defer release()

	tmp, err := tempName(imagePath)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "creating image of %s: %v", id, err)
	}
	published := false
	defer func() {
		if !published {
			os.Remove(tmp)
		}
	}()
	if sourceImage != "" {
		if err := c.copyAtOnePoint(ctx, source, sourceImage, tmp); err != nil {
			return nil, err
		}
	}
	if err := growAndSync(tmp, spec.CapacityBytes); err != nil {
		return nil, status.Errorf(codes.Internal, "sizing image of %s: %v", id, err)
	}
	if sourceImage != "" && spec.AccessType == accessmode.Mount {
		if err := replayJournal(ctx, c.mounter, tmp); err != nil {
			return nil, status.Errorf(codes.Internal, "preparing the filesystem copied into %s: %v", id, err)
		}
		if err := growAndSync(tmp, 0); err != nil { // the replay's writes, to disk
			return nil, status.Errorf(codes.Internal, "syncing image of %s: %v", id, err)
		}
	}
	if formatsAtCreate(spec.AccessType, spec.Modes, source) {
		if err := mkfs(ctx, fsOrDefault(spec.FsType), tmp); err != nil {
			return nil, err
		}
		if err := growAndSync(tmp, spec.CapacityBytes); err != nil {
			return nil, status.Errorf(codes.Internal, "syncing image of %s: %v", id, err)
		}
	}
	fpCreateImageWritten.Hit()
	if err := os.Rename(tmp, imagePath); err != nil {
		return nil, status.Errorf(codes.Internal, "publishing image of %s: %v", id, err)
	}
	published = true
	if err := fsutil.SyncDir(p.kindDir(volumeid.Volume)); err != nil {
		return nil, status.Errorf(codes.Internal, "publishing image of %s: %v", id, err)
	}
	fpCreateImagePublished.Hit()

	vol := &backend.Volume{
		ID:            id,
		Name:          spec.Name,
		CapacityBytes: spec.CapacityBytes,
		Zone:          spec.ID.Zone,
		AccessType:    spec.AccessType,
		FsType:        spec.FsType,
		Modes:         slices.Clone(spec.Modes),
		Parameters:    maps.Clone(spec.Parameters),
		CreatedAt:     time.Now().UTC(),
	}
	if source != nil {
		s := *source
		vol.Source = &s
	}
	if err := fsutil.WriteJSONAtomic(metaPath, vol); err != nil {
		// Without metadata the image is a leftover; drop it now rather than
		// at the next restart.
		if rerr := fsutil.RemoveDurably(imagePath); rerr != nil {
			klog.ErrorS(rerr, "Removing image of a volume whose metadata could not be written", "volumeID", id)
		}
		return nil, status.Errorf(codes.Internal, "recording volume %s: %v", id, err)
	}
	fpCreateRecorded.Hit()
	c.mu.Lock()
	c.volumes[id] = vol
	c.mu.Unlock()
	return cloneVolume(vol), nil
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

// copyAtOnePoint copies a new volume's source image. A snapshot never
// changes; a volume may be in use and goes through copyVolumeAtOnePoint,
// under its lock so that no attach slips in while it is copied.
func (c *Controller) copyAtOnePoint(ctx context.Context, src *backend.Source, image, dst string) error {
	if src.VolumeID == "" {
		if err := cloneImage(image, dst); err == nil || !errors.Is(err, errNoReflink) {
			if err != nil {
				return status.Errorf(codes.Internal, "cloning %s: %v", filepath.Base(image), err)
			}
			return nil
		}
		return copyImage(ctx, image, dst)
	}
	defer c.objects.lock(src.VolumeID)()
	id, err := volumeid.ParseKind(src.VolumeID, volumeid.Volume)
	if err != nil {
		return status.Errorf(codes.NotFound, "source volume: %v", err)
	}
	vol, err := c.Volume(ctx, id)
	if err != nil {
		return err
	}
	return c.copyVolumeAtOnePoint(ctx, vol, image, dst)
}

// copyVolumeAtOnePoint copies a volume's image as it was at one instant, so
// that every write acknowledged before the copy began is in it and nothing
// is torn (crash-consistent). A reflink clone is that instant wherever the
// pool's filesystem has reflinks. Elsewhere a byte copy is only a point in
// time when nothing writes the image, so a volume attached for writing (or
// bound read-write to a loop device on this machine) is refused rather than
// copied while it moves. The caller holds the volume's lock.
func (c *Controller) copyVolumeAtOnePoint(ctx context.Context, vol *backend.Volume, image, dst string) error {
	err := cloneImage(image, dst)
	if err == nil {
		return nil
	}
	if !errors.Is(err, errNoReflink) {
		return status.Errorf(codes.Internal, "cloning the image of %s: %v", vol.ID, err)
	}
	if writer, err := writerOf(vol, image); err != nil {
		return status.Errorf(codes.Unavailable, "cannot tell whether volume %s is being written, so it is not copied (its pool has no reflinks): %v", vol.ID, err)
	} else if writer != "" {
		return status.Errorf(codes.FailedPrecondition,
			"volume %s is %s, and its pool's filesystem cannot clone files (no reflink): a copy of an image in use could be torn and miss acknowledged writes. "+
				"Copy it once no node has it attached for writing, or keep the zone's pool on a filesystem with reflinks (xfs with reflink=1, btrfs)", vol.ID, writer)
	}
	return copyImage(ctx, image, dst)
}

// writerOf says who may be writing a volume's image, or "" if nobody can:
// the controller's record of read-write attachments, and what the kernel
// here knows (a loop device bound read-write to the image, whatever the
// record says).
func writerOf(vol *backend.Volume, image string) (string, error) {
	for _, a := range vol.Attachments {
		if !a.ReadOnly {
			return "attached read-write to node " + a.Node(), nil
		}
	}
	devs, err := loop.List()
	if err != nil {
		return "", fmt.Errorf("listing loop devices: %w", err)
	}
	for _, d := range devs {
		bound, err := loop.BoundTo(d.Device, image)
		if err != nil {
			return "", err
		}
		if !bound {
			continue
		}
		ro, err := loop.ReadOnly(d.Device)
		if err != nil {
			return "", err
		}
		if !ro {
			return "bound read-write to " + d.Device + " on this machine", nil
		}
	}
	return "", nil
}

// formatsAtCreate is true for filesystem volumes no node will ever be
// allowed to write: a read-only node cannot format, so nobody could. A
// copied volume brings its filesystem along.
func formatsAtCreate(t accessmode.AccessType, modes []accessmode.Mode, source *backend.Source) bool {
	if t != accessmode.Mount || source != nil || len(modes) == 0 {
		return false
	}
	for _, m := range modes {
		if !accessmode.IsReadOnly(m) {
			return false
		}
	}
	return true
}

// sourceImage finds the image a new volume is copied from and checks that
// it fits. The source may live in any zone's pool.
func (c *Controller) sourceImage(src *backend.Source, capacity int64) (string, error) {
	var (
		raw  string
		kind volumeid.Kind
	)
	switch {
	case src.SnapshotID != "" && src.VolumeID != "":
		return "", status.Error(codes.InvalidArgument, "a volume has one source: a snapshot or a volume, not both")
	case src.SnapshotID != "":
		raw, kind = src.SnapshotID, volumeid.Snapshot
	default:
		raw, kind = src.VolumeID, volumeid.Volume
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
	v, ok := c.volumes[id.String()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist", id)
	}
	return cloneVolume(v), nil
}

// DeleteVolume removes the metadata, then the image, so that a crash in
// between leaves an image without metadata, which the next start removes.
func (c *Controller) DeleteVolume(ctx context.Context, id volumeid.ID) error {
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
	defer c.objects.lock(id.String())()
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
	delete(c.volumes, id.String())
	delete(c.snapshots, id.String())
	c.mu.Unlock()
	if err := fsutil.RemoveDurably(imagePath); err != nil {
		return status.Errorf(codes.Internal, "deleting image of %s: %v", id, err)
	}
	return nil
}

// SetAttachments records which nodes hold the volume. Nodes read this at
// stage time, so recording it is what makes an attachment effective.
func (c *Controller) SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
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
	defer c.objects.lock(id.String())()
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
	c.volumes[v.ID] = cloneVolume(v)
	c.mu.Unlock()
	return v, nil
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
	return c.updateVolume(ctx, id, func(v *backend.Volume) (bool, error) {
		if bytes <= v.CapacityBytes {
			return false, nil
		}
		if v.AccessType == accessmode.Mount && onlyReadOnly(v.Modes) {
			// Every stage of such a volume is read-only, so no node ever
			// grows its filesystem: a bigger image would report a capacity
			// the filesystem never reaches and hold pool space nobody can
			// use. OUT_OF_RANGE is the spec's "capacity range not allowed";
			// the Kubernetes resizer takes it as infeasible, so the claim
			// can be set back to its size, where FAILED_PRECONDITION would
			// have it wait for the volume to be unused and try again in vain.
			return false, status.Errorf(codes.OutOfRange,
				"volume %s is a filesystem no node may write (%s): no node can ever grow it, so it stays at %d bytes; a clone of it into a larger writable volume grows at its first read/write stage",
				id, modeNames(v.Modes), v.CapacityBytes)
		}
		release, err := c.reserve(p, bytes-v.CapacityBytes, "growing volume "+v.Name)
		if err != nil {
			return false, err
		}
		defer release()
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

// ListVolumes returns copies of every volume, sorted by id.
func (c *Controller) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	c.mu.Lock()
	out := make([]*backend.Volume, 0, len(c.volumes))
	for _, v := range c.volumes {
		out = append(out, cloneVolume(v))
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// VolumeHealth checks that the image is there and as large as recorded.
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
	return imageHealth(imagePath, v.CapacityBytes), nil
}

func imageHealth(imagePath string, capacity int64) backend.Health {
	fi, err := os.Stat(imagePath)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return backend.Health{Abnormal: true, Reason: "ImageMissing", Message: fmt.Sprintf("the volume's image %s is missing", imagePath)}
	case err != nil:
		return backend.Health{Abnormal: true, Reason: "ImageUnreadable", Message: fmt.Sprintf("cannot inspect the volume's image %s: %v", imagePath, err)}
	case fi.Size() < capacity:
		return backend.Health{Abnormal: true, Reason: "ImageTooSmall", Message: fmt.Sprintf("the volume's image is %d bytes, its capacity is %d bytes", fi.Size(), capacity)}
	}
	return backend.Health{Message: "image present and complete"}
}

// CreateSnapshot copies the source volume's image. The snapshot lives in
// the source's pool, so the copy can share extents with it.
func (c *Controller) CreateSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID) (*backend.Snapshot, error) {
	p, err := c.poolFor(id, volumeid.Snapshot)
	if err != nil {
		return nil, err
	}
	if _, err := c.poolFor(source, volumeid.Volume); err != nil {
		return nil, err
	}
	if source.Zone != id.Zone {
		return nil, status.Errorf(codes.InvalidArgument, "snapshot %s must be in the zone of its source volume %s", id, source)
	}
	defer c.objects.lock(id.String())()
	if existing, err := c.Snapshot(ctx, id); err == nil {
		if existing.SourceVolumeID == source.String() {
			return existing, nil
		}
		return nil, status.Errorf(codes.AlreadyExists, "snapshot %s already exists with source volume %s", id, existing.SourceVolumeID)
	}
	// The source's attachments cannot change while it is copied: an
	// attach waits, so "nobody writes it" stays true to the end.
	defer c.objects.lock(source.String())()
	vol, err := c.Volume(ctx, source)
	if err != nil {
		return nil, err
	}
	sourceImage, err := p.imagePath(source)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	metaPath, err := p.metaPath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	imagePath, err := p.imagePath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	// Without reflink the copy takes as much as the source occupies.
	need, err := allocatedBytes(sourceImage)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting image of %s: %v", source, err)
	}
	release, err := c.reserve(p, need, "snapshot "+name)
	if err != nil {
		return nil, err
	}
	defer release()

	tmp, err := tempName(imagePath)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "creating image of %s: %v", id, err)
	}
	published := false
	defer func() {
		if !published {
			os.Remove(tmp)
		}
	}()
	if err := c.copyVolumeAtOnePoint(ctx, vol, sourceImage, tmp); err != nil {
		return nil, err
	}
	if err := growAndSync(tmp, 0); err != nil { // size 0: only mode and fsync
		return nil, status.Errorf(codes.Internal, "syncing image of %s: %v", id, err)
	}
	fpSnapshotCopied.Hit()
	if err := os.Rename(tmp, imagePath); err != nil {
		return nil, status.Errorf(codes.Internal, "publishing image of %s: %v", id, err)
	}
	published = true
	if err := fsutil.SyncDir(p.kindDir(volumeid.Snapshot)); err != nil {
		return nil, status.Errorf(codes.Internal, "publishing image of %s: %v", id, err)
	}
	snap := &backend.Snapshot{
		ID:             id.String(),
		Name:           name,
		SourceVolumeID: source.String(),
		SizeBytes:      vol.CapacityBytes,
		CreatedAt:      time.Now().UTC(),
		AccessType:     vol.AccessType,
		FsType:         vol.FsType,
	}
	if err := fsutil.WriteJSONAtomic(metaPath, snap); err != nil {
		if rerr := fsutil.RemoveDurably(imagePath); rerr != nil {
			klog.ErrorS(rerr, "Removing image of a snapshot whose metadata could not be written", "snapshotID", id.String())
		}
		return nil, status.Errorf(codes.Internal, "recording snapshot %s: %v", id, err)
	}
	c.mu.Lock()
	c.snapshots[snap.ID] = snap
	c.mu.Unlock()
	s := *snap
	return &s, nil
}

// Snapshot returns the recorded snapshot.
func (c *Controller) Snapshot(ctx context.Context, id volumeid.ID) (*backend.Snapshot, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.snapshots[id.String()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", id)
	}
	out := *s
	return &out, nil
}

// DeleteSnapshot removes a snapshot. Volumes restored from it are full
// copies and do not depend on it.
func (c *Controller) DeleteSnapshot(ctx context.Context, id volumeid.ID) error {
	return c.deleteObject(id, volumeid.Snapshot)
}

// ListSnapshots returns copies of every snapshot, sorted by id.
func (c *Controller) ListSnapshots(ctx context.Context) ([]*backend.Snapshot, error) {
	c.mu.Lock()
	out := make([]*backend.Snapshot, 0, len(c.snapshots))
	for _, s := range c.snapshots {
		cp := *s
		out = append(out, &cp)
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

func cloneVolume(v *backend.Volume) *backend.Volume {
	out := *v
	out.Modes = slices.Clone(v.Modes)
	out.Parameters = maps.Clone(v.Parameters)
	out.Attachments = slices.Clone(v.Attachments)
	if v.Source != nil {
		s := *v.Source
		out.Source = &s
	}
	return &out
}

// keyedMutex is a mutex per key that exists only while someone holds or
// waits for it.
type keyedMutex struct {
	mu    sync.Mutex
	locks map[string]*countedMutex
}

type countedMutex struct {
	sync.Mutex
	users int
}

// lock takes key's mutex and returns the function that releases it.
func (k *keyedMutex) lock(key string) (unlock func()) {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*countedMutex{}
	}
	m, ok := k.locks[key]
	if !ok {
		m = &countedMutex{}
		k.locks[key] = m
	}
	m.users++
	k.mu.Unlock()
	m.Lock()
	return func() {
		m.Unlock()
		k.mu.Lock()
		m.users--
		if m.users == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}
