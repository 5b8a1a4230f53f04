// Package keptfs keeps a filesystem the driver needs in a directory that
// is on another one: a sparse image file in that directory, formatted once
// (xfs or btrfs), attached to a loop device and mounted at a subdirectory
// of it. The NFS backend keeps its prjquota pool this way
// (projquota.Prepare), the block backend a pool with reflinks, or one
// whose group snapshots are of one instant (block.KeepPools).
//
// An image is never reformatted or resized once it exists, nor mounted as
// another filesystem than the one its superblock says it holds; it is made
// under a temporary name and renamed into place only once formatted, so an
// image that exists is a formatted one. Calls for one directory are
// serialized by a lock file in it, also between processes and between
// mount namespaces (the lock is on the directory's file, which every
// namespace that sees the directory shares).
//
// One image must never be attached to two loop devices at once: two
// superblocks over one file (xfs or btrfs), each caching its own metadata,
// corrupt it. So a call first looks for a device the kernel already has
// bound to the image (by inode) and mounts that one; mounting one block
// device twice, even from two mount namespaces, gives the same superblock,
// which is safe.
package keptfs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/command"

	mtab "github.com/modeguard/modeguard/pkg/mounts"
)

// MinXFSBytes is the smallest filesystem mkfs.xfs makes (xfsprogs 5.19 and
// later refuse anything below 300 MiB).
const MinXFSBytes = 300 << 20

// The filesystems an image can hold (Spec.Filesystem), by their names for
// mount(2) and mkfs.
const (
	XFS   = "xfs"
	Btrfs = "btrfs"
)

// packageOf names the package that brings each filesystem's mkfs, for the
// error that says it is missing.
var packageOf = map[string]string{XFS: "xfsprogs", Btrfs: "btrfs-progs"}

// Spec says which filesystem to keep and how.
type Spec struct {
	// Dir holds the image, the lock file and the mount point: absolute,
	// free of symbolic links, existing.
	Dir string
	// Image, MountDir and Lock are names within Dir.
	Image, MountDir, Lock string
	// Size is the size of a new image in bytes; with 0 only an existing
	// image is used.
	Size int64
	// Filesystem is what a new image is formatted as, and what an
	// existing one must hold: XFS or Btrfs.
	Filesystem string
	// MkfsArgs go to mkfs.<Filesystem> after -q, before the image's path.
	MkfsArgs []string
	// Mount mounts the loop device dev at mnt.
	Mount func(dev, mnt string) error
	// Shared says that several processes use the mount at once, each
	// keeping it with a call of its own (a controller and the node
	// plugins of one machine, each in its own mount namespace or all in
	// one). Then a device already mounted elsewhere is mounted again
	// (same superblock), the device detaches itself once the last mount
	// of it anywhere is gone, and a release unmounts only when no other
	// keeper in the same mount namespace still uses the filesystem. Without Shared
	// the keeper owns the filesystem: an image mounted elsewhere is
	// refused, and a release unmounts and detaches.
	Shared bool
	// What names the filesystem in logs ("NFS pool").
	What string
}

func (s Spec) image() string { return filepath.Join(s.Dir, s.Image) }
func (s Spec) mnt() string   { return filepath.Join(s.Dir, s.MountDir) }

// FS is a kept filesystem, mounted.
type FS struct {
	// Root is where it is mounted.
	Root string
	// Device is the loop device it is mounted from.
	Device string
	// Formatted is true when this call made the image.
	Formatted bool
	// Reused is true when it was mounted at Root already.
	Reused bool

	spec    Spec
	mountID int
	mu      sync.Mutex
	// users holds a shared lock on the users file while this keeper
	// uses the filesystem (Shared only); nil once released.
	users    *os.File
	released bool
}

