// Package projquota keeps directories with real size limits on one xfs
// filesystem mounted with project quotas (a "pool").
//
// Every directory made by CreateDir or CopyTree gets a project id of its own
// with the project-inherit flag, so that everything created inside it
// inherits the id, and a hard block limit on that project. On xfs, statfs()
// of such a directory reports the project's limit and usage as the size of
// the filesystem, which is what NFS clients of an export of the directory
// see; raising the limit (SetLimit) grows the directory online.
//
// Project ids and flags are set with the FS_IOC_FSGETXATTR /
// FS_IOC_FSSETXATTR ioctls; limits are set and read with xfs_quota(8) from
// xfsprogs, always in expert mode against the pool's mount point and with
// /etc/projects and /etc/projid replaced by /dev/null, so the host's project
// files neither matter nor get changed. Prepare builds a pool from a sparse
// image file when the operator has no prjquota xfs filesystem to give.
//
// Note on errors: when a write goes over a project's hard limit, xfs fails
// it with ENOSPC ("no space left on device"), not EDQUOT: the kernel
// reports project quotas as a full directory tree, which is also what an
// NFS client of the directory sees.
package projquota

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/command"
	"github.com/modeguard/modeguard/pkg/fsutil"

	mtab "github.com/modeguard/modeguard/pkg/mounts"
)

// Pool is a prjquota-mounted xfs filesystem that holds volume directories.
type Pool struct {
	root      string // the mount point, absolute and free of symlinks
	blockSize int64  // the filesystem's block size

	reflinkOnce sync.Once
	reflinks    bool
	reflinkErr  error
}

// DirMode is the mode of directories made by CreateDir.
//
// It is 0777 on purpose. The directory is the whole volume a workload sees,
// and NFS clients reach it through ganesha with root squashed, so neither
// the node's root nor the driver can hand the directory to the workload's
// uid the way a local filesystem's fsGroup change would: anything stricter
// would leave a non-root pod unable to write to its own volume. The
// directory is reachable only through its own export, whose client list is
// the nodes the volume is published to, so world-writable here means
// "writable by whoever may mount this volume" (like an emptyDir), not by
// every user of the NFS server. The sticky bit is not set: a volume's files
// belong to the volume's workloads, which may delete each other's files as
// on any shared volume.
const DirMode os.FileMode = 0o777

// parentMode is the mode of intermediate directories CreateDir and CopyTree
// make above a volume directory. Only the server (ganesha, as root) walks
// them.
const parentMode os.FileMode = 0o755

// Open checks that root is the mount point of an xfs filesystem mounted
// with project quota enforcement and returns it as a Pool.
func Open(root string) (*Pool, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("projquota: %w", err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return nil, fmt.Errorf("projquota: export root %s: %w. %s", abs, err, howToPrepare(abs))
	}
	m, err := mountAt(real)
	if err != nil {
		return nil, fmt.Errorf("projquota: reading %s: %w", mountInfoPath, err)
	}
	switch {
	case m == nil:
		return nil, fmt.Errorf("projquota: export root %s is not a mount point. %s", real, howToPrepare(real))
	case m.FSType != "xfs":
		return nil, fmt.Errorf("projquota: export root %s is %s, not xfs. %s", real, m.FSType, howToPrepare(real))
	case !hasProjectQuota(mtab.SuperOptions(m)):
		return nil, fmt.Errorf("projquota: xfs at %s is mounted without project quota enforcement (options %s); "+
			"xfs cannot turn quotas on by remount: unmount it and mount it again with -o prjquota. %s",
			real, strings.Join(mtab.SuperOptions(m), ","), howToPrepare(real))
	}
	var st unix.Statfs_t
	if err := unix.Statfs(real, &st); err != nil {
		return nil, fmt.Errorf("projquota: statfs %s: %w", real, err)
	}
	if st.Bsize <= 0 {
		return nil, fmt.Errorf("projquota: statfs %s reports block size %d", real, st.Bsize)
	}
	return &Pool{root: real, blockSize: st.Bsize}, nil
}

