// Package imagestore keeps every NFS volume and snapshot as a sparse image
// file of its own, holding an xfs or ext4 filesystem (see Filesystem) that
// is loop-mounted on the server where ganesha exports it. It is the way to
// give NFS volumes real size limits on kernels whose xfs has no quota
// support (package projquota needs that).
//
// An image is mounted when it is created, restored, or first used after a
// restart that left it out (Grow, Copy and Usage mount what they need), so
// a caller may restore only the objects it serves at once.
//
// Layout under the store's root:
//
//	ROOT/images/<group>__<name>.img   the image of rel "<group>/<name>"
//	ROOT/<group>/<name>               its mount point, the exported directory
//
// The image's size is the object's hard limit: a volume of N bytes can
// never hold more than N (less, in fact: the filesystem keeps its log and
// metadata in the same bytes). Growing is online: the file is made longer
// (holes only), the loop device rereads its size (losetup --set-capacity)
// and xfs_growfs or resize2fs grows the mounted filesystem (ext4's needs
// CAP_SYS_RESOURCE, xfs's does not). mkfs.xfs refuses filesystems smaller
// than 300 MiB, hence Filesystem.MinSize. xfs grows well by a few times its
// size, less well by hundreds of times (a 300 MiB filesystem grown to
// terabytes has thousands of small allocation groups), which callers may
// want to keep in mind for their defaults.
//
// Images stay sparse: only what mkfs wrote (for xfs mostly the internal
// log, 64 MiB for small filesystems; for ext4 a few hundred KiB) and what
// clients stored takes space on the disk. Copies are made with cp --reflink=auto --sparse=always, so on a
// root on xfs or btrfs a snapshot shares its blocks with its source.
//
// # Image names
//
// A rel is exactly two elements, "<group>/<name>", each valid for
// projquota.ValidateRel ([A-Za-z0-9_.:-]), and the group has no "_" and is
// not "images". The image is named by replacing the "/" with "__" and
// adding ".img": "volumes/nfs__vol-1" is images/volumes__nfs__vol-1.img.
// The mapping is unambiguous because the group has no underscore: the
// first "__" in an image name is always the one that stood for the "/",
// so the name gives the rel back (Prune relies on that) and two rels never
// share an image. Exactly two elements also means no object's mount point
// can lie inside another's filesystem.
//
// Temporary files, made while formatting or copying, are named
// ".<image name>.tmp-<random>": they start with a dot and do not end in
// ".img", so they are never mistaken for an image, and an image file that
// exists is always complete (formatted, or fully copied).
//
// # Mounts and loop devices
//
// Mounts are made with nodev and nosuid (the server never needs to treat
// what clients stored as devices or setuid programs) and always with
// nouuid: a copy has its source's filesystem UUID, and xfs would refuse to
// mount it next to the source, or after a restart whichever of the two
// comes second. The check nouuid switches off is there to stop one
// filesystem being mounted through two devices at once; the store makes
// sure of that itself by never binding two loop devices to one image:
// before attaching it reuses a device already bound to the image's file
// (asked of the device by inode, not only by path).
//
// The directory a volume is mounted on is made 0755 and owned by root, so
// that while nothing is mounted on it (after a reboot, before Restore)
// NFS clients, whose root is squashed, cannot write into the server's own
// filesystem through an export of it; and the store refuses to mount on a
// directory that is not empty, rather than hide what is in it.
//
// # Concurrency and crashes
//
// Work on one rel is serialized (Copy takes both of its rels); work on
// different rels runs in parallel; Prune and Release wait for everything
// else and exclude it. Only one process may use a root at a time.
//
// Every step is ordered so that a crash leaves something the next call, or
// Restore and Prune after a restart, can finish or undo: an image is
// published by an atomic no-replace rename only when complete; Remove
// unmounts, detaches, removes the mount point and only then the image, so
// a mount point without an image never outlives a crash; Copy freezes the
// source only around the copy of its image and thaws it on every path out,
// and Restore thaws a filesystem left frozen by a process that died in
// between.
package imagestore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
	"github.com/modeguard/modeguard/pkg/command"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/keylock"

	mtab "github.com/modeguard/modeguard/pkg/mounts"
)

// RootDirMode is the mode Create gives the root directory of a new
// volume's filesystem.
//
// It is 0777 on purpose, for the same reason as projquota.DirMode: the
// filesystem is the whole volume a workload sees, and NFS clients reach it
// through ganesha with root squashed, so neither the node's root nor the
// driver can hand the directory to the workload's uid the way a local
// fsGroup change would; anything stricter would leave a non-root pod unable
// to write to its own volume. Only the nodes the volume is published to
// can mount its export, so world-writable here means "writable by whoever
// may mount this volume", like an emptyDir.
const RootDirMode os.FileMode = 0o777

// ImagesDirName is the directory of the images below the root, which no
// other storage makes.
const ImagesDirName = "images"

const (
	imageExt   = ".img"
	tempMarker = ".tmp-"
	nameSep    = "__"

	imagesDirMode os.FileMode = 0o700
	mountDirMode  os.FileMode = 0o755
	imageMode     os.FileMode = 0o600

	// Image sizes are whole 4 KiB (limits are rounded down, never up, so
	// an image is never larger than its limit): the loop device is then a
	// whole number of sectors on 512-byte and 4 KiB disks alike, which
	// direct I/O needs.
	sizeAlign = 4096

	mountFlags = unix.MS_NODEV | unix.MS_NOSUID
)

