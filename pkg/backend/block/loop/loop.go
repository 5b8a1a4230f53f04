// Package loop attaches image files as loop devices and answers questions
// about loop devices from sysfs.
//
// Several node processes on one machine may attach the same image, each to
// its own loop device, so a device is only ever identified by what it is
// bound to right now (its backing file), never by a name remembered from
// earlier: the kernel hands a freed loopN to the next caller.
package loop

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
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
//
// It talks to the loop driver itself (LOOP_CTL_GET_FREE, LOOP_CONFIGURE)
// rather than running losetup: an attach is on the path of every first NFS
// publish and every block stage, and the exec was most of its time.
func Attach(ctx context.Context, image string, readOnly bool) (Device, error) {
	return attach(ctx, "", image, readOnly)
}

// freeRetries bounds how often an attach asks for another free device when
// the one it was given is taken by someone else before it binds it.
const freeRetries = 32

// attach binds image to dev, or to a free device when dev is "", as Attach
// describes.
func attach(ctx context.Context, dev, image string, readOnly bool) (Device, error) {
	backing, err := openBacking(image, readOnly)
	if err != nil {
		return Device{}, err
	}
	defer backing.Close()
	if dev != "" {
		if err := configure(dev, backing, image, readOnly); err != nil {
			// A named device bound now may be another process's, which
			// took it since it was free: it is left alone and reported
			// as taken.
			if errors.Is(err, unix.EBUSY) {
				return Device{}, fmt.Errorf("%s was taken while attaching %s: %w", dev, image, err)
			}
			return Device{}, err
		}
		return describe(dev, image, readOnly), nil
	}
	for range freeRetries {
		if err := ctx.Err(); err != nil {
			return Device{}, err
		}
		free, err := Free(ctx)
		if err != nil {
			return Device{}, err
		}
		err = configure(free, backing, image, readOnly)
		if errors.Is(err, unix.EBUSY) {
			continue // another process bound it first: ask again
		}
		if err != nil {
			return Device{}, err
		}
		return describe(free, image, readOnly), nil
	}
	return Device{}, fmt.Errorf("attaching %s: every free loop device offered was taken before it could be bound (%d tries)", image, freeRetries)
}

// openBacking opens the image as the loop device will use it: read-only
// when the device must be. It is not opened with O_DIRECT: the loop driver
// decides per request (LO_FLAGS_DIRECT_IO), and a file opened with O_DIRECT
// would make even the buffered fallback's I/O direct, misaligned where the
// file wants more than 512-byte alignment.
func openBacking(image string, readOnly bool) (*os.File, error) {
	flags := os.O_RDWR
	if readOnly {
		flags = os.O_RDONLY
	}
	f, err := os.OpenFile(image, flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening image %s: %w", image, err)
	}
	return f, nil
}

// configure binds the open image to dev in one LOOP_CONFIGURE: backing
// file, flags and sector size together, so no one ever sees the device
// bound with other settings.
func configure(dev string, backing *os.File, image string, readOnly bool) error {
	if !ValidDevice(dev) {
		return fmt.Errorf("%q is not a loop device", dev)
	}
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening %s: %w", dev, err)
	}
	defer f.Close()
	cfg := unix.LoopConfig{
		Fd: uint32(backing.Fd()),
		// 512-byte sectors always, whatever the pool: with direct I/O the
		// kernel would otherwise take the image file's direct-I/O
		// alignment as the device's sector size, and that changes under a
		// volume's feet (a reflinked file on xfs asks for 4096 once it
		// shares extents with a snapshot). A filesystem made on 512-byte
		// sectors (ext4 with 1 KiB blocks, xfs with sectsz=512) then no
		// longer mounts. Where the file cannot do direct I/O at 512 bytes
		// the kernel uses the page cache.
		Size: 512,
	}
	if readOnly {
		cfg.Info.Flags |= unix.LO_FLAGS_READ_ONLY
	}
	// Direct I/O, because without it every block is cached twice (once
	// for the image file, once for the device); the kernel turns it off
	// where the file's filesystem cannot do it at the device's sector
	// size, and describe reports what it chose.
	cfg.Info.Flags |= unix.LO_FLAGS_DIRECT_IO
	copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], image)
	if err := unix.IoctlLoopConfigure(int(f.Fd()), &cfg); err != nil {
		return fmt.Errorf("LOOP_CONFIGURE %s on %s: %w", image, dev, err)
	}
	if err := markChanged(f); err != nil {
		if cerr := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); cerr != nil {
			err = fmt.Errorf("%w (and unbinding it again: %v)", err, cerr)
		}
		return fmt.Errorf("%s bound to %s: %w", dev, image, err)
	}
	return nil
}

