// Package nfs is the backend that serves every volume as one nfs-ganesha
// export whose client list is exactly the nodes the volume is published to.
//
// # Storage and size limits
//
// Volume data lives on one xfs filesystem mounted with project quotas (the
// export root, see package projquota): each volume is a directory with its
// own project id and a hard block limit equal to its capacity, so a volume of
// N bytes never holds more than N bytes, and clients see N as the size of the
// filesystem. Project quotas were chosen over one loop-mounted image per
// volume because growing a volume is then raising a limit (online, and
// without CAP_SYS_RESOURCE, which growing a mounted ext4 needs), snapshots and
// clones are reflink copies, and a restart re-attaches one filesystem rather
// than one loop device per volume.
//
// # Copies of volumes in use
//
// The quota storage copies a volume by walking its tree, one reflink per
// file, which by itself is no copy of one instant. So a snapshot or clone
// of a volume attached read-write holds the driver's own ganesha still
// (SIGSTOP, every thread stopped, see ganesha.Server.Pause) for the walk:
// every write ganesha acknowledged is then in the source, nothing changes
// it while it is walked, and clients only see their calls wait. The stall
// is bounded by Config.PauseBudget, far below the NFSv4 lease; a walk that
// does not end within it is abandoned, ganesha resumed and the partial copy
// removed (UNAVAILABLE). Where ganesha cannot be held (one the driver does
// not run) or the pool has no reflinks (the walk would copy bytes), such a
// copy is refused (FAILED_PRECONDITION). The image storage freezes the
// volume's own filesystem instead and needs no pause.
//
// # Layout of the export root
//
//	ROOT/volumes/<file name>/          a volume's data: what ganesha exports
//	ROOT/snapshots/<file name>/        a snapshot's data (never exported)
//	ROOT/meta/volumes/<file name>.json the volume record: backend.Volume plus export and project ids
//	ROOT/meta/snapshots/<file name>.json
//
// and one export file per exported volume, EXPORTS/<file name>.conf, which
// ganesha includes from its configuration.
//
// # Only held volumes are served
//
// A volume is exported only while some node holds it: its first publish
// makes its storage usable (mounts its image, for the image storage) and
// then exports it; its last unpublish removes the export and then lets the
// storage go. A start serves only the published volumes. Work on an idle
// volume or a snapshot (a copy, a growth, a health check) makes its storage
// usable for the work and lets it go again. So what the server holds follows
// what nodes use, not how many volumes exist.
//
// # Order of writes
//
// The record is the truth. A volume's directory is created before its record
// and removed after it; its export file is rendered from the record, written
// atomically, and only then is ganesha told. On start the export file of
// every published volume is rendered again from its record, every other
// export file and every directory without a record is removed, and ganesha
// is told to drop every export it has of no published volume: after a crash
// nothing is ever served wider than the records say.
package nfs

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/keylock"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Volume context keys the node plugin mounts from.
const (
	ContextServer = "nfsServer"
	ContextShare  = "nfsShare"
	ContextPort   = "nfsPort"
)

// Exporter is what the controller needs of ganesha.
type Exporter interface {
	ApplyExport(ctx context.Context, confPath string, id uint16) error
	RemoveExport(ctx context.Context, id uint16) error
	Exports(ctx context.Context) ([]ganesha.ExportInfo, error)
	// Export is what ganesha serves as export id now.
	Export(ctx context.Context, id uint16) (ganesha.ExportInfo, error)
}

// Config is what the NFS controller is told at start.
type Config struct {
	Storage   Storage
	ExportDir string // where export files go; ganesha includes this directory
	Server    string // the address nodes mount from
	Port      int    // ganesha's NFS port (2049 when zero)
	// ControlFailed, when set, is called each time telling ganesha fails,
	// with the operation: OpApplyExport, OpRemoveExport or OpExports.
	ControlFailed func(operation string)
	// WhyRefused, when set, tells what ganesha said about an export path
	// it refused (its log, where it logs why); the refusal over D-Bus
	// only says the export block was invalid.
	WhyRefused func(path string) string
	// Pause, when set, holds the NFS server still, every client's calls
	// waiting, until resume is called or maxStall has passed, whichever
	// comes first; resume reports an error when maxStall came first
	// (ganesha.Server.Pause). With it, a storage that is a PausedCopier
	// snapshots and clones a volume attached read-write at one instant by
	// copying it while the server is held; without it such copies are
	// refused (FAILED_PRECONDITION), as they are with any other storage
	// that does not copy at one point.
	Pause func(ctx context.Context, maxStall time.Duration) (resume func() error, err error)
	// PauseBudget bounds each pause, and so the stall clients see:
	// DefaultPauseBudget when zero. A copy that does not end within it is
	// abandoned (UNAVAILABLE).
	PauseBudget time.Duration
	// Paused, when set, is told how long each pause held the server and
	// how it ended: PauseCopied, PauseOverBudget or PauseFailed.
	Paused func(took time.Duration, outcome string)
}

// DefaultPauseBudget is how long the server may be held still for one copy
// of a volume in use by default: far below the NFSv4 lease the driver's
// ganesha grants (ganesha.DefaultLeaseLifetime, 20 s), so no client loses
// its lease over it, and long enough for the reflink copy of a volume of
// tens of thousands of files.
const DefaultPauseBudget = 5 * time.Second

// How a pause ended, as Config.Paused names it.
const (
	PauseCopied     = "copied"
	PauseOverBudget = "over_budget"
	PauseFailed     = "failed"
)

// The operations of Exporter, as ControlFailed names them.
const (
	OpApplyExport  = "ApplyExport"
	OpRemoveExport = "RemoveExport"
	OpExports      = "Exports"
)

// volumeRecord is a volume's record on disk.
type volumeRecord struct {
	Volume    backend.Volume `json:"volume"`
	ExportID  uint16         `json:"exportID"`
	ProjectID uint32         `json:"projectID"`
	// Deleting marks a volume whose deletion began: it is no volume any
	// more, but its project id and bytes stay taken until its data is gone.
	Deleting bool `json:"deleting,omitempty"`
}

type snapshotRecord struct {
	Snapshot  backend.Snapshot `json:"snapshot"`
	ProjectID uint32           `json:"projectID"`
	Deleting  bool             `json:"deleting,omitempty"`
}

// removal is a deletion begun (its record marked Deleting) and not yet
// complete: the export and data to remove, and what they hold.
type removal struct {
	meta     string // the record's file
	rel      string // the data
	exportID uint16 // 0 for a snapshot
	project  uint32
	bytes    int64
}

// Controller implements backend.Controller for NFS.
type Controller struct {
	cfg      Config
	exporter Exporter // set by Start

	mu        sync.Mutex
	volumes   map[string]*volumeRecord // by id
	nodes     backend.NodeIndex        // the volumes each node holds
	snapshots map[string]*snapshotRecord
	exportIDs map[uint16]string // export id -> volume id, including reservations
	projects  map[uint32]string // project id -> volume or snapshot id, including reservations
	committed int64             // bytes promised to volumes and snapshots
	// exported are the volumes (by rel) whose export ganesha serves: those
	// published to some node. Only they keep their storage in use (for the
	// image storage: mounted, a loop device each); every other volume and
	// every snapshot is idle, made usable for what needs it (a copy, a
	// growth, a health check) and let go again (settle). A start serves
	// only the published volumes (servedAtStart). So what the machine holds
	// follows what nodes use, not how many volumes exist: a mount or a
	// mkfs costs more the more loop devices are mounted.
	exported map[string]bool
	// inUse serializes, per rel, making storage usable and exporting it
	// with letting it go: never an export of an unmounted directory.
	inUse keylock.Set
	// removals are deletions whose data is not gone yet, by id. Their
	// export ids, project ids and bytes stay in the maps above meanwhile.
	removals map[string]*removal
}