// Store keeps images and their mounts under one root directory.
type Store struct {
	root   string // absolute, free of symlinks
	images string // root/images
	newFS  Filesystem

	// all is held shared by the work on single rels and exclusively by
	// Prune and Release.
	all  sync.RWMutex
	rels keylock.Set // one per rel: work on one volume's files
}

// Open prepares root (creates it 0755 if missing, and root/images 0700)
// and returns the store, which formats new images with newFS. It mounts
// nothing: Restore does that for each object the caller knows of, and
// Prune removes the rest.
func Open(ctx context.Context, root string, newFS Filesystem) (*Store, error) {
	if _, err := ParseFilesystem(string(newFS)); err != nil {
		return nil, err
	}
	var missing []string
	for _, tool := range append(newFS.tools(), "cp") {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("imagestore: %s not found in PATH (install xfsprogs or e2fsprogs and coreutils)", strings.Join(missing, ", "))
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("imagestore: %w", err)
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, fmt.Errorf("imagestore: %w", err)
	}
	resolved, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return nil, fmt.Errorf("imagestore: %w", err)
	}
	images := filepath.Join(resolved, ImagesDirName)
	if err := makeDir(images, imagesDirMode); err != nil {
		return nil, err
	}
	if st, err := os.Lstat(images); err != nil {
		return nil, fmt.Errorf("imagestore: %w", err)
	} else if st.Mode().Perm() != imagesDirMode {
		if err := os.Chmod(images, imagesDirMode); err != nil {
			return nil, fmt.Errorf("imagestore: %w", err)
		}
	}
	return &Store{root: resolved, images: images, newFS: newFS}, nil
}

// Root is the directory the mount points are in (absolute, free of
// symlinks): rel is mounted at Root()/rel.
func (s *Store) Root() string { return s.root }

// MinSize is the smallest limit Create accepts.
func (s *Store) MinSize() int64 { return s.newFS.MinSize() }

// checkRel validates rel; see the package comment for the rules.
func checkRel(rel string) error {
	if err := projquota.ValidateRel(rel); err != nil {
		return fmt.Errorf("imagestore: invalid rel: %w", err)
	}
	group, name, _ := strings.Cut(rel, "/")
	switch {
	case name == "" || strings.Contains(name, "/"):
		return fmt.Errorf("imagestore: rel %q is not of the form <group>/<name>", rel)
	case strings.Contains(group, "_"):
		return fmt.Errorf("imagestore: rel %q: the group %q must not contain '_' (image names would be ambiguous)", rel, group)
	case group == ImagesDirName:
		return fmt.Errorf("imagestore: rel %q: the group %q is where the images are kept", rel, group)
	}
	return nil
}

// imageName is the image file name of a valid rel.
func imageName(rel string) string {
	return strings.Replace(rel, "/", nameSep, 1) + imageExt
}

// relOfImage inverts imageName; ok is false for a name no valid rel has.
func relOfImage(name string) (rel string, ok bool) {
	stem, ok := strings.CutSuffix(name, imageExt)
	if !ok {
		return "", false
	}
	group, rest, ok := strings.Cut(stem, nameSep)
	if !ok {
		return "", false
	}
	rel = group + "/" + rest
	if checkRel(rel) != nil || imageName(rel) != name {
		return "", false
	}
	return rel, true
}

// tempPattern is the os.CreateTemp pattern of a temporary file that is to
// become rel's image.
func tempPattern(rel string) string { return "." + imageName(rel) + tempMarker + "*" }

// isTempName reports whether name is one of tempPattern's files.
func isTempName(name string) bool {
	return strings.HasPrefix(name, ".") && strings.Contains(name, imageExt+tempMarker) && !strings.HasSuffix(name, imageExt)
}

func (s *Store) imagePath(rel string) string { return filepath.Join(s.images, imageName(rel)) }
func (s *Store) mountPath(rel string) string { return filepath.Join(s.root, rel) }

// inImages reports whether path is a file directly in the images directory.
func (s *Store) inImages(path string) bool { return path != "" && filepath.Dir(path) == s.images }

func alignDown(n int64) int64 { return n &^ (sizeAlign - 1) }

// lock takes the store's shared lock and the locks of rels.
func (s *Store) lock(ctx context.Context, rels ...string) (func(), error) {
	s.all.RLock()
	unlock, err := s.rels.Lock(ctx, rels...)
	if err != nil {
		s.all.RUnlock()
		return nil, fmt.Errorf("imagestore: waiting for other work on %v: %w", rels, err)
	}
	return func() {
		unlock()
		s.all.RUnlock()
	}, nil
}

