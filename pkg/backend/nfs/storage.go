package nfs

import (
	"context"
	"errors"
	"os"
	"path/filepath"

	"github.com/modeguard/modeguard/pkg/backend/nfs/imagestore"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
)

// Storage keeps each volume and snapshot as a directory under Root() with a
// hard size limit. rel names the object ("volumes/<file name>"); project is
// the object's quota project id, which only quota-based storage uses.
//
// Two implementations exist: xfs project quotas on one shared filesystem
// (package projquota; preferred: limits change instantly, copies are
// reflinks, nothing to re-attach at start) and one xfs or ext4 image per
// object, loop-mounted while in use (package imagestore; works on kernels
// without xfs quota support, at the cost of a minimum size, 300 MiB for
// xfs and 16 MiB for ext4, and a loop device per object in use).
type Storage interface {
	Root() string
	// MinSize is the smallest object the storage can make.
	MinSize() int64
	Create(ctx context.Context, rel string, project uint32, limit int64) error
	Grow(ctx context.Context, rel string, project uint32, limit int64) error
	Copy(ctx context.Context, srcRel, dstRel string, project uint32, limit int64) error
	// CopiesAtOnePoint says whether Copy takes the source as it was at one
	// instant however its writers go on (crash-consistent), or walks a tree
	// that may change under it.
	CopiesAtOnePoint() bool
	Remove(ctx context.Context, rel string, project uint32) error
	Usage(ctx context.Context, rel string, project uint32) (used, limit int64, err error)
	// Free and Size are the backing filesystem's available and total bytes.
	Free() (int64, error)
	Size() (int64, error)
	// Restore makes the recorded objects usable after a restart, all in
	// one call: what it must learn of the machine to do so it learns once,
	// not once per object.
	Restore(ctx context.Context, rels []string) error
	// Ensure makes one object usable now, as Restore would, when Restore
	// left it out: the controller restores only what is published at
	// start. The other methods do the same for the objects they touch, so
	// this is for callers that use the object's directory directly.
	Ensure(ctx context.Context, rel string) error
	// Idle lets go of what one object holds while nothing uses it (the
	// image storage unmounts it and detaches its loop device); the next
	// Ensure, Grow, Copy or Usage makes it usable again.
	Idle(ctx context.Context, rel string) error
	// Prune removes every object whose rel is not in keep.
	Prune(ctx context.Context, keep map[string]bool) ([]string, error)
	// Release lets go of what the storage holds (mounts, loop devices).
	Release() error
}

// A PausedCopier is a Storage that copies a volume as of one instant
// when nothing writes to it while the copy reads it, fast enough that the
// NFS server, every client's writes included, can be held still meanwhile
// (Config.Pause).
type PausedCopier interface {
	// PausedCopyable says why CopyPaused cannot be used (nil when it can).
	PausedCopyable() error
	// CopyPaused is Copy with during run around the step that reads the
	// source: during calls read once, under the context read is to run
	// under, and holds the writers still for it. An error of during's is
	// returned wrapped, the partial copy removed.
	CopyPaused(ctx context.Context, srcRel, dstRel string, project uint32, limit int64,
		during func(ctx context.Context, read func(context.Context) error) error) error
}

// quotaStorage adapts a project-quota pool.
type quotaStorage struct {
	pool    *projquota.Pool
	release func() error
}

// NewQuotaStorage wraps a prepared pool; release is what Prepare returned.
func NewQuotaStorage(pool *projquota.Pool, release func() error) Storage {
	return &quotaStorage{pool: pool, release: release}
}

func (q *quotaStorage) Root() string   { return q.pool.Root() }
func (q *quotaStorage) MinSize() int64 { return q.pool.BlockSize() }
func (q *quotaStorage) Create(ctx context.Context, rel string, project uint32, limit int64) error {
	return q.pool.CreateDir(ctx, rel, project, limit)
}
func (q *quotaStorage) Grow(ctx context.Context, rel string, project uint32, limit int64) error {
	return q.pool.SetLimit(ctx, project, limit)
}
func (q *quotaStorage) Copy(ctx context.Context, srcRel, dstRel string, project uint32, limit int64) error {
	return q.pool.CopyTree(ctx, srcRel, dstRel, project, limit)
}

// CopiesAtOnePoint is false: the copy walks the tree file by file (each a
// reflink), so files written meanwhile may be copied before or after.
// CopyPaused is how a volume in use is copied at one instant.
func (q *quotaStorage) CopiesAtOnePoint() bool { return false }

