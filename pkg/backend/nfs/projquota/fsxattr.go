package projquota

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// golang.org/x/sys/unix has neither struct fsxattr nor the
// FS_IOC_FSGETXATTR / FS_IOC_FSSETXATTR request numbers, so they are spelled
// out here from <linux/fs.h>.

// fsxattr is struct fsxattr (28 bytes).
type fsxattr struct {
	Xflags     uint32
	Extsize    uint32
	Nextents   uint32
	Projid     uint32
	Cowextsize uint32
	Pad        [8]byte
}

const (
	// _IOR('X', 31, struct fsxattr) and _IOW('X', 32, struct fsxattr) in the
	// generic ioctl encoding used by amd64, arm64, riscv64, s390x, 386 and
	// arm (not by mips, powerpc, sparc or alpha).
	fsIocFSGetXattr = 2<<30 | uintptr(unsafe.Sizeof(fsxattr{}))<<16 | 'X'<<8 | 31
	fsIocFSSetXattr = 1<<30 | uintptr(unsafe.Sizeof(fsxattr{}))<<16 | 'X'<<8 | 32

	// fsXflagProjInherit (FS_XFLAG_PROJINHERIT) makes everything created in
	// a directory inherit its project id.
	fsXflagProjInherit = 0x00000200
)

func getFsxattr(fd uintptr) (fsxattr, error) {
	var x fsxattr
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, fd, fsIocFSGetXattr, uintptr(unsafe.Pointer(&x))); errno != 0 {
		return x, errno
	}
	return x, nil
}

func setFsxattr(fd uintptr, x *fsxattr) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, fd, fsIocFSSetXattr, uintptr(unsafe.Pointer(x))); errno != 0 {
		return errno
	}
	return nil
}

// openNoFollow opens path for an ioctl without following a symlink in its
// last element and without blocking on a FIFO.
func openNoFollow(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
}

// projectOf returns the project id of path and whether it has the
// project-inherit flag.
func projectOf(path string) (id uint32, inherit bool, err error) {
	f, err := openNoFollow(path)
	if err != nil {
		return 0, false, err
	}
	defer f.Close()
	x, err := getFsxattr(f.Fd())
	if err != nil {
		return 0, false, fmt.Errorf("FS_IOC_FSGETXATTR on %s: %w", path, err)
	}
	return x.Projid, x.Xflags&fsXflagProjInherit != 0, nil
}

// setProject gives path the project id; a directory also gets the
// project-inherit flag, so that what is created in it later inherits the id.
func setProject(path string, id uint32) error {
	f, err := openNoFollow(path)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	x, err := getFsxattr(f.Fd())
	if err != nil {
		return fmt.Errorf("FS_IOC_FSGETXATTR on %s: %w", path, err)
	}
	want := x
	want.Projid = id
	if st.IsDir() {
		want.Xflags |= fsXflagProjInherit
	}
	if want == x {
		return nil
	}
	if err := setFsxattr(f.Fd(), &want); err != nil {
		return fmt.Errorf("FS_IOC_FSSETXATTR (project %d) on %s: %w", id, path, err)
	}
	return nil
}

// setProjectTree gives every directory and regular file under root
// (root included) the project id. Symlinks, devices, FIFOs and sockets
// cannot be opened for the ioctl and are left alone, as `xfs_quota -c
// 'project -s'` does; inside a directory that already had the id and the
// inherit flag when they were created they carry the id anyway.
func setProjectTree(root string, id uint32) error {
	return filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsDir() && !d.Type().IsRegular() {
			return nil
		}
		if err := setProject(path, id); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil
			}
			return err
		}
		return nil
	})
}