// Create makes rel a new filesystem of limit bytes (rounded down to whole 4
// KiB; at least MinSize): a sparse image formatted with mkfs.xfs (under a
// temporary name, renamed into place once formatted), attached to a loop
// device (direct I/O where the filesystem holding it allows) and mounted
// at Root()/rel, whose root directory gets RootDirMode.
//
// An existing image of rel is reused as it is, never reformatted: Create
// is idempotent, and after a crash it finishes what was started (attach,
// mount, mode). An existing image smaller than limit is an error (Grow
// enlarges); a larger one is fine.
func (s *Store) Create(ctx context.Context, rel string, limit int64) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	if limit < s.MinSize() {
		return fmt.Errorf("imagestore: size %d bytes for %s is below the minimum of %d bytes of an %s image", limit, rel, s.MinSize(), s.newFS)
	}
	size := alignDown(limit)
	unlock, err := s.lock(ctx, rel)
	if err != nil {
		return err
	}
	defer unlock()

	image, mnt := s.imagePath(rel), s.mountPath(rel)
	created := false
	st, err := os.Lstat(image)
	switch {
	case err == nil:
		if !st.Mode().IsRegular() {
			return fmt.Errorf("imagestore: %s is not a regular file", image)
		}
		if st.Size() < size {
			return fmt.Errorf("imagestore: %s exists with %d bytes, fewer than the %d asked for (Grow enlarges it)", rel, st.Size(), size)
		}
	case errors.Is(err, os.ErrNotExist):
		// Refuse before formatting what could not be mounted.
		if err := s.checkMountPoint(rel); err != nil {
			return err
		}
		if err := s.format(ctx, rel, size); err != nil {
			return err
		}
		created = true
	default:
		return fmt.Errorf("imagestore: %w", err)
	}

	mountedNow := true
	if created {
		err = s.mountFresh(ctx, rel)
	} else {
		mountedNow, err = s.mount(ctx, rel)
	}
	if err == nil && (created || pristine(mnt)) {
		// mkfs.xfs makes the root directory 0755 root:root.
		if cerr := os.Chmod(mnt, RootDirMode); cerr != nil {
			err = fmt.Errorf("imagestore: %w", cerr)
		}
	}
	if err != nil {
		if created {
			if rerr := s.remove(context.WithoutCancel(ctx), rel); rerr != nil {
				err = fmt.Errorf("%w (and removing the new image again: %v)", err, rerr)
			}
		}
		return err
	}
	klog.V(2).InfoS("Image volume ready", "rel", rel, "image", image, "size", size, "formatted", created, "mounted", mountedNow)
	return nil
}

// format makes rel's image: a sparse file of size bytes, formatted under a
// temporary name and renamed into place only once formatted, without
// replacing anything.
func (s *Store) format(ctx context.Context, rel string, size int64) error {
	f, err := os.CreateTemp(s.images, tempPattern(rel))
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	tmp := f.Name()
	fail := func(err error) error {
		f.Close()
		_ = os.Remove(tmp)
		return err
	}
	if err := f.Chmod(imageMode); err != nil {
		return fail(fmt.Errorf("imagestore: %w", err))
	}
	if err := f.Truncate(size); err != nil {
		return fail(fmt.Errorf("imagestore: sizing %s: %w", tmp, err))
	}
	if err := s.newFS.mkfs(ctx, tmp); err != nil {
		return fail(fmt.Errorf("imagestore: %w", err))
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("imagestore: %w", err))
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("imagestore: %w", err)
	}
	return s.publish(tmp, s.imagePath(rel))
}

// publish renames the complete temporary file tmp to image, failing if
// image exists, and makes the rename durable. tmp is gone afterwards,
// whatever happened.
func (s *Store) publish(tmp, image string) error {
	err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, image, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		// A filesystem without RENAME_NOREPLACE: a hard link also fails
		// if the name is taken.
		if err = os.Link(tmp, image); err == nil {
			err = os.Remove(tmp)
		}
	}
	if err != nil {
		_ = os.Remove(tmp)
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("imagestore: %s appeared while it was being made", image)
		}
		return fmt.Errorf("imagestore: publishing %s: %w", image, err)
	}
	if err := fsutil.SyncDir(s.images); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	return nil
}

// makeDir creates path with mode (exactly, whatever the umask) unless it
// exists; an existing path must be a directory and not a symlink.
func makeDir(path string, mode os.FileMode) error {
	st, err := os.Lstat(path)
	switch {
	case err == nil:
		if !st.IsDir() {
			return fmt.Errorf("imagestore: %s exists and is not a directory (a symlink is refused too)", path)
		}
		return nil
	case !errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("imagestore: %w", err)
	}
	if err := os.Mkdir(path, mode); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("imagestore: %w", err)
	}
	if err := os.Chmod(path, mode); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	return makeDir(path, mode) // checks what is there now
}

// makeMountPoint creates Root/<group> and Root/<group>/<name> as needed.
func (s *Store) makeMountPoint(rel string) error {
	group, _, _ := strings.Cut(rel, "/")
	if err := makeDir(filepath.Join(s.root, group), mountDirMode); err != nil {
		return err
	}
	return makeDir(s.mountPath(rel), mountDirMode)
}

// checkMountPoint makes sure rel could be mounted on: no path element is a
// symlink or a non-directory, nothing is mounted at the mount point, and
// it is empty if it exists.
func (s *Store) checkMountPoint(rel string) error {
	group, _, _ := strings.Cut(rel, "/")
	for _, p := range []string{filepath.Join(s.root, group), s.mountPath(rel)} {
		st, err := os.Lstat(p)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("imagestore: %w", err)
		}
		if !st.IsDir() {
			return fmt.Errorf("imagestore: %s exists and is not a directory (a symlink is refused too)", p)
		}
	}
	mnt := s.mountPath(rel)
	if err := notMountedOn(mnt); err != nil {
		return err
	}
	return emptyDir(mnt)
}

// emptyDir fails unless dir is an empty directory.
func emptyDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	defer f.Close()
	names, err := f.Readdirnames(1)
	if errors.Is(err, io.EOF) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	return fmt.Errorf("imagestore: mount point %s is not empty (it has %q, written while nothing was mounted on it?); refusing to hide it under a mount", dir, names[0])
}

// pristine reports whether dir looks the way mkfs.xfs leaves a root
// directory: empty, 0755, owned by root. Create uses it to finish setting
// the mode after a crash between mounting and chmod, and to leave alone a
// volume whose owner changed its mode since.
func pristine(dir string) bool {
	st, err := os.Lstat(dir)
	if err != nil || st.Mode().Perm() != 0o755 || !st.IsDir() {
		return false
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); !ok || sys.Uid != 0 || sys.Gid != 0 {
		return false
	}
	return emptyDir(dir) == nil
}

