// Package loop attaches image files as loop devices and answers questions
// about loop devices from sysfs.
//
// Several node processes on one machine may attach the same image, each to
// its own loop device, so a device is only ever identified by what it is
// bound to right now (its backing file), never by a name remembered from
// earlier: the kernel hands a freed loopN to the next caller.
package loop

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/command"
)

var devicePattern = regexp.MustCompile(`^/dev/loop[0-9]+$`)

// DeletedSuffix is what the kernel appends to a backing file's path once the
// file has been unlinked while still bound.
const DeletedSuffix = " (deleted)"

const sysBlock = "/sys/block"

// ValidDevice reports whether dev names a loop device node. Everything that
// takes a device path checks this first, so a corrupted state file cannot
// make the driver run losetup against an arbitrary block device.
func ValidDevice(dev string) bool { return devicePattern.MatchString(dev) }

// Device is an attached loop device.
type Device struct {
	Path string
	// DirectIO is false when the backing filesystem cannot do O_DIRECT
	// (ramfs, some FUSE filesystems) and the device uses the page cache.
	DirectIO bool
	ReadOnly bool
}

// Attach binds image to a free loop device. It asks for direct I/O, because
// without it every block is cached twice (once for the image file, once
// for the loop device), and falls back to buffered I/O where the
// filesystem holding the image refuses O_DIRECT.
func Attach(ctx context.Context, image string, readOnly bool) (Device, error) {
	return attach(ctx, "", image, readOnly)
}

// attach binds image to dev, or to a free device when dev is "" (losetup
// --find --show), as Attach describes.
func attach(ctx context.Context, dev, image string, readOnly bool) (Device, error) {
	args := []string{"--find", "--show"}
	if dev != "" {
		args = nil
	}
	if readOnly {
		args = append(args, "--read-only")
	}
	// 512-byte sectors always, whatever the pool: with direct I/O the
	// kernel would otherwise take the image file's direct-I/O alignment as
	// the device's sector size, and that changes under a volume's feet (a
	// reflinked file on xfs asks for 4096 once it shares extents with a
	// snapshot). A filesystem made on 512-byte sectors (ext4 with 1 KiB
	// blocks, xfs with sectsz=512) then no longer mounts. Where the file
	// cannot do direct I/O at 512 bytes the kernel uses the page cache.
	args = append(args, "--sector-size", "512")
	target := []string{image}
	if dev != "" {
		target = []string{dev, image}
	}
	stdout, dioErr := command.Run(ctx, "losetup", append(append(slices.Clone(args), "--direct-io=on"), target...)...)
	if dioErr == nil {
		d, err := describe(deviceOf(dev, stdout), readOnly)
		if err == nil && !d.DirectIO {
			// Older kernels accept the flag and quietly drop it; newer ones
			// drop it where the file wants larger aligned direct I/O than
			// the device's 512-byte sectors (a reflinked file on xfs).
			klog.InfoS("Kernel turned direct I/O off for loop device, using buffered I/O", "image", image, "device", d.Path)
		}
		return d, err
	}
	if dev != "" {
		// A named device bound now may be another process's, which took
		// it since it was free: that cannot be told from a bind of ours
		// left half done, so it is left alone and reported as taken.
		if backing, _ := BackingFile(dev); backing != "" {
			return Device{}, fmt.Errorf("%s was taken while attaching %s: %v", dev, image, dioErr)
		}
	}
	// Some losetup versions bind the device and then fail to switch on
	// direct I/O, leaving it bound; release it before trying again.
	if bound := deviceOf(dev, stdout); dev == "" && ValidDevice(bound) {
		if _, err := DetachIfBackedBy(ctx, bound, image); err != nil {
			return Device{}, fmt.Errorf("releasing %s after a failed direct-I/O attach: %w (attach: %v)", bound, err, dioErr)
		}
	}
	stdout, err := command.Run(ctx, "losetup", append(args, target...)...)
	if err != nil {
		return Device{}, fmt.Errorf("%w (with direct I/O: %v)", err, dioErr)
	}
	d, err := describe(deviceOf(dev, stdout), readOnly)
	if err == nil {
		klog.InfoS("Direct I/O refused for image, attached with buffered I/O", "image", image, "device", d.Path, "directIOError", dioErr.Error())
	}
	return d, err
}

// deviceOf is dev when the caller named one, else the device losetup
// --show printed.
func deviceOf(dev string, stdout []byte) string {
	if dev != "" {
		return dev
	}
	return firstLine(stdout)
}

// Free names the first free loop device (losetup --find, which creates one
// when none is free). For a caller that records a device before binding it;
// another process may take it meanwhile, and AttachAt then fails.
func Free(ctx context.Context) (string, error) {
	stdout, err := command.Run(ctx, "losetup", "--find")
	if err != nil {
		return "", err
	}
	dev := firstLine(stdout)
	if !ValidDevice(dev) {
		return "", fmt.Errorf("losetup --find reported %q, not a loop device", dev)
	}
	return dev, nil
}

