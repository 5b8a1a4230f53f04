package imagestore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"
)

// bound returns the loop devices bound to image (an absolute path free of
// symlinks). current are bound to the file that is at that path now: same
// path and, asked of the device itself, same inode (loop.BoundTo). stale
// are bound to an earlier file of that name that has been deleted or
// replaced; they are leftovers to detach, and must never be mounted as if
// they held the current image.
func bound(image string) (current, stale []string, err error) {
	if current, stale, err = loop.Bound(image); err != nil {
		return nil, nil, fmt.Errorf("imagestore: %w", err)
	}
	return current, stale, nil
}

// backingPath is the file dev is bound to without the kernel's deleted
// marker, or "" for a device that is not a loop device or not bound.
func backingPath(dev string) string {
	if !loop.ValidDevice(dev) {
		return ""
	}
	b, err := loop.BackingFile(dev)
	if err != nil {
		return ""
	}
	p, _ := strings.CutSuffix(b, loop.DeletedSuffix)
	return p
}

// detach detaches dev if it is still bound to image (or to a deleted file
// of that name) and waits until the kernel has let go of it. A device that
// something still holds open is only marked for detaching by the kernel;
// that is reported as an error after a short wait rather than taken for
// done.
func detach(ctx context.Context, dev, image string) error {
	if _, err := loop.DetachIfBackedBy(ctx, dev, image); err != nil {
		return fmt.Errorf("imagestore: detaching %s from %s: %w", dev, image, err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		ours, err := loop.NamedBy(dev, image)
		if err != nil {
			return fmt.Errorf("imagestore: %w", err)
		}
		if !ours {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("imagestore: %s is still bound to %s after losetup --detach (something holds it open)", dev, image)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// FIFREEZE and FITHAW from <linux/fs.h>: _IOWR('X', 119, int) and
// _IOWR('X', 120, int) in the generic ioctl encoding (amd64, arm64,
// riscv64, s390x, 386, arm); golang.org/x/sys/unix does not define them.
// They are what xfs_freeze -f and -u do.
const (
	fiFreeze uintptr = 3<<30 | 4<<16 | 'X'<<8 | 119
	fiThaw   uintptr = 3<<30 | 4<<16 | 'X'<<8 | 120
)

func fsIoctl(mnt string, req uintptr) error {
	f, err := os.OpenFile(mnt, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), req, 0); errno != 0 {
		return errno
	}
	return nil
}

// freeze freezes the filesystem mounted at mnt: it syncs everything and
// blocks every writer until thaw. It is the ioctl xfs_freeze -f makes,
// done here directly so that no killed child process can stand between a
// freeze and its thaw.
func freeze(mnt string) error {
	err := fsIoctl(mnt, fiFreeze)
	if errors.Is(err, syscall.EBUSY) {
		return fmt.Errorf("imagestore: freezing %s: it is frozen already (by someone else, or by a copy interrupted by a crash; Restore thaws it)", mnt)
	}
	if err != nil {
		return fmt.Errorf("imagestore: freezing %s: %w", mnt, err)
	}
	return nil
}

// thaw undoes freeze. The kernel answers EINVAL when mnt is not frozen.
func thaw(mnt string) error {
	if err := fsIoctl(mnt, fiThaw); err != nil {
		return fmt.Errorf("imagestore: thawing %s: %w", mnt, err)
	}
	return nil
}

// thawIfFrozen thaws mnt if it is frozen, reporting whether it was, and is
// quiet if it is not.
func thawIfFrozen(mnt string) (bool, error) {
	err := fsIoctl(mnt, fiThaw)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, syscall.EINVAL):
		return false, nil
	}
	return false, fmt.Errorf("imagestore: thawing %s: %w", mnt, err)
}
