package block

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/keptfs"
)

// How a --block-pool directory becomes the directory volumes live in (the
// pool root), chosen per process with --block-pool-filesystem.
const (
	// PoolFilesystemAuto keeps a filesystem with reflinks in a pool
	// directory whose own filesystem has none (ext4, tmpfs, xfs made with
	// reflink=0), so that a snapshot or clone of a volume in use is one
	// FICLONE there too: a btrfs where the kernel has btrfs and
	// mkfs.btrfs is installed, since it also takes a group snapshot of
	// volumes being written at one instant, and an xfs with reflinks
	// otherwise. A directory that holds a kept image already keeps
	// whichever of the two it holds, so a pool made before stays what it
	// is. A directory that has reflinks, that already holds a pool of its
	// own, or whose filesystem is too small stays the pool root itself.
	PoolFilesystemAuto = "auto"
	// PoolFilesystemBtrfs keeps a btrfs in a pool directory whose own
	// filesystem is not btrfs, so that the pool gets btrfs's layout
	// (layOutOnBtrfs) and a group snapshot of volumes being written is of
	// one instant; a snapshot of one volume in use is one clone there too.
	// A directory on btrfs, or one that already holds a pool of its own or
	// is too small, stays the pool root itself.
	PoolFilesystemBtrfs = "btrfs"
	// PoolFilesystemXFS keeps an xfs with reflinks where auto would keep
	// one, also where a btrfs could be kept: snapshots and clones of
	// volumes in use, but no group snapshot of several volumes being
	// written.
	PoolFilesystemXFS = "xfs"
	// PoolFilesystemDirect uses every pool directory as the pool root.
	PoolFilesystemDirect = "direct"
)

// keptFilesystems is what each filesystem a pool keeps gives, for logs and
// errors.
var keptFilesystems = map[string]string{
	keptfs.XFS:   "an xfs with reflinks",
	keptfs.Btrfs: "a btrfs",
}

// choiceKeeping is the --block-pool-filesystem value that keeps only fs.
func choiceKeeping(fs string) string {
	switch fs {
	case keptfs.XFS:
		return PoolFilesystemXFS
	case keptfs.Btrfs:
		return PoolFilesystemBtrfs
	}
	return ""
}

// KeptPoolFilesystem is the --block-pool-filesystem value that keeps only
// the filesystem the kept image in the pool directory dir holds (auto
// fits either).
func KeptPoolFilesystem(dir string) (string, error) {
	image := filepath.Join(dir, KeptImageName)
	fs, err := keptfs.FilesystemOf(image)
	if err != nil {
		return "", err
	}
	if choice := choiceKeeping(fs); choice != "" {
		return choice, nil
	}
	return "", &keptfs.OtherFilesystemError{Image: image, Want: keptfs.XFS + " or " + keptfs.Btrfs}
}

const (
	// KeptImageName is the sparse image (xfs or btrfs) a kept pool lives
	// in, in the pool directory.
	KeptImageName = "kept-pool.img"
	// KeptMountDir is where the kept image is mounted, in the pool
	// directory: the pool root of a kept pool.
	KeptMountDir = "kept"
	keptLockName = ".kept-pool.lock"
)

// KeptPools is what KeepPools made of the pool directories.
type KeptPools struct {
	// Roots are the pool roots by zone, for NewController, NewNode and
	// NewNetworkNode.
	Roots map[string]string
	kept  []*keptfs.FS
	// shared are the roots whose syncs are shared (shareSyncs).
	shared []string
}

// Release gives up this process's use of the kept filesystems (clean
// shutdown, tests): the last process of the machine to use one unmounts
// it, and its loop device then detaches itself. Safe to call again.
func (k *KeptPools) Release() error {
	var errs []error
	for _, root := range k.shared {
		errs = append(errs, fsutil.UnshareSyncsUnder(root))
	}
	k.shared = nil
	for _, fs := range k.kept {
		errs = append(errs, fs.Release())
	}
	return errors.Join(errs...)
}