func howToPrepare(root string) string {
	return fmt.Sprintf("The export root must be an xfs filesystem mounted with project quotas: "+
		"mkfs.xfs DEVICE && mount -o prjquota DEVICE %[1]s (in /etc/fstab: DEVICE %[1]s xfs prjquota 0 0; "+
		"for the root filesystem, rootflags=prjquota on the kernel command line); "+
		"or give the driver a plain directory and a pool image size, and it keeps a sparse xfs image "+
		"in that directory and mounts it with prjquota itself (projquota.Prepare)", root)
}

// Root is the pool's mount point.
func (p *Pool) Root() string { return p.root }

// BlockSize is the filesystem's block size; limits are rounded up to it.
func (p *Pool) BlockSize() int64 { return p.blockSize }

// Free is the pool filesystem's available bytes (statfs of Root, not of a
// project directory, so no project limit applies).
func (p *Pool) Free() (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p.root, &st); err != nil {
		return 0, fmt.Errorf("projquota: statfs %s: %w", p.root, err)
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// Size is the pool filesystem's total bytes (statfs of Root).
func (p *Pool) Size() (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p.root, &st); err != nil {
		return 0, fmt.Errorf("projquota: statfs %s: %w", p.root, err)
	}
	return int64(st.Blocks) * st.Bsize, nil
}

var elementPattern = regexp.MustCompile(`^[A-Za-z0-9_.:-]+$`)

// ValidateRel checks that rel is a relative path of plain elements: not
// empty, not absolute, no empty, "." or ".." elements, and each element
// only of [A-Za-z0-9_.:-].
func ValidateRel(rel string) error {
	if rel == "" {
		return errors.New("projquota: empty path")
	}
	if strings.HasPrefix(rel, "/") {
		return fmt.Errorf("projquota: path %q is absolute", rel)
	}
	for _, e := range strings.Split(rel, "/") {
		switch {
		case e == "":
			return fmt.Errorf("projquota: path %q has an empty element", rel)
		case e == "." || e == "..":
			return fmt.Errorf("projquota: path %q has a %q element", rel, e)
		case !elementPattern.MatchString(e):
			return fmt.Errorf("projquota: path %q: element %q has characters other than A-Z a-z 0-9 _ . : -", rel, e)
		}
	}
	return nil
}

// path validates rel and returns Root/rel. It refuses a path that goes
// through a symlink, so nothing created inside a volume can redirect the
// driver's own operations elsewhere.
func (p *Pool) path(rel string) (string, error) {
	if err := ValidateRel(rel); err != nil {
		return "", err
	}
	cur := p.root
	for _, e := range strings.Split(rel, "/") {
		cur = filepath.Join(cur, e)
		st, err := os.Lstat(cur)
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if err != nil {
			return "", fmt.Errorf("projquota: %w", err)
		}
		if st.Mode()&os.ModeSymlink != 0 {
			return "", fmt.Errorf("projquota: %s is a symlink", cur)
		}
	}
	return filepath.Join(p.root, rel), nil
}

func checkProject(id uint32) error {
	if id == 0 {
		return errors.New("projquota: project id 0 is the default project of every file and cannot be a volume's")
	}
	return nil
}

func checkLimit(limitBytes int64) error {
	if limitBytes <= 0 {
		return fmt.Errorf("projquota: limit %d: must be positive (xfs takes 0 as no limit)", limitBytes)
	}
	return nil
}

// roundUp rounds limitBytes up to whole filesystem blocks.
func (p *Pool) roundUp(limitBytes int64) int64 {
	b := p.blockSize
	return (limitBytes + b - 1) / b * b
}