// markChanged sets the device node's modification time to now, which is
// when it took on the content of another file.
//
// libblkid caches what it probed of each device, its UUID above all, and
// believes a cached entry without probing again (for two seconds, and up
// to 200 once verified) unless the device node was modified after the
// probe. nfs-ganesha keeps such a cache for its whole life and tells
// filesystems apart by that UUID. Binding a loop device changes what it
// holds but not its node, so the next image on a device freed a moment
// ago took on the UUID of the one before it: ganesha took it for a
// duplicate of that filesystem and refused its export (resolve_posix_
// filesystem: No such file or directory), and, claimed under the wrong
// UUID, it then shadowed the filesystem that really has it until ganesha
// restarted. A node that says it changed makes every cache probe again.
//
// The time is the fine clock's, one microsecond on: libblkid compares the
// node's time with its probe's to the microsecond, and UTIME_NOW would
// take the kernel's coarse clock, which runs up to a tick behind, so that
// a device bound again within a tick of a probe would still look older
// than it.
func markChanged(dev *os.File) error {
	later := unix.NsecToTimespec(time.Now().Add(time.Microsecond).UnixNano())
	now := []unix.Timespec{later, later}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(int(dev.Fd())), now, 0); err != nil {
		return fmt.Errorf("marking the device node changed for libblkid's cache: %w", err)
	}
	return nil
}

// Free names a free loop device (LOOP_CTL_GET_FREE, which creates one when
// none is free). For a caller that records a device before binding it;
// another process may take it meanwhile, and AttachAt then fails.
func Free(ctx context.Context) (string, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("opening the loop control device: %w", err)
	}
	defer ctl.Close()
	n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
	if err != nil {
		return "", fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
	}
	return fmt.Sprintf("/dev/loop%d", n), nil
}

// AttachAt binds image to dev, which must be free, like Attach.
func AttachAt(ctx context.Context, dev, image string, readOnly bool) (Device, error) {
	if !ValidDevice(dev) {
		return Device{}, fmt.Errorf("%q is not a loop device", dev)
	}
	return attach(ctx, dev, image, readOnly)
}