// Keep makes sure the filesystem s describes is mounted at s.Dir/s.MountDir
// and returns it: reused where it is mounted there already, else mounted
// from the loop device bound to the image (left from an earlier run, or
// another process's), else from a new loop device, the image made first if
// there is none.
func Keep(ctx context.Context, s Spec) (*FS, error) {
	unlock, err := lockFile(ctx, filepath.Join(s.Dir, s.Lock))
	if err != nil {
		return nil, err
	}
	defer unlock()

	image, mnt := s.image(), s.mnt()
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return nil, err
	}
	if err := s.check(); err != nil {
		return nil, err
	}

	// Mounted already (by an earlier run of this process or another one)?
	if m, err := mountAt(mnt); err != nil {
		return nil, err
	} else if m != nil {
		ours := false
		if loop.ValidDevice(m.Source) {
			// The image there now, by inode: a mount left from an image
			// since deleted and made again is not this filesystem.
			if ours, err = loop.BoundTo(m.Source, image); err != nil {
				return nil, err
			}
		}
		if !ours {
			return nil, fmt.Errorf("%s is already mounted from %s, not from the image %s", mnt, m.Source, image)
		}
		fs := &FS{Root: mnt, Device: m.Source, Reused: true, spec: s, mountID: m.ID}
		if err := fs.use(); err != nil {
			return nil, err
		}
		klog.InfoS("Reusing mounted "+s.What, "mountPoint", mnt, "device", m.Source, "image", image)
		return fs, nil
	}

	created, err := ensureImage(ctx, image, s.Size, s.Filesystem, s.MkfsArgs)
	if err != nil {
		return nil, err
	}
	var dev string
	var attached bool
	if s.Shared {
		dev, attached, err = sharedDevice(ctx, image)
	} else {
		dev, attached, err = ownDevice(ctx, image)
	}
	if err != nil {
		return nil, err
	}
	detach := func() {
		if !attached {
			return // someone else's: theirs to detach
		}
		if _, err := loop.DetachIfBackedBy(context.WithoutCancel(ctx), dev, image); err != nil {
			klog.ErrorS(err, "Detaching an image after a failed mount", "device", dev, "image", image)
		}
	}
	if err := mountDevice(s, dev, image, mnt); err != nil {
		detach()
		return nil, err
	}
	m, err := mountAt(mnt)
	if err == nil && (m == nil || m.Source != dev) {
		err = fmt.Errorf("%s is not mounted from %s right after mounting it", mnt, dev)
	}
	if err != nil {
		_ = unix.Unmount(mnt, 0)
		detach()
		return nil, err
	}
	fs := &FS{Root: mnt, Device: dev, Formatted: created, spec: s, mountID: m.ID}
	if err := fs.use(); err != nil {
		_ = unix.Unmount(mnt, 0)
		return nil, err
	}
	klog.InfoS("Mounted "+s.What, "mountPoint", mnt, "device", dev, "image", image, "formatted", created, "newDevice", attached)
	return fs, nil
}

// mountDevice mounts dev at mnt. A shared device is held open meanwhile
// (loop.Hold), so it cannot be detached and handed to another image
// between the lookup and the mount, and is then marked to detach itself
// once the last mount of it anywhere is gone: no process has to be the one
// that detaches it, and none can leave it bound when it goes.
func mountDevice(s Spec, dev, image, mnt string) error {
	if !s.Shared {
		return s.Mount(dev, mnt)
	}
	held, err := loop.Hold(dev, image)
	if err != nil {
		return err
	}
	defer held.Close()
	if err := s.Mount(dev, mnt); err != nil {
		return err
	}
	if err := loop.AutoClear(held); err != nil {
		_ = unix.Unmount(mnt, 0)
		return err
	}
	return nil
}

// usersPrefix starts the name of a users file: the lock file's name, then
// this, then the mount namespace's inode number and the mount point's hash.
const usersPrefix = "-users-"

// use takes this keeper's share of a shared filesystem: a shared lock on
// its mount namespace's users file, by which a release tells whether
// another keeper still uses the mount it would take off. Per namespace:
// a keeper in another one (another pod) has a mount of its own, which goes
// with its namespace, and must not keep this namespace's mounted after the
// last keeper here is gone. Called with the lock file held.
func (f *FS) use() error {
	if !f.spec.Shared {
		return nil
	}
	sweepUsers(f.spec)
	path, err := usersFile(f.spec, f.Root)
	if err != nil {
		return err
	}
	u, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	if err := unix.Flock(int(u.Fd()), unix.LOCK_SH); err != nil {
		u.Close()
		return fmt.Errorf("locking %s: %w", path, err)
	}
	f.users = u
	return nil
}

