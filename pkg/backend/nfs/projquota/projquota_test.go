package projquota

import (
	"github.com/modeguard/modeguard/test/testfiles"

	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"

	mtab "github.com/modeguard/modeguard/pkg/mounts"
)

const (
	MiB       = int64(1) << 20
	imageSize = int64(1) << 30
)

// --- tests that need nothing special ---

func TestValidateRel(t *testing.T) {
	for _, rel := range []string{"../x", "/abs", "a/../../b", "", "a\x00b", ".", "..", "a/.", "a//b", "a/", "a b", "a/b\n", "ä", "a/*"} {
		if err := ValidateRel(rel); err == nil {
			t.Errorf("ValidateRel(%q) accepted it", rel)
		}
	}
	for _, rel := range []string{"a", "volumes/pvc-1", "snapshots/snap_1.2:3-x", "a/b/c", "..a", "a.."} {
		if err := ValidateRel(rel); err != nil {
			t.Errorf("ValidateRel(%q): %v", rel, err)
		}
	}
}

// Every method that takes a path refuses a bad one before touching
// anything, so this needs no real pool.
func TestMethodsRefuseBadPaths(t *testing.T) {
	root := t.TempDir()
	p := &Pool{root: root, blockSize: 4096}
	ctx := context.Background()
	for _, rel := range []string{"../x", "/abs", "a/../../b", "", "a\x00b"} {
		if err := p.CreateDir(ctx, rel, 7, MiB); err == nil {
			t.Errorf("CreateDir(%q) accepted it", rel)
		}
		if err := p.CopyTree(ctx, rel, "ok", 7, MiB); err == nil {
			t.Errorf("CopyTree(src %q) accepted it", rel)
		}
		if err := p.CopyTree(ctx, "ok", rel, 7, MiB); err == nil {
			t.Errorf("CopyTree(dst %q) accepted it", rel)
		}
		if err := p.RemoveDir(ctx, rel, 7); err == nil {
			t.Errorf("RemoveDir(%q) accepted it", rel)
		}
	}
	// A symlink on the way is refused too.
	if err := os.Symlink("/", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := p.RemoveDir(ctx, "link/etc", 7); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("RemoveDir through a symlink: %v", err)
	}
	// Project 0 and non-positive limits are refused.
	if err := p.CreateDir(ctx, "a", 0, MiB); err == nil {
		t.Error("CreateDir accepted project 0")
	}
	if err := p.CreateDir(ctx, "a", 7, 0); err == nil {
		t.Error("CreateDir accepted limit 0")
	}
	if err := p.SetLimit(ctx, 0, MiB); err == nil {
		t.Error("SetLimit accepted project 0")
	}
	entries, err := os.ReadDir(root)
	if err != nil || len(entries) != 1 {
		t.Errorf("refused calls left something behind: %v %v", entries, err)
	}
}

func TestOpenRefusesPlainDirectory(t *testing.T) {
	dir := t.TempDir()
	_, err := Open(dir)
	if err == nil {
		t.Fatalf("Open(%s) accepted a plain directory", dir)
	}
	for _, want := range []string{"not a mount point", "mount -o prjquota", "mkfs.xfs", "Prepare"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Open error %q does not say %q", err, want)
		}
	}
	if _, err := Open(filepath.Join(dir, "missing")); err == nil || !strings.Contains(err.Error(), "prjquota") {
		t.Errorf("Open of a missing directory: %v", err)
	}
	// Not xfs: / on this machine is something, but Open must name why it refuses.
	if _, err := Open("/proc"); err == nil || !strings.Contains(err.Error(), "not xfs") {
		t.Errorf("Open(/proc): %v", err)
	}
}

func TestFsxattrIoctlNumbers(t *testing.T) {
	// <linux/fs.h> on x86_64 and arm64.
	if fsIocFSGetXattr != 0x801c581f || fsIocFSSetXattr != 0x401c5820 {
		t.Errorf("FS_IOC_FSGETXATTR %#x, FS_IOC_FSSETXATTR %#x", fsIocFSGetXattr, fsIocFSSetXattr)
	}
}