// KeepPools turns the pool directories (zone -> directory, as
// --block-pool gives them) into pool roots, the same way in every process
// that uses them (controller, storage target, node plugin), so that they
// all find the same volumes:
//
//   - direct: every directory is its own root, unless it holds a kept
//     image: then the zone's volumes are in there, and using the
//     directory instead would hide them, so it is refused.
//   - xfs: a directory that holds a kept image (KeptImageName) gets it
//     mounted at KeptMountDir (made by whichever process came first,
//     reused by the others: see package keptfs), which is then the root.
//     Otherwise a directory whose filesystem has reflinks, that already
//     holds volumes or snapshots (a pool made before, kept direct so they
//     stay where they are), or whose filesystem is smaller than xfs's
//     minimum, is its own root; any other gets a new kept image as large
//     as its filesystem (sparse: it costs what is written to it).
//   - btrfs: as xfs, with a btrfs kept rather than an xfs, and a
//     directory on btrfs (rather than one with reflinks) as its own root.
//     A kept image of the other filesystem is refused by both: it is
//     never formatted again, and the error names the value that fits it.
//   - auto: as xfs, with a new kept image made a btrfs where this
//     machine can make and mount one (else an xfs), and a kept image
//     mounted as whichever of the two it holds.
//
// What each zone got is logged once. A kept image that cannot be mounted
// is an error: the process must not serve the zone from the directory
// underneath, where its volumes are not.
func KeepPools(ctx context.Context, pools map[string]string, filesystem string) (*KeptPools, error) {
	switch filesystem {
	case PoolFilesystemAuto, PoolFilesystemBtrfs, PoolFilesystemXFS, PoolFilesystemDirect:
	default:
		return nil, fmt.Errorf("--block-pool-filesystem=%q: want %s (keep a btrfs, or an xfs with reflinks where btrfs is missing, where the directory has no reflinks), "+
			"%s (keep a btrfs where the directory is not on btrfs, for group snapshots of volumes being written), "+
			"%s (keep an xfs with reflinks where the directory has none) or %s (use the directories as they are)",
			filesystem, PoolFilesystemAuto, PoolFilesystemBtrfs, PoolFilesystemXFS, PoolFilesystemDirect)
	}
	k := &KeptPools{Roots: map[string]string{}}
	for _, zone := range slices.Sorted(maps.Keys(pools)) {
		root, fs, err := keepPool(ctx, zone, pools[zone], filesystem)
		if err != nil {
			if rerr := k.Release(); rerr != nil {
				klog.ErrorS(rerr, "Releasing the kept pools after a failed start")
			}
			return nil, fmt.Errorf("block pool of zone %s: %w", zone, err)
		}
		k.Roots[zone] = root
		if fs != nil {
			k.kept = append(k.kept, fs)
		}
		if err := k.shareSyncs(zone, root); err != nil {
			if rerr := k.Release(); rerr != nil {
				klog.ErrorS(rerr, "Releasing the kept pools after a failed start")
			}
			return nil, fmt.Errorf("block pool of zone %s: %w", zone, err)
		}
	}
	return k, nil
}

// shareSyncs lets the creations and deletions under a pool root that is a
// filesystem of its own (a kept pool, a disk mounted for the pool) share
// one syncfs each time, rather than flush the disk for every file and
// directory they make durable (fsutil.ShareSyncsUnder): where many are in
// flight at once, that is what their time goes to. A root on a host's
// shared filesystem keeps per-file syncs, since a syncfs there would write
// back everything else on it; a tmpfs has nothing to write back.
func (k *KeptPools) shareSyncs(zone, root string) error {
	own, err := fsutil.IsFilesystemRoot(root)
	if err != nil || !own {
		return err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", root, err)
	}
	if st.Type == unix.TMPFS_MAGIC {
		return nil
	}
	if err := fsutil.ShareSyncsUnder(root); err != nil {
		return err
	}
	k.shared = append(k.shared, root)
	klog.V(2).InfoS("Block pool: creations share their syncs (the pool is a filesystem of its own)", "zone", zone, "root", root)
	return nil
}

