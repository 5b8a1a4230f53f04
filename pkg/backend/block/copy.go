package block

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// Copies of images: how a snapshot, a restore or a clone gets its bytes
// (an instant reflink clone, or a byte copy only of what nobody writes),
// and the byte copies that outlive the call that started them.

// imageInProgress is a snapshot's or volume's image under construction: a
// temporary file in the pool, and what it holds until it is published and
// recorded (space reserved, a source volume locked). Whoever ends it
// (abandon on a failed call, or the background copy it was handed over to)
// lets go of all of it, last taken first.
type imageInProgress struct {
	tmp, final, meta, dir string
	published             bool
	held                  []func()
}

// startImage reserves bytes in p for the object id and makes its temporary
// image next to where it will be published.
func (c *Controller) startImage(p *pool, id volumeid.ID, bytes int64, what string) (*imageInProgress, error) {
	final, err := p.imagePath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	meta, err := p.metaPath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	release, err := c.reserve(p, bytes, what)
	if err != nil {
		return nil, err
	}
	tmp, err := tempName(final)
	if err != nil {
		release()
		return nil, status.Errorf(codes.Internal, "creating image of %s: %v", id, err)
	}
	m := &imageInProgress{tmp: tmp, final: final, meta: meta, dir: p.kindDir(id.Kind), held: []func(){release}}
	m.hold(func() {
		if !m.published {
			os.Remove(m.tmp)
		}
	})
	return m, nil
}

// hold adds something to let go of when the image is done.
func (m *imageInProgress) hold(release func()) { m.held = append(m.held, release) }

// abandon lets go of everything held, unless handed over.
func (m *imageInProgress) abandon() {
	for i := len(m.held) - 1; i >= 0; i-- {
		m.held[i]()
	}
	m.held = nil
}

// handOver returns abandon for the new owner; the deferred abandon of the
// call that started the image then does nothing.
func (m *imageInProgress) handOver() func() {
	held := m.held
	m.held = nil
	return func() {
		for i := len(held) - 1; i >= 0; i-- {
			held[i]()
		}
	}
}

// publishAndRecord renames the complete image into place and then writes
// the object's metadata next to it, each durably and in that order, so
// that metadata never names an image that is not there. The metadata is
// written to its temporary file and synced while the image's rename is
// made durable: where calls are in flight together, both wait for one
// shared sync of the pool's filesystem rather than one after the other.
// published runs once the image is in place, before the metadata is.
// Without metadata the image is a leftover: it goes now rather than at
// the next restart.
func (m *imageInProgress) publishAndRecord(obj any, published func()) (publishErr, recordErr error) {
	data, err := json.MarshalIndent(obj, "", "  ")
	if err != nil {
		return nil, err
	}
	var pending *fsutil.PendingFile
	var pendingErr error
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		pending, pendingErr = fsutil.WritePending(m.meta, append(data, '\n'), 0o600)
	}()
	publishErr = os.Rename(m.tmp, m.final)
	if publishErr == nil {
		m.published = true
		publishErr = fsutil.SyncDir(m.dir)
	}
	<-wrote
	if pendingErr == nil {
		defer pending.Discard()
	}
	if publishErr != nil {
		return publishErr, nil
	}
	published()
	if pendingErr == nil {
		recordErr = pending.Commit()
	} else {
		recordErr = pendingErr
	}
	if recordErr != nil {
		if rerr := fsutil.RemoveDurably(m.final); rerr != nil {
			klog.ErrorS(rerr, "Removing an image whose metadata could not be written", "image", m.final)
		}
	}
	return nil, recordErr
}

// sameCreation tells a retry of the creation a background copy is doing
// from a request for another volume under the same name.
func sameCreation(v *backend.Volume, spec backend.VolumeSpec) bool {
	src := backend.Source{}
	if spec.Source != nil {
		src = *spec.Source
	}
	have := backend.Source{}
	if v.Source != nil {
		have = *v.Source
	}
	return v.CapacityBytes == spec.CapacityBytes && v.AccessType == spec.AccessType && v.FsType == spec.FsType && have == src
}

