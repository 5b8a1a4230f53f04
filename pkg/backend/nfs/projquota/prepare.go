package projquota

import (
	"context"
	"errors"
	"fmt"
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

const (
	// ImageName is the pool image Prepare keeps in its directory.
	ImageName = "export-pool.img"
	// MountDirName is where Prepare mounts the image, inside its directory.
	MountDirName = "pool"
	lockName     = ".export-pool.lock"
)

// ErrNoKernelQuota is returned (wrapped) by Prepare when the running
// kernel's xfs mounts the image without options but refuses prjquota: it
// was built without CONFIG_XFS_QUOTA, and no pool can have limits on it.
var ErrNoKernelQuota = errors.New("this kernel's xfs has no quota support (CONFIG_XFS_QUOTA is not set), so project quotas cannot be enforced")

// Prepare makes dir usable as a pool when the operator has no prjquota xfs
// filesystem: it keeps a sparse image file dir/export-pool.img of imageSize
// bytes (made and formatted with mkfs.xfs on first use; an existing image is
// reused as it is, never reformatted or resized), attaches it to a loop
// device and mounts it with -o prjquota at dir/pool. A pool already mounted
// there from the image, or an image still attached to a loop device from an
// interrupted start, is reused, so Prepare is idempotent across restarts.
//
// The returned release unmounts the pool and detaches the loop device (for
// tests and clean shutdown); it is safe to call more than once. If dir is
// itself a prjquota xfs mount point, Prepare just Opens it and release does
// nothing.
//
// Calls for the same dir are serialized by a lock file in it, also between
// processes.
func Prepare(ctx context.Context, dir string, imageSize int64) (*Pool, func() error, error) {
	noop := func() error { return nil }
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("projquota: %w", err)
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, nil, fmt.Errorf("projquota: %w", err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return nil, nil, fmt.Errorf("projquota: %w", err)
	}
	if m, err := mountAt(real); err != nil {
		return nil, nil, fmt.Errorf("projquota: reading %s: %w", mountInfoPath, err)
	} else if m != nil && m.FSType == "xfs" && hasProjectQuota(mtab.SuperOptions(m)) {
		pool, err := Open(real)
		if err != nil {
			return nil, nil, err
		}
		return pool, noop, nil
	} else if m != nil && m.FSType == "xfs" {
		klog.InfoS("Export root is an xfs mount point without project quotas; keeping a pool image in it instead (mount it with -o prjquota to use it directly)",
			"dir", real, "options", strings.Join(mtab.SuperOptions(m), ","))
	}

	unlock, err := lockDir(ctx, filepath.Join(real, lockName))
	if err != nil {
		return nil, nil, err
	}
	defer unlock()

	image := filepath.Join(real, ImageName)
	mnt := filepath.Join(real, MountDirName)
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return nil, nil, fmt.Errorf("projquota: %w", err)
	}

	// Mounted already (by an earlier run of this process or another one)?
	if m, err := mountAt(mnt); err != nil {
		return nil, nil, fmt.Errorf("projquota: reading %s: %w", mountInfoPath, err)
	} else if m != nil {
		ours := false
		if loop.ValidDevice(m.Source) {
			// The pool image there now, by inode: a mount left from a pool
			// image since deleted and made again is not this pool.
			if ours, err = loop.BoundTo(m.Source, image); err != nil {
				return nil, nil, fmt.Errorf("projquota: %w", err)
			}
		}
		if !ours {
			return nil, nil, fmt.Errorf("projquota: %s is already mounted from %s, not from the pool image %s", mnt, m.Source, image)
		}
		pool, err := Open(mnt)
		if err != nil {
			return nil, nil, err
		}
		klog.InfoS("Reusing mounted NFS pool", "mountPoint", mnt, "device", m.Source, "image", image)
		return pool, releaser(mnt, m.ID, m.Source, image), nil
	}

	created, err := ensureImage(ctx, image, imageSize)
	if err != nil {
		return nil, nil, err
	}
	dev, err := attachImage(ctx, image)
	if err != nil {
		return nil, nil, err
	}
	detach := func() {
		if _, err := loop.DetachIfBackedBy(context.WithoutCancel(ctx), dev, image); err != nil {
			klog.ErrorS(err, "Detaching the pool image after a failed mount", "device", dev, "image", image)
		}
	}
	if err := mountPool(dev, mnt); err != nil {
		detach()
		return nil, nil, err
	}
	m, err := mountAt(mnt)
	if err == nil && (m == nil || m.Source != dev) {
		err = fmt.Errorf("%s is not mounted from %s right after mounting it", mnt, dev)
	}
	if err != nil {
		_ = unix.Unmount(mnt, 0)
		detach()
		return nil, nil, fmt.Errorf("projquota: %w", err)
	}
	release := releaser(mnt, m.ID, dev, image)
	pool, err := Open(mnt)
	if err != nil {
		_ = release()
		return nil, nil, err
	}
	klog.InfoS("Mounted NFS pool", "mountPoint", mnt, "device", dev, "image", image, "formatted", created)
	return pool, release, nil
}