// --- tests on a real pool ---

func needRoot(t *testing.T) {
	t.Helper()
	testfiles.RequireLoopDevices(t, "mounts an xfs image on a loop device", "mkfs.xfs", "xfs_quota", "losetup", "cp")
}

// newPool prepares a pool in a new temporary directory and registers its
// release, plus a check that no mount and no loop device is left.
func newPool(t *testing.T) (*Pool, string) {
	t.Helper()
	needRoot(t)
	dir := t.TempDir()
	p, release, err := Prepare(context.Background(), dir, imageSize)
	if errors.Is(err, ErrNoKernelQuota) {
		t.Skipf("cannot test project quotas on this machine (make test-vm runs them under a kernel that can): %v", err)
	}
	if err != nil {
		t.Fatalf("Prepare: %v", err)
	}
	t.Cleanup(func() { releaseAndCheck(t, dir, release) })
	return p, dir
}

func releaseAndCheck(t *testing.T, dir string, release func() error) {
	t.Helper()
	if err := release(); err != nil {
		t.Errorf("release: %v", err)
	}
	checkNothingLeft(t, dir)
}

func checkNothingLeft(t *testing.T, dir string) {
	t.Helper()
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Errorf("checking for leftovers: %v", err)
		return
	}
	mounts, err := mtab.All()
	if err != nil {
		t.Errorf("checking for leftovers: %v", err)
	}
	for _, m := range mounts {
		if m.Mountpoint == real || strings.HasPrefix(m.Mountpoint, real+"/") {
			t.Errorf("left mounted: %s from %s", m.Mountpoint, m.Source)
		}
	}
	attached, err := loop.List()
	if err != nil {
		t.Errorf("checking for leftovers: %v", err)
	}
	for _, a := range attached {
		if strings.HasPrefix(a.BackingFile, real+"/") {
			t.Errorf("left attached: %s to %s", a.Device, a.BackingFile)
		}
	}
}

func isQuotaError(err error) bool {
	// xfs fails writes over a project's limit with ENOSPC; EDQUOT is what
	// user and group quotas give.
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
}

func usage(t *testing.T, p *Pool, id uint32) (used, limit int64) {
	t.Helper()
	used, limit, err := p.Usage(context.Background(), id)
	if err != nil {
		t.Fatalf("Usage(%d): %v", id, err)
	}
	return used, limit
}

// near reports whether got is within [want, want+slack].
func near(got, want, slack int64) bool { return got >= want && got <= want+slack }