// awaitVolumeCopy waits for a new volume's background copy until shortly
// before the call's deadline. CSI has no "not ready yet" for a volume:
// until the copy is done the answer is ABORTED (the CO retries, and the
// retry waits for the same copy), then the volume.
func (c *Controller) awaitVolumeCopy(ctx context.Context, job *copyJob) (*backend.Volume, error) {
	if !c.awaitCopy(ctx, job) {
		return nil, status.Errorf(codes.Aborted, "volume %s is still being copied from %+v; CreateVolume again returns it once the copy is done", job.vol.ID, *job.vol.Source)
	}
	if job.err != nil {
		return nil, job.err
	}
	return job.vol.Clone(), nil
}

// cloneSource starts the copy of a new volume's source image into dst: a
// reflink clone where the pool has them (cloned), else nothing yet, the
// caller making the byte copy. A snapshot never changes. A volume may be
// in use (cloneOrVet): it stays locked, so that no attach slips in, until
// the caller is done copying and calls unlock.
func (c *Controller) cloneSource(ctx context.Context, src *backend.Source, image, dst string) (unlock func(), cloned bool, err error) {
	if src.VolumeID == "" {
		err := cloneImage(image, dst)
		if err != nil && !errors.Is(err, errNoReflink) {
			return nil, false, status.Errorf(codes.Internal, "cloning %s: %v", filepath.Base(image), err)
		}
		return func() {}, err == nil, nil
	}
	unlock = c.objects.Hold(src.VolumeID)
	id, err := volumeid.ParseKind(src.VolumeID, volumeid.Volume)
	if err != nil {
		unlock()
		return nil, false, status.Errorf(codes.NotFound, "source volume: %v", err)
	}
	vol, err := c.Volume(ctx, id)
	if err == nil {
		cloned, err = c.cloneOrVet(vol, image, dst)
	}
	if err != nil {
		unlock()
		return nil, false, err
	}
	return unlock, cloned, nil
}

// cloneOrVet makes sure a copy of a volume's image is the image as it was
// at one instant, so that every write acknowledged before the copy began is
// in it and nothing is torn (crash-consistent). A reflink clone is that
// instant wherever the pool's filesystem has reflinks: then dst holds the
// copy and cloned is true. Elsewhere a byte copy is only a point in time
// when nothing writes the image, so a volume attached for writing (or bound
// read-write to a loop device on this machine) is refused rather than
// copied while it moves; otherwise the caller makes the byte copy. The
// caller holds the volume's lock until the copy is done.
func (c *Controller) cloneOrVet(vol *backend.Volume, image, dst string) (cloned bool, err error) {
	err = cloneImage(image, dst)
	if err == nil {
		return true, nil
	}
	if !errors.Is(err, errNoReflink) {
		return false, status.Errorf(codes.Internal, "cloning the image of %s: %v", vol.ID, err)
	}
	if writer, err := c.writerOf(vol, image); err != nil {
		return false, status.Errorf(codes.Unavailable, "cannot tell whether volume %s is being written, so it is not copied (its pool has no reflinks): %v", vol.ID, err)
	} else if writer != "" {
		return false, status.Errorf(codes.FailedPrecondition,
			"volume %s is %s, and its pool's filesystem cannot clone files (no reflink): a copy of an image in use could be torn and miss acknowledged writes. "+
				"Copy it once no node has it attached for writing, or keep the zone's pool on a filesystem with reflinks (xfs with reflink=1, btrfs), "+
				"or move the pool to a filesystem with reflinks the driver keeps in the pool directory (--block-pool-filesystem=auto, btrfs or xfs makes one in a directory without volumes; "+
				"the operator guide, \"Snapshots of volumes in use\", says how to move a pool)", vol.ID, writer)
	}
	return false, nil
}

// writerOf says who may be writing a volume's image, or "" if nobody can:
// the controller's record of read-write attachments, and what the kernel
// here knows (a loop device bound read-write to the image, whatever the
// record says; or, where the images are served (SetWriters), whoever the
// server lets write).
func (c *Controller) writerOf(vol *backend.Volume, image string) (string, error) {
	for _, a := range vol.Attachments {
		if !a.ReadOnly {
			return "attached read-write to node " + a.Node.Name, nil
		}
	}
	if c.writers != nil {
		id, err := volumeid.Parse(vol.ID)
		if err != nil {
			return "", err
		}
		return c.writers(id, image)
	}
	devs, err := loop.DevicesOf(image)
	if err != nil {
		return "", fmt.Errorf("listing the loop devices of %s: %w", image, err)
	}
	for _, d := range devs {
		ro, err := loop.ReadOnly(d)
		if err != nil {
			if still, nerr := loop.NamedBy(d, image); nerr == nil && !still {
				continue // detached meanwhile
			}
			return "", err
		}
		if !ro {
			return "bound read-write to " + d + " on this machine", nil
		}
	}
	return "", nil
}

