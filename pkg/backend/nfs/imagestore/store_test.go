package imagestore

import (
	"github.com/modeguard/modeguard/test/testfiles"

	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	mtab "github.com/modeguard/modeguard/pkg/mounts"
)

const MiB = int64(1) << 20

// --- helpers for tests on real loop devices and mounts ---

func needRoot(t *testing.T) {
	t.Helper()
	testfiles.RequireLoopDevices(t, "attaches loop devices and mounts xfs images", "mkfs.xfs", "xfs_growfs", "losetup", "cp")
}

// newStore opens a store in a new temporary directory (on disk, not
// tmpfs, wherever the test's TMPDIR is) and registers its Release and a
// check that no mount and no loop device of it is left.
func newStore(t *testing.T) *Store {
	t.Helper()
	return newStoreOf(t, XFS)
}

// newStoreOf is newStore formatting new images with fs.
func newStoreOf(t *testing.T, fs Filesystem) *Store {
	t.Helper()
	needRoot(t)
	if fs == Ext4 {
		testfiles.RequireLoopDevices(t, "formats ext4 images", "mkfs.ext4", "resize2fs")
	}
	dir := t.TempDir()
	s, err := Open(context.Background(), dir, fs)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Release(); err != nil {
			t.Errorf("Release: %v", err)
		}
		checkNothingLeft(t, s.Root())
	})
	return s
}

// checkNothingLeft fails the test for every mount under root and every loop
// device bound to a file under it, read straight from the kernel
// (/proc/self/mountinfo, /sys/block/loop*/loop/backing_file), and then
// removes them so that a failing test does not leave the machine dirty.
func checkNothingLeft(t *testing.T, root string) {
	t.Helper()
	mounts, err := mtab.All()
	if err != nil {
		t.Errorf("checking for leftovers: %v", err)
	}
	slices.SortFunc(mounts, func(a, b *mtab.Mount) int { return len(b.Mountpoint) - len(a.Mountpoint) })
	for _, m := range mounts {
		if m.Mountpoint == root || strings.HasPrefix(m.Mountpoint, root+"/") {
			t.Errorf("left mounted: %s from %s", m.Mountpoint, m.Source)
			if err := unix.Unmount(m.Mountpoint, unix.MNT_DETACH); err != nil {
				t.Errorf("cleanup: unmounting %s: %v", m.Mountpoint, err)
			}
		}
	}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		backing := strings.TrimSpace(string(b))
		if strings.HasPrefix(backing, root+"/") {
			dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(f)))
			t.Errorf("left attached: %s to %s", dev, backing)
			if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
				t.Errorf("cleanup: losetup --detach %s: %v: %s", dev, err, out)
			}
		}
	}
}

// mountAt is the mount visible at path, or nil.
func mountAt(t *testing.T, path string) *mtab.Mount {
	t.Helper()
	mounts, err := mtab.All()
	if err != nil {
		t.Fatal(err)
	}
	return mtab.TopAt(mounts, path)
}

// devicesOf lists the loop devices bound to image, current or stale.
func devicesOf(t *testing.T, image string) []string {
	t.Helper()
	current, stale, err := bound(image)
	if err != nil {
		t.Fatal(err)
	}
	return append(current, stale...)
}

// checkMounted checks that rel is mounted from a loop device bound to its
// image, the only one, with the options the store promises.
func checkMounted(t *testing.T, s *Store, rel string) *mtab.Mount {
	t.Helper()
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	m := mountAt(t, mnt)
	if m == nil {
		t.Fatalf("%s is not mounted", mnt)
	}
	current, stale, err := bound(image)
	if err != nil {
		t.Fatal(err)
	}
	if len(current) != 1 || current[0] != m.Source || len(stale) > 0 {
		t.Errorf("%s mounted from %s; loop devices bound to its image: %v, to deleted earlier images: %v", rel, m.Source, current, stale)
	}
	fs, err := filesystemOf(image)
	if err != nil {
		t.Fatal(err)
	}
	if m.FSType != string(fs) {
		t.Errorf("%s is %s, its image holds %s", mnt, m.FSType, fs)
	}
	for _, o := range []string{"nodev", "nosuid"} {
		if !slices.Contains(strings.Split(m.Options, ","), o) {
			t.Errorf("%s mounted without %s: %v", mnt, o, m.Options)
		}
	}
	if !slices.Contains(mtab.SuperOptions(m), fs.mountOptions()) {
		t.Errorf("%s mounted without %s: %v", mnt, fs.mountOptions(), mtab.SuperOptions(m))
	}
	return m
}

// checkGone checks that nothing of rel is left: mount, loop device, image,
// mount point.
func checkGone(t *testing.T, s *Store, rel string) {
	t.Helper()
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	if m := mountAt(t, mnt); m != nil {
		t.Errorf("%s still mounted from %s", mnt, m.Source)
	}
	if devs := devicesOf(t, image); len(devs) > 0 {
		t.Errorf("loop devices still bound to %s: %v", image, devs)
	}
	for _, p := range []string{image, mnt} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still there: %v", p, err)
		}
	}
}