func describe(dev, image string, readOnly bool) Device {
	d := Device{Path: dev, ReadOnly: readOnly}
	if v, err := readSys(dev, "loop/dio"); err == nil {
		d.DirectIO = v == "1"
	}
	if !d.DirectIO {
		// Older kernels accept the flag and quietly drop it; newer ones
		// drop it where the file wants larger aligned direct I/O than the
		// device's 512-byte sectors (a reflinked file on xfs).
		klog.InfoS("Loop device uses buffered I/O", "image", image, "device", dev)
	}
	return d
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

// DevicesOfFile lists the loop devices bound to the very file image is now
// (same filesystem and inode), by whatever path the process that bound it
// reached the file. The kernel reports a backing file by the path its
// binder saw: one in another mount namespace (a pod whose hostPath shows
// the directory elsewhere) or through a bind mount names the same file by
// another path, which DevicesOf does not recognise. Only the devices whose
// backing file has image's base name are opened to compare inodes, so no
// other image's device is held open even for a moment.
func DevicesOfFile(image string) ([]string, error) {
	all, err := List()
	if err != nil {
		return nil, err
	}
	base := filepath.Base(image)
	var out []string
	for _, a := range all {
		if filepath.Base(strings.TrimSuffix(a.BackingFile, DeletedSuffix)) != base {
			continue
		}
		same, err := BoundTo(a.Device, image)
		if err != nil {
			return nil, err
		}
		if same {
			out = append(out, a.Device)
		}
	}
	return out, nil
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
//
// It returns once the kernel has let go of the image, not when it was
// asked to: LOOP_CLR_FD only marks a device that someone else holds open
// (a filesystem on it still mounted in another mount namespace, a process
// reading it) to be detached at its last close. Until then the image is
// still in use, and a caller that moves on (unmounts the pool, lets
// another node attach the volume) would do so on a device that is still
// bound. So it waits, for at most DetachWait or ctx's deadline, and then
// fails, naming what holds the device where it can tell; the device stays
// marked, and a retry finds it bound and waits again.
//
// The check and the detach go through one open file of dev. A device
// checked by its path and then detached by its path could be freed in
// between (by its own autoclear, or its owner's detach) and bound by
// someone else to another volume, whose device the detach would then take
// away. While this holds dev open the kernel cannot free it, so what the
// second check sees is what LOOP_CLR_FD acts on.
func DetachIfBackedBy(ctx context.Context, dev, image string) (bool, error) {
	// The first check reads sysfs only: opening a device that is not
	// image's, even for a moment, would hold up its owner's detach.
	ours, err := NamedBy(dev, image)
	if err != nil || !ours {
		return false, err
	}
	if betweenCheckAndOpen != nil {
		betweenCheckAndOpen(dev)
	}
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EROFS) || errors.Is(err, unix.EACCES) {
		f, err = os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENXIO) {
		return false, nil // the device is gone: nothing of image's is left on it
	}
	if err != nil {
		return false, fmt.Errorf("opening %s: %w", dev, err)
	}
	backing, err := BackingFile(dev)
	if err == nil && backing != "" {
		ours, err = NamedBy(dev, image)
	}
	if err != nil || backing == "" || !ours {
		// Freed since the first look, or freed and bound to another
		// file: either way nothing of image's is left on it.
		f.Close()
		return false, err
	}
	err = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
	f.Close()
	if err != nil {
		// Detached by someone else in the meantime: the goal is reached.
		if now, berr := BackingFile(dev); berr == nil && now == "" {
			return false, nil
		}
		return false, fmt.Errorf("LOOP_CLR_FD on %s: %w", dev, err)
	}
	if err := waitReleased(ctx, dev, backing); err != nil {
		return false, err
	}
	return true, nil
}

// betweenCheckAndOpen, when a test sets it, runs between DetachIfBackedBy's
// first look at a device and its opening of it: the window in which the
// device can change hands.
var betweenCheckAndOpen func(dev string)

// DetachWait bounds how long a detach waits for the last other opener of a
// device to close it.
const DetachWait = 10 * time.Second

// waitReleased waits until dev is no longer bound to backing (its
// backing file as sysfs showed it before the detach): unbound, or bound
// again to something else by whoever took the freed device. It reads
// sysfs only: opening the device to ask would make this one more opener
// the detach waits for.
func waitReleased(ctx context.Context, dev, backing string) error {
	ctx, cancel := context.WithTimeout(ctx, DetachWait)
	defer cancel()
	delay := time.Millisecond
	for {
		now, err := BackingFile(dev)
		if err != nil {
			return fmt.Errorf("checking that %s let go of %s: %w", dev, backing, err)
		}
		if now != backing {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s is still bound to %s after detaching it: %s; the kernel detaches it when that is closed: %w",
				dev, backing, describeHolders(dev), ctx.Err())
		case <-time.After(delay):
		}
		delay = min(2*delay, 50*time.Millisecond)
	}
}

// describeHolders says who keeps dev open, as far as /proc tells: the
// processes whose mount namespace has a filesystem of dev mounted, and
// those holding the device node open. It is only asked when a detach
// could not finish, to make that error actionable.
func describeHolders(dev string) string {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return "it is held open by someone"
	}
	devField := fmt.Sprintf(" %d:%d ", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	procs, _ := os.ReadDir("/proc")
	var mounted, open []string
	for _, p := range procs {
		if _, err := strconv.Atoi(p.Name()); err != nil {
			continue
		}
		if len(mounted) < 3 {
			if info, err := os.ReadFile("/proc/" + p.Name() + "/mountinfo"); err == nil && bytes.Contains(info, []byte(devField)) {
				mounted = append(mounted, p.Name())
			}
		}
		if len(open) < 3 {
			fds, _ := os.ReadDir("/proc/" + p.Name() + "/fd")
			for _, fd := range fds {
				if target, err := os.Readlink("/proc/" + p.Name() + "/fd/" + fd.Name()); err == nil && target == dev {
					open = append(open, p.Name())
					break
				}
			}
		}
	}
	var parts []string
	if len(mounted) > 0 {
		parts = append(parts, "a filesystem on it is mounted in the mount namespace of process "+strings.Join(mounted, ", "))
	}
	if len(open) > 0 {
		parts = append(parts, "it is open in process "+strings.Join(open, ", "))
	}
	if len(parts) == 0 {
		return "it is held open by someone"
	}
	return strings.Join(parts, "; ")
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
	return loopIoctl(dev, unix.LOOP_SET_CAPACITY, 0)
}