// usersFile is the users file of the mount at root in this process's
// mount namespace: named by the namespace's inode number and the mount
// point, since keepers that reach the directory by two paths (a bind
// mount) each have a mount of their own to take off.
func usersFile(s Spec, root string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/mnt", &st); err != nil {
		return "", fmt.Errorf("finding this process's mount namespace: %w", err)
	}
	h := fnv.New32a()
	h.Write([]byte(root))
	return filepath.Join(s.Dir, fmt.Sprintf("%s%s%d-%08x", s.Lock, usersPrefix, st.Ino, h.Sum32())), nil
}

// sweepUsers removes the users files nobody holds a lock on: those of
// mount namespaces whose keepers have all gone (a pod's, after it ended).
// Called with the lock file held, so no keeper is between opening one and
// locking it.
func sweepUsers(s Spec) {
	entries, err := os.ReadDir(s.Dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), s.Lock+usersPrefix) {
			continue
		}
		path := filepath.Join(s.Dir, e.Name())
		u, err := os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		if unix.Flock(int(u.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
			_ = os.Remove(path)
		}
		u.Close()
	}
}

// Release gives up this keeper's use of the filesystem (clean shutdown,
// tests); it is safe to call more than once. Without Shared it unmounts
// the filesystem, if the mount there is still the one Keep found or made,
// and detaches its device unless it is mounted elsewhere too. With Shared
// it unmounts only when no other keeper in this mount namespace uses it;
// the device
// detaches itself once the last mount of it, in any mount namespace, is
// gone. A filesystem still busy (images on it attached to loop devices)
// stays mounted.
func (f *FS) Release() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.released {
		return nil
	}
	if !f.spec.Shared {
		if err := f.releaseOwn(); err != nil {
			return err
		}
		f.released = true
		return nil
	}
	unlock, err := lockFile(context.Background(), filepath.Join(f.spec.Dir, f.spec.Lock))
	if err != nil {
		return err
	}
	defer unlock()
	// Last user? The lock is taken by this keeper's own file, so its own
	// shared lock does not stand in the way; any other keeper's does.
	// (A refused conversion drops this keeper's shared lock: it is
	// leaving anyway.)
	last := unix.Flock(int(f.users.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil
	defer func() {
		if f.released {
			f.users.Close()
		}
	}()
	if !last {
		klog.InfoS("Leaving "+f.spec.What+" mounted: another process uses it", "mountPoint", f.Root)
		f.released = true
		return nil
	}
	// No keeper here is left to need this namespace's users file.
	defer func() {
		if f.released {
			_ = os.Remove(f.users.Name())
		}
	}()
	m, err := mountAt(f.Root)
	if err != nil {
		return err
	}
	if m != nil && m.ID == f.mountID && m.Source == f.Device {
		err := unix.Unmount(f.Root, 0)
		if errors.Is(err, unix.EBUSY) {
			klog.InfoS("Leaving "+f.spec.What+" mounted: it is busy (images on it still attached)", "mountPoint", f.Root)
		} else if err != nil && !errors.Is(err, unix.EINVAL) {
			// Shared again for a retry.
			_ = unix.Flock(int(f.users.Fd()), unix.LOCK_SH)
			return fmt.Errorf("unmounting %s: %w", f.Root, err)
		}
	}
	f.released = true
	return nil
}

// releaseOwn unmounts a filesystem the keeper owns, but only while the
// mount there is still the one Keep found or made (same mount id and
// device), and then detaches the device if it is still bound to the image
// and not mounted elsewhere (a bind mount).
func (f *FS) releaseOwn() error {
	m, err := mountAt(f.Root)
	if err != nil {
		return err
	}
	if m != nil && m.ID == f.mountID && m.Source == f.Device {
		if err := unix.Unmount(f.Root, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("unmounting %s: %w", f.Root, err)
		}
	}
	if still, err := mountedFrom(f.Device); err != nil {
		return err
	} else if still != "" {
		return nil
	}
	if _, err := loop.DetachIfBackedBy(context.Background(), f.Device, f.spec.image()); err != nil {
		return fmt.Errorf("detaching %s: %w", f.Device, err)
	}
	return nil
}

// lockFile takes an exclusive flock on path, waiting until ctx is done.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { _ = f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("locking %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("waiting for the lock %s: %w", path, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// ensureImage makes the image if it does not exist yet. The new image is
// built under a temporary name and renamed into place only once formatted,
// so an image file that exists is always a formatted one, and reusing it
// unformatted after a crash can't happen.
func ensureImage(ctx context.Context, image string, size int64, filesystem string, mkfsArgs []string) (created bool, err error) {
	st, err := os.Lstat(image)
	if err == nil {
		if !st.Mode().IsRegular() {
			return false, fmt.Errorf("image %s is not a regular file", image)
		}
		if size > 0 && st.Size() < size {
			klog.InfoS("Image is smaller than asked for; it is reused as it is, not grown", "image", image, "size", st.Size(), "asked", size)
		}
		return false, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return false, err
	}
	if size <= 0 {
		return false, fmt.Errorf("image %s does not exist and no image size was given to create it", image)
	}
	tmp := image + ".new"
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return false, err
	}
	fail := func(err error) (bool, error) {
		f.Close()
		_ = os.Remove(tmp)
		return false, err
	}
	if err := f.Truncate(size); err != nil {
		return fail(fmt.Errorf("sizing %s: %w", tmp, err))
	}
	args := append(append([]string{"-q"}, mkfsArgs...), tmp)
	if _, err := command.Run(ctx, "mkfs."+filesystem, args...); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(tmp)
		return false, err
	}
	if err := os.Rename(tmp, image); err != nil {
		_ = os.Remove(tmp)
		return false, err
	}
	if d, err := os.Open(filepath.Dir(image)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return true, nil
}

