package block

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A pool on btrfs keeps its volumes' images in a subvolume of their own
// (DIR/volumes), made when the pool is. One read-only snapshot of that
// subvolume holds every image as it was at the commit of one transaction:
// a single instant for all of them, which is what a group snapshot of
// volumes being written needs (group.go). Single snapshots and clones are
// reflinks there, as on xfs.
//
// The three ioctls are called directly rather than through btrfs(8): they
// are the whole of what is needed, and the driver's image then needs no
// btrfs-progs.

const (
	btrfsIoctlMagic = 0x94
	// BTRFS_PATH_NAME_MAX + 1 and BTRFS_SUBVOL_NAME_MAX + 1 (linux/btrfs.h).
	btrfsPathNameLen   = 4088
	btrfsSubvolNameLen = 4040
	// btrfsSubvolReadOnly is BTRFS_SUBVOL_RDONLY.
	btrfsSubvolReadOnly = 1 << 1
	// btrfsSubvolumeInode is the inode number of every subvolume's root
	// directory (BTRFS_FIRST_FREE_OBJECTID).
	btrfsSubvolumeInode = 256
	// fsNoCOWFlag is FS_NOCOW_FL (linux/fs.h).
	fsNoCOWFlag = 0x00800000
)

// btrfsVolArgs is struct btrfs_ioctl_vol_args.
type btrfsVolArgs struct {
	fd   int64
	name [btrfsPathNameLen]byte
}

// btrfsVolArgsV2 is struct btrfs_ioctl_vol_args_v2.
type btrfsVolArgsV2 struct {
	fd      int64
	transid uint64
	flags   uint64
	unused  [4]uint64
	name    [btrfsSubvolNameLen]byte
}

// iow is the kernel's _IOW.
func iow(nr, size uintptr) uintptr {
	return 1<<30 | size<<16 | btrfsIoctlMagic<<8 | nr
}

var (
	btrfsIocSubvolCreate  = iow(14, unsafe.Sizeof(btrfsVolArgs{}))
	btrfsIocSnapDestroy   = iow(15, unsafe.Sizeof(btrfsVolArgs{}))
	btrfsIocSnapCreateV2  = iow(23, unsafe.Sizeof(btrfsVolArgsV2{}))
	errNotBtrfsSubvolume  = errors.New("not a btrfs subvolume")
	errBtrfsNameTooLong   = errors.New("btrfs subvolume name too long")
	errBtrfsNameWithSlash = errors.New("btrfs subvolume name with a slash")
)

// onBtrfs says whether path lies on btrfs.
func onBtrfs(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, err
	}
	return st.Type == unix.BTRFS_SUPER_MAGIC, nil
}

// isSubvolume says whether dir is the root of a btrfs subvolume.
func isSubvolume(dir string) (bool, error) {
	btrfs, err := onBtrfs(dir)
	if err != nil || !btrfs {
		return false, err
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return false, err
	}
	return st.Ino == btrfsSubvolumeInode, nil
}

func btrfsName(name string, room int) ([]byte, error) {
	if len(name) >= room {
		return nil, errBtrfsNameTooLong
	}
	if filepath.Base(name) != name || name == "." || name == ".." {
		return nil, errBtrfsNameWithSlash
	}
	return []byte(name), nil
}

// btrfsIoctl calls an ioctl on the directory dir.
func btrfsIoctl(dir string, req uintptr, arg unsafe.Pointer) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, d.Fd(), req, uintptr(arg)); errno != 0 {
		return errno
	}
	return nil
}

// createSubvolume makes parent/name an empty subvolume.
func createSubvolume(parent, name string) error {
	n, err := btrfsName(name, btrfsPathNameLen)
	if err != nil {
		return err
	}
	var args btrfsVolArgs
	copy(args.name[:], n)
	if err := btrfsIoctl(parent, btrfsIocSubvolCreate, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("creating btrfs subvolume %s: %w", filepath.Join(parent, name), err)
	}
	return nil
}

// snapshotSubvolume makes parent/name a read-only snapshot of the
// subvolume src, as of one transaction's commit.
func snapshotSubvolume(src, parent, name string) error {
	if ok, err := isSubvolume(src); err != nil {
		return err
	} else if !ok {
		return fmt.Errorf("%s: %w", src, errNotBtrfsSubvolume)
	}
	n, err := btrfsName(name, btrfsSubvolNameLen)
	if err != nil {
		return err
	}
	s, err := os.Open(src)
	if err != nil {
		return err
	}
	defer s.Close()
	args := btrfsVolArgsV2{fd: int64(s.Fd()), flags: btrfsSubvolReadOnly}
	copy(args.name[:], n)
	if err := btrfsIoctl(parent, btrfsIocSnapCreateV2, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("snapshotting btrfs subvolume %s at %s: %w", src, filepath.Join(parent, name), err)
	}
	return nil
}

// deleteSubvolume removes the subvolume parent/name (its space is freed
// by the filesystem in the background); an absent one is fine.
func deleteSubvolume(parent, name string) error {
	n, err := btrfsName(name, btrfsPathNameLen)
	if err != nil {
		return err
	}
	if ok, err := isSubvolume(filepath.Join(parent, name)); errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	} else if !ok {
		return fmt.Errorf("%s: %w", filepath.Join(parent, name), errNotBtrfsSubvolume)
	}
	var args btrfsVolArgs
	copy(args.name[:], n)
	if err := btrfsIoctl(parent, btrfsIocSnapDestroy, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("deleting btrfs subvolume %s: %w", filepath.Join(parent, name), err)
	}
	return nil
}

// setNoCOW turns off copy-on-write for the files that will be made in the
// empty directory dir (they inherit it): the images are written with
// O_DIRECT through loop devices, which on checksummed btrfs data can store
// a checksum of a page the writer changed in flight. Reflinks and
// snapshots still share extents; a shared extent is copied once when
// written.
func setNoCOW(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	flags, err := unix.IoctlGetUint32(int(d.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		return fmt.Errorf("reading the attributes of %s: %w", dir, err)
	}
	if err := unix.IoctlSetPointerInt(int(d.Fd()), unix.FS_IOC_SETFLAGS, int(flags|fsNoCOWFlag)); err != nil {
		return fmt.Errorf("turning off copy-on-write in %s: %w", dir, err)
	}
	return nil
}