// mount makes sure rel's image is attached and mounted at its mount point,
// and reports whether it mounted it now. A loop device already bound to
// the image is reused; an image mounted there already is left as it is.
func (s *Store) mount(ctx context.Context, rel string) (bool, error) {
	mounts, devs, err := machine()
	if err != nil {
		return false, err
	}
	return s.mountSeeing(ctx, rel, mounts, devs)
}

// machine reads the mount table and the bound loop devices.
func machine() ([]*mtab.Mount, []loop.Attached, error) {
	mounts, err := mtab.All()
	if err != nil {
		return nil, nil, err
	}
	devs, err := loop.List()
	if err != nil {
		return nil, nil, fmt.Errorf("imagestore: listing loop devices: %w", err)
	}
	return mounts, devs, nil
}

// mountSeeing is mount with the mount table and the bound loop devices as
// read before: current for what concerns rel's own mount point and image,
// however many other objects were mounted since (see RestoreAll).
func (s *Store) mountSeeing(ctx context.Context, rel string, mounts []*mtab.Mount, devs []loop.Attached) (bool, error) {
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	if err := s.makeMountPoint(rel); err != nil {
		return false, err
	}
	current, stale, err := loop.BoundAmong(devs, image)
	if err != nil {
		return false, fmt.Errorf("imagestore: %w", err)
	}
	if top := mtab.TopAt(mounts, mnt); top != nil {
		if slices.Contains(current, top.Source) {
			return false, nil
		}
		return false, fmt.Errorf("imagestore: %s is mounted from %s, not from its image %s", mnt, top.Source, image)
	}
	if err := emptyDir(mnt); err != nil {
		return false, err
	}
	// Devices bound to an earlier file of this name are leftovers.
	for _, d := range stale {
		if len(mountPointsOf(mounts, d)) > 0 {
			continue
		}
		if err := detach(ctx, d, image); err != nil {
			klog.ErrorS(err, "Detaching a loop device bound to a deleted image", "device", d, "image", image)
		} else {
			klog.InfoS("Detached a loop device bound to a deleted image", "device", d, "image", image)
		}
	}
	dev := ""
	var inUse []string
	for _, d := range current {
		if len(mountPointsOf(mounts, d)) > 0 {
			inUse = append(inUse, d)
		}
	}
	switch {
	case len(inUse) > 1:
		return false, fmt.Errorf("imagestore: image %s is bound to several mounted loop devices (%s); refusing to mount it once more", image, strings.Join(inUse, ", "))
	case len(inUse) == 1:
		// The same device mounted twice is the same filesystem twice,
		// which is safe; the same image through two devices would not be.
		dev = inUse[0]
		klog.InfoS("Image is mounted elsewhere too; mounting the same device", "image", image, "device", dev, "elsewhere", mountPointsOf(mounts, dev))
	case len(current) > 0:
		dev = current[0]
		klog.InfoS("Reusing the loop device still bound to the image", "image", image, "device", dev)
	}
	for _, d := range current {
		if d != dev && !slices.Contains(inUse, d) {
			if err := detach(ctx, d, image); err != nil {
				return false, err
			}
		}
	}
	if err := attachAndMount(ctx, image, mnt, dev); err != nil {
		return false, err
	}
	return true, nil
}

// attachAndMount mounts image at mnt through dev, or through a loop device
// it attaches when dev is "" (and detaches again if the mount fails).
func attachAndMount(ctx context.Context, image, mnt, dev string) error {
	fs, err := filesystemOf(image)
	if err != nil {
		return err
	}
	attachedNow := false
	if dev == "" {
		d, err := loop.Attach(ctx, image, false)
		if err != nil {
			return fmt.Errorf("imagestore: attaching %s: %w", image, err)
		}
		dev, attachedNow = d.Path, true
		if !d.DirectIO {
			klog.V(2).InfoS("Loop device uses buffered I/O", "image", image, "device", dev)
		}
	}
	undoAttach := func() {
		if attachedNow {
			if err := detach(context.WithoutCancel(ctx), dev, image); err != nil {
				klog.ErrorS(err, "Detaching after a failed mount", "device", dev, "image", image)
			}
		}
	}
	if err := unix.Mount(dev, mnt, string(fs), mountFlags, fs.mountOptions()); err != nil {
		undoAttach()
		return fmt.Errorf("imagestore: mount -t %s -o nodev,nosuid,%s %s %s: %w (the kernel log, dmesg, tells why)", fs, fs.mountOptions(), dev, mnt, err)
	}
	if err := mountedFrom(mnt, dev); err != nil {
		_ = unix.Unmount(mnt, unix.UMOUNT_NOFOLLOW)
		undoAttach()
		return err
	}
	return nil
}

// mountFresh mounts the image Create has just formatted. No loop device can
// be bound to a file that did not exist a moment ago, and the mount point
// must be an empty directory with nothing mounted on it, which one statx
// tells: so neither the mount table nor the loop devices are read, which
// would make each create cost more the more volumes are mounted.
func (s *Store) mountFresh(ctx context.Context, rel string) error {
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	if err := s.makeMountPoint(rel); err != nil {
		return err
	}
	if err := notMountedOn(mnt); err != nil {
		return err
	}
	if err := emptyDir(mnt); err != nil {
		return err
	}
	return attachAndMount(ctx, image, mnt, "")
}