// copyJob is a byte copy that may outlive the call that started it: a
// snapshot's (snap) or a new volume's (vol, a restore or a clone).
type copyJob struct {
	snap   backend.Snapshot // as it will be recorded; Cutting while copying
	vol    *backend.Volume  // as it will be recorded
	done   chan struct{}
	err    error // set before done is closed
	cancel context.CancelFunc
}

// copiesStarted counts the byte copies started in the background, so a
// test can tell a retry that waits from one that starts over.
var copiesStarted atomic.Int64

// startCopy runs finish in the background under a context of its own (the
// call's ends with the call), then lets go of what the image in progress
// held (the source's lock, the reservation, the temporary file). The
// caller's deferred abandon no longer does: the copy owns them now.
func (c *Controller) startCopy(id string, job *copyJob, finish func(context.Context) error, m *imageInProgress) *copyJob {
	ctx, cancel := context.WithCancel(context.Background())
	job.done, job.cancel = make(chan struct{}), cancel
	c.mu.Lock()
	c.copies[id] = job
	c.mu.Unlock()
	copiesStarted.Add(1)
	undo := m.handOver()
	go func() {
		err := finish(ctx)
		undo()
		cancel()
		if err != nil {
			klog.ErrorS(err, "A background copy failed; the next call starts it again", "id", id)
		} else {
			klog.InfoS("Background copy done", "id", id)
		}
		c.mu.Lock()
		delete(c.copies, id)
		job.err = err
		c.mu.Unlock()
		close(job.done)
	}()
	return job
}

// Creating reports whether volume id is being created by a background copy
// (a restore or a clone that outlasted its call): not there yet, but a
// retry must wait for it (see backend.ControllerCapabilities).
func (c *Controller) Creating(_ context.Context, id volumeid.ID) (bool, error) {
	job := c.copyJobFor(id.String())
	return job != nil && job.vol != nil, nil
}

func (c *Controller) copyJobFor(id string) *copyJob {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.copies[id]
}

// cancelCopy stops the background copy of id, if there is one, and waits
// until it has undone what it held.
func (c *Controller) cancelCopy(ctx context.Context, id volumeid.ID) error {
	job := c.copyJobFor(id.String())
	if job == nil {
		return nil
	}
	job.cancel()
	select {
	case <-job.done:
		return nil
	case <-ctx.Done():
		return status.Errorf(codes.Aborted, "the copy of %s is still being cancelled: %v", id, ctx.Err())
	}
}

// awaitCopy waits for a background copy until shortly before the call's
// deadline and reports whether it is done (then job.err says how).
func (c *Controller) awaitCopy(ctx context.Context, job *copyJob) bool {
	var early <-chan time.Time
	if deadline, ok := ctx.Deadline(); ok {
		// Answer with a fifth of the time left to spare (at least 10ms,
		// at most a second): a late answer is a DEADLINE_EXCEEDED.
		left := time.Until(deadline)
		spare := min(max(left/5, 10*time.Millisecond), time.Second)
		t := time.NewTimer(max(left-spare, 0))
		defer t.Stop()
		early = t.C
	}
	select {
	case <-job.done:
		return true
	case <-early:
	case <-ctx.Done():
	}
	return false
}

// awaitSnapshotCopy answers with the snapshot as it stands shortly before
// the call's deadline: ready once the copy is done, not ready (Cutting)
// while it goes on, the copy's error if it failed.
func (c *Controller) awaitSnapshotCopy(ctx context.Context, job *copyJob) (*backend.Snapshot, error) {
	out := job.snap
	if !c.awaitCopy(ctx, job) {
		return &out, nil
	}
	if job.err != nil {
		return nil, job.err
	}
	out.Cutting = false
	return &out, nil
}