var _ backend.Controller = (*Controller)(nil)

// NewController loads every record, makes the storage of the volumes
// published to some node usable and renders their export files from the
// records, removing every other export file (see servedAtStart). It tells
// no ganesha anything: this is what must be on disk before ganesha starts,
// so that it comes up serving exactly the recorded exports. Start completes
// the work once ganesha runs.
func NewController(ctx context.Context, cfg Config) (*Controller, error) {
	if cfg.Storage == nil || cfg.ExportDir == "" {
		return nil, errors.New("nfs: storage and export directory are required")
	}
	if _, err := netip.ParseAddr(cfg.Server); err != nil {
		return nil, fmt.Errorf("nfs: server address %q is not an IP address: %w", cfg.Server, err)
	}
	if cfg.Port == 0 {
		cfg.Port = 2049
	}
	if cfg.PauseBudget < 0 {
		return nil, fmt.Errorf("nfs: pause budget %v is negative", cfg.PauseBudget)
	}
	if cfg.PauseBudget == 0 {
		cfg.PauseBudget = DefaultPauseBudget
	}
	c := &Controller{cfg: cfg, volumes: map[string]*volumeRecord{}, snapshots: map[string]*snapshotRecord{},
		exportIDs: map[uint16]string{}, projects: map[uint32]string{}, removals: map[string]*removal{},
		exported: map[string]bool{}}
	for _, d := range []string{c.dir("volumes"), c.dir("snapshots"), c.dir("meta", "volumes"), c.dir("meta", "snapshots"), cfg.ExportDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	// Exported directories must be reachable by the squashed users the
	// server maps clients to; their parent must let them through.
	if err := os.Chmod(c.dir("volumes"), 0o711); err != nil {
		return nil, err
	}
	if err := c.load(); err != nil {
		return nil, err
	}
	if err := c.prepareOffline(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// Start connects the controller to a running ganesha: it drops every export
// no published volume accounts for, removes storage no record accounts for
// (only now, when no stale export holds it busy), and makes ganesha serve
// the export of every published volume with its recorded clients.
func (c *Controller) Start(ctx context.Context, exporter Exporter) error {
	c.exporter = exporter
	return c.reconcileOnline(ctx)
}

// controlFailed counts a failure to tell ganesha something.
func (c *Controller) controlFailed(operation string) {
	if c.cfg.ControlFailed != nil {
		c.cfg.ControlFailed(operation)
	}
}

func (c *Controller) dir(elem ...string) string {
	return filepath.Join(append([]string{c.cfg.Storage.Root()}, elem...)...)
}

func (c *Controller) Backend() accessmode.Backend { return accessmode.BackendNFS }

// Zones is nil: every node of every zone can reach the NFS server.
func (c *Controller) Zones() []string { return nil }

// NodeExpansionRequired is false: a raised quota is what clients see at once.
func (c *Controller) NodeExpansionRequired(*backend.Volume) bool { return false }

// Creating is always false: a volume's copy of its source ends with the
// CreateVolume that makes it.
func (c *Controller) Creating(context.Context, volumeid.ID) (bool, error) { return false, nil }

// ZonesFillableFrom is nil: NFS volumes have no zone, and every one of
// them can be filled from any source of the export root.
func (c *Controller) ZonesFillableFrom(context.Context, string) ([]string, error) { return nil, nil }

// SnapshotBlocks refuses: an NFS volume is a directory tree, not a device,
// so its snapshots have files, not blocks.
func (c *Controller) SnapshotBlocks(_ context.Context, req backend.BlockRangesRequest) (*backend.BlockRanges, error) {
	return nil, status.Errorf(codes.InvalidArgument,
		"snapshot %s is of an NFS volume (a filesystem); snapshot metadata covers block volumes only", req.Target)
}

func (c *Controller) volumeRel(id volumeid.ID) string { return filepath.Join("volumes", id.FileName()) }
func (c *Controller) snapshotRel(id volumeid.ID) string {
	return filepath.Join("snapshots", id.FileName())
}
func (c *Controller) volumeMeta(id volumeid.ID) string {
	return c.dir("meta", "volumes", id.FileName()+".json")
}
func (c *Controller) snapshotMeta(id volumeid.ID) string {
	return c.dir("meta", "snapshots", id.FileName()+".json")
}
func (c *Controller) exportFile(id volumeid.ID) string {
	return filepath.Join(c.cfg.ExportDir, id.FileName()+".conf")
}

// pseudo is the path clients mount: one per volume.
func pseudo(id volumeid.ID) string { return "/" + id.FileName() }

func (c *Controller) load() error {
	entries, err := os.ReadDir(c.dir("meta", "volumes"))
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		rec := &volumeRecord{}
		if err := fsutil.ReadJSON(c.dir("meta", "volumes", e.Name()), rec); err != nil {
			return fmt.Errorf("nfs: a volume record is unreadable; refusing to start rather than lose track of it: %w", err)
		}
		id, err := volumeid.ParseKind(rec.Volume.ID, volumeid.Volume)
		if err != nil || id.FileName()+".json" != e.Name() {
			return fmt.Errorf("nfs: volume record %s names volume %q", e.Name(), rec.Volume.ID)
		}
		if rec.Deleting {
			c.removals[rec.Volume.ID] = &removal{meta: c.dir("meta", "volumes", e.Name()), rel: c.volumeRel(id),
				exportID: rec.ExportID, project: rec.ProjectID, bytes: rec.Volume.CapacityBytes}
		} else {
			c.putVolume(rec)
		}
		c.exportIDs[rec.ExportID] = rec.Volume.ID
		c.projects[rec.ProjectID] = rec.Volume.ID
		c.committed += rec.Volume.CapacityBytes
	}
	entries, err = os.ReadDir(c.dir("meta", "snapshots"))
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		rec := &snapshotRecord{}
		if err := fsutil.ReadJSON(c.dir("meta", "snapshots", e.Name()), rec); err != nil {
			return fmt.Errorf("nfs: a snapshot record is unreadable: %w", err)
		}
		if rec.Deleting {
			id, err := volumeid.ParseKind(rec.Snapshot.ID, volumeid.Snapshot)
			if err != nil {
				return fmt.Errorf("nfs: snapshot record %s names snapshot %q", e.Name(), rec.Snapshot.ID)
			}
			c.removals[rec.Snapshot.ID] = &removal{meta: c.dir("meta", "snapshots", e.Name()), rel: c.snapshotRel(id),
				project: rec.ProjectID, bytes: rec.Snapshot.SizeBytes}
		} else {
			c.snapshots[rec.Snapshot.ID] = rec
		}
		c.projects[rec.ProjectID] = rec.Snapshot.ID
		c.committed += rec.Snapshot.SizeBytes
	}
	return nil
}

// servedAtStart reports whether a start serves the volume at once: one
// published to some node must be, because the node may be using it right
// now. Any other volume waits for its first publish, which mounts its
// storage and exports it then: with the image storage each served volume
// costs a loop device and a mount, and only published ones need them.
// A volume whose every node is fenced is served to nobody.
func servedAtStart(rec *volumeRecord) bool { return exported(&rec.Volume) }

// exported reports whether the volume has an export: whether some node it
// is attached to is not fenced (accessmode.Served).
func exported(v *backend.Volume) bool { return len(accessmode.Served(v.Attachments)) > 0 }

// losesClient reports whether a node served under old is not under now:
// unpublished, or fenced.
func losesClient(old, now []accessmode.Attachment) bool {
	stays := map[string]bool{}
	for _, a := range accessmode.Served(now) {
		stays[a.Node.Name] = true
	}
	for _, a := range accessmode.Served(old) {
		if !stays[a.Node.Name] {
			return true
		}
	}
	return false
}

// prepareOffline restores the storage of the volumes served at start and
// renders their export files, removing every other export file: a file
// left for a volume whose storage is not mounted would have ganesha serve
// the empty directory beneath.
func (c *Controller) prepareOffline(ctx context.Context) error {
	keepExports := map[string]bool{}
	var rels []string
	for _, rec := range c.volumes {
		if !servedAtStart(rec) {
			continue
		}
		id, _ := volumeid.Parse(rec.Volume.ID)
		keepExports[id.FileName()+".conf"] = true
		rels = append(rels, c.volumeRel(id))
	}
	sort.Strings(rels) // the same order at every start
	// The storage is mounted before ganesha may export its path: otherwise
	// ganesha would serve the empty directory beneath.
	if err := c.cfg.Storage.Restore(ctx, rels); err != nil {
		return fmt.Errorf("nfs: restoring the storage of the published volumes: %w", err)
	}
	entries, err := os.ReadDir(c.cfg.ExportDir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if keepExports[e.Name()] {
			continue
		}
		klog.V(2).InfoS("Removing an export file no published volume accounts for", "file", e.Name())
		if err := os.Remove(filepath.Join(c.cfg.ExportDir, e.Name())); err != nil {
			return err
		}
	}
	for _, rec := range c.volumes {
		if !servedAtStart(rec) {
			continue
		}
		if err := c.writeExportFile(rec); err != nil {
			return err
		}
		c.exported[c.volumeRel(mustID(rec))] = true
	}
	return nil
}

// reconcileOnline makes the running ganesha match the records.
func (c *Controller) reconcileOnline(ctx context.Context) error {
	served, err := c.exporter.Exports(ctx)
	if err != nil {
		c.controlFailed(OpExports)
		return fmt.Errorf("nfs: listing ganesha's exports: %w", err)
	}
	keepServed := map[uint16]bool{}
	for _, rec := range c.volumes {
		if servedAtStart(rec) {
			keepServed[rec.ExportID] = true
		}
	}
	for _, ex := range served {
		if ex.ID == 0 {
			continue // the pseudo root
		}
		if keepServed[ex.ID] {
			continue
		}
		// An export of no record, or of a volume published nowhere, which
		// a ganesha that outlived the controller still serves.
		klog.InfoS("Removing an export no published volume accounts for from ganesha", "exportID", ex.ID, "path", ex.Path)
		if err := c.exporter.RemoveExport(ctx, ex.ID); err != nil && !ganesha.IsNotFound(err) {
			c.controlFailed(OpRemoveExport)
			return fmt.Errorf("nfs: removing stale export %d: %w", ex.ID, err)
		}
	}
	keep := map[string]bool{}
	for _, rec := range c.volumes {
		id, _ := volumeid.Parse(rec.Volume.ID)
		keep[c.volumeRel(id)] = true
	}
	for _, rec := range c.snapshots {
		id, _ := volumeid.Parse(rec.Snapshot.ID)
		keep[c.snapshotRel(id)] = true
	}
	removed, err := c.cfg.Storage.Prune(ctx, keep)
	for _, rel := range removed {
		klog.InfoS("Removed NFS data no record accounts for (a crash leftover)", "path", c.dir(rel))
	}
	if err != nil {
		return fmt.Errorf("nfs: removing leftovers: %w", err)
	}
	// Deletions an earlier run began: finished now if their data can go,
	// else kept, with what they hold, for a retried delete.
	for id, r := range c.removalsCopy() {
		if err := c.finishRemoval(ctx, id, r); err != nil {
			klog.ErrorS(err, "A deletion begun earlier cannot finish yet; its project id and bytes stay reserved", "id", id)
		}
	}
	for _, rec := range c.volumes {
		if !servedAtStart(rec) {
			continue
		}
		if err := c.applyExport(ctx, rec); err != nil {
			return err
		}
	}
	return nil
}

// export renders what ganesha must serve for a volume.
func (c *Controller) export(rec *volumeRecord) (ganesha.Export, error) {
	id, err := volumeid.Parse(rec.Volume.ID)
	if err != nil {
		return ganesha.Export{}, err
	}
	e := ganesha.Export{
		ID: rec.ExportID, Path: c.dir(c.volumeRel(id)), Pseudo: pseudo(id),
		Squash: squashOf(&rec.Volume), Comment: "modeguard volume " + rec.Volume.ID,
	}
	for _, a := range accessmode.Served(rec.Volume.Attachments) {
		address, err := clientAddress(a.Node)
		if err != nil {
			return ganesha.Export{}, err
		}
		e.Clients = append(e.Clients, ganesha.ClientRule{Address: address, ReadOnly: a.ReadOnly})
	}
	return e, nil
}

// clientAddress is the address node mounts exports from, which its
// export's client list names.
func clientAddress(node nodeid.Node) (netip.Addr, error) {
	address, err := netip.ParseAddr(node.Address)
	if err != nil {
		return netip.Addr{}, status.Errorf(codes.FailedPrecondition,
			"node %q has no NFS client address; start its node plugin with --node-address", node)
	}
	return address, nil
}

// squashOf is the root squashing a volume's export gets: its rootSquash
// attribute (a VolumeAttributesClass may change it), squashed unless that
// clearly says false.
func squashOf(v *backend.Volume) ganesha.Squash {
	if v.RootSquash() {
		return ganesha.RootSquash
	}
	return ganesha.NoRootSquash
}

// writeExportFile renders the volume's export file from its record.
func (c *Controller) writeExportFile(rec *volumeRecord) error {
	e, err := c.export(rec)
	if err != nil {
		return err
	}
	id, _ := volumeid.Parse(rec.Volume.ID)
	if err := ganesha.WriteExportFile(c.exportFile(id), e); err != nil {
		return status.Errorf(codes.Internal, "writing the export file of %s: %v", rec.Volume.ID, err)
	}
	return nil
}

// Steps a test can kill the controller at (package faultpoint).
var (
	fpCreateStorageMade   = faultpoint.New("nfs.create.storage-made")
	fpCreateRecorded      = faultpoint.New("nfs.create.recorded")
	fpExportFileWritten   = faultpoint.New("nfs.export.file-written")
	fpExportApplied       = faultpoint.New("nfs.export.applied")
	fpAttachmentsRecorded = faultpoint.New("nfs.attachments.recorded")
	fpDeleteExportRemoved = faultpoint.New("nfs.delete.export-removed")
	fpDeleteRecordRemoved = faultpoint.New("nfs.delete.record-removed")
)

// applyExport writes the volume's export file and tells ganesha. A volume
// this run has not served yet gets its storage made usable first (mounted,
// for the image storage): the export must never reach ganesha before what
// it exports is there.
func (c *Controller) applyExport(ctx context.Context, rec *volumeRecord) error {
	id, rel, unlock, err := c.lockInUse(ctx, rec)
	if err != nil {
		return err
	}
	defer unlock()
	return c.applyExportLocked(ctx, rec, id, rel)
}

// applyExportLocked is applyExport with rel's inUse lock held.
func (c *Controller) applyExportLocked(ctx context.Context, rec *volumeRecord, id volumeid.ID, rel string) error {
	wasExported := c.isExported(rel)
	if !wasExported {
		if err := c.cfg.Storage.Ensure(ctx, rel); err != nil {
			return status.Errorf(codes.Internal, "making the storage of %s usable before exporting it: %v", rec.Volume.ID, err)
		}
	}
	if err := c.writeExportFile(rec); err != nil {
		if !wasExported {
			c.idleLocked(ctx, rel)
		}
		return err
	}
	fpExportFileWritten.Hit()
	if err := c.exporter.ApplyExport(ctx, c.exportFile(id), rec.ExportID); err != nil {
		c.controlFailed(OpApplyExport)
		if !wasExported {
			c.undoFirstExport(ctx, rec)
		}
		path := c.dir(rel)
		why := ""
		if c.cfg.WhyRefused != nil {
			if w := c.cfg.WhyRefused(path); w != "" {
				why = "; ganesha's log says: " + w
			}
		}
		return status.Errorf(codes.Unavailable, "ganesha refused the export of %s from %s: %v%s", rec.Volume.ID, path, err, why)
	}
	fpExportApplied.Hit()
	c.setExported(rel, true)
	klog.V(2).InfoS("Export served", "volumeID", rec.Volume.ID, "exportID", rec.ExportID, "clients", clientList(rec))
	return nil
}

// reexport serves the volume's export anew, removed and added again rather
// than updated, because the writer that left must lose its NFSv4 state
// with its access: ganesha keeps a client's opens and locks through an
// UpdateExport that drops the client, and frees them when the export goes.
// The readers that stay lose theirs too; their kernel clients open their
// files again on the next use. Between the two calls the export is gone
// for a moment, and a reader's request then is answered as for a removed
// export.
func (c *Controller) reexport(ctx context.Context, rec *volumeRecord) error {
	id, rel, unlock, err := c.lockInUse(ctx, rec)
	if err != nil {
		return err
	}
	defer unlock()
	removed := false
	if c.isExported(rel) {
		if err := c.exporter.RemoveExport(ctx, rec.ExportID); err != nil && !ganesha.IsNotFound(err) {
			c.controlFailed(OpRemoveExport)
			return status.Errorf(codes.Unavailable, "removing the export of %s to release the state of the writer that left: %v", rec.Volume.ID, err)
		}
		removed = true
	}
	if err := c.applyExportLocked(ctx, rec, id, rel); err != nil {
		return err
	}
	klog.V(2).InfoS("Export served anew: the volume's only writer left, its opens and locks are released",
		"volumeID", rec.Volume.ID, "exportID", rec.ExportID, "removedFirst", removed, "clients", clientList(rec))
	return nil
}

// lockInUse takes the inUse lock of rec's volume.
func (c *Controller) lockInUse(ctx context.Context, rec *volumeRecord) (volumeid.ID, string, func(), error) {
	id := mustID(rec)
	rel := c.volumeRel(id)
	unlock, err := c.inUse.Lock(ctx, rel)
	if err != nil {
		return id, rel, nil, status.Errorf(codes.Aborted, "waiting for other work on %s: %v", rec.Volume.ID, err)
	}
	return id, rel, unlock, nil
}

// undoFirstExport takes back a first export ganesha refused, with rel's
// inUse lock held: the export (in case the refusal came after it was
// made), its file (which a restarted ganesha would read) and the storage.
// If the export cannot be confirmed gone, the storage stays mounted and the
// volume counts as exported, so that nothing can serve the empty directory
// beneath and the next unpublish removes it again.
func (c *Controller) undoFirstExport(ctx context.Context, rec *volumeRecord) {
	id := mustID(rec)
	ctx = context.WithoutCancel(ctx)
	if err := c.exporter.RemoveExport(ctx, rec.ExportID); err != nil && !ganesha.IsNotFound(err) {
		klog.ErrorS(err, "ganesha refused an export and its removal; the volume stays mounted", "volumeID", rec.Volume.ID)
		c.setExported(c.volumeRel(id), true)
		return
	}
	if err := fsutil.RemoveDurably(c.exportFile(id)); err != nil {
		klog.ErrorS(err, "Removing the export file of a refused export", "volumeID", rec.Volume.ID)
	}
	c.idleLocked(ctx, c.volumeRel(id))
}

// withdrawExport ends the export of a volume no node holds any more and
// lets its storage go idle. Nothing is served wider meanwhile: the export
// goes first, and a failure to let go of the storage only costs a mount.
func (c *Controller) withdrawExport(ctx context.Context, rec *volumeRecord) error {
	id, rel, unlock, err := c.lockInUse(ctx, rec)
	if err != nil {
		return err
	}
	defer unlock()
	if !c.isExported(rel) {
		return nil
	}
	if err := c.exporter.RemoveExport(ctx, rec.ExportID); err != nil && !ganesha.IsNotFound(err) {
		c.controlFailed(OpRemoveExport)
		return status.Errorf(codes.Unavailable, "removing the export of %s: %v", rec.Volume.ID, err)
	}
	c.setExported(rel, false)
	if err := fsutil.RemoveDurably(c.exportFile(id)); err != nil {
		return status.Errorf(codes.Internal, "removing the export file of %s: %v", rec.Volume.ID, err)
	}
	klog.V(2).InfoS("Export withdrawn: no node holds the volume", "volumeID", rec.Volume.ID, "exportID", rec.ExportID)
	c.idleLocked(ctx, rel)
	return nil
}

// settle lets rel's storage go idle unless its volume is exported: called
// after work that made it usable (a copy, a growth, a health check).
func (c *Controller) settle(ctx context.Context, rel string) {
	unlock, err := c.inUse.Lock(context.WithoutCancel(ctx), rel)
	if err != nil {
		return
	}
	defer unlock()
	if !c.isExported(rel) {
		c.idleLocked(ctx, rel)
	}
}

// idleLocked lets rel's storage go idle, with rel's inUse lock held. A
// failure is logged, not returned: the storage stays usable, which costs
// resources but loses nothing, and the next settle or start tries again.
func (c *Controller) idleLocked(ctx context.Context, rel string) {
	if err := c.cfg.Storage.Idle(context.WithoutCancel(ctx), rel); err != nil {
		klog.ErrorS(err, "Letting an unused NFS volume's storage go", "path", c.dir(rel))
	}
}

func (c *Controller) isExported(rel string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.exported[rel]
}

func (c *Controller) setExported(rel string, on bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if on {
		c.exported[rel] = true
	} else {
		delete(c.exported, rel)
	}
}

// mustID is the id of a loaded record (load checked it).
func mustID(rec *volumeRecord) volumeid.ID {
	id, _ := volumeid.Parse(rec.Volume.ID)
	return id
}

// reserve promises bytes to owner and takes the lowest free export id (when
// needExport) and project id, all under one lock, so concurrent creates can
// never promise the same bytes or ids twice. release undoes it.
func (c *Controller) reserve(ctx context.Context, owner string, needExport bool, bytes int64) (uint16, uint32, error) {
	free, total, err := c.poolSpace()
	if err != nil {
		return 0, 0, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if avail := min(free, total-c.committed); avail < bytes {
		return 0, 0, status.Errorf(codes.ResourceExhausted,
			"the NFS pool can promise %d more bytes, not %d", max(0, avail), bytes)
	}
	var exportID uint16
	if needExport {
		for i := uint16(1); i != 0; i++ {
			if _, used := c.exportIDs[i]; !used {
				exportID = i
				break
			}
		}
		if exportID == 0 {
			return 0, 0, status.Error(codes.ResourceExhausted, "every NFS export id (1..65535) is in use")
		}
		c.exportIDs[exportID] = owner
	}
	var project uint32
	for p := uint32(1); ; p++ {
		if _, used := c.projects[p]; !used {
			project = p
			break
		}
	}
	c.projects[project] = owner
	c.committed += bytes
	return exportID, project, nil
}

func (c *Controller) release(exportID uint16, project uint32, bytes int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if exportID != 0 {
		delete(c.exportIDs, exportID)
	}
	delete(c.projects, project)
	c.committed -= bytes
}

func (c *Controller) poolSpace() (free, total int64, err error) {
	if free, err = c.cfg.Storage.Free(); err != nil {
		return 0, 0, status.Errorf(codes.Internal, "reading the pool's free space: %v", err)
	}
	if total, err = c.cfg.Storage.Size(); err != nil {
		return 0, 0, status.Errorf(codes.Internal, "reading the pool's size: %v", err)
	}
	return free, total, nil
}

// Capacity is what a new volume could still get: the pool's free space, and
// no more than what is not yet promised to other volumes and snapshots (the
// pool is not overcommitted, so a promised volume can always fill up).
func (c *Controller) Capacity(ctx context.Context, zone string) (int64, error) {
	if zone != "" {
		return 0, status.Errorf(codes.InvalidArgument, "NFS volumes have no zone; got %q", zone)
	}
	free, total, err := c.poolSpace()
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return max(0, min(free, total-c.committed)), nil
}

// Pools reports the one pool every zone shares: the storage's size and free
// space, and the bytes promised to volumes and snapshots.
func (c *Controller) Pools(ctx context.Context) ([]backend.PoolStats, error) {
	free, total, err := c.poolSpace()
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	committed := c.committed
	c.mu.Unlock()
	return []backend.PoolStats{{SizeBytes: total, FreeBytes: free, CommittedBytes: committed}}, nil
}

func (c *Controller) commit(delta int64) {
	c.mu.Lock()
	c.committed += delta
	c.mu.Unlock()
}

// promise commits more bytes to an existing volume if the pool has them.
func (c *Controller) promise(bytes int64) error {
	free, total, err := c.poolSpace()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if avail := min(free, total-c.committed); avail < bytes {
		return status.Errorf(codes.ResourceExhausted, "the NFS pool can promise %d more bytes, not %d", max(0, avail), bytes)
	}
	c.committed += bytes
	return nil
}

// MinimumSize is the smallest volume the storage can make.
func (c *Controller) MinimumSize() int64 { return c.cfg.Storage.MinSize() }

// sourceTree finds the directory a new volume is copied from, and whether
// it is a volume in use, to be copied while the server is held still.
func (c *Controller) sourceTree(src *backend.Source) (rel string, inUse bool, err error) {
	if src == nil {
		return "", false, nil
	}
	if src.SnapshotID != "" {
		id, err := volumeid.ParseKind(src.SnapshotID, volumeid.Snapshot)
		if err != nil || id.Backend != accessmode.BackendNFS {
			return "", false, status.Errorf(codes.InvalidArgument, "snapshot %q is not an NFS snapshot; an NFS volume can only be restored from one", src.SnapshotID)
		}
		c.mu.Lock()
		_, ok := c.snapshots[id.String()]
		c.mu.Unlock()
		if !ok {
			return "", false, status.Errorf(codes.NotFound, "snapshot %s does not exist", src.SnapshotID)
		}
		return c.snapshotRel(id), false, nil
	}
	id, err := volumeid.ParseKind(src.VolumeID, volumeid.Volume)
	if err != nil || id.Backend != accessmode.BackendNFS {
		return "", false, status.Errorf(codes.InvalidArgument, "volume %q is not an NFS volume; an NFS volume can only be cloned from one", src.VolumeID)
	}
	rec, err := c.record(id)
	if err != nil {
		return "", false, err
	}
	inUse, err = c.copyable(&rec.Volume)
	if err != nil {
		return "", false, err
	}
	return c.volumeRel(id), inUse, nil
}

// copyable says whether a volume must be copied while the NFS server is
// held still (inUse): a node may be writing it and the storage does not
// copy at one instant by itself. It refuses the copy when that is needed
// and cannot be done: a copy of a tree that changes under it could hold
// half of what an application wrote and acknowledged.
func (c *Controller) copyable(vol *backend.Volume) (inUse bool, err error) {
	if c.cfg.Storage.CopiesAtOnePoint() {
		return false, nil
	}
	writers := backend.Writers(vol)
	if len(writers) == 0 {
		return false, nil
	}
	writer := writers[0]
	pc, ok := c.cfg.Storage.(PausedCopier)
	var why string
	switch {
	case !ok:
		why = "this server's storage copies a volume file by file, not as of one instant"
	case c.cfg.Pause == nil:
		why = "this server's quota storage copies a volume file by file, and the NFS server is not the driver's own ganesha " +
			"(--nfs-ganesha-dbus), which it could hold still for the copy"
	default:
		if err := pc.PausedCopyable(); err != nil {
			why = err.Error()
		}
	}
	if why != "" {
		return false, status.Errorf(codes.FailedPrecondition,
			"volume %s is attached read-write to node %s, and %s; copy it once no node has it attached for writing", vol.ID, writer, why)
	}
	return true, nil
}

// copyTree copies srcRel to dstRel; a volume in use (inUse) is copied while
// the NFS server is held still (Config.Pause), so the copy holds every
// write the server acknowledged before, and is the tree of one instant.
func (c *Controller) copyTree(ctx context.Context, srcRel, dstRel string, project uint32, limit int64, inUse bool) error {
	if !inUse {
		return c.cfg.Storage.Copy(ctx, srcRel, dstRel, project, limit)
	}
	pc := c.cfg.Storage.(PausedCopier) // copyable checked
	return pc.CopyPaused(ctx, srcRel, dstRel, project, limit, func(ctx context.Context, read func(context.Context) error) error {
		return c.whilePaused(ctx, srcRel, read)
	})
}

// errOverBudget is a copy that did not end within the pause budget.
type errOverBudget struct {
	rel    string
	budget time.Duration
}

func (e *errOverBudget) Error() string {
	return fmt.Sprintf("the copy of %s did not end within %v, the longest the NFS server may be held still for it", e.rel, e.budget)
}

// errNoPause is a pause of the NFS server that could not be had.
type errNoPause struct{ err error }

func (e *errNoPause) Error() string { return "holding the NFS server still: " + e.err.Error() }

// whilePaused runs read while the NFS server is held still, for at most
// the pause budget: read's context ends with the budget, which kills the
// copy, and the pause's own timer resumes the server at the budget even if
// read does not return.
func (c *Controller) whilePaused(ctx context.Context, rel string, read func(context.Context) error) error {
	budget := c.cfg.PauseBudget
	began := time.Now()
	resume, err := c.cfg.Pause(ctx, budget)
	if err != nil {
		c.paused(time.Since(began), PauseFailed)
		return &errNoPause{err: err}
	}
	rctx, cancel := context.WithDeadline(ctx, began.Add(budget))
	err = read(rctx)
	over := rctx.Err() == context.DeadlineExceeded && ctx.Err() == nil
	cancel()
	rerr := resume()
	took := time.Since(began)
	if rerr != nil || over {
		c.paused(took, PauseOverBudget)
		klog.InfoS("Copy of a volume in use abandoned: it did not end while the NFS server could be held still",
			"source", rel, "budget", budget, "held", took, "copyError", err, "resumeError", rerr)
		return &errOverBudget{rel: rel, budget: budget}
	}
	if err != nil {
		c.paused(took, PauseFailed)
		return err
	}
	c.paused(took, PauseCopied)
	klog.V(2).InfoS("Copied a volume in use while the NFS server was held still", "source", rel, "held", took)
	return nil
}

func (c *Controller) paused(took time.Duration, outcome string) {
	if c.cfg.Paused != nil {
		c.cfg.Paused(took, outcome)
	}
}

// copyError is the gRPC error of a copy of source that failed for want
// of a pause or within its budget, nil for any other failure.
func (c *Controller) copyError(source string, err error) error {
	var over *errOverBudget
	if errors.As(err, &over) {
		// UNAVAILABLE, not ABORTED: CSI keeps ABORTED for another call on
		// the same snapshot being under way, and the copy may well fit on
		// a retry once the machine is less busy; when the volume simply
		// has too many files, the message says what to change.
		return status.Errorf(codes.Unavailable,
			"%s is attached read-write, so it is copied while the NFS server is held still, which may last %v (--nfs-pause-budget), "+
				"and its copy did not end within that: the volume has too many files to copy while its writers wait. "+
				"Nothing was kept. Retry when the server is less busy, raise --nfs-pause-budget (clients stall that long; keep it well below "+
				"the NFSv4 lease of %v), or copy it once no node has it attached for writing",
			source, over.budget, ganesha.DefaultLeaseLifetime)
	}
	var noPause *errNoPause
	if errors.As(err, &noPause) {
		return status.Errorf(codes.Unavailable,
			"%s is attached read-write, so it is copied while the NFS server is held still, and the server could not be held: %v; nothing was kept",
			source, noPause.err)
	}
	return nil
}

func (c *Controller) CreateVolume(ctx context.Context, spec backend.VolumeSpec) (*backend.Volume, error) {
	if spec.AccessType != accessmode.Mount {
		return nil, status.Error(codes.InvalidArgument, "backend nfs serves filesystems only; for access type block use backend block")
	}
	if spec.ID.Backend != accessmode.BackendNFS || spec.ID.Zone != "" {
		return nil, status.Errorf(codes.InvalidArgument, "id %s is not an NFS volume id", spec.ID)
	}
	c.mu.Lock()
	_, exists := c.volumes[spec.ID.String()]
	c.mu.Unlock()
	if exists {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s already exists", spec.ID)
	}
	srcRel, inUse, err := c.sourceTree(spec.Source)
	if err != nil {
		return nil, err
	}
	exportID, project, err := c.reserve(ctx, spec.ID.String(), true, spec.CapacityBytes)
	if err != nil {
		return nil, err
	}
	rel := c.volumeRel(spec.ID)
	if srcRel != "" {
		err = c.copyTree(ctx, srcRel, rel, project, spec.CapacityBytes, inUse)
		c.settle(ctx, srcRel)
	} else {
		err = c.cfg.Storage.Create(ctx, rel, project, spec.CapacityBytes)
	}
	if err != nil {
		c.release(exportID, project, spec.CapacityBytes)
		if cerr := c.copyError(spec.Source.VolumeID, err); cerr != nil {
			return nil, cerr
		}
		return nil, status.Errorf(codes.Internal, "creating the storage of %s: %v", spec.ID, err)
	}
	fpCreateStorageMade.Hit()
	rec := &volumeRecord{
		Volume: backend.Volume{
			ID: spec.ID.String(), Name: spec.Name, CapacityBytes: spec.CapacityBytes,
			AccessType: spec.AccessType, FsType: "", Modes: spec.Modes, Parameters: spec.Parameters,
			MutableParameters: spec.MutableParameters, Source: spec.Source, CreatedAt: time.Now().UTC(),
			Context: map[string]string{
				ContextServer: c.cfg.Server, ContextShare: pseudo(spec.ID), ContextPort: strconv.Itoa(c.cfg.Port),
			},
		},
		ExportID: exportID, ProjectID: project,
	}
	if err := fsutil.WriteJSONAtomic(c.volumeMeta(spec.ID), rec); err != nil {
		_ = c.cfg.Storage.Remove(ctx, rel, project)
		c.release(exportID, project, spec.CapacityBytes)
		return nil, status.Errorf(codes.Internal, "recording %s: %v", spec.ID, err)
	}
	fpCreateRecorded.Hit()
	c.mu.Lock()
	c.putVolume(rec)
	c.mu.Unlock()
	// No node holds it yet: it is exported at its first publish.
	c.settle(ctx, rel)
	return rec.Volume.Clone(), nil
}

// putVolume makes rec the recorded state of its volume, in the node index
// too. Called with c.mu held.
func (c *Controller) putVolume(rec *volumeRecord) {
	var before []accessmode.Attachment
	if old, ok := c.volumes[rec.Volume.ID]; ok {
		before = old.Volume.Attachments
	}
	c.volumes[rec.Volume.ID] = rec
	c.nodes.Set(rec.Volume.ID, before, rec.Volume.Attachments)
}

// dropVolume forgets volume id and its attachments. Called with c.mu held.
func (c *Controller) dropVolume(id string) {
	if old, ok := c.volumes[id]; ok {
		c.nodes.Set(id, old.Volume.Attachments, nil)
		delete(c.volumes, id)
	}
}

// VolumesOn returns the volumes node holds, sorted by id.
func (c *Controller) VolumesOn(ctx context.Context, node string) ([]*backend.Volume, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes.Volumes(node, func(id string) *backend.Volume { return c.volumes[id].Volume.Clone() }), nil
}

func (c *Controller) record(id volumeid.ID) (*volumeRecord, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.volumes[id.String()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist", id)
	}
	cp := *rec
	return &cp, nil
}

func (c *Controller) Volume(ctx context.Context, id volumeid.ID) (*backend.Volume, error) {
	rec, err := c.record(id)
	if err != nil {
		return nil, err
	}
	return rec.Volume.Clone(), nil
}

func (c *Controller) DeleteVolume(ctx context.Context, id volumeid.ID) error {
	if r := c.removalOf(id.String()); r != nil {
		return c.finishRemoval(ctx, id.String(), r)
	}
	rec, err := c.record(id)
	if status.Code(err) == codes.NotFound {
		return nil
	}
	if err != nil {
		return err
	}
	// The record is marked first: from here on the volume is gone for
	// every lookup, and a crash at any later step leaves a deletion the
	// next start (or a retry) finishes, never a volume without its data.
	rec.Deleting = true
	if err := fsutil.WriteJSONAtomic(c.volumeMeta(id), rec); err != nil {
		return status.Errorf(codes.Internal, "marking %s deleted: %v", id, err)
	}
	r := &removal{meta: c.volumeMeta(id), rel: c.volumeRel(id), exportID: rec.ExportID, project: rec.ProjectID, bytes: rec.Volume.CapacityBytes}
	c.mu.Lock()
	c.dropVolume(id.String())
	c.removals[id.String()] = r
	c.mu.Unlock()
	return c.finishRemoval(ctx, id.String(), r)
}

func (c *Controller) removalOf(id string) *removal {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.removals[id]
}

func (c *Controller) removalsCopy() map[string]*removal {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.removals)
}

// finishRemoval removes a deleted volume's export (access goes first), its
// data, then its record, and only then gives back its export id, project
// id and bytes: a project id whose files are still there would count them
// against the next volume it is given to, and bytes given back for data
// still on disk would be promised twice. A failure leaves the rest for a
// retry of the delete or the next start.
func (c *Controller) finishRemoval(ctx context.Context, id string, r *removal) error {
	if r.exportID != 0 {
		c.setExported(r.rel, false)
		if err := c.exporter.RemoveExport(ctx, r.exportID); err != nil && !ganesha.IsNotFound(err) {
			c.controlFailed(OpRemoveExport)
			return status.Errorf(codes.Unavailable, "removing the export of %s: %v", id, err)
		}
		fpDeleteExportRemoved.Hit()
		if err := fsutil.RemoveDurably(filepath.Join(c.cfg.ExportDir, filepath.Base(r.rel)+".conf")); err != nil {
			return status.Errorf(codes.Internal, "removing the export file of %s: %v", id, err)
		}
	}
	if err := c.cfg.Storage.Remove(ctx, r.rel, r.project); err != nil {
		return status.Errorf(codes.Internal,
			"removing the data of %s: %v; its project id %d and %d bytes stay reserved until a retried delete or the next start removes it",
			id, err, r.project, r.bytes)
	}
	if err := fsutil.RemoveDurably(r.meta); err != nil {
		return status.Errorf(codes.Internal, "removing the record of %s: %v", id, err)
	}
	fpDeleteRecordRemoved.Hit()
	c.mu.Lock()
	delete(c.removals, id)
	c.mu.Unlock()
	c.release(r.exportID, r.project, r.bytes)
	return nil
}

// SetAttachments records the nodes and makes the export's client list
// exactly their addresses, but for the fenced ones. If ganesha cannot be told, the record is put back,
// so a retried publish or unpublish does the work again.
func (c *Controller) SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
	rec, err := c.record(id)
	if err != nil {
		return nil, err
	}
	seen := map[netip.Addr]nodeid.Node{}
	for _, a := range attachments {
		address, err := clientAddress(a.Node)
		if err != nil {
			return nil, err
		}
		if other, dup := seen[address]; dup {
			return nil, status.Errorf(codes.FailedPrecondition,
				"nodes %q and %q report the same NFS client address %s; the server could not tell them apart", other, a.Node, address)
		}
		seen[address] = a.Node
	}
	old := *rec
	rec.Volume.Attachments = attachments
	if err := fsutil.WriteJSONAtomic(c.volumeMeta(id), rec); err != nil {
		return nil, status.Errorf(codes.Internal, "recording the attachments of %s: %v", id, err)
	}
	fpAttachmentsRecorded.Hit()
	serve := c.applyExport
	switch {
	case !exported(&rec.Volume):
		// Unexporting drops every client's open files and locks on it.
		serve = c.withdrawExport
	case accessmode.SoleWriterLeft(old.Volume.Attachments, attachments):
		serve = c.reexport
	}
	if err := serve(ctx, rec); err != nil {
		if losesClient(old.Volume.Attachments, attachments) {
			// A node was leaving: the record keeps it, so that a retried
			// unpublish does the work again, but ganesha is not told to
			// serve it again. Whatever ganesha serves now (the old clients,
			// the new ones, or nothing after a failed re-export) is at most
			// what the old export granted.
			c.putBackRecord(id, &old)
		} else {
			c.putBack(ctx, id, &old)
		}
		return nil, err
	}
	return c.keep(rec), nil
}

