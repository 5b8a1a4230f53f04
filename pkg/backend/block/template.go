package block

// Filesystem templates: a new ext4 volume gets its filesystem at creation
// as a copy of a template image formatted once per size, instead of a mkfs
// at its first stage. A fresh ext4 holds a few hundred KiB of data in a
// sparse image, so the copy (only the runs that hold data) takes well under
// a millisecond where mkfs takes ten, and the first stage finds the volume
// formatted. Each copy then gets a filesystem UUID of its own
// (setExt4UUID): mounts by UUID, blkid's cache and ganesha tell
// filesystems apart by it.
//
// Templates live in DIR/templates, beside the volumes and snapshots and
// never among them: nothing there is a volume, and no record names them.
// A template is made under a temporary name, synced and renamed into place,
// so a template found by its name is complete; the controller's start keeps
// those and removes anything else there (a crash mid-copy leaves only the
// volume's temporary image, which the start removes as well), and a
// controller keeps at most maxTemplates, dropping the least recently used.

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/command"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

const (
	templatesDir = "templates"
	// maxTemplates bounds the templates a pool keeps: one per volume size
	// in use, and volumes mostly come in a few sizes.
	maxTemplates = 8
)

// templateMkfsArgs format a template. They are mkfs's for a new volume
// plus metadata_csum_seed, which keeps the checksums of every metadata
// block independent of the UUID, so that a copy's UUID changes with one
// superblock write instead of a rewrite of the whole filesystem. The
// name of a template file says which arguments made it.
var templateMkfsArgs = []string{"-F", "-q", "-m0", "-O", "metadata_csum_seed"}

const templateFormatVersion = "v1"

// templateSet holds the templates of every pool of a controller.
type templateSet struct {
	mu    sync.Mutex
	byKey map[string]*fsTemplate // by path
}

type fsTemplate struct {
	path     string
	ready    chan struct{} // closed once made (err says how)
	err      error
	users    int
	lastUsed time.Time
}

func (p *pool) templatesDir() string { return filepath.Join(p.dir, templatesDir) }

// templateFsTypes are the filesystems new volumes copy from a template.
var templateFsTypes = []string{fsExt4}

func (p *pool) templatePath(fsType string, size int64) string {
	return filepath.Join(p.templatesDir(), templateName(fsType, size))
}

// templateName is the name a complete template of fsType for volumes of
// size bytes has; nothing else in the directory has such a name.
func templateName(fsType string, size int64) string {
	return fsType + "-" + strconv.FormatInt(size, 10) + "-" + templateFormatVersion + imageSuffix
}

// templateSize reads from name the size of the volumes a template is for;
// ok is false when name is not that of a complete template of this
// version.
func templateSize(name string) (size int64, ok bool) {
	for _, fsType := range templateFsTypes {
		digits, found := strings.CutPrefix(name, fsType+"-")
		if !found {
			continue
		}
		if digits, found = strings.CutSuffix(digits, "-"+templateFormatVersion+imageSuffix); !found {
			continue
		}
		if n, err := strconv.ParseInt(digits, 10, 64); err == nil && n > 0 && templateName(fsType, n) == name {
			return n, true
		}
	}
	return 0, false
}

// IsTemplateFile says whether relPath, relative to a pool's directory,
// names a complete filesystem template (a template gets its name only once
// complete): a file the controller keeps in the pool as its cache of
// formatted filesystems, which stays when every volume is deleted. It is
// no volume and nothing a crash left behind.
func IsTemplateFile(relPath string) bool {
	dir, name := filepath.Split(filepath.Clean(relPath))
	_, ok := templateSize(name)
	return ok && filepath.Clean(dir) == templatesDir
}

// loadTemplates keeps the pool's complete templates (made by this
// version, found by their names, which they get only once synced) for
// later creates, and removes everything else in their directory: a
// template a crash interrupted, or one of another format.
func (s *templateSet) loadTemplates(p *pool) error {
	dir := p.templatesDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byKey == nil {
		s.byKey = map[string]*fsTemplate{}
	}
	removed := false
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		size, named := templateSize(e.Name())
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() && named && fi.Size() == size {
			done := make(chan struct{})
			close(done)
			s.byKey[path] = &fsTemplate{path: path, ready: done, lastUsed: fi.ModTime()}
			continue
		}
		klog.InfoS("Removing a filesystem template left unfinished or of another format", "path", path)
		if err := os.RemoveAll(path); err != nil {
			return err
		}
		removed = true
	}
	s.evict()
	if removed {
		return fsutil.SyncDir(dir)
	}
	return nil
}