func allocated(t *testing.T, path string) (size, alloc int64) {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size(), st.Sys().(*syscall.Stat_t).Blocks * 512
}

// tree maps every path under root to its mode and a hash of its content.
func tree(t *testing.T, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		info, err := d.Info()
		if err != nil {
			return err
		}
		v := info.Mode().String()
		if info.Mode().IsRegular() {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			v += fmt.Sprintf(" %x", sha256.Sum256(b))
		}
		out[rel] = v
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func tempFiles(t *testing.T, s *Store) []string {
	t.Helper()
	entries, err := os.ReadDir(s.images)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if isTempName(e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out
}

// --- tests on real images ---

func TestCreateEnforcesSize(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const rel = "volumes/nfs__vol-a"
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	if filepath.Base(image) != "volumes__nfs__vol-a.img" {
		t.Errorf("image named %s", image)
	}
	size, alloc := allocated(t, image)
	if size != 300*MiB {
		t.Errorf("image has %d bytes, want %d", size, 300*MiB)
	}
	// mkfs.xfs writes the 64 MiB internal log and a few headers; the
	// rest is holes.
	t.Logf("new 300 MiB image: %d MiB allocated", alloc/MiB)
	if alloc > size/4 {
		t.Errorf("image is not sparse: %d of %d bytes allocated", alloc, size)
	}
	if st, err := os.Stat(image); err != nil || st.Mode().Perm() != imageMode {
		t.Errorf("image mode: %v %v", st.Mode(), err)
	}
	if st, err := os.Stat(s.images); err != nil || st.Mode().Perm() != imagesDirMode {
		t.Errorf("images directory mode: %v %v", st.Mode(), err)
	}
	m := checkMounted(t, s, rel)
	if dio, err := os.ReadFile("/sys/block/" + filepath.Base(m.Source) + "/loop/dio"); err == nil && strings.TrimSpace(string(dio)) != "1" {
		t.Logf("loop device %s runs without direct I/O", m.Source)
	}
	if st, err := os.Stat(mnt); err != nil || st.Mode().Perm() != RootDirMode {
		t.Errorf("filesystem root mode %v %v, want %v", st.Mode(), err, RootDirMode)
	}
	total, _ := testfiles.Statfs(t, mnt)
	if total > 300*MiB || total < 200*MiB {
		t.Errorf("statfs total %d", total)
	}
	used, utotal, err := s.Usage(ctx, rel)
	if err != nil || utotal != total || used <= 0 || used > 64*MiB {
		t.Errorf("Usage: used %d total %d (statfs %d) %v", used, utotal, total, err)
	}

	// 320 MiB do not fit.
	n, err := testfiles.WriteFile(t, filepath.Join(mnt, "big"), 320*MiB)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("wrote %d bytes into a 300 MiB volume: %v", n, err)
	}
	t.Logf("wrote %d MiB before ENOSPC", n/MiB)
	if n > 300*MiB {
		t.Errorf("%d bytes fit into a 300 MiB volume", n)
	}
	if used, _, err := s.Usage(ctx, rel); err != nil || used < n-MiB {
		t.Errorf("Usage after filling: %d (wrote %d) %v", used, n, err)
	}
	if _, alloc := allocated(t, image); alloc > 300*MiB {
		t.Errorf("image takes %d bytes", alloc)
	}

	// Again: nothing changes, nothing is stacked, the data stays.
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatalf("Create again: %v", err)
	}
	if m2 := checkMounted(t, s, rel); m2.ID != m.ID {
		t.Errorf("second Create remounted: mount %d, was %d", m2.ID, m.ID)
	}
	if st, err := os.Stat(filepath.Join(mnt, "big")); err != nil || st.Size() != n {
		t.Errorf("data after the second Create: %v %v", st, err)
	}
	// An existing image smaller than asked is not quietly kept.
	if err := s.Create(ctx, rel, 400*MiB); err == nil {
		t.Error("Create with a larger size over an existing image succeeded")
	}
	// A user's mode on the root is not reset by a retried Create.
	if err := os.Chmod(mnt, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(mnt); st.Mode().Perm() != 0o750 {
		t.Errorf("retried Create changed the root's mode to %v", st.Mode())
	}
	if tmp := tempFiles(t, s); len(tmp) > 0 {
		t.Errorf("temporary files left: %v", tmp)
	}
}

func TestBigImageIsSparse(t *testing.T) {
	s := newStore(t)
	const rel = "volumes/big"
	if err := s.Create(context.Background(), rel, 8<<30+123); err != nil {
		t.Fatal(err)
	}
	size, alloc := allocated(t, s.imagePath(rel))
	if size != 8<<30 {
		t.Errorf("image has %d bytes, want the limit rounded down to 4 KiB (%d)", size, int64(8<<30))
	}
	t.Logf("new 8 GiB image: %d MiB allocated", alloc/MiB)
	if alloc > size/32 {
		t.Errorf("image is not sparse: %d of %d bytes allocated", alloc, size)
	}
	if total, _ := testfiles.Statfs(t, s.mountPath(rel)); total > 8<<30 {
		t.Errorf("statfs total %d", total)
	}
}

func TestGrowOnline(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const rel = "volumes/grow"
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	mnt := s.mountPath(rel)
	m := checkMounted(t, s, rel)
	before, _ := testfiles.Statfs(t, mnt)
	if n, err := testfiles.WriteFile(t, filepath.Join(mnt, "a"), 400*MiB); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("filling: wrote %d, %v", n, err)
	}
	if err := os.Remove(filepath.Join(mnt, "a")); err != nil {
		t.Fatal(err)
	}
	if _, err := testfiles.WriteFile(t, filepath.Join(mnt, "a"), 200*MiB); err != nil {
		t.Fatal(err)
	}
	// A file open for writing all along: growing is online.
	f, err := os.OpenFile(filepath.Join(mnt, "open"), os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}

	if err := s.Grow(ctx, rel, 400*MiB); err != nil {
		t.Fatal(err)
	}
	after, _ := testfiles.Statfs(t, mnt)
	if after-before != 100*MiB {
		t.Errorf("statfs total %d before, %d after growing by 100 MiB", before, after)
	}
	if m2 := checkMounted(t, s, rel); m2.ID != m.ID {
		t.Errorf("Grow remounted: mount %d, was %d", m2.ID, m.ID)
	}
	if size, _ := allocated(t, s.imagePath(rel)); size != 400*MiB {
		t.Errorf("image size %d", size)
	}
	if _, err := f.Write([]byte(" after")); err != nil {
		t.Errorf("writing to a file open across Grow: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Error(err)
	}
	if n, err := testfiles.WriteFile(t, filepath.Join(mnt, "b"), 90*MiB); err != nil {
		t.Errorf("after growing by 100 MiB, 90 MiB more did not fit: wrote %d, %v", n, err)
	}
	if _, total, err := s.Usage(ctx, rel); err != nil || total != after {
		t.Errorf("Usage total %d, statfs %d, %v", total, after, err)
	}

	// Never shrinks; the same size again is a no-op.
	for _, limit := range []int64{300 * MiB, 400 * MiB} {
		if err := s.Grow(ctx, rel, limit); err != nil {
			t.Errorf("Grow to %d: %v", limit, err)
		}
		if total, _ := testfiles.Statfs(t, mnt); total != after {
			t.Errorf("Grow to %d changed the size to %d", limit, total)
		}
	}
	if err := s.Grow(ctx, "volumes/missing", 400*MiB); err == nil {
		t.Error("Grow of a missing volume succeeded")
	}
	// Something else mounted over the volume: refused, and nothing is
	// changed (an unmounted one is mounted and grown: see
	// TestGrowAndUsageMountWhatRestoreLeftOut).
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	err = s.Grow(ctx, rel, 500*MiB)
	if uerr := unix.Unmount(mnt, 0); uerr != nil {
		t.Fatal(uerr)
	}
	if err == nil {
		t.Error("Grow of a volume with something else mounted over it succeeded")
	}
	if size, _ := allocated(t, s.imagePath(rel)); size != 400*MiB {
		t.Errorf("refused Grow changed the image size to %d", size)
	}
}

func TestCopy(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const src, dst, big = "volumes/src", "snapshots/copy", "volumes/restored"
	if err := s.Create(ctx, src, 300*MiB); err != nil {
		t.Fatal(err)
	}
	srcMnt := s.mountPath(src)
	if _, err := testfiles.WriteFile(t, filepath.Join(srcMnt, "data"), 20*MiB); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(srcMnt, "sub/deeper"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(srcMnt, "sub/deeper/small"), []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("sub/deeper/small", filepath.Join(srcMnt, "link")); err != nil {
		t.Fatal(err)
	}
	before := tree(t, srcMnt)

	if err := s.Copy(ctx, src, dst, 0); err != nil {
		t.Fatal(err)
	}
	dstMnt := s.mountPath(dst)
	// Both are mounted at once although they share a filesystem UUID.
	mSrc, mDst := checkMounted(t, s, src), checkMounted(t, s, dst)
	if mSrc.Source == mDst.Source {
		t.Errorf("source and copy mounted from the same device %s", mSrc.Source)
	}
	if got := tree(t, dstMnt); !maps.Equal(got, before) {
		t.Errorf("copy differs from the source:\n%v\n%v", got, before)
	}
	if size, alloc := allocated(t, s.imagePath(dst)); size != 300*MiB || alloc > 150*MiB {
		t.Errorf("copy image: %d bytes, %d allocated", size, alloc)
	}
	// Independent: writing to either changes only that one.
	if _, err := testfiles.WriteFile(t, filepath.Join(dstMnt, "data"), MiB); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dstMnt, "new"), []byte("copy only"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := tree(t, srcMnt); !maps.Equal(got, before) {
		t.Error("writing to the copy changed the source")
	}
	if err := os.WriteFile(filepath.Join(srcMnt, "sub/deeper/small"), []byte("changed"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dstMnt, "sub/deeper/small")); string(b) != "hello" {
		t.Errorf("writing to the source changed the copy: %q", b)
	}
	if tmp := tempFiles(t, s); len(tmp) > 0 {
		t.Errorf("temporary files left: %v", tmp)
	}

	// A copy of a copy, larger than its source: grown and mounted.
	if err := s.Copy(ctx, dst, big, 400*MiB); err != nil {
		t.Fatal(err)
	}
	checkMounted(t, s, big)
	srcTotal, _ := testfiles.Statfs(t, dstMnt)
	if total, _ := testfiles.Statfs(t, s.mountPath(big)); total != srcTotal+100*MiB {
		t.Errorf("copy grown to 400 MiB has %d bytes, its 300 MiB source %d", total, srcTotal)
	}
	if b, _ := os.ReadFile(filepath.Join(s.mountPath(big), "new")); string(b) != "copy only" {
		t.Errorf("copy of the copy: %q", b)
	}

	// An existing destination is refused and left alone.
	if err := s.Copy(ctx, src, dst, 0); err == nil {
		t.Error("Copy onto an existing copy succeeded")
	}
	if b, _ := os.ReadFile(filepath.Join(dstMnt, "new")); string(b) != "copy only" {
		t.Errorf("refused Copy touched the existing copy: %q", b)
	}
	// A missing source: nothing of the destination.
	if err := s.Copy(ctx, "volumes/missing", "snapshots/none", 0); err == nil {
		t.Error("Copy of a missing source succeeded")
	}
	checkGone(t, s, "snapshots/none")

	// A Copy whose context has ended fails: nothing of the destination,
	// and the source is not left frozen.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := s.Copy(cctx, src, "snapshots/cancelled", 0); err == nil {
		t.Error("Copy with an ended context succeeded")
	}
	checkGone(t, s, "snapshots/cancelled")
	if tmp := tempFiles(t, s); len(tmp) > 0 {
		t.Errorf("temporary files left by the failed copy: %v", tmp)
	}
	checkWritable(t, filepath.Join(srcMnt, "after-failed-copy"))

	// A source that is not mounted (its device still bound) is mounted
	// again and copied.
	if err := unix.Unmount(srcMnt, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Copy(ctx, src, "snapshots/unmounted", 0); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(s.mountPath("snapshots/unmounted"), "after-failed-copy")); err != nil || string(b) != "x" {
		t.Errorf("copy of an unmounted source: %q %v", b, err)
	}
	if err := s.Restore(ctx, src); err != nil {
		t.Fatal(err)
	}
	checkMounted(t, s, src)
	checkMounted(t, s, "snapshots/unmounted")
}

// checkWritable writes a file within a few seconds, failing the test if
// the write blocks (a frozen filesystem) or fails.
func checkWritable(t *testing.T, path string) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- os.WriteFile(path, []byte("x"), 0o644) }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("writing %s: %v", path, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("writing %s blocks: is the filesystem still frozen?", path)
	}
}