// ModifyVolume records the volume's new mutable parameters and, when a
// node holds the volume, has ganesha serve the changed export at once
// (rootSquash) and checks over the bus that it does. If ganesha refuses or
// serves something else, the old record and export are put back and the
// call fails: the claim's attributes never say what the server does not.
func (c *Controller) ModifyVolume(ctx context.Context, id volumeid.ID, mutable map[string]string) (*backend.Volume, error) {
	rec, err := c.record(id)
	if err != nil {
		return nil, err
	}
	old := *rec
	rec.Volume.MutableParameters = backend.WithMutable(rec.Volume.MutableParameters, mutable)
	served := exported(&rec.Volume)
	if maps.Equal(rec.Volume.MutableParameters, old.Volume.MutableParameters) && !served {
		out := rec.Volume
		return &out, nil
	}
	if err := fsutil.WriteJSONAtomic(c.volumeMeta(id), rec); err != nil {
		return nil, status.Errorf(codes.Internal, "recording the attributes of %s: %v", id, err)
	}
	if served {
		err := c.applyExport(ctx, rec)
		if err == nil {
			err = c.checkSquash(ctx, rec)
		}
		if err != nil {
			c.putBack(ctx, id, &old)
			return nil, err
		}
	}
	return c.keep(rec), nil
}