// CreateDir creates Root/rel with mode DirMode (see there for why 0777),
// gives it projectID with the project-inherit flag, and sets the project's
// hard block limit to limitBytes rounded up to whole filesystem blocks.
// Missing parents of rel are made with mode 0755 and stay in project 0.
//
// The limit is set before the directory exists, so the directory is never
// seen without it. If Root/rel already exists with projectID (a retry after
// a crash), only the limit is set again; with another project id it is an
// error.
func (p *Pool) CreateDir(ctx context.Context, rel string, projectID uint32, limitBytes int64) error {
	path, err := p.path(rel)
	if err != nil {
		return err
	}
	if err := checkProject(projectID); err != nil {
		return err
	}
	if err := checkLimit(limitBytes); err != nil {
		return err
	}
	if st, err := os.Lstat(path); err == nil {
		if !st.IsDir() {
			return fmt.Errorf("projquota: %s exists and is not a directory", path)
		}
		id, inherit, err := projectOf(path)
		if err != nil {
			return fmt.Errorf("projquota: %w", err)
		}
		if id != projectID || !inherit {
			return fmt.Errorf("projquota: %s exists with project %d (inherit %v), not project %d", path, id, inherit, projectID)
		}
		return p.SetLimit(ctx, projectID, limitBytes)
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("projquota: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), parentMode); err != nil {
		return fmt.Errorf("projquota: %w", err)
	}
	if err := p.SetLimit(ctx, projectID, limitBytes); err != nil {
		return err
	}
	if err := p.makeProjectDir(path, projectID); err != nil {
		_ = p.clearLimit(context.WithoutCancel(ctx), projectID)
		return err
	}
	return nil
}

// makeProjectDir creates path with DirMode, projectID and project-inherit;
// on failure the directory is removed again.
func (p *Pool) makeProjectDir(path string, projectID uint32) error {
	if err := os.Mkdir(path, DirMode); err != nil {
		return fmt.Errorf("projquota: %w", err)
	}
	// Mkdir's mode went through the umask.
	err := os.Chmod(path, DirMode)
	if err == nil {
		err = setProject(path, projectID)
	}
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("projquota: %w", err)
	}
	return nil
}

// SetLimit sets the project's hard block limit to limitBytes rounded up to
// whole filesystem blocks. It takes effect at once, on a mounted pool: this
// is how a volume grows (or shrinks: xfs accepts a limit below the usage,
// after which every write that allocates fails).
func (p *Pool) SetLimit(ctx context.Context, projectID uint32, limitBytes int64) error {
	if err := checkProject(projectID); err != nil {
		return err
	}
	if err := checkLimit(limitBytes); err != nil {
		return err
	}
	return p.setLimit(ctx, projectID, p.roundUp(limitBytes))
}

func (p *Pool) clearLimit(ctx context.Context, projectID uint32) error {
	return p.setLimit(ctx, projectID, 0)
}

func (p *Pool) setLimit(ctx context.Context, projectID uint32, bytes int64) error {
	// A plain number given to bhard is bytes; xfs_quota stores it in 512-byte
	// basic blocks, which a multiple of the block size always is.
	cmd := fmt.Sprintf("limit -p bhard=%d %d", bytes, projectID)
	_, stderr, err := p.xfsQuota(ctx, cmd)
	if err != nil {
		return err
	}
	// xfs_quota reports some failures on stderr with exit status 0, so the
	// limit is read back.
	_, limit, err := p.Usage(ctx, projectID)
	if err != nil {
		return err
	}
	if limit != bytes {
		return fmt.Errorf("projquota: xfs_quota %q on %s left the limit at %d bytes, not %d: %s", cmd, p.root, limit, bytes, stderr)
	}
	return nil
}