// keepPool resolves one zone's pool directory (KeepPools).
func keepPool(ctx context.Context, zone, dir, filesystem string) (string, *keptfs.FS, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", nil, err
	}
	// Made if missing, as the controller's lock makes it: this runs
	// before that lock (a node role in the same process needs the root
	// first), and a fresh directory is where a kept pool starts.
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return "", nil, err
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return "", nil, err
	}
	if fi, err := os.Stat(real); err != nil {
		return "", nil, err
	} else if !fi.IsDir() {
		return "", nil, fmt.Errorf("%s is not a directory", dir)
	}
	direct := func(why string) (string, *keptfs.FS, error) {
		klog.InfoS("Block pool: the directory is the pool root", "zone", zone, "dir", real, "why", why)
		return real, nil, nil
	}
	image := filepath.Join(real, KeptImageName)
	_, err = os.Lstat(image)
	hasImage := err == nil
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", nil, err
	}
	if filesystem == PoolFilesystemDirect {
		if hasImage {
			fits, err := KeptPoolFilesystem(real)
			if err != nil {
				return "", nil, err
			}
			return "", nil, fmt.Errorf("%s holds the kept filesystem of the pool (%s), where the zone's volumes are; "+
				"with --block-pool-filesystem=%s they would not be found: start with --block-pool-filesystem=%s or --block-pool-filesystem=%s",
				real, KeptImageName, PoolFilesystemDirect, PoolFilesystemAuto, fits)
		}
		return direct("--block-pool-filesystem=" + PoolFilesystemDirect)
	}
	// want is the filesystem kept: fixed by the choice; for auto, a new
	// image's is what this machine can make (below), and an image's that
	// exists is whichever it holds (tried as an xfs first: see the retry).
	want := map[string]string{PoolFilesystemXFS: keptfs.XFS, PoolFilesystemBtrfs: keptfs.Btrfs, PoolFilesystemAuto: keptfs.XFS}[filesystem]
	var size int64
	if !hasImage {
		if filesystem == PoolFilesystemBtrfs {
			btrfs, err := onBtrfs(real)
			if err != nil {
				return "", nil, err
			}
			if btrfs {
				return direct("its filesystem is btrfs: a new pool there takes group snapshots at one instant")
			}
		} else {
			reflinks, err := fsutil.HasReflinks(real)
			if err != nil {
				return "", nil, err
			}
			if reflinks {
				return direct("its filesystem has reflinks: a snapshot of a volume in use is one clone")
			}
		}
		if held, err := holdsPool(real); err != nil {
			return "", nil, err
		} else if held {
			return direct("it holds volumes or snapshots of a pool made on it before: they stay there, " +
				"with what the directory's own filesystem gives (without reflinks, a snapshot or clone of a volume attached read-write is refused)")
		}
		var st unix.Statfs_t
		if err := unix.Statfs(real, &st); err != nil {
			return "", nil, fmt.Errorf("statfs %s: %w", real, err)
		}
		size = int64(st.Blocks) * int64(st.Bsize)
		if size < keptfs.MinXFSBytes {
			return direct(fmt.Sprintf("at %d bytes its filesystem is smaller than the %d a kept filesystem needs: "+
				"a snapshot or clone of a volume attached read-write is refused without reflinks", size, keptfs.MinXFSBytes))
		}
		if filesystem == PoolFilesystemAuto {
			want = autoFilesystem(zone, filepath.Join(real, KeptMountDir))
		}
	}
	keep := func(fs string) (*keptfs.FS, error) {
		return keptfs.Keep(ctx, keptfs.Spec{
			Dir: real, Image: KeptImageName, MountDir: KeptMountDir, Lock: keptLockName,
			Size: size, Filesystem: fs, MkfsArgs: keptMkfsArgs(fs, size), Mount: mountKept(fs),
			Shared: true, What: "kept block pool",
		})
	}
	fs, err := keep(want)
	other := (*keptfs.OtherFilesystemError)(nil)
	if errors.As(err, &other) && other.Found != "" && filesystem == PoolFilesystemAuto {
		// The image holds the other filesystem: made before, or just
		// now by another process of the zone whose machine chose
		// otherwise. auto keeps whichever of the two the image holds;
		// Keep refused it before binding or mounting anything.
		want = other.Found
		fs, err = keep(want)
	}
	if errors.As(err, &other) && other.Found != "" {
		return "", nil, fmt.Errorf("%s holds the kept filesystem of the pool (%s), where the zone's volumes are, and it is a %s, "+
			"not the %s that --block-pool-filesystem=%s keeps: a kept image is never formatted again; start with --block-pool-filesystem=%s or --block-pool-filesystem=%s",
			real, KeptImageName, other.Found, want, filesystem, PoolFilesystemAuto, choiceKeeping(other.Found))
	}
	if err != nil {
		if hasImage {
			return "", nil, fmt.Errorf("%s holds the kept filesystem of the pool (%s), where the zone's volumes are, and it cannot be mounted at %s: %w",
				real, KeptImageName, filepath.Join(real, KeptMountDir), err)
		}
		if filesystem == PoolFilesystemBtrfs {
			return "", nil, fmt.Errorf("keeping a btrfs in %s: %w; --block-pool-filesystem=%s keeps an xfs with reflinks instead "+
				"(snapshots of volumes in use, but no group snapshots of several volumes being written), "+
				"and --block-pool-filesystem=%s uses the directory as it is", real, err, PoolFilesystemXFS, PoolFilesystemDirect)
		}
		return "", nil, fmt.Errorf("keeping %s in %s: %w", keptFilesystems[want], real, err)
	}
	klog.InfoS("Block pool: "+keptFilesystems[want]+" kept in the directory is the pool root", "zone", zone, "dir", real,
		"root", fs.Root, "device", fs.Device, "formatted", fs.Formatted, "alreadyMounted", fs.Reused)
	return fs.Root, fs, nil
}