// checkSquash asks ganesha what it serves for the volume's export and
// fails unless every client has the squashing the record says.
func (c *Controller) checkSquash(ctx context.Context, rec *volumeRecord) error {
	info, err := c.exporter.Export(ctx, rec.ExportID)
	if err != nil {
		c.controlFailed(OpExports)
		return status.Errorf(codes.Unavailable, "asking ganesha what it serves for %s: %v", rec.Volume.ID, err)
	}
	want := squashOf(&rec.Volume)
	if len(info.Clients) == 0 {
		return status.Errorf(codes.Internal, "ganesha serves export %d of %s to no client after the update", rec.ExportID, rec.Volume.ID)
	}
	for _, cl := range info.Clients {
		if cl.Squash != want {
			return status.Errorf(codes.Internal, "ganesha serves export %d of %s to %s with %s after it was told %s",
				rec.ExportID, rec.Volume.ID, cl.Match, cl.Squash, want)
		}
	}
	return nil
}

// keep makes rec, already written, the volume's state here, and returns a
// copy of its volume for the caller.
func (c *Controller) keep(rec *volumeRecord) *backend.Volume {
	c.mu.Lock()
	c.putVolume(rec)
	c.mu.Unlock()
	out := rec.Volume
	return &out
}

// putBack restores a volume's record, and its export where nodes hold it,
// after ganesha refused a change: a retry then finds the old state and
// does the work again.
func (c *Controller) putBack(ctx context.Context, id volumeid.ID, old *volumeRecord) {
	c.putBackRecord(id, old)
	if exported(&old.Volume) {
		if err := c.applyExport(ctx, old); err != nil {
			klog.ErrorS(err, "Restoring an export after ganesha refused a change", "volumeID", id)
		}
	}
}