// ownDevice returns a loop device bound to image for a keeper that owns
// the filesystem: one left bound and unmounted by an interrupted earlier
// start, or a new one (attached true). An image mounted elsewhere is
// refused.
func ownDevice(ctx context.Context, image string) (dev string, attached bool, err error) {
	// This image, not a deleted one of its name.
	bound, err := loop.DevicesOfFile(image)
	if err != nil {
		return "", false, fmt.Errorf("listing the loop devices of %s: %w", image, err)
	}
	mounts, err := mtab.All()
	if err != nil {
		return "", false, fmt.Errorf("reading the mount table: %w", err)
	}
	for _, dev := range bound {
		for _, m := range mounts {
			if m.Source == dev {
				return "", false, fmt.Errorf("image %s is already mounted at %s (through %s)", image, m.Mountpoint, dev)
			}
		}
		klog.InfoS("Reusing loop device still bound to the image", "device", dev, "image", image)
		return dev, false, nil
	}
	d, err := loop.Attach(ctx, image, false)
	if err != nil {
		return "", false, fmt.Errorf("attaching %s: %w", image, err)
	}
	return d.Path, true, nil
}

// sharedDevice returns the loop device bound to image, which another
// process (in this mount namespace or another) may have mounted, or a new
// one (attached true). Two devices bound to it are refused: mounting
// either would put a second superblock over a file the first may be
// writing through.
//
// Devices are found by inode, not by path: the process that bound one may
// have seen the directory at another path (another pod's hostPath, a bind
// mount), and missing its device would attach a second one.
func sharedDevice(ctx context.Context, image string) (dev string, attached bool, err error) {
	bound, err := loop.DevicesOfFile(image)
	if err != nil {
		return "", false, fmt.Errorf("listing the loop devices of %s: %w", image, err)
	}
	switch len(bound) {
	case 0:
		d, err := loop.Attach(ctx, image, false)
		if err != nil {
			return "", false, fmt.Errorf("attaching %s: %w", image, err)
		}
		return d.Path, true, nil
	case 1:
		klog.InfoS("Mounting the loop device already bound to the image", "device", bound[0], "image", image)
		return bound[0], false, nil
	}
	return "", false, fmt.Errorf("image %s is bound to %d loop devices (%v): mounting one could corrupt the filesystem another holds; "+
		"unmount the filesystem of all but one of them and detach those (losetup -d)", image, len(bound), bound)
}

// mountAt returns the mount visible at path (absolute, free of symlinks), or nil.
func mountAt(path string) (*mtab.Mount, error) {
	all, err := mtab.All()
	if err != nil {
		return nil, fmt.Errorf("reading the mount table: %w", err)
	}
	return mtab.TopAt(all, path), nil
}

// mountedFrom returns a mount point of dev, or "".
func mountedFrom(dev string) (string, error) {
	mounts, err := mtab.All()
	if err != nil {
		return "", fmt.Errorf("reading the mount table: %w", err)
	}
	for _, m := range mounts {
		if m.Source == dev {
			return m.Mountpoint, nil
		}
	}
	return "", nil
}