// A copy taken while a writer is busy in the source is a consistent
// filesystem that mounts, and every file in it holds what was written.
func TestCopyWhileWriting(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const src = "volumes/busy"
	if err := s.Create(ctx, src, 300*MiB); err != nil {
		t.Fatal(err)
	}
	srcMnt := s.mountPath(src)
	pattern := func(i int) []byte {
		return bytes.Repeat([]byte(fmt.Sprintf("file %06d|", i)), 64*1024/12)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	var writeErr error
	var files atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			f, err := os.Create(filepath.Join(srcMnt, fmt.Sprintf("f%06d", i)))
			if err != nil {
				writeErr = err
				return
			}
			p := pattern(i)
			// Written in pieces, so that a freeze can fall in the middle.
			for off := 0; off < len(p) && err == nil; off += 4096 {
				_, err = f.Write(p[off:min(off+4096, len(p))])
			}
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				writeErr = err
				return
			}
			files.Store(int64(i + 1))
			if i >= 100 {
				// Keep within the volume: the last 100 files stay.
				if err := os.Remove(filepath.Join(srcMnt, fmt.Sprintf("f%06d", i-100))); err != nil {
					writeErr = err
					return
				}
			}
		}
	}()
	for files.Load() < 50 {
		time.Sleep(5 * time.Millisecond)
	}
	copies := []string{"snapshots/busy-1", "snapshots/busy-2", "snapshots/busy-3"}
	var copyErr error
	for _, dst := range copies {
		if copyErr = s.Copy(ctx, src, dst, 0); copyErr != nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	if copyErr != nil {
		t.Fatal(copyErr)
	}
	if writeErr != nil {
		t.Fatalf("writer: %v", writeErr)
	}
	t.Logf("writer made %d files", files.Load())
	for _, dst := range copies {
		checkMounted(t, s, dst)
		entries, err := os.ReadDir(s.mountPath(dst))
		if err != nil {
			t.Fatal(err)
		}
		if len(entries) == 0 {
			t.Errorf("%s is empty", dst)
		}
		for _, e := range entries {
			var i int
			if _, err := fmt.Sscanf(e.Name(), "f%06d", &i); err != nil {
				t.Errorf("%s: unexpected %s", dst, e.Name())
				continue
			}
			b, err := os.ReadFile(filepath.Join(s.mountPath(dst), e.Name()))
			if err != nil {
				t.Errorf("%s/%s: %v", dst, e.Name(), err)
				continue
			}
			// A file the freeze caught being written is shorter, but what
			// it has is what was written.
			if !bytes.HasPrefix(pattern(i), b) {
				t.Errorf("%s/%s: %d bytes that were never written", dst, e.Name(), len(b))
			}
		}
	}
	// Consistent on disk too: unmounted cleanly, xfs_repair finds nothing.
	if _, err := exec.LookPath("xfs_repair"); err != nil {
		t.Skipf("xfs_repair not found: %v", err)
	}
	if err := s.Release(); err != nil {
		t.Fatal(err)
	}
	for _, dst := range copies {
		if out, err := exec.Command("xfs_repair", "-n", "-f", s.imagePath(dst)).CombinedOutput(); err != nil {
			t.Errorf("xfs_repair -n %s: %v\n%s", dst, err, out)
		}
	}
}