// Usage returns the bytes the project uses and its hard limit (0: none).
// A project that has neither has no quota record, and gives 0, 0.
func (p *Pool) Usage(ctx context.Context, projectID uint32) (used, limit int64, err error) {
	if err := checkProject(projectID); err != nil {
		return 0, 0, err
	}
	// -b: blocks, in KiB; -N: no header; -n: numeric ids; -L/-U: just this
	// id. A line reads "#ID USED SOFT HARD WARNS [GRACE]".
	// xfs frees the blocks of deleted files in the background; statfs waits
	// for that work, so a file deleted just before counts as deleted.
	var st unix.Statfs_t
	_ = unix.Statfs(p.root, &st)
	id := strconv.FormatUint(uint64(projectID), 10)
	stdout, stderr, err := p.xfsQuota(ctx, fmt.Sprintf("report -p -b -N -n -L %s -U %s", id, id))
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(stdout, "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || f[0] != "#"+id {
			continue
		}
		usedK, err1 := strconv.ParseInt(f[1], 10, 64)
		hardK, err2 := strconv.ParseInt(f[3], 10, 64)
		if err1 != nil || err2 != nil {
			return 0, 0, fmt.Errorf("projquota: cannot read xfs_quota report line %q", line)
		}
		return usedK * 1024, hardK * 1024, nil
	}
	if s := strings.TrimSpace(stderr); s != "" {
		return 0, 0, fmt.Errorf("projquota: xfs_quota report for project %d on %s: %s", projectID, p.root, s)
	}
	return 0, 0, nil
}

// xfsQuota runs one xfs_quota command in expert mode on the pool.
func (p *Pool) xfsQuota(ctx context.Context, quotaCommand string) (stdout, stderr string, err error) {
	args := []string{"-x", "-D", os.DevNull, "-P", os.DevNull, "-c", quotaCommand, p.root}
	out, errOut, err := command.Output(ctx, "xfs_quota", args...)
	if err != nil {
		err = fmt.Errorf("projquota: %w", err)
	}
	return string(out), string(errOut), err
}

// CopyTree copies Root/srcRel to Root/dstRel with cp -a --reflink=auto
// (owners, modes, times, xattrs and ACLs kept; on xfs with reflink the data
// blocks are shared until written), gives the copy projectID and sets the
// project's limit to limitBytes. dstRel must not exist. The copy's blocks
// count against the new project in full, shared or not, so a limit smaller
// than the source's data makes the copy fail; on any failure dstRel is
// removed and the limit cleared.
//
// Order: the limit is set first and dstRel is created with the project id
// and the inherit flag before cp runs, so every inode cp creates is in the
// new project from its start and the limit holds during the copy. The id is
// then set over the whole tree once more, in case cp carried anything
// across that changed it.
//
// The copy is of the tree as cp walks it: files written to the source
// meanwhile may be copied before or after the write. Callers that need a
// point-in-time copy stop writers first (CopyTreeAround).
func (p *Pool) CopyTree(ctx context.Context, srcRel, dstRel string, projectID uint32, limitBytes int64) error {
	return p.CopyTreeAround(ctx, srcRel, dstRel, projectID, limitBytes, nil)
}