// loopIoctl issues an ioctl whose argument is a plain value on dev:
// LOOP_CLR_FD, which the kernel defers until the last opener closes the
// device (as losetup --detach does), LOOP_SET_CAPACITY or BLKRASET. The
// device is opened for writing where it can be (the kernel asks that of
// LOOP_SET_CAPACITY from a caller without CAP_SYS_ADMIN), read-only where
// it is a read-only device.
func loopIoctl(dev string, req uint, value int) error {
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EROFS) || errors.Is(err, unix.EACCES) {
		f, err = os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return fmt.Errorf("opening %s: %w", dev, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), req, value); err != nil {
		return fmt.Errorf("ioctl %#x on %s: %w", req, dev, err)
	}
	return nil
}

// SetReadAhead sets dev's read-ahead to kib KiB (BLKRASET, in 512-byte
// sectors) and checks that the kernel took it: the queue's read_ahead_kb
// is what the page cache uses for the device and any filesystem on it.
func SetReadAhead(dev string, kib uint64) error {
	if !ValidDevice(dev) {
		return fmt.Errorf("%q is not a loop device", dev)
	}
	if err := loopIoctl(dev, unix.BLKRASET, int(kib*2)); err != nil {
		return err
	}
	got, err := ReadAhead(dev)
	if err != nil {
		return err
	}
	if got != kib {
		return fmt.Errorf("%s reads ahead %d KiB after it was set to %d", dev, got, kib)
	}
	return nil
}

// ReadAhead is dev's read-ahead in KiB, as the kernel reports it.
func ReadAhead(dev string) (uint64, error) {
	if !ValidDevice(dev) {
		return 0, fmt.Errorf("%q is not a loop device", dev)
	}
	v, err := readSys(dev, "queue/read_ahead_kb")
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(v, 10, 64)
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

// Hold opens dev and checks, through that open file, that dev is bound to
// the very file image is now (same filesystem and inode). While the file
// stays open the kernel cannot detach dev, not even one marked to detach
// itself at its last close (AutoClear): so what the caller mounts from dev
// meanwhile is image, and never a file someone bound to a freed device
// since it was looked up. The caller closes the file.
func Hold(dev, image string) (*os.File, error) {
	if !ValidDevice(dev) {
		return nil, fmt.Errorf("%q is not a loop device", dev)
	}
	var st unix.Stat_t
	if err := unix.Stat(image, &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", image, err)
	}
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", dev, err)
	}
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err == nil && (info.Inode != st.Ino || !sameDevice(info.Device, st.Dev)) {
		err = fmt.Errorf("%s is bound to another file than %s", dev, image)
	} else if err != nil {
		err = fmt.Errorf("LOOP_GET_STATUS64 on %s: %w", dev, err)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// AutoClear marks the device open as f to detach itself when its last
// opener closes it (LO_FLAGS_AUTOCLEAR, as mount -o loop does): a device
// that lives exactly as long as some mount of its filesystem does, in any
// mount namespace.
func AutoClear(f *os.File) error {
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return fmt.Errorf("LOOP_GET_STATUS64 on %s: %w", f.Name(), err)
	}
	if info.Flags&unix.LO_FLAGS_AUTOCLEAR != 0 {
		return nil
	}
	info.Flags |= unix.LO_FLAGS_AUTOCLEAR
	if err := unix.IoctlLoopSetStatus64(int(f.Fd()), info); err != nil {
		return fmt.Errorf("LOOP_SET_STATUS64 (autoclear) on %s: %w", f.Name(), err)
	}
	return nil
}