// AttachAt binds image to dev, which must be free, like Attach.
func AttachAt(ctx context.Context, dev, image string, readOnly bool) (Device, error) {
	if !ValidDevice(dev) {
		return Device{}, fmt.Errorf("%q is not a loop device", dev)
	}
	return attach(ctx, dev, image, readOnly)
}

func describe(dev string, readOnly bool) (Device, error) {
	if !ValidDevice(dev) {
		return Device{}, fmt.Errorf("losetup reported %q, not a loop device", dev)
	}
	d := Device{Path: dev, ReadOnly: readOnly}
	if v, err := readSys(dev, "loop/dio"); err == nil {
		d.DirectIO = v == "1"
	}
	return d, nil
}

// BackingFile returns the file dev is bound to, with the kernel's
// " (deleted)" marker if the file was unlinked, or "" if dev is not bound
// (or does not exist).
func BackingFile(dev string) (string, error) {
	if !ValidDevice(dev) {
		return "", fmt.Errorf("%q is not a loop device", dev)
	}
	v, err := readSys(dev, "loop/backing_file")
	// A device detached while this reads (by whoever owns it) answers
	// ENODEV from sysfs, or its attribute is gone: not bound, either way.
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO) {
		return "", nil
	}
	return v, err
}

// NamedBy reports whether dev is bound to a file of image's name: the image
// now, or an earlier file of that name since unlinked (the kernel's
// " (deleted)" marker). That is the test for cleaning up: a device left
// bound to a deleted image of this name is this name's garbage. It is not
// the test for "dev is this image" (a volume deleted and created again
// reuses the name): that is BoundTo. The kernel records the path with
// symlinks resolved, so image's directory is resolved the same way.
//
// The kernel writes the path as seen through the mount the file was opened
// on. When that mount is out of this process's reach (a node plugin's
// container, since restarted, opened it through its own mount of the pool,
// which went with the container), the path is relative to that mount's root:
// a tail of image's path, on the filesystem of image's directory. That is
// the same file's name too, and is checked as such: the tail, then the
// filesystem (asked of the loop driver only for a device whose path already
// names the image, so no other volume's device is opened).
func NamedBy(dev, image string) (bool, error) {
	backing, err := BackingFile(dev)
	if err != nil || backing == "" {
		return false, err
	}
	want, err := canonical(image)
	if err != nil {
		return false, err
	}
	if backing == want || backing == want+DeletedSuffix {
		return true, nil
	}
	tail := strings.TrimSuffix(backing, DeletedSuffix)
	if !strings.HasPrefix(tail, "/") || !strings.HasSuffix(want, tail) {
		return false, nil
	}
	var dir unix.Stat_t
	if err := unix.Stat(filepath.Dir(want), &dir); err != nil {
		return false, fmt.Errorf("stat %s: %w", filepath.Dir(want), err)
	}
	info, bound, err := status(dev)
	if err != nil || !bound {
		return false, err
	}
	return sameDevice(info.Device, dir.Dev), nil
}

// BoundTo reports whether dev is bound to the very file image is now: the
// same filesystem and inode, asked of the loop driver itself
// (LOOP_GET_STATUS64). A path comparison cannot tell an image from one
// deleted and made again under the same name (a volume deleted and created
// anew), nor survives a bind-mounted pool directory; the inode can. An
// unbound device, a missing device node or a missing image is not bound.
func BoundTo(dev, image string) (bool, error) {
	if !ValidDevice(dev) {
		return false, fmt.Errorf("%q is not a loop device", dev)
	}
	var st unix.Stat_t
	if err := unix.Stat(image, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, fmt.Errorf("stat %s: %w", image, err)
	}
	info, bound, err := status(dev)
	if err != nil || !bound {
		return false, err
	}
	return info.Inode == st.Ino && sameDevice(info.Device, st.Dev), nil
}

// status asks the loop driver which file dev is bound to; bound is false
// for an unbound device or a missing device node.
func status(dev string) (info *unix.LoopInfo64, bound bool, err error) {
	if !ValidDevice(dev) {
		return nil, false, fmt.Errorf("%q is not a loop device", dev)
	}
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENXIO) {
			return nil, false, nil
		}
		return nil, false, err
	}
	defer f.Close()
	info, err = unix.IoctlLoopGetStatus64(int(f.Fd()))
	if errors.Is(err, unix.ENXIO) {
		return nil, false, nil // not bound
	}
	if err != nil {
		return nil, false, fmt.Errorf("LOOP_GET_STATUS64 on %s: %w", dev, err)
	}
	return info, true, nil
}

// sameDevice compares the loop driver's record of a backing file's device,
// in the kernel's own encoding (which unix.Major and unix.Minor decode like
// a stat's), with a stat's device.
func sameDevice(loopDevice, statDevice uint64) bool {
	return unix.Major(loopDevice) == unix.Major(statDevice) && unix.Minor(loopDevice) == unix.Minor(statDevice)
}

// DevicesOf lists the loop devices bound to the very file image is now.
func DevicesOf(image string) ([]string, error) {
	current, _, err := Bound(image)
	return current, err
}