// CopyTreeAround is CopyTree with around run around the one step that
// reads the source: around is called with that step (cp) as read, and
// must call it at most once, with the context cp is to run under. A caller
// that holds every writer of the source still inside around gets the
// source as it was at one instant, and holds them only for the walk: the
// limit, the destination directory and the project ids are set outside
// it. With around, cp clones every file (--reflink=always) and fails on a
// file it cannot clone instead of copying its bytes, so that the time
// writers are held grows with the number of files, not with their size
// (see Reflinks). An error of around's is returned wrapped (errors.Is and
// errors.As find it), after the partial copy is removed as on any failure.
func (p *Pool) CopyTreeAround(ctx context.Context, srcRel, dstRel string, projectID uint32, limitBytes int64,
	around func(ctx context.Context, read func(context.Context) error) error) (err error) {
	src, err := p.path(srcRel)
	if err != nil {
		return err
	}
	dst, err := p.path(dstRel)
	if err != nil {
		return err
	}
	if err := checkProject(projectID); err != nil {
		return err
	}
	if err := checkLimit(limitBytes); err != nil {
		return err
	}
	if st, err := os.Lstat(src); err != nil {
		return fmt.Errorf("projquota: copy source: %w", err)
	} else if !st.IsDir() {
		return fmt.Errorf("projquota: copy source %s is not a directory", src)
	}
	if _, err := os.Lstat(dst); err == nil {
		return fmt.Errorf("projquota: copy destination %s already exists", dst)
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("projquota: %w", err)
	}
	if rel, err := filepath.Rel(src, dst); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
		return fmt.Errorf("projquota: cannot copy %s into itself (%s)", src, dst)
	}
	if err := os.MkdirAll(filepath.Dir(dst), parentMode); err != nil {
		return fmt.Errorf("projquota: %w", err)
	}
	if err := p.SetLimit(ctx, projectID, limitBytes); err != nil {
		return err
	}
	if err := p.makeProjectDir(dst, projectID); err != nil {
		_ = p.clearLimit(context.WithoutCancel(ctx), projectID)
		return err
	}
	defer func() {
		if err == nil {
			return
		}
		cleanup := context.WithoutCancel(ctx)
		if rmErr := os.RemoveAll(dst); rmErr != nil {
			err = fmt.Errorf("%w (and removing the partial copy: %v)", err, rmErr)
			return
		}
		if clErr := p.clearLimit(cleanup, projectID); clErr != nil {
			err = fmt.Errorf("%w (and clearing the limit of project %d: %v)", err, projectID, clErr)
		}
	}()
	// -T: dst is the copy itself, so src's contents (and src's own mode,
	// owner and times) land in the dst made above.
	reflink := "--reflink=auto"
	if around != nil {
		reflink = "--reflink=always"
	}
	read := func(ctx context.Context) error {
		_, err := command.Run(ctx, "cp", "-a", reflink, "--no-target-directory", "--", src, dst)
		return err
	}
	if around == nil {
		err = read(ctx)
	} else {
		err = around(ctx, read)
	}
	if err != nil {
		return fmt.Errorf("projquota: %w", err)
	}
	if err := setProjectTree(dst, projectID); err != nil {
		return fmt.Errorf("projquota: setting project %d on %s: %w", projectID, dst, err)
	}
	return nil
}

// RemoveDir removes Root/rel with its whole tree and clears the project's
// limit. A missing directory is not an error (only the limit is cleared);
// a directory that belongs to another project is refused. Once it returns,
// Usage of the project is 0.
func (p *Pool) RemoveDir(ctx context.Context, rel string, projectID uint32) error {
	path, err := p.path(rel)
	if err != nil {
		return err
	}
	if err := checkProject(projectID); err != nil {
		return err
	}
	st, err := os.Lstat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return fmt.Errorf("projquota: %w", err)
	case !st.IsDir():
		return fmt.Errorf("projquota: %s is not a directory", path)
	default:
		id, _, err := projectOf(path)
		if err != nil {
			return fmt.Errorf("projquota: %w", err)
		}
		// Project 0: a directory whose creation stopped before it got its id.
		if id != projectID && id != 0 {
			return fmt.Errorf("projquota: %s belongs to project %d, not %d", path, id, projectID)
		}
		if err := os.RemoveAll(path); err != nil {
			return fmt.Errorf("projquota: %w", err)
		}
	}
	return p.clearLimit(ctx, projectID)
}

// Reflinks reports whether the pool's filesystem clones files (xfs made
// with reflink=1, mkfs.xfs's default since xfsprogs 5.1, so Prepare's
// images have it): then a copy shares the source's blocks and takes time
// for each file and extent, not for each byte. It is learned once, by
// cloning one block between two unnamed temporary files (O_TMPFILE) in the
// pool, which leave nothing behind.
func (p *Pool) Reflinks() (bool, error) {
	p.reflinkOnce.Do(func() { p.reflinks, p.reflinkErr = probeReflink(p.root) })
	return p.reflinks, p.reflinkErr
}

func probeReflink(dir string) (bool, error) {
	ok, err := fsutil.HasReflinks(dir)
	if err != nil {
		return false, fmt.Errorf("projquota: %w", err)
	}
	return ok, nil
}