// putBackRecord restores a volume's record only.
func (c *Controller) putBackRecord(id volumeid.ID, old *volumeRecord) {
	if err := fsutil.WriteJSONAtomic(c.volumeMeta(id), old); err != nil {
		klog.ErrorS(err, "Restoring a volume record after ganesha refused a change", "volumeID", id)
	}
}

func (c *Controller) ExpandVolume(ctx context.Context, id volumeid.ID, bytes int64) (*backend.Volume, error) {
	rec, err := c.record(id)
	if err != nil {
		return nil, err
	}
	if bytes <= rec.Volume.CapacityBytes {
		out := rec.Volume
		return &out, nil
	}
	growth := bytes - rec.Volume.CapacityBytes
	if err := c.promise(growth); err != nil {
		return nil, err
	}
	err = c.cfg.Storage.Grow(ctx, c.volumeRel(id), rec.ProjectID, bytes)
	c.settle(ctx, c.volumeRel(id))
	if err != nil {
		c.commit(-growth)
		return nil, status.Errorf(codes.Internal, "raising the limit of %s: %v", id, err)
	}
	rec.Volume.CapacityBytes = bytes
	if err := fsutil.WriteJSONAtomic(c.volumeMeta(id), rec); err != nil {
		return nil, status.Errorf(codes.Internal, "recording the size of %s: %v", id, err)
	}
	return c.keep(rec), nil
}