func TestCreateDirLimitAndGrow(t *testing.T) {
	p, _ := newPool(t)
	ctx := context.Background()
	const id = 101
	if err := p.CreateDir(ctx, "volumes/a", id, 20*MiB); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(p.Root(), "volumes/a")
	st, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o777 {
		t.Errorf("mode %v, want 0777", st.Mode().Perm())
	}
	if got, inherit, err := projectOf(dir); err != nil || got != id || !inherit {
		t.Errorf("project %d inherit %v (%v), want %d with inherit", got, inherit, err, id)
	}
	if total, _ := testfiles.Statfs(t, dir); total != 20*MiB {
		t.Errorf("statfs of the directory: total %d, want %d", total, 20*MiB)
	}
	if _, limit := usage(t, p, id); limit != 20*MiB {
		t.Errorf("Usage limit %d, want %d", limit, 20*MiB)
	}

	file := filepath.Join(dir, "data")
	written, err := testfiles.WriteFile(t, file, 30*MiB)
	if !isQuotaError(err) {
		t.Fatalf("writing 30 MiB into a 20 MiB directory: wrote %d, error %v; want ENOSPC/EDQUOT", written, err)
	}
	t.Logf("write stopped after %d bytes with %v", written, err)
	if written < 18*MiB || written > 20*MiB {
		t.Errorf("wrote %d bytes before the limit, want about 20 MiB", written)
	}
	used, _ := usage(t, p, id)
	if !near(used, written, 64*1024) {
		t.Errorf("Usage %d after writing %d", used, written)
	}
	if _, dused := testfiles.Statfs(t, dir); dused != used {
		t.Errorf("statfs used %d, Usage %d", dused, used)
	}
	if free, err := p.Free(); err != nil || free < 900*MiB {
		t.Errorf("pool Free %d (%v): the project limit should not show there", free, err)
	}
	if size, err := p.Size(); err != nil || size < 900*MiB || size > imageSize {
		t.Errorf("pool Size %d (%v)", size, err)
	}

	// Grow online.
	if err := p.SetLimit(ctx, id, 40*MiB); err != nil {
		t.Fatal(err)
	}
	if total, _ := testfiles.Statfs(t, dir); total != 40*MiB {
		t.Errorf("statfs after SetLimit: total %d, want %d", total, 40*MiB)
	}
	if _, limit := usage(t, p, id); limit != 40*MiB {
		t.Errorf("Usage limit after SetLimit %d", limit)
	}
	if n, err := testfiles.WriteFile(t, filepath.Join(dir, "more"), 10*MiB); err != nil {
		t.Fatalf("writing 10 MiB after growing: %d bytes, %v", n, err)
	}
	n, err := testfiles.WriteFile(t, filepath.Join(dir, "more"), 30*MiB)
	if !isQuotaError(err) {
		t.Fatalf("writing past the new limit: %d bytes, %v", n, err)
	}
	if used, _ := usage(t, p, id); used < 38*MiB || used > 40*MiB {
		t.Errorf("Usage %d at the 40 MiB limit", used)
	}

	// Limits round up to whole blocks.
	if err := p.SetLimit(ctx, id, 50*MiB+1); err != nil {
		t.Fatal(err)
	}
	if _, limit := usage(t, p, id); limit != 50*MiB+p.BlockSize() {
		t.Errorf("limit %d for 50 MiB + 1 byte, want %d", limit, 50*MiB+p.BlockSize())
	}

	// CreateDir again is a retry: same project is fine, another is not.
	if err := p.CreateDir(ctx, "volumes/a", id, 60*MiB); err != nil {
		t.Errorf("CreateDir retry: %v", err)
	}
	if _, limit := usage(t, p, id); limit != 60*MiB {
		t.Errorf("limit after retry %d", limit)
	}
	if err := p.CreateDir(ctx, "volumes/a", id+1, 60*MiB); err == nil {
		t.Error("CreateDir over a directory of another project succeeded")
	}
}

