package block

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/command"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	mount "k8s.io/mount-utils"
)

// Filesystems the node can format and grow; anything else would need tools
// the image does not ship.
const (
	fsExt4      = "ext4"
	fsXFS       = "xfs"
	defaultFs   = fsExt4
	sectorBytes = 512 // unit of stat's Blocks, whatever the filesystem's block size
)

func fsOrDefault(fsType string) string {
	if fsType == "" {
		return defaultFs
	}
	return fsType
}

// outstanding is what a volume may still take from its pool: the part of
// its capacity its sparse image has not allocated yet.
func outstanding(capacity, allocated int64) int64 {
	if d := capacity - allocated; d > 0 {
		return d
	}
	return 0
}

// spare is what a pool can promise a new volume: the free space minus
// everything already promised to existing volumes and to operations in
// flight, never negative.
func spare(free int64, promised []int64, reserved int64) int64 {
	left := free - reserved
	for _, p := range promised {
		left -= p
	}
	if left < 0 {
		return 0
	}
	return left
}

// freeBytes is what an unprivileged writer could still store in dir.
// Bavail rather than Bfree: promising volumes the filesystem's root reserve
// would leave the pool's host without its safety margin.
// In a kept pool (keptpool.go) it is the lesser of the kept filesystem's
// free space and that of the filesystem under its sparse image: as large
// as that filesystem, the kept one would promise space other files there
// took.
func freeBytes(dir string) (int64, error) {
	_, free, err := poolSpace(dir)
	return free, err
}

// poolSpace is the total size of dir's filesystem and, as freeBytes, what an
// unprivileged writer could still store there.
func poolSpace(dir string) (size, free int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, err
	}
	size, free = int64(st.Blocks)*int64(st.Bsize), int64(st.Bavail)*int64(st.Bsize)
	if outer := keptOuter(dir); outer != "" {
		var ost unix.Statfs_t
		if err := unix.Statfs(outer, &ost); err != nil {
			return 0, 0, err
		}
		free = min(free, int64(ost.Bavail)*int64(ost.Bsize))
	}
	return size, free, nil
}

// allocatedBytes is the space a file really occupies; an absent file
// occupies nothing.
func allocatedBytes(path string) (int64, error) {
	fi, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fi.Size(), nil
	}
	return st.Blocks * sectorBytes, nil
}

// tempName reserves a temporary file next to final, so the rename that
// publishes it stays within one filesystem and is atomic.
func tempName(final string) (string, error) {
	f, err := os.CreateTemp(filepath.Dir(final), "."+filepath.Base(final)+tempMarker+"*")
	if err != nil {
		return "", err
	}
	name := f.Name()
	if err := f.Close(); err != nil {
		os.Remove(name)
		return "", err
	}
	return name, nil
}

// copyImage copies src over dst sharing extents where the filesystem can
// (reflink on xfs and btrfs) and keeping holes everywhere else, so copies of
// mostly empty volumes stay cheap.
func copyImage(ctx context.Context, src, dst string) error {
	if _, err := command.Run(ctx, "cp", "--reflink=auto", "--sparse=always", "--", src, dst); err != nil {
		if strings.Contains(err.Error(), "No space left on device") {
			return status.Errorf(codes.ResourceExhausted, "copying %s: %v", filepath.Base(src), err)
		}
		return status.Errorf(codes.Internal, "copying %s: %v", filepath.Base(src), err)
	}
	return nil
}