// formatsFromTemplate says whether a new volume gets its filesystem from a
// template at creation: an empty volume that names ext4. Copies bring
// their source's filesystem, raw block volumes get none, a volume that
// names no filesystem takes the one its first stage asks for, and xfs
// volumes are formatted as before (xfs stamps its UUID into every
// metadata block).
func formatsFromTemplate(vol *backend.Volume) bool {
	return vol.AccessType == accessmode.Mount && vol.Source == nil && vol.FsType == fsExt4
}

// fillFromTemplate gives the empty image dst the filesystem of a template
// of its size, with a new UUID.
func (s *templateSet) fillFromTemplate(ctx context.Context, p *pool, fsType string, size int64, dst string) error {
	uuid := newUUID()
	err := s.copyTemplate(ctx, p, fsType, size, dst, uuid)
	if errors.Is(err, errTemplateGone) {
		// Removed behind the controller's back: made again.
		err = s.copyTemplate(ctx, p, fsType, size, dst, uuid)
	}
	return err
}

// errTemplateGone: a template's file went away while it was known.
var errTemplateGone = errors.New("the template's file is gone")

// copyTemplate copies the template of fsType and size into dst and gives
// the copy uuid, while the template is held (its superblocks are read from
// it). A clone shares the template's extents where the pool has reflinks;
// elsewhere only the few hundred KiB a fresh filesystem holds are copied.
func (s *templateSet) copyTemplate(ctx context.Context, p *pool, fsType string, size int64, dst string, uuid [16]byte) error {
	t, release, err := s.acquire(ctx, p, fsType, size)
	if err != nil {
		return err
	}
	defer release()
	err = cloneImage(t.path, dst)
	if errors.Is(err, errNoReflink) {
		err = copyDataRuns(t.path, dst)
	}
	if err != nil {
		err = status.Errorf(codes.Internal, "copying the %s template: %v", fsType, err)
	} else if uerr := setExt4UUID(t.path, dst, uuid); uerr != nil {
		err = status.Errorf(codes.Internal, "giving the new filesystem its own UUID: %v", uerr)
	}
	if _, serr := os.Stat(t.path); err != nil && errors.Is(serr, os.ErrNotExist) {
		s.forget(t)
		return errTemplateGone
	}
	return err
}

// forget drops a template whose file is gone, so that the next use makes
// it again.
func (s *templateSet) forget(t *fsTemplate) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byKey[t.path] == t {
		delete(s.byKey, t.path)
	}
}