// PausedCopyable is nil when the pool clones files: the walk then takes
// time for each file, not for each byte, and the NFS server can be held
// still for it.
func (q *quotaStorage) PausedCopyable() error {
	ok, err := q.pool.Reflinks()
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("this server's quota pool was made without reflinks (xfs reflink=0), so a copy of a volume copies its bytes, " +
			"which is too slow to hold the NFS server still for")
	}
	return nil
}

func (q *quotaStorage) CopyPaused(ctx context.Context, srcRel, dstRel string, project uint32, limit int64,
	during func(ctx context.Context, read func(context.Context) error) error) error {
	return q.pool.CopyTreeAround(ctx, srcRel, dstRel, project, limit, during)
}
func (q *quotaStorage) Remove(ctx context.Context, rel string, project uint32) error {
	return q.pool.RemoveDir(ctx, rel, project)
}
func (q *quotaStorage) Usage(ctx context.Context, rel string, project uint32) (int64, int64, error) {
	return q.pool.Usage(ctx, project)
}
func (q *quotaStorage) Free() (int64, error) { return q.pool.Free() }
func (q *quotaStorage) Size() (int64, error) { return q.pool.Size() }

// Restore has nothing to mount: the pool is one filesystem, mounted by
// Prepare. It checks that every object's directory is there.
func (q *quotaStorage) Restore(ctx context.Context, rels []string) error {
	for _, rel := range rels {
		if _, err := os.Stat(filepath.Join(q.pool.Root(), rel)); err != nil {
			return err
		}
	}
	return nil
}

// Ensure checks that the object's directory is there: nothing to mount.
func (q *quotaStorage) Ensure(ctx context.Context, rel string) error {
	return q.Restore(ctx, []string{rel})
}

// Idle has nothing to let go: every object lives in the one filesystem.
func (q *quotaStorage) Idle(context.Context, string) error { return nil }

func (q *quotaStorage) Prune(ctx context.Context, keep map[string]bool) ([]string, error) {
	var removed []string
	for _, sub := range []string{"volumes", "snapshots"} {
		entries, err := os.ReadDir(filepath.Join(q.pool.Root(), sub))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return removed, err
		}
		for _, e := range entries {
			rel := filepath.Join(sub, e.Name())
			if keep[rel] {
				continue
			}
			if err := os.RemoveAll(filepath.Join(q.pool.Root(), rel)); err != nil {
				return removed, err
			}
			removed = append(removed, rel)
		}
	}
	return removed, nil
}

func (q *quotaStorage) Release() error {
	if q.release == nil {
		return nil
	}
	return q.release()
}

// imageStorage adapts an image store; project ids mean nothing to it.
type imageStorage struct{ store *imagestore.Store }

// NewImageStorage wraps an opened image store.
func NewImageStorage(store *imagestore.Store) Storage { return &imageStorage{store: store} }

func (i *imageStorage) Root() string   { return i.store.Root() }
func (i *imageStorage) MinSize() int64 { return i.store.MinSize() }
func (i *imageStorage) Create(ctx context.Context, rel string, _ uint32, limit int64) error {
	return i.store.Create(ctx, rel, limit)
}
func (i *imageStorage) Grow(ctx context.Context, rel string, _ uint32, limit int64) error {
	return i.store.Grow(ctx, rel, limit)
}
func (i *imageStorage) Copy(ctx context.Context, srcRel, dstRel string, _ uint32, limit int64) error {
	return i.store.Copy(ctx, srcRel, dstRel, limit)
}

// CopiesAtOnePoint is true: the source's filesystem is frozen while its
// files are copied.
func (i *imageStorage) CopiesAtOnePoint() bool { return true }
func (i *imageStorage) Remove(ctx context.Context, rel string, _ uint32) error {
	return i.store.Remove(ctx, rel)
}
func (i *imageStorage) Usage(ctx context.Context, rel string, _ uint32) (int64, int64, error) {
	return i.store.Usage(ctx, rel)
}
func (i *imageStorage) Free() (int64, error) { return i.store.Free() }
func (i *imageStorage) Size() (int64, error) { return i.store.Size() }
func (i *imageStorage) Restore(ctx context.Context, rels []string) error {
	return i.store.RestoreAll(ctx, rels)
}
func (i *imageStorage) Ensure(ctx context.Context, rel string) error {
	return i.store.Restore(ctx, rel)
}
func (i *imageStorage) Idle(ctx context.Context, rel string) error {
	return i.store.Unmount(ctx, rel)
}
func (i *imageStorage) Prune(ctx context.Context, keep map[string]bool) ([]string, error) {
	return i.store.Prune(ctx, keep)
}
func (i *imageStorage) Release() error { return i.store.Release() }