// growAndSync makes path at least size bytes long (holes only, no blocks
// allocated) and forces its data and size to disk.
func growAndSync(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	fi, err := f.Stat()
	if err == nil && fi.Size() < size {
		err = f.Truncate(size)
	}
	if err == nil {
		err = f.Chmod(0o600)
	}
	if err == nil {
		err = fsutil.SyncFile(f)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// mkfs formats an image file in place.
func mkfs(ctx context.Context, fsType, image string) error {
	var args []string
	switch fsType {
	case fsExt4:
		// -m0: a volume belongs to one workload; root's reserve would only
		// hide space from it.
		args = []string{"-F", "-q", "-m0", image}
	case fsXFS:
		args = []string{"-f", "-q", image}
	default:
		return status.Errorf(codes.InvalidArgument, "cannot format %q", fsType)
	}
	if _, err := command.Run(ctx, "mkfs."+fsType, args...); err != nil {
		return status.Errorf(codes.Internal, "formatting new volume as %s: %v", fsType, err)
	}
	return nil
}

// growExt4Offline grows the unmounted ext4 filesystem whose superblock is
// sb to fill its device, and does nothing (not even the forced check) when
// it already does. grown says it changed the filesystem.
func growExt4Offline(ctx context.Context, dev string, sb ext4Super) (grown bool, err error) {
	devBytes, err := loop.Size(dev)
	if err != nil {
		return false, err
	}
	blockCount, blockSize := sb.blockCount(), sb.blockSize()
	if blockCount*blockSize+blockSize > devBytes {
		return false, nil
	}
	// resize2fs insists on a freshly checked filesystem. Exit status 1
	// means e2fsck fixed something and the filesystem is now consistent.
	if _, err := command.Run(ctx, "e2fsck", "-f", "-p", dev); err != nil {
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 {
			return false, err
		}
	}
	if _, err := command.Run(ctx, "resize2fs", dev); err != nil {
		return false, err
	}
	klog.InfoS("Grew ext4 filesystem to fill its device", "device", dev, "fromBytes", blockCount*blockSize, "toBytes", devBytes)
	return true, nil
}

// errNoReflink: the pool's filesystem cannot share extents between files.
var errNoReflink = errors.New("the pool's filesystem cannot clone files (no reflink)")

// cloneImage makes dst (an existing, empty file) share every extent of src
// with one FICLONE: an instant copy that is a single point in time, since
// the kernel flushes src's dirty pages and holds its lock while it clones.
// It answers errNoReflink where the pool's filesystem has no reflinks
// (ext4, tmpfs; xfs made with reflink=0). dst is not synced here: every
// caller's image goes on to completeVolume or completeSnapshot, whose
// growAndSync makes it durable before it is published, and a sync here
// as well would cost every create from a template or a source one more
// commit of the pool's filesystem.
func cloneImage(src, dst string) error {
	err := betweenFiles(src, dst, func(in, out *os.File) error {
		return unix.IoctlFileClone(int(out.Fd()), int(in.Fd()))
	})
	switch {
	case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOTTY), errors.Is(err, unix.EXDEV),
		errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
		return errNoReflink
	}
	return err
}

// betweenFiles opens src to read and dst, an existing file, to write, has
// f copy between them and closes both, reporting f's error or else a
// failed close of dst (where a write may report itself).
func betweenFiles(src, dst string, f func(in, out *os.File) error) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	err = f(in, out)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}

// replayJournal mounts a copied filesystem read-write once and unmounts it,
// so the kernel replays its journal (ext4) or log (xfs) as it would after a
// crash. A copy of a volume in use is crash-consistent: what was fsync'd
// may sit only in the journal, and a read-only mount could never replay it.
// An image without a filesystem (never staged, raw block) has nothing to
// replay. The mount point is a temporary directory of the pool, which
// NewController unmounts and removes should the controller die here; the
// loop device mount makes is released by the unmount (autoclear).
func replayJournal(ctx context.Context, mounter *mount.SafeFormatAndMount, image string) error {
	fsType, err := mounter.GetDiskFormat(image)
	if err != nil {
		return fmt.Errorf("probing the filesystem of %s: %w", filepath.Base(image), err)
	}
	opts := []string{"loop"}
	switch fsType {
	case "":
		return nil
	case fsExt4:
	case fsXFS:
		// The copy has its source's UUID, which may be mounted here.
		opts = append(opts, "nouuid")
	default:
		return fmt.Errorf("%s holds a %s filesystem, which this backend does not make", filepath.Base(image), fsType)
	}
	dir, err := os.MkdirTemp(filepath.Dir(image), "."+filepath.Base(image)+replayMarker+tempMarker)
	if err != nil {
		return err
	}
	defer os.Remove(dir)
	if err := mounter.Mount(image, dir, fsType, opts); err != nil {
		return fmt.Errorf("mounting %s to replay its journal: %w", filepath.Base(image), err)
	}
	if err := mounter.Unmount(dir); err != nil {
		return fmt.Errorf("unmounting %s after replaying its journal: %w", filepath.Base(image), err)
	}
	klog.V(4).InfoS("Replayed the journal of a copied filesystem", "image", image, "fsType", fsType)
	return nil
}