func TestRemove(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const rel = "volumes/gone"
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	mnt := s.mountPath(rel)
	if _, err := testfiles.WriteFile(t, filepath.Join(mnt, "f"), 10*MiB); err != nil {
		t.Fatal(err)
	}
	// In use: refused, and everything stays.
	f, err := os.Open(filepath.Join(mnt, "f"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(ctx, rel); err == nil || !errors.Is(err, unix.EBUSY) {
		t.Errorf("Remove of a volume in use: %v", err)
	}
	f.Close()
	checkMounted(t, s, rel)
	if _, err := os.Stat(filepath.Join(mnt, "f")); err != nil {
		t.Errorf("refused Remove lost data: %v", err)
	}

	if err := s.Remove(ctx, rel); err != nil {
		t.Fatal(err)
	}
	checkGone(t, s, rel)
	if err := s.Remove(ctx, rel); err != nil {
		t.Errorf("second Remove: %v", err)
	}
	if err := s.Remove(ctx, "volumes/never"); err != nil {
		t.Errorf("Remove of a volume that never was: %v", err)
	}
	if _, err := os.Stat(filepath.Join(s.Root(), "volumes")); err != nil {
		t.Errorf("Remove removed the group directory: %v", err)
	}
	if _, _, err := s.Usage(ctx, rel); err == nil {
		t.Error("Usage of a removed volume succeeded")
	}
	// A name can be used again.
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(mnt, "f")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("recreated volume has the old data: %v", err)
	}
}

// A loop device still bound to a deleted earlier image of the same name
// (a crash between deleting an image and detaching it, and a new volume of
// that name since) must never be mounted as the new volume.
func TestStaleDeviceNotReused(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const rel = "volumes/again"
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	mnt, image := s.mountPath(rel), s.imagePath(rel)
	if err := os.WriteFile(filepath.Join(mnt, "old"), []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	old := checkMounted(t, s, rel).Source
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	if _, stale, _ := bound(image); len(stale) != 1 || stale[0] != old {
		t.Fatalf("stale devices %v, want %s", stale, old)
	}
	if err := s.Restore(ctx, rel); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Restore without an image: %v", err)
	}
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	if m := mountAt(t, mnt); m == nil || m.Source == old {
		t.Fatalf("the new volume is mounted from %v, want a device other than %s, the deleted image's", m, old)
	}
	if _, err := os.Stat(filepath.Join(mnt, "old")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("new volume shows the deleted one's data: %v", err)
	}
	// The leftover device itself goes at the next start's Prune (a create
	// does not read the loop devices: see mountFresh).
	if _, err := s.Prune(ctx, map[string]bool{rel: true}); err != nil {
		t.Fatal(err)
	}
	if backing, _ := os.ReadFile("/sys/block/" + filepath.Base(old) + "/loop/backing_file"); strings.Contains(string(backing), image) && strings.Contains(string(backing), loop.DeletedSuffix) {
		t.Errorf("%s is still bound to the deleted image after Prune", old)
	}
	checkMounted(t, s, rel) // the new volume's one device, mounted; none stale
}

func TestRestore(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	rels := []string{"volumes/a", "snapshots/b"}
	if err := s.Create(ctx, rels[0], 300*MiB); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.mountPath(rels[0]), "marker"), []byte("a"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Copy(ctx, rels[0], rels[1], 0); err != nil {
		t.Fatal(err)
	}

	// Release: nothing mounted or attached, images kept.
	if err := s.Release(); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(); err != nil {
		t.Errorf("second Release: %v", err)
	}
	checkNothingLeft(t, s.Root())
	for _, rel := range rels {
		if _, err := os.Stat(s.imagePath(rel)); err != nil {
			t.Errorf("Release lost the image of %s: %v", rel, err)
		}
		if _, err := os.Stat(filepath.Join(s.mountPath(rel), "marker")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: marker visible after Release: %v", rel, err)
		}
	}

	// Restore through the same store, and through a new one (a restart);
	// the copy and its source both mount although they share a UUID.
	if err := s.Restore(ctx, rels[0]); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(ctx, s.Root(), s.newFS)
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.Restore(ctx, rels[1]); err != nil {
		t.Fatal(err)
	}
	for _, rel := range rels {
		checkMounted(t, s, rel)
		if b, err := os.ReadFile(filepath.Join(s.mountPath(rel), "marker")); err != nil || string(b) != "a" {
			t.Errorf("%s after Restore: %q %v", rel, b, err)
		}
	}
	// Restore of something mounted changes nothing.
	m := checkMounted(t, s, rels[0])
	if err := s.Restore(ctx, rels[0]); err != nil {
		t.Fatal(err)
	}
	if m2 := checkMounted(t, s, rels[0]); m2.ID != m.ID {
		t.Errorf("Restore of a mounted volume remounted it")
	}

	// A crash that left the loop device bound: it is reused.
	if err := unix.Unmount(s.mountPath(rels[0]), 0); err != nil {
		t.Fatal(err)
	}
	devs := devicesOf(t, s.imagePath(rels[0]))
	if len(devs) != 1 {
		t.Fatalf("bound devices after unmounting: %v", devs)
	}
	if err := s.Restore(ctx, rels[0]); err != nil {
		t.Fatal(err)
	}
	if m := checkMounted(t, s, rels[0]); m.Source != devs[0] {
		t.Errorf("Restore attached %s instead of reusing %s", m.Source, devs[0])
	}

	// A crash in the middle of a Copy that left the source frozen.
	if err := freeze(s.mountPath(rels[0])); err != nil {
		t.Fatal(err)
	}
	if err := s.Restore(ctx, rels[0]); err != nil {
		t.Fatal(err)
	}
	checkWritable(t, filepath.Join(s.mountPath(rels[0]), "after-thaw"))

	// A missing image is an error, and nothing is made for it.
	err = s.Restore(ctx, "volumes/missing")
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Restore of a missing image: %v", err)
	}
	if _, err := os.Lstat(s.mountPath("volumes/missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Restore of a missing image made its mount point: %v", err)
	}
}

