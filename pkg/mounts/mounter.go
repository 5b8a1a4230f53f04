package mounts

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Mounter makes and removes the bind mounts through which a workload sees
// a staged volume. The node plugin takes one so that its rules (who may
// hold a volume, what is refused, what survives a restart) can be tested
// on a table kept in memory (Memory) without root, while the kernel's
// (Kernel) serves in production and in the tests that are about the kernel.
type Mounter interface {
	// Bind mounts source (a directory, or a device node) at target, which
	// must exist; readOnly makes the new mount read-only. On an error
	// nothing is left mounted at target by this call.
	Bind(source, target string, readOnly bool) error
	// Unmount removes the mount visible at target (the last stacked
	// there), never following a symbolic link at target.
	Unmount(target string) error
}

// Kernel is the Mounter of the running kernel. It calls mount(2) and
// umount(2) itself rather than running mount(8): a bind mount needs nothing
// the command adds (no helper, no fstab, no mtab), and the command costs a
// fork and exec on every publish.
type Kernel struct{}

var _ Mounter = Kernel{}

// Bind makes the bind mount; a read-only one takes a second call (the
// kernel ignores MS_RDONLY on the first), and is undone if that fails.
func (Kernel) Bind(source, target string, readOnly bool) error {
	if err := unix.Mount(source, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mounting %s at %s: %w", source, target, err)
	}
	if !readOnly {
		return nil
	}
	if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		if uerr := unix.Unmount(target, unix.UMOUNT_NOFOLLOW); uerr != nil {
			return fmt.Errorf("making the bind mount at %s read-only: %w; and undoing it: %v", target, err, uerr)
		}
		return fmt.Errorf("making the bind mount at %s read-only: %w", target, err)
	}
	return nil
}

// Unmount calls umount(2) with UMOUNT_NOFOLLOW, so that a symbolic link put
// at target cannot redirect it.
func (Kernel) Unmount(target string) error {
	if err := unix.Unmount(target, unix.UMOUNT_NOFOLLOW); err != nil {
		return fmt.Errorf("umount %s: %w", target, err)
	}
	return nil
}