// acquire finds the template, making it if needed (one maker per template;
// the others wait for it), and holds it until release.
func (s *templateSet) acquire(ctx context.Context, p *pool, fsType string, size int64) (*fsTemplate, func(), error) {
	path := p.templatePath(fsType, size)
	s.mu.Lock()
	if s.byKey == nil {
		s.byKey = map[string]*fsTemplate{}
	}
	t := s.byKey[path]
	maker := t == nil
	if maker {
		t = &fsTemplate{path: path, ready: make(chan struct{})}
		s.byKey[path] = t
	}
	t.users++
	s.mu.Unlock()
	release := func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		t.users--
		t.lastUsed = time.Now()
		s.evict()
	}
	if maker {
		t.err = makeTemplate(context.WithoutCancel(ctx), fsType, size, path)
		if t.err != nil {
			s.mu.Lock()
			delete(s.byKey, path) // the next create tries again
			s.mu.Unlock()
		}
		close(t.ready)
	} else {
		select {
		case <-t.ready:
		case <-ctx.Done():
			release()
			return nil, nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	if t.err != nil {
		release()
		return nil, nil, t.err
	}
	return t, release, nil
}

// evict drops the least recently used unused templates beyond
// maxTemplates (under s.mu). A removed template needs no directory sync:
// one that comes back after a crash goes at the next start.
func (s *templateSet) evict() {
	for len(s.byKey) > maxTemplates {
		var oldest *fsTemplate
		for _, t := range s.byKey {
			if t.users > 0 {
				continue
			}
			if oldest == nil || t.lastUsed.Before(oldest.lastUsed) {
				oldest = t
			}
		}
		if oldest == nil {
			return
		}
		delete(s.byKey, oldest.path)
		if err := os.Remove(oldest.path); err != nil && !errors.Is(err, os.ErrNotExist) {
			klog.ErrorS(err, "Removing an unused filesystem template", "path", oldest.path)
		}
	}
}

// makeTemplate formats a template of size bytes at path: under a temporary
// name, synced, then renamed into place and the directory synced.
func makeTemplate(ctx context.Context, fsType string, size int64, path string) error {
	if fsType != fsExt4 {
		return status.Errorf(codes.Internal, "no templates of %s filesystems", fsType)
	}
	tmp, err := tempName(path)
	if err != nil {
		return status.Errorf(codes.Internal, "creating a %s template: %v", fsType, err)
	}
	defer os.Remove(tmp) // gone after the rename
	if err := os.Truncate(tmp, size); err != nil {
		return status.Errorf(codes.Internal, "sizing a %s template: %v", fsType, err)
	}
	if _, err := command.Run(ctx, "mkfs."+fsType, append(templateMkfsArgs, tmp)...); err != nil {
		return status.Errorf(codes.Internal, "formatting a %s template: %v", fsType, err)
	}
	if err := growAndSync(tmp, size); err != nil {
		return status.Errorf(codes.Internal, "syncing a %s template: %v", fsType, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return status.Errorf(codes.Internal, "publishing a %s template: %v", fsType, err)
	}
	if err := fsutil.SyncDir(filepath.Dir(path)); err != nil {
		return status.Errorf(codes.Internal, "publishing a %s template: %v", fsType, err)
	}
	klog.V(2).InfoS("Made a filesystem template", "path", path)
	return nil
}

// copyDataRuns copies the runs of src that hold data into dst at the same
// offsets and leaves the holes between them holes: dst must hold nothing
// yet.
func copyDataRuns(src, dst string) error {
	return betweenFiles(src, dst, func(in, out *os.File) error {
		fi, err := in.Stat()
		if err != nil {
			return err
		}
		return copyRuns(in, out, fi.Size())
	})
}

func copyRuns(in, out *os.File, size int64) error {
	runs, err := dataRuns(in, 0, size)
	if err != nil {
		return err
	}
	for _, r := range runs {
		inOff, outOff := r.logical, r.logical
		for left := r.length; left > 0; {
			n, err := unix.CopyFileRange(int(in.Fd()), &inOff, int(out.Fd()), &outOff, int(left), 0)
			if err != nil {
				return &os.PathError{Op: "copy_file_range", Path: out.Name(), Err: err}
			}
			if n == 0 {
				return io.ErrUnexpectedEOF
			}
			left -= int64(n)
		}
	}
	return nil
}

func newUUID() [16]byte {
	var u [16]byte
	_, _ = rand.Read(u[:])
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // RFC 4122 variant
	return u
}

// Fields of the ext4 superblock (Documentation/filesystems/ext4), as byte
// offsets into it.
const (
	ext4SuperOffset      = 1024
	ext4SuperSize        = 1024
	ext4Magic            = 0xEF53
	sbBlocksCountLo      = 0x04
	sbFirstDataBlock     = 0x14
	sbLogBlockSize       = 0x18
	sbBlocksPerGroup     = 0x20
	sbMntCount           = 0x34
	sbMaxMntCount        = 0x36
	sbMagic              = 0x38
	sbState              = 0x3A
	sbCheckInterval      = 0x44
	sbFeatureCompat      = 0x5C
	sbFeatureIncompat    = 0x60
	sbFeatureROCompat    = 0x64
	sbUUID               = 0x68
	sbLastOrphan         = 0xE8
	sbBlocksCountHi      = 0x150
	sbChecksum           = 0x3FC
	ext4StateValid       = 0x1
	ext4StateErrors      = 0x2
	incompatRecover      = 0x4
	incompatExtents      = 0x40
	incompat64Bit        = 0x80
	incompatFlexBG       = 0x200
	incompatCsumSeed     = 0x2000
	roCompatSparseSuper  = 0x1
	roCompatMetadataCsum = 0x400
	roCompatOrphanFull   = 0x10000
	compatSparseSuper2   = 0x200
)

var crc32c = crc32.MakeTable(crc32.Castagnoli)

// ext4Super is the primary superblock of an ext4 filesystem.
type ext4Super []byte

func (s ext4Super) u16(off int) uint16 { return binary.LittleEndian.Uint16(s[off:]) }
func (s ext4Super) u32(off int) uint32 { return binary.LittleEndian.Uint32(s[off:]) }

func (s ext4Super) blockSize() int64 { return 1024 << s.u32(sbLogBlockSize) }

func (s ext4Super) blockCount() int64 {
	n := int64(s.u32(sbBlocksCountLo))
	if s.u32(sbFeatureIncompat)&incompat64Bit != 0 {
		n |= int64(s.u32(sbBlocksCountHi)) << 32
	}
	return n
}

// isExt4 tells an ext4 filesystem, as blkid does: the ext2 magic and a
// feature ext3 lacks.
func (s ext4Super) isExt4() bool {
	return s.u16(sbMagic) == ext4Magic && s.u32(sbFeatureIncompat)&(incompatExtents|incompat64Bit|incompatFlexBG) != 0
}

// clean says that e2fsck -p would find nothing to do: unmounted cleanly,
// no errors recorded, no journal to replay, no orphan inodes to release,
// and no check due by mount count or by time.
func (s ext4Super) clean() bool {
	state := s.u16(sbState)
	maxMounts := int16(s.u16(sbMaxMntCount))
	return state&ext4StateValid != 0 && state&ext4StateErrors == 0 &&
		s.u32(sbFeatureIncompat)&incompatRecover == 0 &&
		s.u32(sbLastOrphan) == 0 && s.u32(sbFeatureROCompat)&roCompatOrphanFull == 0 &&
		s.u32(sbCheckInterval) == 0 &&
		(maxMounts <= 0 || int16(s.u16(sbMntCount)) < maxMounts)
}

// sealChecksum sets the superblock's checksum, where it has one.
func (s ext4Super) sealChecksum() {
	if s.u32(sbFeatureROCompat)&roCompatMetadataCsum != 0 {
		binary.LittleEndian.PutUint32(s[sbChecksum:], ^crc32.Checksum(s[:sbChecksum], crc32c))
	}
}

// readExt4Super reads the primary superblock of the ext4 filesystem on
// path; ok is false when path holds no ext4 filesystem.
func readExt4Super(path string) (sb ext4Super, ok bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, false, err
	}
	defer f.Close()
	sb = make(ext4Super, ext4SuperSize)
	if _, err := f.ReadAt(sb, ext4SuperOffset); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, false, nil
		}
		return nil, false, err
	}
	return sb, sb.isExt4(), nil
}