func (c *Controller) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*backend.Volume, 0, len(c.volumes))
	for _, rec := range c.volumes {
		out = append(out, rec.Volume.Clone())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

func (c *Controller) VolumeHealth(ctx context.Context, id volumeid.ID) (backend.Health, error) {
	rec, err := c.record(id)
	if err != nil {
		return backend.Health{}, err
	}
	if _, err := os.Stat(c.dir(c.volumeRel(id))); err != nil {
		return backend.Health{Abnormal: true, Condition: backend.DataLoss, Reason: "DataMissing", Message: fmt.Sprintf("the volume's directory is gone: %v", err)}, nil
	}
	// A volume no node holds has no export file, rightly.
	if c.isExported(c.volumeRel(id)) {
		if _, err := os.Stat(c.exportFile(id)); err != nil {
			return backend.Health{Abnormal: true, Condition: backend.Inaccessible, Reason: "ExportMissing", Message: fmt.Sprintf("the volume's export file is gone: %v", err)}, nil
		}
	}
	// Usage reads the volume's own filesystem (the image storage mounts an
	// idle volume to do so): a volume whose data cannot be read is not
	// reported healthy.
	used, limit, err := c.cfg.Storage.Usage(ctx, c.volumeRel(id), rec.ProjectID)
	c.settle(ctx, c.volumeRel(id))
	if err != nil {
		return backend.Health{Abnormal: true, Condition: backend.Inaccessible, Reason: "StorageUnreadable", Message: fmt.Sprintf("the volume's storage cannot be read: %v", err)}, nil
	}
	if limit > 0 && used >= limit {
		return backend.Health{Abnormal: true, Condition: backend.Degraded, Reason: "Full", Message: fmt.Sprintf("the volume is full: %d of %d bytes used", used, limit)}, nil
	}
	return backend.Health{}, nil
}

func (c *Controller) CreateSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID) (*backend.Snapshot, error) {
	src, err := c.record(source)
	if err != nil {
		return nil, err
	}
	inUse, err := c.copyable(&src.Volume)
	if err != nil {
		return nil, err
	}
	_, project, err := c.reserve(ctx, id.String(), false, src.Volume.CapacityBytes)
	if err != nil {
		return nil, err
	}
	err = c.copyTree(ctx, c.volumeRel(source), c.snapshotRel(id), project, src.Volume.CapacityBytes, inUse)
	c.settle(ctx, c.volumeRel(source))
	if err != nil {
		c.release(0, project, src.Volume.CapacityBytes)
		if cerr := c.copyError(source.String(), err); cerr != nil {
			return nil, cerr
		}
		return nil, status.Errorf(codes.Internal, "copying %s: %v", source, err)
	}
	return c.recordSnapshot(ctx, id, name, &src.Volume, project)
}