// notMountedOn fails if something is mounted at dir. statx says so
// directly; on a kernel that does not report it (before 5.8) the mount
// table decides.
func notMountedOn(dir string) error {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		if stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0 {
			return fmt.Errorf("imagestore: %s is a mount point already, but its image is new", dir)
		}
		return nil
	}
	mounts, err := mtab.All()
	if err != nil {
		return err
	}
	if top := mtab.TopAt(mounts, dir); top != nil {
		return fmt.Errorf("imagestore: %s is mounted from %s already, but its image is new", dir, top.Source)
	}
	return nil
}

// mountedFrom checks that the filesystem at mnt is the one on dev: a
// filesystem on a block device reports that device's number as its own, so
// two stats answer what a read of the whole mount table would.
func mountedFrom(mnt, dev string) error {
	var m, d unix.Stat_t
	if err := unix.Stat(mnt, &m); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if err := unix.Stat(dev, &d); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if m.Dev != d.Rdev {
		return fmt.Errorf("imagestore: %s is not mounted from %s right after mounting it", mnt, dev)
	}
	return nil
}

// unmountAll unmounts what is mounted at mnt, topmost first, as long as
// ours says it is mounted from a device of the store's; anything else on
// top is an error and stays.
func unmountAll(mnt string, ours func(dev string) bool) error {
	for range 16 {
		mounts, err := mtab.All()
		if err != nil {
			return err
		}
		top := mtab.TopAt(mounts, mnt)
		if top == nil {
			return nil
		}
		if !ours(top.Source) {
			return fmt.Errorf("imagestore: %s is mounted from %s, which is not its image; leaving it alone", mnt, top.Source)
		}
		if thawed, err := thawIfFrozen(mnt); err != nil {
			return err
		} else if thawed {
			klog.InfoS("Thawed a frozen filesystem before unmounting it", "mountPoint", mnt)
		}
		if err := unix.Unmount(mnt, unix.UMOUNT_NOFOLLOW); err != nil {
			if errors.Is(err, unix.EBUSY) {
				return fmt.Errorf("imagestore: unmounting %s: %w (still exported, or a process has files open in it)", mnt, err)
			}
			return fmt.Errorf("imagestore: unmounting %s: %w", mnt, err)
		}
	}
	return fmt.Errorf("imagestore: %s: still mounted after unmounting it 16 times", mnt)
}

// detachAll detaches every loop device bound to image (current or stale)
// unless it is still mounted somewhere.
func detachAll(ctx context.Context, image string) error {
	current, stale, err := bound(image)
	if err != nil {
		return err
	}
	devs := append(current, stale...)
	if len(devs) == 0 {
		return nil
	}
	mounts, err := mtab.All()
	if err != nil {
		return err
	}
	var errs []error
	for _, d := range devs {
		if mp := mountPointsOf(mounts, d); len(mp) > 0 {
			errs = append(errs, fmt.Errorf("imagestore: %s (bound to %s) is still mounted at %s; not detaching it", d, image, strings.Join(mp, ", ")))
			continue
		}
		if err := detach(ctx, d, image); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Remove unmounts Root()/rel, detaches its loop device (only one bound to
// its image), deletes the mount point and then the image. Absent parts are
// fine; a second Remove does nothing. A mount point that is still in use
// (exported) fails with EBUSY and everything stays.
func (s *Store) Remove(ctx context.Context, rel string) error {
	return s.withRel(ctx, rel, s.remove)
}

// withRel runs f on a valid rel with its lock held.
func (s *Store) withRel(ctx context.Context, rel string, f func(context.Context, string) error) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	unlock, err := s.lock(ctx, rel)
	if err != nil {
		return err
	}
	defer unlock()
	return f(ctx, rel)
}

func (s *Store) remove(ctx context.Context, rel string) error {
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	if err := s.unmount(ctx, rel); err != nil {
		return err
	}
	// The mount point goes before the image, so that a crash in between
	// leaves an image (which Prune finds) rather than a bare directory.
	// Remove, not RemoveAll: what is here now is the server's own empty
	// directory, and anything in it is not ours to delete.
	if err := os.Remove(mnt); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("imagestore: removing the mount point: %w", err)
	}
	if err := fsutil.SyncDir(filepath.Dir(mnt)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("imagestore: %w", err)
	}
	if err := fsutil.RemoveDurably(image); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	return nil
}

// Unmount lets go of rel's mount and loop device while nothing uses it:
// the image stays, and Restore, Grow, Copy or Usage mount it again. As for
// Remove, a mount point still in use (exported) fails with EBUSY and stays
// mounted, and something other than rel's image mounted there is an error.
func (s *Store) Unmount(ctx context.Context, rel string) error {
	return s.withRel(ctx, rel, s.unmount)
}

// unmount is Unmount with rel's lock held.
func (s *Store) unmount(ctx context.Context, rel string) error {
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	if err := unmountAll(mnt, func(dev string) bool { return backingPath(dev) == image }); err != nil {
		return err
	}
	return detachAll(ctx, image)
}

// Grow enlarges rel's image to limit (rounded down to whole 4 KiB; a
// smaller limit leaves the size as it is, images never shrink), makes the
// loop device pick up the new size and grows the mounted filesystem with
// xfs_growfs: online, writers keep going. An image not mounted yet (one
// Restore left out) is mounted first. A retry after an interrupted Grow
// finishes the steps left.
func (s *Store) Grow(ctx context.Context, rel string, limit int64) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	if limit <= 0 {
		return fmt.Errorf("imagestore: size %d for %s: must be positive", limit, rel)
	}
	size := alignDown(limit)
	unlock, err := s.lock(ctx, rel)
	if err != nil {
		return err
	}
	defer unlock()

	image, mnt := s.imagePath(rel), s.mountPath(rel)
	st, err := os.Lstat(image)
	if err != nil {
		return fmt.Errorf("imagestore: growing %s: %w", rel, err)
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("imagestore: %s is not a regular file", image)
	}
	dev, err := mountedDevice(image, mnt)
	if err != nil {
		return err
	}
	if dev == "" {
		// The filesystem grows while mounted, and a volume nobody used
		// since the start is not mounted yet.
		if err := s.restoreLocked(ctx, rel); err != nil {
			return err
		}
		if dev, err = mountedDevice(image, mnt); err != nil {
			return err
		}
		if dev == "" {
			return fmt.Errorf("imagestore: cannot grow %s: it is still not mounted at %s after mounting it", rel, mnt)
		}
	}
	if st.Size() < size {
		if err := extend(image, size); err != nil {
			return err
		}
	}
	if err := refresh(ctx, dev, image); err != nil {
		return err
	}
	fs, err := filesystemOf(image)
	if err != nil {
		return err
	}
	if err := fs.grow(ctx, dev, mnt); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if st.Size() < size {
		klog.V(2).InfoS("Grew image volume", "rel", rel, "from", st.Size(), "to", size)
	}
	return nil
}

