package fsutil

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// HasReflinks tells whether dir's filesystem clones files (FICLONE): it
// clones one block between two unnamed temporary files (O_TMPFILE) in dir,
// which leave nothing behind, not even after a crash.
func HasReflinks(dir string) (bool, error) {
	open := func() (*os.File, error) {
		fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("a temporary file in %s: %w", dir, err)
		}
		return os.NewFile(uintptr(fd), "reflink-probe"), nil
	}
	src, err := open()
	if err != nil {
		return false, err
	}
	defer src.Close()
	if _, err := src.Write(make([]byte, 4096)); err != nil {
		return false, fmt.Errorf("writing a temporary file in %s: %w", dir, err)
	}
	dst, err := open()
	if err != nil {
		return false, err
	}
	defer dst.Close()
	switch err := unix.IoctlFileClone(int(dst.Fd()), int(src.Fd())); {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOTTY),
		errors.Is(err, unix.EXDEV), errors.Is(err, unix.ENOSYS):
		return false, nil
	default:
		return false, fmt.Errorf("cloning a file in %s: %w", dir, err)
	}
}