// autoFilesystem is the filesystem auto keeps in a new kept image of zone's
// pool: a btrfs, which takes group snapshots of volumes being written at
// one instant, where this machine can make and mount one; else an xfs
// with reflinks, which takes snapshots of volumes in use but no such
// groups. probe is the (empty) mount point of the image to come.
func autoFilesystem(zone, probe string) string {
	if err := os.MkdirAll(probe, 0o755); err != nil {
		klog.InfoS("Block pool: keeping an xfs with reflinks, without group snapshots of volumes being written", "zone", zone, "btrfs", err)
		return keptfs.XFS
	}
	if err := keptfs.CanMake(keptfs.Btrfs, probe); err != nil {
		klog.InfoS("Block pool: keeping an xfs with reflinks, without group snapshots of volumes being written, since no btrfs can be made here",
			"zone", zone, "btrfs", err)
		return keptfs.XFS
	}
	return keptfs.Btrfs
}

// keptMkfsArgs format a new kept image of size bytes. For btrfs: one copy
// of the metadata (-m single), since a second copy in the same sparse file
// on the same disk guards against nothing and doubles every metadata
// write; data and metadata in one kind of chunk (--mixed) only below
// mixedBelow, where separate chunks run out of one kind while the other
// has room.
func keptMkfsArgs(fs string, size int64) []string {
	if fs == keptfs.XFS {
		return []string{"-m", "reflink=1"}
	}
	args := []string{"-m", "single", "-d", "single"}
	if size < mixedBelow {
		args = append(args, "--mixed")
	}
	return args
}

// mixedBelow is the size under which a kept btrfs mixes data and metadata
// in its chunks.
const mixedBelow = 512 << 20

// mountKept mounts a kept pool's device, of filesystem fs. discard: a
// volume or snapshot deleted in the pool punches its blocks out of the
// sparse image, so the directory underneath gets the space back (on
// btrfs, the synchronous kind rather than its delayed discard=async, so
// the space comes back as soon as the deletion is committed). nodev,
// nosuid: the pool holds images, never device nodes or programs.
func mountKept(fs string) func(dev, mnt string) error {
	return func(dev, mnt string) error {
		if err := unix.Mount(dev, mnt, fs, unix.MS_NODEV|unix.MS_NOSUID, "discard"); err != nil {
			return fmt.Errorf("mount -t %s -o discard %s %s: %w (the kernel log, dmesg, tells why)", fs, dev, mnt, err)
		}
		return nil
	}
}

// holdsPool tells whether dir already holds a pool's volumes or snapshots.
func holdsPool(dir string) (bool, error) {
	for _, sub := range []string{volumesDir, snapshotsDir} {
		entries, err := os.ReadDir(filepath.Join(dir, sub))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return false, err
		}
		if len(entries) > 0 {
			return true, nil
		}
	}
	return false, nil
}

// keptOuter is the directory a kept pool's image lies in when root is a
// kept pool's root, else "": the space a kept pool promises is that of
// both filesystems, the sparse image's and the one under it.
func keptOuter(root string) string {
	if filepath.Base(root) != KeptMountDir {
		return ""
	}
	outer := filepath.Dir(root)
	if _, err := os.Lstat(filepath.Join(outer, KeptImageName)); err != nil {
		return ""
	}
	return outer
}