// mountedDevice returns the loop device bound to image (the current file)
// that is mounted on top at mnt, or "" when mnt shows something else.
func mountedDevice(image, mnt string) (string, error) {
	mounts, err := mtab.All()
	if err != nil {
		return "", err
	}
	top := mtab.TopAt(mounts, mnt)
	if top == nil {
		return "", nil
	}
	current, _, err := bound(image)
	if err != nil {
		return "", err
	}
	if !slices.Contains(current, top.Source) {
		return "", fmt.Errorf("imagestore: %s is mounted from %s, not from its image %s", mnt, top.Source, image)
	}
	return top.Source, nil
}

// extend makes path size bytes long (holes only) and durable.
func extend(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	err = f.Truncate(size)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("imagestore: extending %s to %d bytes: %w", path, size, err)
	}
	return nil
}

// refresh makes dev's size that of image if it is not yet.
func refresh(ctx context.Context, dev, image string) error {
	st, err := os.Stat(image)
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	want := st.Size() &^ 511
	have, err := loop.Size(dev)
	if err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if have == want {
		return nil
	}
	if err := loop.Refresh(ctx, dev); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if have, err = loop.Size(dev); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	if have != want {
		return fmt.Errorf("imagestore: %s has %d bytes after losetup --set-capacity, its image %d", dev, have, want)
	}
	return nil
}

// Copy makes dstRel a copy of srcRel, at least as big as the source and
// of limit bytes when that is larger.
//
// The copy is a freshly formatted filesystem with the source's files copied
// in (cp -a, reflinked where the images' filesystem can, holes kept), not a
// copy of the source image: xfs reports its metadata UUID to the kernel, and
// no tool changes that UUID in an existing filesystem, so an image copy
// would look to an NFS server like the very same filesystem as its source
// (ganesha skips it as a duplicate and cannot export it). The source is
// frozen while its files are read, so the copy is consistent; atime updates
// are skipped on a frozen filesystem, so reading does not wait on the
// freeze. dstRel must not exist; on failure nothing of it remains.
func (s *Store) Copy(ctx context.Context, srcRel, dstRel string, limit int64) (err error) {
	if err := checkRel(srcRel); err != nil {
		return err
	}
	if err := checkRel(dstRel); err != nil {
		return err
	}
	if srcRel == dstRel {
		return fmt.Errorf("imagestore: cannot copy %s onto itself", srcRel)
	}
	if limit < 0 {
		return fmt.Errorf("imagestore: size %d for %s: must not be negative", limit, dstRel)
	}
	if _, err := os.Lstat(s.imagePath(dstRel)); err == nil {
		return fmt.Errorf("imagestore: copy destination %s already exists", dstRel)
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("imagestore: %w", err)
	}
	srcSt, err := os.Lstat(s.imagePath(srcRel))
	if err != nil {
		return fmt.Errorf("imagestore: copy source %s: %w", srcRel, err)
	}
	if !srcSt.Mode().IsRegular() {
		return fmt.Errorf("imagestore: %s is not a regular file", s.imagePath(srcRel))
	}
	if err := s.Create(ctx, dstRel, max(srcSt.Size(), alignDown(limit))); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			if rerr := s.Remove(context.WithoutCancel(ctx), dstRel); rerr != nil {
				err = fmt.Errorf("%w (and removing the partial copy: %v)", err, rerr)
			}
		}
	}()
	unlock, err := s.lock(ctx, srcRel, dstRel)
	if err != nil {
		return err
	}
	defer unlock()
	// The files are read through the source's mount, made (or checked)
	// under the source's lock: an Unmount between the two would leave the
	// freeze below to the filesystem the mount point lies in.
	if err := s.restoreLocked(ctx, srcRel); err != nil {
		return err
	}
	srcMnt, dstMnt := s.mountPath(srcRel), s.mountPath(dstRel)
	if err := freeze(srcMnt); err != nil {
		return err
	}
	defer func() {
		// An error here also means someone thawed it during the copy,
		// which may then be inconsistent: the copy fails.
		if terr := thaw(srcMnt); terr != nil {
			klog.ErrorS(terr, "Thawing the copy source", "mountPoint", srcMnt)
			err = errors.Join(err, terr)
		}
	}()
	if _, err := command.Run(ctx, "cp", "-a", "--reflink=auto", "--sparse=always", "--", srcMnt+"/.", dstMnt+"/"); err != nil {
		return fmt.Errorf("imagestore: %w", err)
	}
	klog.V(2).InfoS("Copied image volume", "from", srcRel, "to", dstRel)
	return nil
}