// recordSnapshot records a snapshot whose copy of source is in place, or
// removes the copy and lets go of its reservation when it cannot.
func (c *Controller) recordSnapshot(ctx context.Context, id volumeid.ID, name string, source *backend.Volume, project uint32) (*backend.Snapshot, error) {
	c.settle(ctx, c.snapshotRel(id)) // never exported
	rec := &snapshotRecord{Snapshot: backend.Snapshot{
		ID: id.String(), Name: name, SourceVolumeID: source.ID, SizeBytes: source.CapacityBytes, CreatedAt: time.Now().UTC(),
		AccessType: source.AccessType, FsType: source.FsType,
	}, ProjectID: project}
	if err := fsutil.WriteJSONAtomic(c.snapshotMeta(id), rec); err != nil {
		_ = c.cfg.Storage.Remove(ctx, c.snapshotRel(id), project)
		c.release(0, project, source.CapacityBytes)
		return nil, status.Errorf(codes.Internal, "recording snapshot %s: %v", id, err)
	}
	c.mu.Lock()
	c.snapshots[id.String()] = rec
	c.mu.Unlock()
	out := rec.Snapshot
	return &out, nil
}

func (c *Controller) Snapshot(ctx context.Context, id volumeid.ID) (*backend.Snapshot, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.snapshots[id.String()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", id)
	}
	out := rec.Snapshot
	return &out, nil
}

