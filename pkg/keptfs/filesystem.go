package keptfs

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"

	"golang.org/x/sys/unix"
)

// Where each filesystem's superblock says what it is (the offsets and
// magic numbers blkid reads too).
var superblockMagic = []struct {
	fs     string
	offset int64
	magic  []byte
}{
	{XFS, 0, []byte("XFSB")},
	{Btrfs, 0x10040, []byte("_BHRfS_M")},
}

// FilesystemOf says which filesystem the image holds, XFS or Btrfs, from
// its superblock; "" for neither.
func FilesystemOf(image string) (string, error) {
	f, err := os.Open(image)
	if err != nil {
		return "", err
	}
	defer f.Close()
	for _, sb := range superblockMagic {
		buf := make([]byte, len(sb.magic))
		if _, err := f.ReadAt(buf, sb.offset); err != nil && !errors.Is(err, io.EOF) {
			return "", fmt.Errorf("reading the superblock of %s: %w", image, err)
		}
		if bytes.Equal(buf, sb.magic) {
			return sb.fs, nil
		}
	}
	return "", nil
}

// OtherFilesystemError is Keep's refusal of an image that holds another
// filesystem than the Spec's: it is never mounted as the one asked for,
// nor formatted again, since it may hold data.
type OtherFilesystemError struct {
	Image string
	// Found is what the image holds (XFS, Btrfs, or "" for neither);
	// Want is what the Spec asked for.
	Found, Want string
}

func (e *OtherFilesystemError) Error() string {
	found := e.Found
	if found == "" {
		found = "neither an xfs nor a btrfs (no superblock of either)"
	}
	return fmt.Sprintf("image %s holds %s, not %s; an image is never formatted again", e.Image, found, e.Want)
}

// check refuses what Keep cannot do before it binds or makes anything: an
// image of another filesystem, a filesystem the kernel does not have, and
// a new image without the mkfs to format it. Called with the lock held.
func (s Spec) check() error {
	if packageOf[s.Filesystem] == "" {
		return fmt.Errorf("no filesystem %q to keep: want %s or %s", s.Filesystem, XFS, Btrfs)
	}
	image := s.image()
	_, err := os.Lstat(image)
	switch {
	case err == nil:
		found, err := FilesystemOf(image)
		if err != nil {
			return err
		}
		if found != s.Filesystem {
			return &OtherFilesystemError{Image: image, Found: found, Want: s.Filesystem}
		}
	case !errors.Is(err, os.ErrNotExist):
		return err
	case s.Size > 0:
		mkfs := "mkfs." + s.Filesystem
		if _, err := exec.LookPath(mkfs); err != nil {
			return fmt.Errorf("%s is not installed (package %s), so no %s image can be made: %w", mkfs, packageOf[s.Filesystem], s.Filesystem, err)
		}
	}
	return kernelHas(s.Filesystem, s.mnt())
}

// CanMake says, as an error, whether a new image of fs can be made and
// mounted here: its mkfs is installed and the kernel has fs. probe is an
// empty directory kernelHas may aim a mount at.
func CanMake(fs, probe string) error {
	if packageOf[fs] == "" {
		return fmt.Errorf("no filesystem %q to keep: want %s or %s", fs, XFS, Btrfs)
	}
	mkfs := "mkfs." + fs
	if _, err := exec.LookPath(mkfs); err != nil {
		return fmt.Errorf("%s is not installed (package %s): %w", mkfs, packageOf[fs], err)
	}
	return kernelHas(fs, probe)
}

// kernelHas says, as an error, whether the kernel can mount fs. A
// filesystem built as a module is listed in /proc/filesystems only once
// loaded; a mount(2) of that type loads it (its source does not exist,
// so nothing is mounted), and ENODEV from it means there is none to load.
// probe is an empty directory to aim that mount at.
func kernelHas(fs, probe string) error {
	listed := func() (bool, error) {
		f, err := os.Open("/proc/filesystems")
		if err != nil {
			return false, err
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) > 0 && fields[len(fields)-1] == fs {
				return true, nil
			}
		}
		return false, sc.Err()
	}
	if ok, err := listed(); err != nil || ok {
		return err
	}
	err := unix.Mount("/nonexistent/modeguard-probe", probe, fs, unix.MS_RDONLY|unix.MS_NODEV|unix.MS_NOSUID|unix.MS_NOEXEC, "")
	if err == nil {
		_ = unix.Unmount(probe, 0)
	}
	if ok, lerr := listed(); lerr != nil || ok {
		return lerr
	}
	return fmt.Errorf("the kernel has no %s: not in /proc/filesystems, and mounting one loaded no module (%v)", fs, err)
}