// setExt4UUID gives the unmounted ext4 filesystem in dst, a copy of the
// one in src, a new UUID, in its primary superblock and in every backup
// that carries the old one, as tune2fs -U does. It refuses a filesystem
// whose metadata checksums are seeded with the UUID (metadata_csum without
// metadata_csum_seed): every checksum would change with it.
//
// What it reads comes from src, a template whose pages stay in memory from
// one create to the next; what it writes to dst are whole pages. The new
// image's own pages are in no cache yet (a clone shares the template's
// blocks, not its pages), so reading a superblock from dst, or writing part
// of a page of it, would wait for the disk: on a busy pool those reads were
// where creates in flight spent their time.
func setExt4UUID(src, dst string, uuid [16]byte) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer out.Close()
	primary := make(ext4Super, ext4SuperSize)
	if _, err := in.ReadAt(primary, ext4SuperOffset); err != nil {
		return err
	}
	if !primary.isExt4() {
		return fmt.Errorf("%s holds no ext4 filesystem", filepath.Base(src))
	}
	if primary.u32(sbFeatureROCompat)&roCompatMetadataCsum != 0 && primary.u32(sbFeatureIncompat)&incompatCsumSeed == 0 {
		return fmt.Errorf("%s has metadata checksums seeded with its UUID (no metadata_csum_seed)", filepath.Base(src))
	}
	old := string(primary[sbUUID : sbUUID+16])
	blockSize := primary.blockSize()
	perGroup := int64(primary.u32(sbBlocksPerGroup))
	first := int64(primary.u32(sbFirstDataBlock))
	if perGroup <= 0 {
		return fmt.Errorf("%s: superblock names no blocks per group", filepath.Base(src))
	}
	groups := (primary.blockCount() - first + perGroup - 1) / perGroup
	offsets := []int64{ext4SuperOffset}
	if primary.u32(sbFeatureCompat)&compatSparseSuper2 == 0 {
		sparse := primary.u32(sbFeatureROCompat)&roCompatSparseSuper != 0
		for g := int64(1); g < groups; g++ {
			if !sparse || hasBackupSuper(g) {
				offsets = append(offsets, (first+g*perGroup)*blockSize)
			}
		}
	}
	// A page holds at most one superblock: groups are at least 8 MiB apart.
	pageSize := int64(os.Getpagesize())
	page := make([]byte, pageSize)
	for _, off := range offsets {
		pageStart := off - off%pageSize
		if _, err := in.ReadAt(page, pageStart); err != nil {
			return err
		}
		sb := ext4Super(page[off-pageStart : off-pageStart+ext4SuperSize])
		if sb.u16(sbMagic) != ext4Magic || string(sb[sbUUID:sbUUID+16]) != old {
			continue // not a backup (sparse_super2 keeps them elsewhere)
		}
		copy(sb[sbUUID:], uuid[:])
		sb.sealChecksum()
		if _, err := out.WriteAt(page, pageStart); err != nil {
			return err
		}
	}
	return out.Close()
}

// hasBackupSuper: with sparse_super, groups 1 and the powers of 3, 5 and
// 7 keep a copy of the superblock.
func hasBackupSuper(g int64) bool {
	if g <= 1 {
		return true
	}
	for _, base := range []int64{3, 5, 7} {
		n := g
		for n%base == 0 {
			n /= base
		}
		if n == 1 {
			return true
		}
	}
	return false
}