// Usage returns the used and total bytes of rel's filesystem, as statfs
// reports them (total excludes xfs's internal log), mounting it first if
// it is not mounted yet (an image Restore left out).
func (s *Store) Usage(ctx context.Context, rel string) (used, total int64, err error) {
	if err := checkRel(rel); err != nil {
		return 0, 0, err
	}
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	s.all.RLock()
	_, err = s.mountID(image, mnt)
	s.all.RUnlock()
	if errors.Is(err, errNotMounted) {
		if err := s.Restore(ctx, rel); err != nil {
			return 0, 0, err
		}
	}
	// Only the shared lock: Usage should not wait for a long Copy of rel.
	// The mount is checked before and after statfs instead.
	s.all.RLock()
	defer s.all.RUnlock()
	before, err := s.mountID(image, mnt)
	if err != nil {
		return 0, 0, err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(mnt, &st); err != nil {
		return 0, 0, fmt.Errorf("imagestore: statfs %s: %w", mnt, err)
	}
	after, err := s.mountID(image, mnt)
	if err != nil {
		return 0, 0, err
	}
	if after != before {
		return 0, 0, fmt.Errorf("imagestore: %s was remounted while its usage was read", mnt)
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize, int64(st.Blocks) * st.Bsize, nil
}

// mountID is the id of the mount on top at mnt, which must come from
// image; an error if nothing or something else is mounted there.
func (s *Store) mountID(image, mnt string) (int, error) {
	mounts, err := mtab.All()
	if err != nil {
		return 0, err
	}
	top := mtab.TopAt(mounts, mnt)
	if top == nil {
		return 0, fmt.Errorf("imagestore: %s: %w", mnt, errNotMounted)
	}
	current, _, err := bound(image)
	if err != nil {
		return 0, err
	}
	if !slices.Contains(current, top.Source) {
		return 0, fmt.Errorf("imagestore: %s is mounted from %s, not from its image %s", mnt, top.Source, image)
	}
	return top.ID, nil
}

// Free is the available bytes of the filesystem holding the images
// (statfs; what an unprivileged writer could still store).
func (s *Store) Free() (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(s.images, &st); err != nil {
		return 0, fmt.Errorf("imagestore: statfs %s: %w", s.images, err)
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// Size is the total bytes of the filesystem holding the images.
func (s *Store) Size() (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(s.images, &st); err != nil {
		return 0, fmt.Errorf("imagestore: statfs %s: %w", s.images, err)
	}
	return int64(st.Blocks) * st.Bsize, nil
}

// errNotMounted says an image's mount point has nothing mounted on it.
var errNotMounted = errors.New("not mounted (Restore mounts it)")

// Restore makes rel usable again after a restart or a reboot: it attaches
// the image unless a loop device is still bound to it (which is reused),
// and mounts it unless it is mounted. A filesystem found mounted and
// frozen (by a Copy interrupted by a crash) is thawed. The image must
// exist: a missing one is an error that wraps os.ErrNotExist.
func (s *Store) Restore(ctx context.Context, rel string) error {
	return s.withRel(ctx, rel, s.restoreLocked)
}

// restoreLocked is Restore with rel's lock held.
func (s *Store) restoreLocked(ctx context.Context, rel string) error {
	mounts, devs, err := machine()
	if err != nil {
		return err
	}
	return s.restore(ctx, rel, mounts, devs)
}

// RestoreAll restores every rel as Restore does, reading the mount table
// and the loop devices once for all of them instead of once for each: a
// start with a thousand objects would otherwise read a thousand entries a
// thousand times. One reading serves the whole batch because each rel has
// its own image and a mount point no other rel's lies in, so restoring one
// changes nothing another consults; the batch holds off every other call.
func (s *Store) RestoreAll(ctx context.Context, rels []string) error {
	seen := make(map[string]bool, len(rels))
	for _, rel := range rels {
		if err := checkRel(rel); err != nil {
			return err
		}
		if seen[rel] {
			return fmt.Errorf("imagestore: %s is to be restored twice", rel)
		}
		seen[rel] = true
	}
	s.all.Lock()
	defer s.all.Unlock()
	mounts, devs, err := machine()
	if err != nil {
		return err
	}
	for _, rel := range rels {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := s.restore(ctx, rel, mounts, devs); err != nil {
			return err
		}
	}
	return nil
}

// restore is Restore of one rel, with the mount table and loop devices as
// read before (see mountSeeing).
func (s *Store) restore(ctx context.Context, rel string, mounts []*mtab.Mount, devs []loop.Attached) error {
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	st, err := os.Lstat(image)
	if err != nil {
		return fmt.Errorf("imagestore: restoring %s: %w", rel, err)
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("imagestore: %s is not a regular file", image)
	}
	mountedNow, err := s.mountSeeing(ctx, rel, mounts, devs)
	if err != nil {
		return err
	}
	if !mountedNow {
		if thawed, err := thawIfFrozen(mnt); err != nil {
			return err
		} else if thawed {
			klog.InfoS("Thawed a filesystem left frozen by an interrupted copy", "rel", rel, "mountPoint", mnt)
		}
	}
	return nil
}

// ourMounts returns the mounts under Root() made from loop devices bound to
// files in the images directory, deepest mount point first.
func (s *Store) ourMounts(mounts []*mtab.Mount) []*mtab.Mount {
	var out []*mtab.Mount
	for _, m := range mounts {
		if strings.HasPrefix(m.Mountpoint, s.root+"/") && s.inImages(backingPath(m.Source)) {
			out = append(out, m)
		}
	}
	slices.SortStableFunc(out, func(a, b *mtab.Mount) int { return len(b.Mountpoint) - len(a.Mountpoint) })
	return out
}

// Prune removes every object whose rel is not in keep, the leftovers of
// operations a crash interrupted or of objects the caller forgot: it
// unmounts the store's mounts of such rels, detaches their loop devices and
// deletes their images and mount points. It also deletes temporary files
// in the images directory and detaches loop devices still bound to deleted
// images. Files in the images directory that are neither images nor
// temporary files are left alone (and logged). A kept rel is not touched
// (except that a mount of it from a deleted earlier image is unmounted);
// Prune does not mount anything. It returns the rels it removed, sorted,
// with the errors of what it could not remove.
func (s *Store) Prune(ctx context.Context, keep map[string]bool) ([]string, error) {
	s.all.Lock()
	defer s.all.Unlock()
	var errs []error
	removed := map[string]bool{}
	doomed := map[string]bool{} // rels to remove, found from mounts or images

	mounts, err := mtab.All()
	if err != nil {
		return nil, err
	}
	for _, m := range s.ourMounts(mounts) {
		rel, _ := filepath.Rel(s.root, m.Mountpoint)
		valid := checkRel(rel) == nil
		if valid && keep[rel] {
			current, _, err := bound(s.imagePath(rel))
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if slices.Contains(current, m.Source) {
				continue
			}
		}
		if valid && !keep[rel] {
			doomed[rel] = true
			continue // remove unmounts it
		}
		// A mount at an odd place, or a kept rel mounted from a deleted
		// earlier image: only the mount goes.
		if err := unmountAll(m.Mountpoint, func(dev string) bool { return dev == m.Source }); err != nil {
			errs = append(errs, err)
		} else {
			klog.InfoS("Unmounted a stray mount of an image", "mountPoint", m.Mountpoint, "device", m.Source, "backingFile", backingPath(m.Source))
		}
	}

	entries, err := os.ReadDir(s.images)
	if err != nil {
		return nil, fmt.Errorf("imagestore: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(s.images, name)
		if rel, ok := relOfImage(name); ok {
			if !keep[rel] {
				doomed[rel] = true
			}
			continue
		}
		if isTempName(name) {
			if err := detachAll(ctx, path); err != nil {
				errs = append(errs, err)
				continue
			}
			if err := fsutil.RemoveDurably(path); err != nil {
				errs = append(errs, fmt.Errorf("imagestore: %w", err))
				continue
			}
			klog.InfoS("Removed a temporary image file left by an interrupted operation", "file", path)
			continue
		}
		klog.InfoS("Leaving alone a file in the image directory that is no image", "file", path)
	}

	for _, rel := range slices.Sorted(maps.Keys(doomed)) {
		if err := s.remove(ctx, rel); err != nil {
			errs = append(errs, fmt.Errorf("imagestore: pruning %s: %w", rel, err))
			continue
		}
		removed[rel] = true
		klog.InfoS("Pruned an image volume nobody keeps", "rel", rel)
	}

	// Loop devices bound to images that were deleted, or to files that are
	// gone, and mounted nowhere.
	if err := s.detachOrphans(ctx); err != nil {
		errs = append(errs, err)
	}

	return slices.Sorted(maps.Keys(removed)), errors.Join(errs...)
}

// detachOrphans detaches the loop devices bound to files of the images
// directory that no longer exist, unless they are mounted.
func (s *Store) detachOrphans(ctx context.Context) error {
	all, err := loop.List()
	if err != nil {
		return fmt.Errorf("imagestore: listing loop devices: %w", err)
	}
	mounts, err := mtab.All()
	if err != nil {
		return err
	}
	var errs []error
	for _, a := range all {
		path, deleted := strings.CutSuffix(a.BackingFile, loop.DeletedSuffix)
		if !s.inImages(path) {
			continue
		}
		if !deleted {
			if _, err := os.Lstat(path); err == nil {
				continue
			}
		}
		// This device alone: a new image of the same name may be bound
		// to another one, mounted and in use.
		if mp := mountPointsOf(mounts, a.Device); len(mp) > 0 {
			errs = append(errs, fmt.Errorf("imagestore: %s (bound to the deleted %s) is still mounted at %s; not detaching it", a.Device, path, strings.Join(mp, ", ")))
			continue
		}
		if err := detach(ctx, a.Device, path); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Release unmounts every mount of the store's images under Root() and
// detaches every loop device bound to a file of the images directory, for
// a clean shutdown and for tests. The images stay; Restore brings each
// back, also through this same Store. Release is idempotent; what it could
// not release (a mount still exported, a device mounted outside Root()) is
// reported and left as it is.
func (s *Store) Release() error {
	s.all.Lock()
	defer s.all.Unlock()
	var errs []error
	mounts, err := mtab.All()
	if err != nil {
		return err
	}
	for _, m := range s.ourMounts(mounts) {
		if err := unmountAll(m.Mountpoint, func(dev string) bool { return s.inImages(backingPath(dev)) }); err != nil {
			errs = append(errs, err)
		}
	}
	all, err := loop.List()
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("imagestore: listing loop devices: %w", err))...)
	}
	done := map[string]bool{}
	for _, a := range all {
		path, _ := strings.CutSuffix(a.BackingFile, loop.DeletedSuffix)
		if !s.inImages(path) || done[path] {
			continue
		}
		done[path] = true
		if err := detachAll(context.Background(), path); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