func TestProjectsAreIndependent(t *testing.T) {
	p, _ := newPool(t)
	ctx := context.Background()
	for _, v := range []struct {
		rel string
		id  uint32
	}{{"volumes/a", 201}, {"volumes/b", 202}} {
		if err := p.CreateDir(ctx, v.rel, v.id, 20*MiB); err != nil {
			t.Fatal(err)
		}
	}
	a, b := filepath.Join(p.Root(), "volumes/a"), filepath.Join(p.Root(), "volumes/b")
	wa, err := testfiles.WriteFile(t, filepath.Join(a, "f"), 30*MiB)
	if !isQuotaError(err) {
		t.Fatalf("a: wrote %d, %v", wa, err)
	}
	if n, err := testfiles.WriteFile(t, filepath.Join(b, "f"), 10*MiB); err != nil {
		t.Fatalf("b is full because a is: wrote %d, %v", n, err)
	}
	// A subdirectory inherits the project.
	if err := os.Mkdir(filepath.Join(b, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	wb, err := testfiles.WriteFile(t, filepath.Join(b, "sub", "g"), 30*MiB)
	if !isQuotaError(err) {
		t.Fatalf("b/sub: wrote %d, %v", wb, err)
	}
	if wb < 8*MiB || wb > 10*MiB {
		t.Errorf("b/sub took %d bytes, want the 10 MiB left of b", wb)
	}
	usedA, _ := usage(t, p, 201)
	usedB, _ := usage(t, p, 202)
	if !near(usedA, wa, 64*1024) || !near(usedB, 10*MiB+wb, 128*1024) {
		t.Errorf("Usage a %d (wrote %d), b %d (wrote %d)", usedA, wa, usedB, 10*MiB+wb)
	}
	for _, d := range []string{a, b} {
		if total, _ := testfiles.Statfs(t, d); total != 20*MiB {
			t.Errorf("statfs %s: %d", d, total)
		}
	}
}

// treeEntry is what a copy must keep of a file.
type treeEntry struct {
	mode     fs.FileMode
	uid, gid uint32
	data     string // content, or a symlink's target
}

func readTree(t *testing.T, root string) map[string]treeEntry {
	t.Helper()
	out := map[string]treeEntry{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		info, err := d.Info()
		if err != nil {
			return err
		}
		st := info.Sys().(*syscall.Stat_t)
		e := treeEntry{mode: info.Mode(), uid: st.Uid, gid: st.Gid}
		switch {
		case info.Mode()&fs.ModeSymlink != 0:
			e.data, err = os.Readlink(path)
		case info.Mode().IsRegular():
			var b []byte
			b, err = os.ReadFile(path)
			e.data = string(b)
		}
		out[rel] = e
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestCopyTree(t *testing.T) {
	p, _ := newPool(t)
	ctx := context.Background()
	const srcID, dstID = 301, 302
	if err := p.CreateDir(ctx, "volumes/src", srcID, 40*MiB); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(p.Root(), "volumes/src")
	if _, err := testfiles.WriteFile(t, filepath.Join(src, "big"), 8*MiB); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(src, "sub/deeper"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "sub/deeper/small"), []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(filepath.Join(src, "sub/deeper/small"), 1234, 5678); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("sub/deeper/small", filepath.Join(src, "link")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(src, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	before := readTree(t, src)
	srcUsed, _ := usage(t, p, srcID)

	if err := p.CopyTree(ctx, "volumes/src", "snapshots/copy", dstID, 40*MiB); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(p.Root(), "snapshots/copy")
	after := readTree(t, dst)
	if len(after) != len(before) {
		t.Errorf("copy has %d entries, source %d", len(after), len(before))
	}
	for rel, want := range before {
		got, ok := after[rel]
		if !ok {
			t.Errorf("copy lacks %s", rel)
			continue
		}
		if got != want {
			t.Errorf("%s: copy mode %v uid %d gid %d (%d bytes), source mode %v uid %d gid %d (%d bytes)",
				rel, got.mode, got.uid, got.gid, len(got.data), want.mode, want.uid, want.gid, len(want.data))
		}
	}
	// Every directory and file is in the new project; directories inherit.
	err := filepath.WalkDir(dst, func(path string, d fs.DirEntry, err error) error {
		if err != nil || (!d.IsDir() && !d.Type().IsRegular()) {
			return err
		}
		id, inherit, err := projectOf(path)
		if err != nil {
			return err
		}
		if id != dstID || (d.IsDir() && !inherit) {
			t.Errorf("%s: project %d inherit %v, want %d", path, id, inherit, dstID)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if id, inherit, _ := projectOf(src); id != srcID || !inherit {
		t.Errorf("source project changed to %d", id)
	}
	copyUsed, copyLimit := usage(t, p, dstID)
	if copyLimit != 40*MiB || copyUsed < 8*MiB {
		t.Errorf("copy's project: used %d limit %d; its 8 MiB must count against it even when shared", copyUsed, copyLimit)
	}
	if total, _ := testfiles.Statfs(t, dst); total != 40*MiB {
		t.Errorf("statfs of the copy: %d", total)
	}

	// Writes into the copy count against the copy's project only, and the
	// source never changes.
	if _, err := testfiles.WriteFile(t, filepath.Join(dst, "big"), 5*MiB); err != nil {
		t.Fatal(err)
	}
	if _, err := testfiles.WriteFile(t, filepath.Join(dst, "new"), 5*MiB); err != nil {
		t.Fatal(err)
	}
	if used, _ := usage(t, p, dstID); !near(used, copyUsed+10*MiB, 256*1024) {
		t.Errorf("copy's usage %d after writing 10 MiB into it (was %d)", used, copyUsed)
	}
	if used, _ := usage(t, p, srcID); used != srcUsed {
		t.Errorf("source usage went from %d to %d by writing into the copy", srcUsed, used)
	}
	if now := readTree(t, src); !maps.Equal(now, before) {
		t.Error("source tree changed")
	}

	// A destination that exists is refused and kept.
	if err := p.CopyTree(ctx, "volumes/src", "snapshots/copy", 303, 40*MiB); err == nil {
		t.Error("CopyTree onto an existing directory succeeded")
	}
	if _, err := os.Stat(filepath.Join(dst, "new")); err != nil {
		t.Errorf("refused CopyTree touched the existing copy: %v", err)
	}

	// Too small a limit: cp fails, nothing is left.
	err = p.CopyTree(ctx, "volumes/src", "snapshots/small", 304, 4*MiB)
	if err == nil {
		t.Fatal("copying 8 MiB under a 4 MiB limit succeeded")
	}
	t.Logf("copy under too small a limit: %v", err)
	if _, serr := os.Lstat(filepath.Join(p.Root(), "snapshots/small")); !errors.Is(serr, os.ErrNotExist) {
		t.Errorf("failed copy left its destination: %v", serr)
	}
	if used, limit := usage(t, p, 304); used != 0 || limit != 0 {
		t.Errorf("failed copy left project 304 with used %d limit %d", used, limit)
	}
	if now := readTree(t, src); !maps.Equal(now, before) {
		t.Error("source tree changed by the failed copy")
	}

	// Copying a full directory into a limit smaller than its data fails too.
	if err := p.CreateDir(ctx, "volumes/full", 305, 6*MiB); err != nil {
		t.Fatal(err)
	}
	if _, err := testfiles.WriteFile(t, filepath.Join(p.Root(), "volumes/full/f"), 10*MiB); !isQuotaError(err) {
		t.Fatalf("filling: %v", err)
	}
	if err := p.CopyTree(ctx, "volumes/full", "snapshots/full", 306, 3*MiB); err == nil {
		t.Error("copying a full 6 MiB directory under a 3 MiB limit succeeded")
	}
	if _, serr := os.Lstat(filepath.Join(p.Root(), "snapshots/full")); !errors.Is(serr, os.ErrNotExist) {
		t.Errorf("failed copy left its destination: %v", serr)
	}
	if err := p.CopyTree(ctx, "volumes/full", "snapshots/full", 306, 6*MiB); err != nil {
		t.Errorf("copying a full directory under the same limit: %v", err)
	}

	// Into itself.
	if err := p.CopyTree(ctx, "volumes/src", "volumes/src/inner", 308, 40*MiB); err == nil {
		t.Error("copy of a directory into itself succeeded")
	}
	if _, serr := os.Lstat(filepath.Join(src, "inner")); !errors.Is(serr, os.ErrNotExist) {
		t.Errorf("refused copy left its destination: %v", serr)
	}

	// Missing source.
	if err := p.CopyTree(ctx, "volumes/missing", "snapshots/x", 307, MiB); err == nil {
		t.Error("copy of a missing source succeeded")
	}
	if _, serr := os.Lstat(filepath.Join(p.Root(), "snapshots/x")); !errors.Is(serr, os.ErrNotExist) {
		t.Errorf("failed copy left its destination: %v", serr)
	}
}

func TestRemoveDir(t *testing.T) {
	p, _ := newPool(t)
	ctx := context.Background()
	const id = 401
	if err := p.CreateDir(ctx, "volumes/r", id, 20*MiB); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(p.Root(), "volumes/r")
	if err := os.MkdirAll(filepath.Join(dir, "a/b/c"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := testfiles.WriteFile(t, filepath.Join(dir, "a/b/c/f"), 5*MiB); err != nil {
		t.Fatal(err)
	}
	if used, _ := usage(t, p, id); used < 5*MiB {
		t.Fatalf("usage %d before removing", used)
	}
	if err := p.RemoveDir(ctx, "volumes/r", id+1); err == nil {
		t.Error("RemoveDir with another project id succeeded")
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("refused RemoveDir removed the directory: %v", err)
	}
	if err := p.RemoveDir(ctx, "volumes/r", id); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("directory still there: %v", err)
	}
	if used, limit := usage(t, p, id); used != 0 || limit != 0 {
		t.Errorf("after RemoveDir: used %d limit %d, want 0 0", used, limit)
	}
	if err := p.RemoveDir(ctx, "volumes/r", id); err != nil {
		t.Errorf("RemoveDir of a removed directory: %v", err)
	}
	if _, err := os.Stat(filepath.Join(p.Root(), "volumes")); err != nil {
		t.Errorf("RemoveDir removed the parent: %v", err)
	}
}

func TestPrepareIsIdempotent(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	t.Cleanup(func() { checkNothingLeft(t, dir) })
	p1, release1, err := Prepare(ctx, dir, imageSize)
	if errors.Is(err, ErrNoKernelQuota) {
		t.Skipf("cannot test project quotas on this machine (make test-vm runs them under a kernel that can): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = release1() })
	image := filepath.Join(dir, ImageName)
	ist, err := os.Stat(image)
	if err != nil {
		t.Fatal(err)
	}
	if ist.Size() != imageSize {
		t.Errorf("image size %d, want %d", ist.Size(), imageSize)
	}
	if allocated := ist.Sys().(*syscall.Stat_t).Blocks * 512; allocated > imageSize/4 {
		t.Errorf("image is not sparse: %d bytes allocated", allocated)
	}
	ino := ist.Sys().(*syscall.Stat_t).Ino
	if err := p1.CreateDir(ctx, "volumes/keep", 501, 10*MiB); err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(p1.Root(), "volumes/keep/marker")
	if err := os.WriteFile(marker, []byte("still here"), 0o644); err != nil {
		t.Fatal(err)
	}

	// Again while mounted: the same mount is reused, not stacked.
	p2, release2, err := Prepare(ctx, dir, imageSize)
	if err != nil {
		t.Fatalf("Prepare while mounted: %v", err)
	}
	t.Cleanup(func() { _ = release2() })
	if p2.Root() != p1.Root() {
		t.Errorf("second Root %s, first %s", p2.Root(), p1.Root())
	}
	if n := countMounts(t, p1.Root()); n != 1 {
		t.Errorf("%d mounts at %s, want 1", n, p1.Root())
	}
	if b, err := os.ReadFile(marker); err != nil || string(b) != "still here" {
		t.Errorf("marker through the second pool: %q %v", b, err)
	}

	// Prepare of the mount point itself just opens it; its release does nothing.
	p3, release3, err := Prepare(ctx, p1.Root(), imageSize)
	if err != nil {
		t.Fatalf("Prepare of a prjquota mount point: %v", err)
	}
	if p3.Root() != p1.Root() {
		t.Errorf("Root %s", p3.Root())
	}
	if err := release3(); err != nil {
		t.Error(err)
	}
	if n := countMounts(t, p1.Root()); n != 1 {
		t.Errorf("release of an opened mount point unmounted it (%d mounts)", n)
	}
	if _, err := os.Stat(filepath.Join(p1.Root(), ImageName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Prepare of a mount point made an image in it: %v", err)
	}

	// Release: unmounted and detached; a second release is a no-op.
	if err := release2(); err != nil {
		t.Fatal(err)
	}
	if err := release1(); err != nil {
		t.Errorf("second release: %v", err)
	}
	checkNothingLeft(t, dir)
	if _, err := os.Stat(marker); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("marker visible after release: %v", err)
	}

	// Prepare after release: same image, same data, same limits.
	p4, release4, err := Prepare(ctx, dir, imageSize)
	if err != nil {
		t.Fatalf("Prepare after release: %v", err)
	}
	t.Cleanup(func() {
		if err := release4(); err != nil {
			t.Error(err)
		}
	})
	ist2, err := os.Stat(image)
	if err != nil {
		t.Fatal(err)
	}
	if ino2 := ist2.Sys().(*syscall.Stat_t).Ino; ino2 != ino {
		t.Errorf("image replaced: inode %d, was %d", ino2, ino)
	}
	if b, err := os.ReadFile(filepath.Join(p4.Root(), "volumes/keep/marker")); err != nil || string(b) != "still here" {
		t.Errorf("marker after remount: %q %v", b, err)
	}
	if _, limit := usage(t, p4, 501); limit != 10*MiB {
		t.Errorf("limit after remount %d", limit)
	}
	if total, _ := testfiles.Statfs(t, filepath.Join(p4.Root(), "volumes/keep")); total != 10*MiB {
		t.Errorf("statfs after remount %d", total)
	}
	if id, inherit, err := projectOf(filepath.Join(p4.Root(), "volumes/keep")); err != nil || id != 501 || !inherit {
		t.Errorf("project after remount %d %v %v", id, inherit, err)
	}
}

func countMounts(t *testing.T, mnt string) int {
	t.Helper()
	mounts, err := mtab.All()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range mounts {
		if m.Mountpoint == mnt {
			n++
		}
	}
	return n
}

func TestOpenRefusesXFSWithoutProjectQuota(t *testing.T) {
	needRoot(t)
	mnt := mountPlainXFS(t)
	_, err := Open(mnt)
	if err == nil {
		t.Fatal("Open accepted xfs mounted without prjquota")
	}
	for _, want := range []string{"without project quota", "-o prjquota"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Open error %q does not say %q", err, want)
		}
	}
}

// Concurrent calls on one pool, for the race detector and for xfs_quota
// runs that overlap.
func TestConcurrentUse(t *testing.T) {
	p, _ := newPool(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := uint32(601 + i)
			rel := fmt.Sprintf("volumes/c%d", i)
			if err := p.CreateDir(ctx, rel, id, int64(i+1)*MiB); err != nil {
				errs <- err
				return
			}
			data := bytes.Repeat([]byte{byte(i)}, 512*1024)
			if err := os.WriteFile(filepath.Join(p.Root(), rel, "f"), data, 0o644); err != nil {
				errs <- err
				return
			}
			used, limit, err := p.Usage(ctx, id)
			if err != nil {
				errs <- err
				return
			}
			if limit != int64(i+1)*MiB || used < 512*1024 {
				errs <- fmt.Errorf("project %d: used %d limit %d", id, used, limit)
				return
			}
			if err := p.SetLimit(ctx, id, int64(i+2)*MiB); err != nil {
				errs <- err
				return
			}
			if err := p.RemoveDir(ctx, rel, id); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestKernelSupportsQuotaAgreesWithMount checks the cheap probe the NFS
// backend uses to choose its storage against what mounting with prjquota
// actually does, on whichever kernel runs the test (the host lacks xfs
// quota support; the VM of make test-vm has it).
func TestKernelSupportsQuotaAgreesWithMount(t *testing.T) {
	needRoot(t)
	_, release, err := Prepare(context.Background(), t.TempDir(), imageSize)
	if err == nil {
		defer release()
	}
	switch probe := KernelSupportsQuota(); {
	case probe && err != nil:
		t.Fatalf("the probe says the kernel has xfs quota support, but Prepare failed: %v", err)
	case !probe && !errors.Is(err, ErrNoKernelQuota):
		t.Fatalf("the probe says the kernel lacks xfs quota support, but Prepare gave %v", err)
	}
}

// TestReflinkProbe: the probe behind Reflinks tells an xfs made with
// reflinks (mkfs.xfs's default, what Prepare makes) from one made without,
// and leaves no file behind. Plain xfs mounts, so it runs on kernels
// without xfs quota support too.
func TestReflinkProbe(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		name string
		mkfs []string
		want bool
	}{
		{"mkfs.xfs defaults", nil, true},
		{"reflink=0", []string{"-m", "reflink=0"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mnt := mountPlainXFS(t, tc.mkfs...)
			got, err := probeReflink(mnt)
			if err != nil || got != tc.want {
				t.Errorf("probe on xfs made with %q: %v, %v; want %v", tc.mkfs, got, err, tc.want)
			}
			if entries, err := os.ReadDir(mnt); err != nil || len(entries) != 0 {
				t.Errorf("the probe left %v (%v)", entries, err)
			}
		})
	}
}

// TestCopyTreeAround: the step around is given copies the source, by
// reflinks, and only that step: the destination and its limit are made
// before around is called. An error of around's comes back wrapped and
// leaves neither a partial copy nor a limit.
func TestCopyTreeAround(t *testing.T) {
	p, _ := newPool(t)
	ctx := context.Background()
	if ok, err := p.Reflinks(); err != nil || !ok {
		t.Fatalf("Reflinks of a pool Prepare made: %v, %v; want true (mkfs.xfs makes reflink=1 by default)", ok, err)
	}
	if err := p.CreateDir(ctx, "volumes/src", 401, 40*MiB); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(p.Root(), "volumes/src")
	if _, err := testfiles.WriteFile(t, filepath.Join(src, "big"), 8*MiB); err != nil {
		t.Fatal(err)
	}
	before := readTree(t, src)
	dst := filepath.Join(p.Root(), "snapshots/around")
	calls := 0
	err := p.CopyTreeAround(ctx, "volumes/src", "snapshots/around", 402, 40*MiB, func(ctx context.Context, read func(context.Context) error) error {
		calls++
		if _, err := os.Stat(dst); err != nil {
			t.Errorf("the destination is not made before around: %v", err)
		}
		if _, limit := usage(t, p, 402); limit != 40*MiB {
			t.Errorf("the limit is %d before around, want %d", limit, 40*MiB)
		}
		if entries, _ := os.ReadDir(dst); len(entries) != 0 {
			t.Errorf("the destination holds %d entries before read", len(entries))
		}
		return read(ctx)
	})
	if err != nil || calls != 1 {
		t.Fatalf("CopyTreeAround: %v (around called %d times)", err, calls)
	}
	if after := readTree(t, dst); !maps.Equal(after, before) {
		t.Error("the copy differs from the source")
	}

	held := errors.New("held too long")
	err = p.CopyTreeAround(ctx, "volumes/src", "snapshots/failed", 403, 40*MiB, func(ctx context.Context, read func(context.Context) error) error {
		if err := read(ctx); err != nil {
			return err
		}
		return held
	})
	if !errors.Is(err, held) {
		t.Errorf("CopyTreeAround whose around failed: %v, want it wrapping %v", err, held)
	}
	if _, serr := os.Lstat(filepath.Join(p.Root(), "snapshots/failed")); !errors.Is(serr, os.ErrNotExist) {
		t.Errorf("failed copy left its destination: %v", serr)
	}
	if used, limit := usage(t, p, 403); used != 0 || limit != 0 {
		t.Errorf("failed copy left project 403 with used %d limit %d", used, limit)
	}
}

// mountPlainXFS makes an xfs (mkfs.xfs -q with mkfsArgs) in a 512 MiB image
// of a fresh temporary directory, mounts it without project quotas and
// returns the mount point; both go when the test ends, and nothing may be
// left in the directory then.
func mountPlainXFS(t *testing.T, mkfsArgs ...string) string {
	t.Helper()
	dir := t.TempDir()
	image := filepath.Join(dir, "plain.img")
	if err := os.WriteFile(image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(image, 512*MiB); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.xfs", append(append([]string{"-q"}, mkfsArgs...), image)...).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs: %v: %s", err, out)
	}
	dev, err := loop.Attach(context.Background(), image, false)
	if err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := loop.DetachIfBackedBy(context.Background(), dev.Path, image); err != nil {
			t.Error(err)
		}
		checkNothingLeft(t, dir)
	})
	if err := unix.Mount(dev.Path, mnt, "xfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Error(err)
		}
	})
	return mnt
}
