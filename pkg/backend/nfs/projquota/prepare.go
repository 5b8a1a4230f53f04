package projquota

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/keptfs"

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
// processes. Keeping the image mounted is package keptfs's; the pool owns
// its filesystem (no other process mounts it).
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

	fs, err := keptfs.Keep(ctx, keptfs.Spec{
		Dir: real, Image: ImageName, MountDir: MountDirName, Lock: lockName,
		Size: imageSize, Filesystem: keptfs.XFS, Mount: mountPool, What: "NFS pool",
	})
	if err != nil {
		return nil, nil, fmt.Errorf("projquota: %w", err)
	}
	pool, err := Open(fs.Root)
	if err != nil {
		_ = fs.Release()
		return nil, nil, err
	}
	return pool, fs.Release, nil
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
			return fmt.Errorf("mount -t xfs -o prjquota %s %s: %v: %w", dev, mnt, err, ErrNoKernelQuota)
		}
	}
	return fmt.Errorf("mount -t xfs -o prjquota %s %s: %w (the kernel log, dmesg, tells why)", dev, mnt, err)
}

// KernelSupportsQuota reports whether the running kernel's xfs can enforce
// quotas: only a kernel built with CONFIG_XFS_QUOTA registers
// /proc/fs/xfs/xqmstat. It lets a caller choose another way to limit sizes
// without first building and mounting a pool image to find out.
func KernelSupportsQuota() bool {
	_, err := os.Stat("/proc/fs/xfs/xqmstat")
	return err == nil
}