func (c *Controller) DeleteSnapshot(ctx context.Context, id volumeid.ID) error {
	if r := c.removalOf(id.String()); r != nil {
		return c.finishRemoval(ctx, id.String(), r)
	}
	c.mu.Lock()
	rec, ok := c.snapshots[id.String()]
	c.mu.Unlock()
	if !ok {
		return nil
	}
	marked := *rec
	marked.Deleting = true
	if err := fsutil.WriteJSONAtomic(c.snapshotMeta(id), &marked); err != nil {
		return status.Errorf(codes.Internal, "marking %s deleted: %v", id, err)
	}
	r := &removal{meta: c.snapshotMeta(id), rel: c.snapshotRel(id), project: rec.ProjectID, bytes: rec.Snapshot.SizeBytes}
	c.mu.Lock()
	delete(c.snapshots, id.String())
	c.removals[id.String()] = r
	c.mu.Unlock()
	return c.finishRemoval(ctx, id.String(), r)
}

func (c *Controller) ListSnapshots(ctx context.Context) ([]*backend.Snapshot, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*backend.Snapshot, 0, len(c.snapshots))
	for _, rec := range c.snapshots {
		s := rec.Snapshot
		out = append(out, &s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// ClientList returns the addresses the volume's export is open to, RW or
// RO, as recorded: what `modeguard inspect` and the tests compare against
// what clients can actually do.
func (c *Controller) ClientList(id volumeid.ID) ([]ganesha.ClientRule, error) {
	rec, err := c.record(id)
	if err != nil {
		return nil, err
	}
	e, err := c.export(rec)
	if err != nil {
		return nil, err
	}
	return e.Clients, nil
}

// clientList is the export's clients as a log value: "10.0.0.11 RW, ...".
func clientList(rec *volumeRecord) string {
	var out []string
	for _, a := range accessmode.Served(rec.Volume.Attachments) {
		access := "RW"
		if a.ReadOnly {
			access = "RO"
		}
		out = append(out, a.Node.Address+" "+access)
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}