// Bound lists the loop devices bound to a file of image's name: current
// to the very file there now (same inode, BoundTo), stale to an earlier
// file of that name since deleted or replaced, a leftover to detach and
// never to mount as the image. Only the devices whose backing path names
// the image are opened to compare the inode: opening another volume's
// device, even for a moment, would hold up its detach (the kernel defers
// it while the device is open), and the unstage of that volume would find
// its device still bound.
func Bound(image string) (current, stale []string, err error) {
	all, err := List()
	if err != nil {
		return nil, nil, err
	}
	return BoundAmong(all, image)
}

// BoundAmong is Bound over a list of the bound devices taken earlier (List),
// for a caller that asks about many images and knows that the devices of
// each can only have changed through its own work on that image.
func BoundAmong(all []Attached, image string) (current, stale []string, err error) {
	for _, a := range all {
		named, err := NamedBy(a.Device, image)
		if err != nil {
			return nil, nil, err
		}
		if !named {
			continue
		}
		same, err := BoundTo(a.Device, image)
		if err != nil {
			return nil, nil, err
		}
		if same {
			current = append(current, a.Device)
		} else {
			stale = append(stale, a.Device)
		}
	}
	return current, stale, nil
}

func canonical(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	dir, err := filepath.EvalSymlinks(filepath.Dir(abs))
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, filepath.Base(abs)), nil
}

// DetachIfBackedBy detaches dev only if it is bound to a file of image's
// name (NamedBy: the image, or a deleted one of that name), so a device
// that has since been handed to someone else is never taken from them. It
// reports whether it detached anything.
func DetachIfBackedBy(ctx context.Context, dev, image string) (bool, error) {
	ours, err := NamedBy(dev, image)
	if err != nil || !ours {
		return false, err
	}
	if _, err := command.Run(ctx, "losetup", "--detach", dev); err != nil {
		// Detached by someone else in the meantime: the goal is reached.
		if backing, berr := BackingFile(dev); berr == nil && backing == "" {
			return false, nil
		}
		return false, err
	}
	return true, nil
}

// ReadOnly reports whether the kernel refuses writes to dev.
func ReadOnly(dev string) (bool, error) {
	if !ValidDevice(dev) {
		return false, fmt.Errorf("%q is not a loop device", dev)
	}
	v, err := readSys(dev, "ro")
	return v == "1", err
}

// Refresh makes dev pick up a new size of its backing file.
func Refresh(ctx context.Context, dev string) error {
	if !ValidDevice(dev) {
		return fmt.Errorf("%q is not a loop device", dev)
	}
	_, err := command.Run(ctx, "losetup", "--set-capacity", dev)
	return err
}

// Size is the size of the block device in bytes, as the kernel sees it.
func Size(dev string) (int64, error) {
	f, err := os.Open(dev)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var size uint64
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&size))); errno != 0 {
		return 0, fmt.Errorf("BLKGETSIZE64 on %s: %w", dev, errno)
	}
	return int64(size), nil
}

// Attached is one bound loop device.
type Attached struct {
	Device      string
	BackingFile string
}

// List returns every bound loop device on the machine.
func List() ([]Attached, error) {
	entries, err := os.ReadDir(sysBlock)
	if err != nil {
		return nil, err
	}
	var out []Attached
	for _, e := range entries {
		dev := "/dev/" + e.Name()
		if !ValidDevice(dev) {
			continue
		}
		backing, err := BackingFile(dev)
		if err != nil {
			return nil, err
		}
		if backing != "" {
			out = append(out, Attached{Device: dev, BackingFile: backing})
		}
	}
	return out, nil
}

func readSys(dev, attr string) (string, error) {
	data, err := os.ReadFile(filepath.Join(sysBlock, filepath.Base(dev), attr))
	if err != nil {
		return "", err
	}
	return strings.TrimRight(string(data), "\n"), nil
}

func firstLine(b []byte) string {
	line, _, _ := strings.Cut(string(b), "\n")
	return strings.TrimSpace(line)
}

// Unused lists the loop devices bound to image that nothing uses: no
// filesystem on them is mounted and no bind mount of their device node
// exists (how a raw block volume reaches a workload). They are what a stage
// interrupted between attaching and recording leaves behind.
func Unused(image string) ([]string, error) {
	all, err := List()
	if err != nil {
		return nil, err
	}
	var bound []string
	for _, a := range all {
		if ok, err := NamedBy(a.Device, image); err == nil && ok {
			bound = append(bound, a.Device)
		}
	}
	if len(bound) == 0 {
		return nil, nil
	}
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, dev := range bound {
		var st unix.Stat_t
		if err := unix.Stat(dev, &st); err != nil {
			continue
		}
		major, minor := int(unix.Major(st.Rdev)), int(unix.Minor(st.Rdev))
		used := false
		for _, m := range mounts {
			// A filesystem on the device, or the device node bind-mounted
			// somewhere (its root is the node's path within devtmpfs).
			if (m.Major == major && m.Minor == minor) || m.Root == "/"+filepath.Base(dev) || m.Source == dev {
				used = true
				break
			}
		}
		if !used {
			out = append(out, dev)
		}
	}
	return out, nil
}