// lockDir takes an exclusive flock on path, waiting until ctx is done.
func lockDir(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("projquota: %w", err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { _ = f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("projquota: locking %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("projquota: waiting for the lock %s: %w", path, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// ensureImage makes the image if it does not exist yet. The new image is
// built under a temporary name and renamed into place only once formatted,
// so an image file that exists is always a formatted one, and reusing it
// unformatted after a crash can't happen.
func ensureImage(ctx context.Context, image string, size int64) (created bool, err error) {
	st, err := os.Lstat(image)
	if err == nil {
		if !st.Mode().IsRegular() {
			return false, fmt.Errorf("projquota: pool image %s is not a regular file", image)
		}
		if size > 0 && st.Size() < size {
			klog.InfoS("Pool image is smaller than asked for; it is reused as it is, not grown", "image", image, "size", st.Size(), "asked", size)
		}
		return false, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return false, fmt.Errorf("projquota: %w", err)
	}
	if size <= 0 {
		return false, fmt.Errorf("projquota: pool image %s does not exist and no image size was given to create it", image)
	}
	tmp := image + ".new"
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return false, fmt.Errorf("projquota: %w", err)
	}
	fail := func(err error) (bool, error) {
		f.Close()
		_ = os.Remove(tmp)
		return false, err
	}
	if err := f.Truncate(size); err != nil {
		return fail(fmt.Errorf("projquota: sizing %s: %w", tmp, err))
	}
	if _, err := command.Run(ctx, "mkfs.xfs", "-q", tmp); err != nil {
		return fail(fmt.Errorf("projquota: %w", err))
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("projquota: %w", err))
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(tmp)
		return false, fmt.Errorf("projquota: %w", err)
	}
	if err := os.Rename(tmp, image); err != nil {
		_ = os.Remove(tmp)
		return false, fmt.Errorf("projquota: %w", err)
	}
	if d, err := os.Open(filepath.Dir(image)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return true, nil
}

// attachImage returns a loop device bound to image: one left bound and
// unmounted by an interrupted earlier start, or a new one.
func attachImage(ctx context.Context, image string) (string, error) {
	// This image, not a deleted one of its name.
	attached, err := loop.DevicesOf(image)
	if err != nil {
		return "", fmt.Errorf("projquota: listing the loop devices of %s: %w", image, err)
	}
	mounts, err := mtab.All()
	if err != nil {
		return "", fmt.Errorf("projquota: reading %s: %w", mountInfoPath, err)
	}
	for _, dev := range attached {
		for _, m := range mounts {
			if m.Source == dev {
				return "", fmt.Errorf("projquota: pool image %s is already mounted at %s (through %s)", image, m.Mountpoint, dev)
			}
		}
		klog.InfoS("Reusing loop device still bound to the pool image", "device", dev, "image", image)
		return dev, nil
	}
	dev, err := loop.Attach(ctx, image, false)
	if err != nil {
		return "", fmt.Errorf("projquota: attaching %s: %w", image, err)
	}
	return dev.Path, nil
}

// mountPool mounts dev at mnt with project quotas. nodev and nosuid: the
// pool holds files NFS clients wrote, which the server itself never needs
// to treat as devices or setuid programs.
func mountPool(dev, mnt string) error {
	const flags = unix.MS_NODEV | unix.MS_NOSUID
	err := unix.Mount(dev, mnt, "xfs", flags, "prjquota")
	if err == nil {
		return nil
	}
	if errors.Is(err, unix.EINVAL) {
		// Tell a kernel without xfs quota support from a bad image: the
		// former mounts without the option. norecovery, read-only: the
		// probe changes nothing on the image.
		if perr := unix.Mount(dev, mnt, "xfs", flags|unix.MS_RDONLY, "norecovery"); perr == nil {
			_ = unix.Unmount(mnt, 0)
			return fmt.Errorf("projquota: mount -t xfs -o prjquota %s %s: %v: %w", dev, mnt, err, ErrNoKernelQuota)
		}
	}
	return fmt.Errorf("projquota: mount -t xfs -o prjquota %s %s: %w (the kernel log, dmesg, tells why)", dev, mnt, err)
}

// releaser unmounts mnt, but only while the mount there is still the one
// Prepare found or made (same mount id and device), and then detaches dev
// if it is still bound to image. It can be called again after an error.
func releaser(mnt string, mountID int, dev, image string) func() error {
	var mu sync.Mutex
	done := false
	return func() error {
		mu.Lock()
		defer mu.Unlock()
		if done {
			return nil
		}
		m, err := mountAt(mnt)
		if err != nil {
			return fmt.Errorf("projquota: reading %s: %w", mountInfoPath, err)
		}
		if m != nil && m.ID == mountID && m.Source == dev {
			if err := unix.Unmount(mnt, 0); err != nil && !errors.Is(err, unix.EINVAL) {
				return fmt.Errorf("projquota: unmounting %s: %w", mnt, err)
			}
		}
		if still, err := mountedFrom(dev); err != nil {
			return err
		} else if still != "" {
			// Mounted somewhere else too (a bind mount): leave it bound.
			done = true
			return nil
		}
		if _, err := loop.DetachIfBackedBy(context.Background(), dev, image); err != nil {
			return fmt.Errorf("projquota: detaching %s: %w", dev, err)
		}
		done = true
		return nil
	}
}

// mountedFrom returns a mount point of dev, or "".
func mountedFrom(dev string) (string, error) {
	mounts, err := mtab.All()
	if err != nil {
		return "", fmt.Errorf("projquota: reading %s: %w", mountInfoPath, err)
	}
	for _, m := range mounts {
		if m.Source == dev {
			return m.Mountpoint, nil
		}
	}
	return "", nil
}

// KernelSupportsQuota reports whether the running kernel's xfs can enforce
// quotas: only a kernel built with CONFIG_XFS_QUOTA registers
// /proc/fs/xfs/xqmstat. It lets a caller choose another way to limit sizes
// without first building and mounting a pool image to find out.
func KernelSupportsQuota() bool {
	_, err := os.Stat("/proc/fs/xfs/xqmstat")
	return err == nil
}