// RestoreAll reads the machine once for a whole batch; every object must
// still end up as Restore would leave it, whatever state a stop or a crash
// left it in: still mounted, released, unmounted with its loop device still
// bound, or frozen by a copy that never ended.
func TestRestoreAll(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	rels := []string{"volumes/mounted", "volumes/released", "volumes/bound", "volumes/frozen"}
	for _, rel := range rels {
		if err := s.Create(ctx, rel, 300*MiB); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(s.mountPath(rel), "marker"), []byte(rel), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	stillMounted := checkMounted(t, s, rels[0])
	if err := unix.Unmount(s.mountPath(rels[1]), 0); err != nil {
		t.Fatal(err)
	}
	for _, d := range devicesOf(t, s.imagePath(rels[1])) {
		if err := detach(ctx, d, s.imagePath(rels[1])); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Unmount(s.mountPath(rels[2]), 0); err != nil {
		t.Fatal(err)
	}
	leftBound := devicesOf(t, s.imagePath(rels[2]))
	if err := freeze(s.mountPath(rels[3])); err != nil {
		t.Fatal(err)
	}

	s2, err := Open(ctx, s.Root(), s.newFS) // a restart
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.RestoreAll(ctx, rels); err != nil {
		t.Fatalf("RestoreAll: %v", err)
	}
	for _, rel := range rels {
		checkMounted(t, s, rel)
		if b, err := os.ReadFile(filepath.Join(s.mountPath(rel), "marker")); err != nil || string(b) != rel {
			t.Errorf("%s after RestoreAll: %q %v", rel, b, err)
		}
	}
	if m := checkMounted(t, s, rels[0]); m.ID != stillMounted.ID {
		t.Errorf("RestoreAll remounted %s, which was mounted", rels[0])
	}
	if m := checkMounted(t, s, rels[2]); len(leftBound) != 1 || m.Source != leftBound[0] {
		t.Errorf("RestoreAll mounted %s from %s instead of reusing the device left bound to it (%v)", rels[2], m.Source, leftBound)
	}
	checkWritable(t, filepath.Join(s.mountPath(rels[3]), "after-thaw"))

	// Bad batches are refused before anything is done.
	if err := s2.RestoreAll(ctx, []string{rels[0], rels[0]}); err == nil {
		t.Error("RestoreAll of a rel twice succeeded")
	}
	if err := s2.RestoreAll(ctx, []string{"../escape"}); err == nil {
		t.Error("RestoreAll of an invalid rel succeeded")
	}
	// A missing image is an error, and nothing is made for it.
	if err := s2.RestoreAll(ctx, []string{rels[0], "volumes/missing"}); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("RestoreAll with a missing image: %v", err)
	}
	if _, err := os.Lstat(s.mountPath("volumes/missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("RestoreAll of a missing image made its mount point: %v", err)
	}
}

// A restarted controller restores only the images of published volumes;
// the others must still grow and report their usage, which needs them
// mounted: Grow and Usage mount an image nobody restored.
func TestGrowAndUsageMountWhatRestoreLeftOut(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	rels := []string{"volumes/grown", "volumes/measured"}
	for _, rel := range rels {
		if err := s.Create(ctx, rel, 300*MiB); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(s.mountPath(rel), "marker"), []byte(rel), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Release(); err != nil { // a graceful stop
		t.Fatal(err)
	}
	s2, err := Open(ctx, s.Root(), s.newFS) // the restart, which restores nothing
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.RestoreAll(ctx, nil); err != nil {
		t.Fatal(err)
	}
	for _, rel := range rels {
		if m := mountAt(t, s.mountPath(rel)); m != nil {
			t.Fatalf("%s is mounted from %s before anything asked for it", rel, m.Source)
		}
	}

	if err := s2.Grow(ctx, rels[0], 400*MiB); err != nil {
		t.Fatalf("Grow of an image not restored: %v", err)
	}
	checkMounted(t, s, rels[0])
	var st unix.Statfs_t
	if err := unix.Statfs(s.mountPath(rels[0]), &st); err != nil {
		t.Fatal(err)
	}
	if total := int64(st.Blocks) * st.Bsize; total <= 300*MiB {
		t.Errorf("after Grow to 400 MiB the filesystem has %d bytes", total)
	}

	used, total, err := s2.Usage(ctx, rels[1])
	if err != nil {
		t.Fatalf("Usage of an image not restored: %v", err)
	}
	checkMounted(t, s, rels[1])
	if used <= 0 || total < 200*MiB || total > 300*MiB {
		t.Errorf("Usage = %d used of %d; want the mounted filesystem's figures", used, total)
	}
	for _, rel := range rels {
		if b, err := os.ReadFile(filepath.Join(s.mountPath(rel), "marker")); err != nil || string(b) != rel {
			t.Errorf("%s after mounting on demand: %q %v", rel, b, err)
		}
	}
}

// The mount point of an unmounted volume must not collect data that would
// then be hidden under the mount.
func TestRestoreRefusesNonEmptyMountPoint(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const rel = "volumes/v"
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(s.mountPath(rel)); err != nil || st.Mode().Perm() != mountDirMode {
		t.Errorf("mount point mode %v %v", st.Mode(), err)
	}
	stray := filepath.Join(s.mountPath(rel), "stray")
	if err := os.WriteFile(stray, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Restore(ctx, rel); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("Restore onto a non-empty mount point: %v", err)
	}
	if devs := devicesOf(t, s.imagePath(rel)); len(devs) != 0 {
		t.Errorf("refused Restore left devices bound: %v", devs)
	}
	if err := os.Remove(stray); err != nil {
		t.Fatal(err)
	}
	if err := s.Restore(ctx, rel); err != nil {
		t.Fatal(err)
	}
	checkMounted(t, s, rel)
}

// A new volume's mount point with something mounted on it (a bind mount of
// the same filesystem, which no device number comparison would see) is
// refused before anything is formatted.
func TestCreateRefusesAMountedMountPoint(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const rel = "volumes/taken"
	if err := s.makeMountPoint(rel); err != nil {
		t.Fatal(err)
	}
	mnt := s.mountPath(rel)
	if err := unix.Mount(s.images, mnt, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	err := s.Create(ctx, rel, 300*MiB)
	if uerr := unix.Unmount(mnt, 0); uerr != nil {
		t.Fatal(uerr)
	}
	if err == nil || !strings.Contains(err.Error(), "mount point already") {
		t.Errorf("Create onto a mount point in use: %v", err)
	}
	if _, err := os.Lstat(s.imagePath(rel)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused Create left an image: %v", err)
	}
	if err := notMountedOn(mnt); err != nil {
		t.Errorf("after the unmount: %v", err)
	}
}

func TestPrune(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	for _, rel := range []string{"volumes/keep", "volumes/gone"} {
		if err := s.Create(ctx, rel, 300*MiB); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(s.mountPath("volumes/keep"), "marker"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Copy(ctx, "volumes/keep", "snapshots/gone", 0); err != nil {
		t.Fatal(err)
	}
	// Leftovers of crashes: an image nobody mounted, one that is attached
	// but not mounted, a temporary file (attached, even), and a file that
	// is none of the store's.
	if err := s.format(ctx, "volumes/orphan", XFS.MinSize()); err != nil {
		t.Fatal(err)
	}
	if err := s.Create(ctx, "volumes/attached", 300*MiB); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(s.mountPath("volumes/attached"), 0); err != nil {
		t.Fatal(err)
	}
	tmp, err := os.CreateTemp(s.images, tempPattern("volumes/crashed"))
	if err != nil {
		t.Fatal(err)
	}
	tmp.Close()
	if err := os.Truncate(tmp.Name(), XFS.MinSize()); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "--find", tmp.Name()).CombinedOutput(); err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	other := filepath.Join(s.images, "notes.txt")
	if err := os.WriteFile(other, []byte("mine"), 0o600); err != nil {
		t.Fatal(err)
	}

	removed, err := s.Prune(ctx, map[string]bool{"volumes/keep": true, "volumes/absent": true})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"snapshots/gone", "volumes/attached", "volumes/gone", "volumes/orphan"}
	if !slices.Equal(removed, want) {
		t.Errorf("Prune removed %v, want %v", removed, want)
	}
	for _, rel := range want {
		checkGone(t, s, rel)
	}
	checkMounted(t, s, "volumes/keep")
	if b, err := os.ReadFile(filepath.Join(s.mountPath("volumes/keep"), "marker")); err != nil || string(b) != "kept" {
		t.Errorf("kept volume: %q %v", b, err)
	}
	if _, err := os.Stat(tmp.Name()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("temporary file left: %v", err)
	}
	if devs := devicesOf(t, tmp.Name()); len(devs) > 0 {
		t.Errorf("temporary file still attached to %v", devs)
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("Prune removed a file that is not the store's: %v", err)
	}
	if removed, err := s.Prune(ctx, map[string]bool{"volumes/keep": true}); err != nil || len(removed) != 0 {
		t.Errorf("second Prune: %v %v", removed, err)
	}
	checkMounted(t, s, "volumes/keep")
}

// Parallel work on different volumes, for the race detector and for
// losetup and mount calls that overlap.
func TestConcurrentUse(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	if err := s.Create(ctx, "volumes/shared", 300*MiB); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rel := fmt.Sprintf("volumes/c%d", i)
			snap := fmt.Sprintf("snapshots/c%d", i)
			steps := []func() error{
				func() error { return s.Create(ctx, rel, 300*MiB) },
				func() error { return s.Create(ctx, rel, 300*MiB) },
				func() error {
					return os.WriteFile(filepath.Join(s.mountPath(rel), "f"), bytes.Repeat([]byte{byte(i)}, 1<<20), 0o644)
				},
				func() error { return s.Grow(ctx, rel, 320*MiB) },
				func() error {
					_, total, err := s.Usage(ctx, rel)
					if err == nil && total <= 250*MiB {
						err = fmt.Errorf("%s: total %d after growing", rel, total)
					}
					return err
				},
				func() error { return s.Copy(ctx, rel, snap, 0) },
				func() error { _, _, err := s.Usage(ctx, "volumes/shared"); return err },
				func() error { return s.Remove(ctx, rel) },
				func() error { return s.Remove(ctx, snap) },
			}
			for _, step := range steps {
				if err := step(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i := range 4 {
		checkGone(t, s, fmt.Sprintf("volumes/c%d", i))
		checkGone(t, s, fmt.Sprintf("snapshots/c%d", i))
	}
	checkMounted(t, s, "volumes/shared")
	if free, err := s.Free(); err != nil || free <= 0 {
		t.Errorf("Free: %d %v", free, err)
	}
	if size, err := s.Size(); err != nil || size <= 0 {
		t.Errorf("Size: %d %v", size, err)
	}
}

func TestOpen(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	// Through a symlink: Root is the real path, which is what the kernel
	// shows in mountinfo and loop backing files.
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, ImagesDirName), 0o755); err != nil {
		t.Fatal(err)
	}
	s, err := Open(context.Background(), link, XFS)
	if err != nil {
		t.Fatal(err)
	}
	if s.Root() != dir {
		t.Errorf("Root %s, want %s", s.Root(), dir)
	}
	if st, err := os.Stat(filepath.Join(dir, ImagesDirName)); err != nil || st.Mode().Perm() != imagesDirMode {
		t.Errorf("images directory: %v %v", st.Mode(), err)
	}
	if s.MinSize() != 300*MiB {
		t.Errorf("MinSize %d", s.MinSize())
	}
	// images must be a directory of its own, not a symlink.
	dir2 := t.TempDir()
	if err := os.Symlink(dir, filepath.Join(dir2, ImagesDirName)); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(context.Background(), dir2, XFS); err == nil {
		t.Error("Open accepted an images symlink")
	}
}

// Unmount lets an unused volume go (no mount, no loop device) and keeps its
// data for the next use; a busy one stays mounted.
func TestUnmountKeepsTheImage(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	const rel = "volumes/resting"
	if err := s.Create(ctx, rel, 300*MiB); err != nil {
		t.Fatal(err)
	}
	mnt := s.mountPath(rel)
	if err := os.WriteFile(filepath.Join(mnt, "kept"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	busy, err := os.Open(filepath.Join(mnt, "kept"))
	if err != nil {
		t.Fatal(err)
	}
	err = s.Unmount(ctx, rel)
	busy.Close()
	if !errors.Is(err, unix.EBUSY) {
		t.Errorf("Unmount of a volume with an open file: %v, want EBUSY", err)
	}
	checkMounted(t, s, rel)
	if err := s.Unmount(ctx, rel); err != nil {
		t.Fatal(err)
	}
	if m := mountAt(t, mnt); m != nil {
		t.Errorf("still mounted from %s after Unmount", m.Source)
	}
	if devs := devicesOf(t, s.imagePath(rel)); len(devs) != 0 {
		t.Errorf("loop devices still bound after Unmount: %v", devs)
	}
	if err := s.Unmount(ctx, rel); err != nil {
		t.Errorf("a second Unmount: %v", err)
	}
	if _, _, err := s.Usage(ctx, rel); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "kept")); err != nil || string(b) != "kept" {
		t.Errorf("data after Unmount and a new use: %q %v", b, err)
	}
}
